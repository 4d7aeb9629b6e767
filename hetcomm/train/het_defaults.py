"""Heterogeneity in ``hetcomm train``: the per-rank MoE time the summary reports and the
start-up chunk measurement. Which levers are on is decided by the policy record
(:mod:`hetcomm.moe.policy`), not here; rank speeds come from the one source,
:mod:`hetcomm.moe.speed`.

- :func:`moe_time_summary`: the summary row ``per-rank MoE time max/mean``, from the one
  rank-speed source's agreed busy expert seconds per step (summed over layers; identical on
  every rank, no collective).
- :func:`measure_chunks`: ``--chunks auto`` on CUDA/NPU (the policy's ``chunks`` lever; 1 on
  CPU ranks, where chunking was measured slower): a short measurement at the start (1, 2, 4
  chunks, 3 timed forward + backward steps each, the group's slowest rank decides) picks the count.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["moe_time_summary", "measure_chunks", "CHUNK_CANDIDATES"]


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
