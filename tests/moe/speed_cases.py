"""Rank functions of tests/moe/test_speed.py (module level: run_ranks forks them)."""

from __future__ import annotations

import time
from typing import Any, Dict

import torch
import torch.distributed as dist


def _spin(cpu_s: float) -> None:
    """Compute for ``cpu_s`` seconds of this thread's CPU time (the same work however loaded)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def wait_in_a_collective(rank: int, world_size: int) -> Dict[str, Any]:
    """Both ranks time the same compute each step; rank 1's timed section also waits in a
    barrier for rank 0, which sleeps 0.2 s before joining it. The busy clock must not count the
    wait (a wall-clock timer would read rank 1 several times slower)."""
    from hetcomm.moe.speed import SpeedMeter

    meter = SpeedMeter(world_size, rank, [1.0] * world_size, every=4, alpha=0.8)
    cpu = torch.device("cpu")
    walls, busy = [], []
    for _ in range(12):
        t = time.perf_counter()
        mark = meter.begin(cpu)
        _spin(0.02)
        if rank == 1:
            dist.barrier()  # waits here for rank 0's sleep
        meter.end(mark, 256)
        walls.append(time.perf_counter() - t)
        if rank == 0:
            time.sleep(0.2)
            dist.barrier()
        meter.finish_step()
        busy.append(meter.last_step[1])
    snap = meter.snapshot()
    return {"speeds": snap.rows_per_s, "own": snap.own_rows_per_s, "noise": snap.noise, "differ": snap.differ,
            "wall": walls, "busy": busy}


def equal_ranks_cold_move(rank: int, world_size: int) -> Dict[str, Any]:
    """Equal ranks train one replicated MoE layer with the library's defaults (an agreement
    every 5 steps) through the measured loop until its placement by speed is due: nothing may
    move, and every rank holds the same agreed snapshot."""
    from hetcomm.moe import MeasuredLoop, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(64, 8, k=2, dropless=True, calibrate=False, replicate=True)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    loop = MeasuredLoop([layer], opt)
    due_at, events = None, []
    for step in range(1, 41):
        x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1000 * rank + step))
        layer(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        events += [str(e) for e in loop.after_step(step) if e.kind == "migration"]
        if loop.cold.done[0]:
            due_at = step
            break
    snap = layer.speed.snapshot()
    return {"moved": events, "due_at": due_at, "rows": loop.cold.rows, "speeds": snap.rows_per_s, "noise": snap.noise,
            "differ": snap.differ, "own": snap.own_rows_per_s, "agreements": snap.agreements,
            "owner": list(layer.placement.owner)}


def agreement_collectives(rank: int, world_size: int) -> Dict[str, Any]:
    """Ten training forwards of one layer (agreements at 5 and 10), counting the all-reduces: the
    agreement rides in the all-reduce of the load statistics (the gate's calibration sums them)."""
    from hetcomm.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(16, 4, k=2, calibrate=True, replicate=False)
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        for step in range(10):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(10 * rank + step))
            layer(x).sum().backward()
    finally:
        dist.all_reduce = real
    snap = layer.speed.snapshot()
    return {"calls": calls, "agreements": snap.agreements, "seconds": snap.seconds_per_step,
            "rows": snap.own_rows_per_s, "forward": snap.forward_seconds}
