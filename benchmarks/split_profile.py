"""Where the per-step token split's time goes: one MoE layer on 4 ranks, split on and off in
alternating blocks of the same processes (``layer.splitter`` removed for the "off" blocks), over
the ``hetcomm`` backend and plain ``gloo`` (issue 19, item 3).

Per variant, median over timed steps of: forward + backward ms, forward ms, the splitter's count
all-reduce ms (``TokenSplitter._gather``), the rest of ``route`` (plan + rename) ms, rank 0's rows
sent and the number of destination ranks its rows go to.

    .venv/bin/python benchmarks/split_profile.py --steps 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _body(rank: int, world_size: int, steps: int, block: int):
    import torch
    import torch.distributed as dist

    from hetcomm.moe import MoELayer
    from hetcomm.moe import token_split as ts

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = MoELayer(64, 8, k=2, replicate=True, token_split=True, calibrate=False, wire_dtype="fp32",
                     cluster=os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml"), replicate_every=1)
    splitter = layer.splitter
    gather_s = []
    orig = ts.TokenSplitter._gather

    def timed_gather(self, send_counts):
        t = time.perf_counter()
        out = orig(self, send_counts)
        gather_s.append(time.perf_counter() - t)
        return out

    ts.TokenSplitter._gather = timed_gather
    route_s = []
    orig_route = ts.TokenSplitter.route

    def timed_route(self, *a, **kw):
        t = time.perf_counter()
        out = orig_route(self, *a, **kw)
        route_s.append(time.perf_counter() - t)
        return out

    ts.TokenSplitter.route = timed_route
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(512, 64, generator=gen)
    res = {"on": [], "off": []}
    for i in range(steps):
        mode = "on" if (i // block) % 2 == 0 else "off"
        layer.splitter = splitter if mode == "on" else None
        gather_s.clear()
        route_s.clear()
        xi = x.clone().requires_grad_(True)
        dist.barrier()
        t0 = time.perf_counter()
        y = layer(xi)
        t1 = time.perf_counter()
        y.float().pow(2).mean().backward()
        t2 = time.perf_counter()
        layer.sync_replicas()
        st = layer.step_stats()
        g = sum(gather_s)
        res[mode].append((t2 - t0, t1 - t0, g, sum(route_s) - g, st.a2a_bytes_sent))
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--block", type=int, default=5)
    args = ap.parse_args()
    from tests.backends.ranks import MIXED_MINI, run_ranks

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {open('/proc/loadavg').read().split()[:3]}")
    print("| backend | split | fwd+bwd ms | fwd ms | count all-reduce ms | plan+rename ms | rank0 a2a KB sent |")
    print("|---|---|---|---|---|---|---|")
    for backend in ("hetcomm", "gloo"):
        out = run_ranks(_body, 4, backend=backend, cluster=MIXED_MINI, timeout=600, args=(args.steps, args.block))
        for mode in ("on", "off"):
            rows = [r for rank_res in out for r in rank_res[mode][2:]]  # all ranks, first 2 per mode skipped
            med = [statistics.median(r[j] for r in rows) for j in range(4)]
            kb = statistics.median(r[4] for r in out[0][mode][2:]) / 1024
            print(f"| {backend} | {mode} | {med[0] * 1e3:.1f} | {med[1] * 1e3:.1f} | {med[2] * 1e3:.2f} | "
                  f"{med[3] * 1e3:.2f} | {kb:.0f} |", flush=True)
    print(f"end load {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
