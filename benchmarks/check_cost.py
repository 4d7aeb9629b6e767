"""Cost per call of hetcomm's cross-rank check (issue 14.6): tiny collectives with and without it.

Every rank runs, in one process group set-up, three groups side by side: the default hetcomm
group (check on, the default), a hetcomm group with ``HetcommOptions(check_splits=False)``, and
a plain gloo group. It times blocks of calls of each collective on each group, alternating the
groups block by block (so load drifts hit all three alike), and reports the median over blocks
of the per-call time, in microseconds, from rank 0. The check's cost per call is the difference
between the first two columns.

    .venv/bin/python benchmarks/check_cost.py --ranks 2 4 [--cluster configs/clusters/mixed-mini.yaml]

One node without ``--cluster``: the check goes through the shared-memory board. With mixed-mini
(YAML nodes apart, no board) it is a round of tiny messages over the rails for the routed
collectives and the same for the delegated ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPS = ("all_reduce", "broadcast", "all_gather", "barrier", "all_to_all_single")


def _call(op: str, group, n: int, t: torch.Tensor, outs, y: torch.Tensor) -> None:
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(t, group=group)
    elif op == "broadcast":
        dist.broadcast(t, src=0, group=group)
    elif op == "all_gather":
        dist.all_gather(outs, t, group=group)
    elif op == "barrier":
        dist.barrier(group=group)
    else:
        dist.all_to_all_single(y, torch.ones(n * 4), group=group)


def rank_body(rank: int, n: int, blocks: int, per_block: int) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import HetcommOptions

    groups = {
        "checked": dist.group.WORLD,
        "unchecked": dist.new_group(backend="hetcomm", pg_options=HetcommOptions(check_splits=False)),
        "gloo": dist.new_group(backend="gloo"),
    }
    t = torch.ones(4)
    outs = [torch.empty(4) for _ in range(n)]
    y = torch.empty(n * 4)
    times = {(op, g): [] for op in OPS for g in groups}
    for op in OPS:
        for g in groups.values():  # warm-up: connections, buffers
            for _ in range(5):
                _call(op, g, n, t, outs, y)
        for _ in range(blocks):
            for name, g in groups.items():
                dist.barrier(group=groups["gloo"])
                t0 = time.perf_counter()
                for _ in range(per_block):
                    _call(op, g, n, t, outs, y)
                times[(op, name)].append((time.perf_counter() - t0) / per_block * 1e6)
    return {f"{op}/{g}": statistics.median(v) for (op, g), v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--cluster", default=None, help="cluster YAML (HETCOMM_CLUSTER), e.g. mixed-mini")
    p.add_argument("--blocks", type=int, default=15)
    p.add_argument("--per-block", type=int, default=40)
    a = p.parse_args()
    from tests.backends.ranks import run_ranks

    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(f"| ranks | collective | hetcomm, check on (us) | hetcomm, check off (us) | check cost (us) | plain gloo (us) |")
    print("|---|---|---|---|---|---|")
    for n in a.ranks:
        res = run_ranks(rank_body, world_size=n, cluster=a.cluster, args=(a.blocks, a.per_block), timeout=1800, pg_timeout=120)[0]
        for op in OPS:
            on, off, gloo = res[f"{op}/checked"], res[f"{op}/unchecked"], res[f"{op}/gloo"]
            print(f"| {n} | {op} | {on:.0f} | {off:.0f} | {on - off:+.0f} | {gloo:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
