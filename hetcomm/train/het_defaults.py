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
- :func:`resolve_chunks` / :func:`measure_chunks`: ``--chunks auto`` is 1 on CPU ranks
  (``docs/MOE.md``, Overlap: chunking lost 18-23% there, so nothing is measured); on CUDA/NPU a
  short measurement at the start (1, 2, 4 chunks, 3 timed forward + backward steps each, the
  group's slowest rank decides) picks the count.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

__all__ = ["SPEED_SPREAD", "cluster_is_mixed", "token_split_default", "speeds_differ",
           "BatchSplit", "BATCH_MIN_GAIN", "MoETimeTracker", "resolve_chunks", "measure_chunks", "CHUNK_CANDIDATES"]

#: Datasheet speeds further apart than this (max / min - 1) make a cluster "mixed".
SPEED_SPREAD = 0.10
#: A batch re-deal must shorten the step by this fraction of it (:meth:`BatchSplit.plan`).
BATCH_MIN_GAIN = 0.03
#: Forward + backward seconds per forward second of the dense part.
FWD_BWD = 3.0


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


def speeds_differ(speeds: Sequence[float]) -> bool:
    """Measured speeds more than :data:`SPEED_SPREAD` apart (max / min - 1)."""
    return bool(speeds) and max(speeds) > (1 + SPEED_SPREAD) * min(speeds)


class BatchSplit:
    """Per-rank sequences per step in proportion to each rank's measured dense-compute speed.

    The data-parallel part of a step (embedding, attention, norms, output projection, loss:
    everything outside the MoE layers) runs on each rank's own sequences, and every rank waits
    for the slowest at the first collective; on unequal ranks equal batches leave the fast ones
    idle. Each step a rank times its forward outside the MoE layers (``observe``: the model's
    forward seconds minus the layers' ``forward_s``; no communication happens there, so it is
    pure local compute) against the sequences it ran; EMAs of both, and every ``every`` steps one
    all-reduce of a ``[W, 2]`` float64 table (each rank fills its row) gives every rank the same
    vector ``sequences / second``. When those speeds differ by more than :data:`SPEED_SPREAD` the
    ``W * batch_size`` sequences of a step are dealt in proportion to them (largest remainder, at
    least one each); otherwise every rank gets ``batch_size``; a new deal is taken only when it
    shortens the slowest rank's dense time by more than :data:`BATCH_MIN_GAIN` of the step
    (:meth:`plan`), and when two agreements in a row propose it (within one sequence per rank:
    noise between equal ranks proposes a different deal each time). The total, and so tokens per
    step, never changes.

    Exact in expectation: rank ``r``'s mean loss is scaled by ``W * b_r / sum(b)``
    (:meth:`loss_scale`), so after the usual ``1 / W`` gradient average the gradients are those
    of the mean loss over all ``sum(b)`` sequences, as with equal batches.
    """

    def __init__(self, batch_size: int, world_size: int, rank: int, *, enabled: bool = True,
                 every: int = 10, alpha: float = 0.8, fixed_speeds: Optional[Sequence[float]] = None) -> None:
        self.world_size, self.rank, self.every, self.alpha = world_size, rank, every, alpha
        self.enabled = enabled and world_size > 1
        self.total = batch_size * world_size
        self.sizes: List[int] = [batch_size] * world_size
        self.speeds: Optional[List[float]] = None
        self.changes = 0
        self._seq = self._sec = self._step_s = 0.0
        self._steps = 0
        self.last_gain_s = 0.0
        self._last_proposal: Optional[List[int]] = None
        # Datasheet speeds (TrainConfig.speed="datasheet"): dealt once, nothing measured.
        self.fixed = fixed_speeds is not None and self.enabled
        if self.fixed:
            self.speeds = [float(v) for v in fixed_speeds]
            self.sizes, self.last_gain_s = self.plan(self.total, self.sizes, self.speeds, 0.0)

    @property
    def mine(self) -> int:
        """Sequences this rank runs this step."""
        return self.sizes[self.rank]

    def loss_scale(self) -> float:
        return self.world_size * self.mine / self.total

    def observe(self, dense_seconds: float) -> None:
        """This step's forward seconds outside the MoE layers (for :attr:`mine` sequences)."""
        if not self.enabled or self.fixed or dense_seconds <= 0:
            return
        a = self.alpha if self._steps else 0.0
        self._seq = a * self._seq + (1 - a) * self.mine
        self._sec = a * self._sec + (1 - a) * dense_seconds
        self._steps += 1

    def maybe_agree(self, step_seconds: float) -> bool:
        """End of a step that took ``step_seconds`` on this rank: every ``every`` observed steps,
        agree the speed vector and re-deal the sequences when that pays (:meth:`plan`;
        collective on the default group). Returns True when the split changed."""
        if not self.enabled or self.fixed:
            return False
        a = self.alpha if self._step_s else 0.0
        self._step_s = a * self._step_s + (1 - a) * step_seconds
        if self._steps == 0 or self._steps % self.every:
            return False
        table = torch.zeros(self.world_size, 3, dtype=torch.float64)  # host: three scalars per rank
        table[self.rank] = torch.tensor([self._seq, self._sec, self._step_s], dtype=torch.float64)  # host
        if dist.is_initialized():
            dist.all_reduce(table)  # exact: each entry is one rank's number plus zeros
        rows = table.tolist()
        if any(q <= 0 or t <= 0 for q, t, _ in rows):
            return False
        self.speeds = [q / t for q, t, _ in rows]
        step_s = sum(r[2] for r in rows) / self.world_size
        proposal, self.last_gain_s = self.plan(self.total, self.sizes, self.speeds, step_s)
        return self.adopt(proposal)

    def adopt(self, proposal: List[int]) -> bool:
        """Take ``proposal`` when the previous agreement proposed it too (within one sequence per
        rank): a real speed difference proposes the same deal again, noise between equal ranks
        does not. Returns True when the deal changed."""
        last, self._last_proposal = self._last_proposal, list(proposal)
        if proposal == self.sizes or last is None or max(abs(a - b) for a, b in zip(proposal, last)) > 1:
            return False
        self.sizes = list(proposal)
        self.changes += 1
        return True

    @staticmethod
    def plan(total: int, sizes: Sequence[int], speeds: Sequence[float], step_s: float) -> Tuple[List[int], float]:
        """``(sizes, predicted gain in s/step)``: the deal by ``speeds`` (equal when they are within
        :data:`SPEED_SPREAD`), adopted only when it shortens the slowest rank's dense forward +
        backward (``FWD_BWD`` x forward) by more than :data:`BATCH_MIN_GAIN` of the step
        (``step_s``); otherwise ``sizes`` stay. Noise between equal ranks does not re-deal."""
        from hetcomm.moe.placement.assign import split_by_weight

        W = len(speeds)
        new = split_by_weight(total, speeds) if speeds_differ(speeds) else [total // W] * W
        t_now = max(b / s for b, s in zip(sizes, speeds))
        t_new = max(b / s for b, s in zip(new, speeds))
        gain = FWD_BWD * (t_now - t_new)
        if list(new) != list(sizes) and gain > BATCH_MIN_GAIN * step_s:
            return list(new), gain
        return list(sizes), gain

    def summary(self) -> str:
        if not self.enabled:
            return "off"
        sp = "-" if self.speeds is None else "/".join(f"{s:,.0f}" for s in self.speeds) + (" (datasheet)" if self.fixed else "")
        return (f"sequences per rank {self.sizes} (of {self.total}); dense forward speed {sp} seq/s; {self.changes} "
                f"re-deals (last predicted gain {self.last_gain_s * 1e3:.1f} ms/step)")

    def state_dict(self) -> Dict[str, Any]:
        return {"sizes": torch.tensor(self.sizes, dtype=torch.int64),
                "ema": torch.tensor([self._seq, self._sec, float(self._steps), self._step_s], dtype=torch.float64)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.sizes = [int(v) for v in sd["sizes"].tolist()]
        self._seq, self._sec, steps, self._step_s = sd["ema"].tolist()
        self._steps = int(steps)


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
