"""Heterogeneity by default in ``hetcomm train``: when the per-step token split is on, and the
per-rank MoE time the summary reports.

- :func:`token_split_default`: ``TrainConfig.token_split`` ``auto`` turns the per-step,
  time-proportional split (:mod:`hetcomm.moe.token_split`) on whenever the cluster is mixed --
  more than one device model among the ranks, or datasheet speeds (``hetcomm.topo.compute``)
  more than :data:`SPEED_SPREAD` apart -- and replication is on (the copies it splits among).
  The split itself reads the *measured* speed vector (:mod:`hetcomm.moe.speed`). The default is
  off (``False``): at the demo's size (8 experts of 64 x 128, ~5 ms of expert time in a ~600 ms
  step) there is nothing to balance, and the split's per-step count exchange and row moves cost
  11-16% of tokens/s on the emulated half-speed cluster (docs/MOE.md).
  ``hetcomm train --no-balance`` turns it (and the migration balancer) off.
- :class:`MoETimeTracker`: each step's forward expert seconds of this rank, summed over layers;
  at the end one ``all_gather`` gives every step's per-rank vector, and the summary row
  ``per-rank MoE time max/mean`` is the median over steps of ``max / mean``.
- :func:`resolve_chunks`: ``--chunks auto`` is 1 on CPU ranks (``docs/MOE.md``, Overlap: chunking
  lost 18-23% there); on CUDA/NPU no measurement decides yet, so auto stays 1 and says so.
"""

from __future__ import annotations

import statistics
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

__all__ = ["SPEED_SPREAD", "cluster_is_mixed", "token_split_default", "MoETimeTracker", "resolve_chunks"]

#: Datasheet speeds further apart than this (max / min - 1) make a cluster "mixed".
SPEED_SPREAD = 0.10


def cluster_is_mixed(cluster, world_size: int) -> bool:
    """More than one device model among the ranks, or speeds more than 10% apart."""
    from hetcomm.topo.compute import rank_speeds

    models = {cluster.rank(r).model for r in range(world_size)}
    speeds = rank_speeds(cluster, range(world_size))
    return len(models) > 1 or max(speeds) > (1 + SPEED_SPREAD) * min(speeds)


def token_split_default(token_split: Union[bool, str, None], replicate: bool, cluster, world_size: int) -> bool:
    """The split's setting for a run: explicit when True/False, else (``auto``, None) on for a
    mixed cluster with replication and more than one rank."""
    if isinstance(token_split, bool):
        return token_split and replicate and world_size > 1
    return replicate and world_size > 1 and cluster is not None and cluster_is_mixed(cluster, world_size)


def resolve_chunks(chunks: Union[int, str], device: torch.device) -> Tuple[int, str]:
    """``(num_chunks, why)`` for ``--chunks N|auto``."""
    if chunks != "auto":
        return int(chunks), "given"
    if device.type == "cpu":
        return 1, "auto: CPU ranks (chunking measured 18-23% slower, docs/MOE.md)"
    return 1, f"auto: no measurement on {device.type} yet, unpipelined"


class MoETimeTracker:
    """Per-step forward expert seconds of this rank (summed over MoE layers)."""

    def __init__(self) -> None:
        self.per_step: List[float] = []

    def observe(self, layers: Sequence[torch.nn.Module]) -> None:
        self.per_step.append(sum(float(m.last_stats.get("expert_s", 0.0)) for m in layers))

    def gather(self, world_size: int) -> List[List[float]]:
        """``[steps][W]`` (collective: every rank calls it once, after the last step)."""
        mine = torch.tensor(self.per_step, dtype=torch.float64)
        if world_size > 1 and dist.is_initialized():
            parts = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(parts, mine)
            table = torch.stack(parts, 1)
        else:
            table = mine.unsqueeze(1)
        return table.tolist()

    @staticmethod
    def summary(table: List[List[float]]) -> str:
        from hetcomm.moe.token_split import max_over_mean

        if not table:
            return "no steps"
        skip = min(len(table) - 1, max(1, len(table) // 10))  # warm-up steps (allocation, first agreement)
        mm = [max_over_mean(row) for row in table[skip:]]
        means = [sum(row) / len(row) for row in table[skip:]]
        return (f"{statistics.median(mm):.2f} (median over steps {skip + 1}-{len(table)}; mean forward expert time "
                f"{statistics.median(means) * 1e3:.1f} ms/step per rank)")
