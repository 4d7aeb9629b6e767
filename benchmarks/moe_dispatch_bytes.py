"""Bytes one MoE step sends: token dispatch (a token crosses to a rank once) vs a per-copy exchange.

Real rank processes over the hetcomm backend (or gloo). Each rank routes ``T`` tokens to ``k`` of
``E`` experts (uniform: ``k`` distinct experts drawn uniformly per token; experts evenly over the
ranks) and runs one forward and backward step twice in the same processes:

- **per-copy**: the exchange the MoE layer used before the token engine (``hetcomm.backends.tokens``): every (token, expert)
  copy is a row of the all-to-all (``hetcomm.moe.routing.route_tokens``; its bytes follow from the counts),
  there and back, forward and backward (4 exchanges of ``S`` rows);
- **dispatch**: ``hetcomm.backends.tokens.dispatch``/``combine`` (4 exchanges of token rows),
  plus their metadata (counts, expert slots and weights, weight gradients) counted separately.

Bytes are what each rank sends to *other* ranks, summed over ranks, counted by both code paths'
own counters (and checked against ``hetcomm.stats()`` when the backend is hetcomm). Expected
ratio under uniform routing with ``L`` experts per rank of ``E``: the rows to a remote rank fall
from ``k (W-1)/W`` per token to ``(W-1) (1 - C(E-L, k) / C(E, k))``: 0.881 for E=64, k=2, W=4 and
0.457 for k=8.

    .venv/bin/python benchmarks/moe_dispatch_bytes.py                # E=64, k in 2,8, 4 ranks
    .venv/bin/python benchmarks/moe_dispatch_bytes.py --k 2 4 8 --tokens 4096 --dim 1024
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _uniform_topk(T: int, E: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].contiguous()


def rank_body(rank: int, world_size: int, E: int, ks, T: int, D: int):
    from hetcomm.backends import tokens as td
    from hetcomm.moe.placement import place_experts
    from hetcomm.moe.routing import ChunkLayout, route_tokens

    placement = place_experts(E, world_size)
    owner = list(placement.owner)
    layout = ChunkLayout.build(placement, 1)
    comm = td.GroupComm.of(None)
    out = {}
    for k in ks:
        idx = _uniform_topk(T, E, k, seed=1000 * k + rank)
        w = torch.rand(T, k) + 0.1
        x = torch.randn(T, D)
        # --- per-copy: S rows there and back, forward and backward --------------------------
        route = route_tokens(idx, layout.key_of_expert, None)
        send_per_rank = [0] * world_size
        for e, n in enumerate(route.send_counts.tolist()):
            send_per_rank[owner[e]] += n
        counts = torch.tensor(send_per_rank, dtype=torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        # A per-copy exchange sends its S rows out (dispatch, backward of combine) and the
        # received rows back (combine, backward of dispatch): FP32 rows to other ranks, twice each.
        remote = lambda rows: sum(n for p, n in enumerate(rows) if p != rank)  # noqa: E731
        per_copy = 2 * (remote(send_per_rank) + remote(recv_counts.tolist())) * D * 4
        # --- dispatch / combine, forward and backward ----------------------------------------
        td.reset_counters()
        xg = x.clone().requires_grad_(True)
        wg = w.clone().requires_grad_(True)
        res = td.dispatch(comm, xg, idx, wg, expert_to_rank=owner)
        y = res.recv_x * 2.0  # stands for the experts
        o = td.combine(comm, y, res.handle)
        o.sum().backward()
        c = td.counters()
        out[k] = {"per_copy": per_copy, "dispatch": c["bytes_sent"], "meta": c["meta_bytes_sent"]}
    return out


def expected_ratio(E: int, W: int, k: int) -> float:
    L = E // W
    hit = 1 - math.comb(E - L, k) / math.comb(E, k)
    return W * hit / k  # (W-1) remote ranks each hit with probability hit, over k (W-1)/W copies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--backend", default="hetcomm", choices=["hetcomm", "gloo"])
    a = ap.parse_args()
    from tests.backends.ranks import run_ranks

    res = run_ranks(rank_body, world_size=a.ranks, backend=a.backend, timeout=600,
                    args=(a.experts, a.k, a.tokens, a.dim))
    print(f"E={a.experts} W={a.ranks} T={a.tokens}/rank D={a.dim} FP32, uniform routing, one step fwd+bwd, "
          f"bytes sent to other ranks summed over ranks ({a.backend} backend)")
    print("| k | per-copy rows | dispatch rows | rows ratio | dispatch + metadata | total ratio | expected rows ratio |")
    print("|---|---|---|---|---|---|---|")
    for k in a.k:
        pc = sum(r[k]["per_copy"] for r in res)
        dd = sum(r[k]["dispatch"] for r in res)
        mm = sum(r[k]["meta"] for r in res)
        print(f"| {k} | {pc / 2**20:.2f} MiB | {dd / 2**20:.2f} MiB | {dd / pc:.3f} | {(dd + mm) / 2**20:.2f} MiB | "
              f"{(dd + mm) / pc:.3f} | {expected_ratio(a.experts, a.ranks, k):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
