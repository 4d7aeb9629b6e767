"""Heterogeneity by default in ``hetcomm train``: when the per-step token split is on, the
chunk count, and the summary's per-rank MoE time.

- :func:`token_split_default`: ``TrainConfig.token_split`` ``auto`` turns the per-step,
  time-proportional split (:mod:`hetcomm.moe.token_split`) on whenever the cluster is mixed --
  more than one device model among the ranks, or datasheet speeds that differ by the one rule
  (:func:`hetcomm.moe.speed.speeds_differ`, exact numbers: no noise) -- and replication is on
  (the copies it splits among). The split itself reads the *measured* speeds
  (:mod:`hetcomm.moe.speed`). The default is off (``False``): at the demo's size there is
  nothing to balance, and the split's per-step count exchange and row moves cost more than they
  save (docs/MOE.md). ``hetcomm train --no-balance`` turns it (and the migration balancer) off.
- :func:`moe_time_summary`: the summary row ``per-rank MoE time max/mean``, from the one
  rank-speed source's agreed busy expert seconds per step (summed over layers; identical on
  every rank, no collective).
- :func:`resolve_chunks` / :func:`measure_chunks`: ``--chunks auto`` is 1 on CPU ranks
  (``docs/MOE.md``, Overlap: chunking is slower there, so nothing is measured); on CUDA/NPU a
  short measurement at the start (1, 2, 4 chunks, 3 timed forward + backward steps each, the
  group's slowest rank decides) picks the count.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

__all__ = ["cluster_is_mixed", "token_split_default", "moe_time_summary", "resolve_chunks", "measure_chunks",
           "CHUNK_CANDIDATES"]


def cluster_is_mixed(cluster, world_size: int) -> bool:
    """More than one device model among the ranks, or datasheet speeds that differ by the one
    rule (:func:`hetcomm.moe.speed.speeds_differ`; datasheet figures are exact: no noise)."""
    from hetcomm.moe.speed import speeds_differ
    from hetcomm.topo.compute import rank_speeds

    models = {cluster.rank(r).model for r in range(world_size)}
    return len(models) > 1 or speeds_differ(rank_speeds(cluster, range(world_size)))


def token_split_default(token_split: Union[bool, str, None], replicate: bool, cluster, world_size: int) -> bool:
    """The split's setting for a run: explicit when True/False, else (``auto``, None) on for a
    mixed cluster with replication and more than one rank."""
    if isinstance(token_split, bool):
        return token_split and replicate and world_size > 1
    return replicate and world_size > 1 and cluster is not None and cluster_is_mixed(cluster, world_size)


def moe_time_summary(layers: Sequence[torch.nn.Module]) -> str:
    """``max / mean`` over ranks of the busy expert seconds per step (the agreed
    :attr:`hetcomm.moe.speed.SpeedSnapshot.seconds_per_step`, summed over ``layers``), with the
    mean in ms; "not measured" before an agreement with measurements."""
    from hetcomm.moe.token_split import max_over_mean

    snaps = [m.speed.agreed for m in layers]
    if not snaps or not all(s.measured and s.seconds_per_step for s in snaps):
        return "not measured"
    per_rank = [sum(v) for v in zip(*(s.seconds_per_step for s in snaps))]
    mean = sum(per_rank) / len(per_rank)
    return (f"{max_over_mean(per_rank):.2f} (busy expert seconds per step, agreed EMA; mean "
            f"{mean * 1e3:.1f} ms/step per rank)")


def resolve_chunks(chunks: Union[int, str], device: torch.device) -> Tuple[Optional[int], str]:
    """``(num_chunks, why)`` for ``--chunks N|auto``; ``(None, why)``: measure (:func:`measure_chunks`)."""
    if chunks != "auto":
        return int(chunks), "given"
    if device.type == "cpu":
        return 1, "auto: CPU ranks (chunking measured 18-23% slower, docs/MOE.md)"
    return None, f"auto: measured on {device.type} at the start"


#: Chunk counts ``--chunks auto`` tries on a device.
CHUNK_CANDIDATES = (1, 2, 4)


def measure_chunks(layers: Sequence[torch.nn.Module], run_step: Callable[[], None],
                   candidates: Sequence[int] = CHUNK_CANDIDATES, repeats: int = 3,
                   group: Optional[dist.ProcessGroup] = None) -> Tuple[int, Dict[int, float]]:
    """Pick the chunk count of ``layers`` from a short measurement (collective when distributed).

    For each candidate every layer is set to it (``MoELayer.set_num_chunks``), ``run_step()`` (one
    forward + backward of a sample batch, no optimizer step) runs once to warm up and ``repeats``
    times timed; a candidate's time is the median, and the group's time the maximum over ranks
    (one all-reduce of ``[len(candidates)]``), so every rank picks the same, fastest, count
    (ties: the fewest chunks). The layers are left at that count.

    Returns:
        ``(num_chunks, {candidate: seconds per step})``.
    """
    times = []
    for c in candidates:
        for m in layers:
            m.set_num_chunks(int(c))
        run_step()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            run_step()
            ts.append(time.perf_counter() - t)
        times.append(statistics.median(ts))
    vec = torch.tensor(times, dtype=torch.float64)  # host: a few scalars
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    best = min(range(len(candidates)), key=lambda i: (float(vec[i]), candidates[i]))
    for m in layers:
        m.set_num_chunks(int(candidates[best]))
    return int(candidates[best]), {int(c): float(v) for c, v in zip(candidates, vec.tolist())}
