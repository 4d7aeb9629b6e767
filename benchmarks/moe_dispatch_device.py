"""dispatch/combine against all_to_all_single on a device (what ``scripts/device-check`` times).

Two ranks on one host, over the hetcomm backend with ``tests/gpu/nvidia-ascend-2.yaml``: rank 0
holds its tensors on ``--device`` (``cuda`` on a GPU machine), rank 1 is a CPU process standing
for an Ascend rank, so the pair crosses the bridge rail (pinned, pipelined host staging). One
GPU is enough (no NCCL between the two). Per iteration, on the same routing (``T`` tokens per
rank, ``k`` of ``E`` experts, uniform):

- ``a2a per-copy``: ``all_to_all_single`` of the ``T * k`` per-copy rows, there and back
  (what a per-copy MoE exchange moves; the rows are gathered first, inside the timing);
- ``dispatch+combine``: ``hetcomm.backends.tokens.dispatch`` then ``combine`` (forward only), experts
  replaced by the identity.

Times are medians over iterations of the slower rank, synchronised on the device. With
``--device cpu`` it runs anywhere (a smoke test of the script itself).

    .venv/bin/python benchmarks/moe_dispatch_device.py --device cuda --json out.json
    .venv/bin/python benchmarks/moe_dispatch_device.py --device cpu --tokens 512 --iters 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
CLUSTER = os.path.join(REPO, "tests", "gpu", "nvidia-ascend-2.yaml")


def _sync(dev: str) -> None:
    if dev != "cpu":
        torch.get_device_module(dev).synchronize()


def rank_body(rank, world_size, device, T, D, E, k, iters, warmup):
    from hetcomm.backends import tokens as td

    dev = device if rank == 0 else "cpu"
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].contiguous().to(dev)
    w = (torch.rand(T, k, generator=g) + 0.1).to(dev)
    x = torch.randn(T, D, generator=g).to(dev)
    owner = [e * world_size // E for e in range(E)]
    comm = td.GroupComm.of(None)
    # Per-copy splits: copies per destination rank, exchanged once (not timed).
    own = torch.tensor(owner, device=dev)[idx.reshape(-1)]
    order = torch.argsort(own, stable=True)
    send = torch.bincount(own, minlength=world_size).cpu()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send_l, recv_l = send.tolist(), recv.tolist()
    token = order // k
    times = {"a2a per-copy": [], "dispatch+combine": []}
    out = torch.empty(sum(recv_l), D, device=dev)
    back = torch.empty(T * k, D, device=dev)
    with torch.no_grad():
        for it in range(warmup + iters):
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            rows = x.index_select(0, token)
            dist.all_to_all_single(out, rows, recv_l, send_l)
            dist.all_to_all_single(back, out, send_l, recv_l)
            _sync(dev)
            t1 = time.perf_counter()
            dist.barrier()
            _sync(dev)
            t2 = time.perf_counter()
            res = td.dispatch(comm, x, idx, w, expert_to_rank=owner)
            y = td.combine(comm, res.recv_x, res.handle)
            _sync(dev)
            t3 = time.perf_counter()
            if it >= warmup:
                times["a2a per-copy"].append(t1 - t0)
                times["dispatch+combine"].append(t3 - t2)
    # The combine of the identity is sum_j w_j x: a check that the timed path is right.
    ok = bool(torch.allclose(y, x * w.sum(1, keepdim=True), atol=1e-4))
    return {"times": times, "ok": ok, "device": str(x.device), "bytes_dispatch": res.handle.bytes_sent}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tests.backends.ranks import run_ranks

    res = run_ranks(rank_body, world_size=2, backend="hetcomm", cluster=CLUSTER, timeout=400,
                    args=(a.device, a.tokens, a.dim, a.experts, a.k, a.iters, a.warmup),
                    start_method="spawn" if a.device != "cpu" else "forkserver")  # tests/gpu/__init__.py
    summary = {"config": vars(a), "ranks": res, "median_ms": {}}
    print(f"2 ranks over the bridge (rank 0 on {res[0]['device']}, rank 1 on cpu): T={a.tokens} D={a.dim} "
          f"E={a.experts} k={a.k} FP32, {a.iters} iterations; checks: {[r['ok'] for r in res]}")
    print("| variant | median ms (slower rank) |")
    print("|---|---|")
    for name in res[0]["times"]:
        per_iter = [max(r["times"][name][i] for r in res) for i in range(a.iters)]
        summary["median_ms"][name] = 1e3 * statistics.median(per_iter)
        print(f"| {name} | {summary['median_ms'][name]:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
