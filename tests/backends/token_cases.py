"""Rank-side bodies of the dispatch/combine tests (module level, so they pickle by reference).

The yardstick is :func:`dense_reference`: every token runs every one of its experts in one
process (a loop over slots, no sorting, no exchange), so it shares nothing with the dispatch code.
Experts are small deterministic functions of ``(seed, expert id)``; every rank can build all
of them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

D = 16


def expert_weight(e: int, dim: int = D, device="cpu") -> torch.Tensor:
    """``[D, D]`` float32 weight of expert ``e`` (same on every rank)."""
    g = torch.Generator().manual_seed(7000 + e)
    return (torch.randn(dim, dim, generator=g) / dim**0.5).to(device)


def expert_fn(e: int, z: torch.Tensor, weights: Dict[int, torch.Tensor]) -> torch.Tensor:
    """Expert ``e`` on rows ``z`` ``[n, D]``: ``tanh(z @ W_e) + z`` (nonlinear, differentiable)."""
    w = weights[e].to(z.dtype)
    return torch.tanh(z @ w) + z


def make_inputs(case: Dict[str, Any], rank: int, device="cpu"):
    """This rank's ``x [T, D]``, ``topk_idx [T, k]``, ``topk_weights [T, k]``, upstream grad."""
    T = case.get("tokens", [24] * 8)[rank]
    k, E = case["k"], len(case["owner"])
    g = torch.Generator().manual_seed(100 * rank + case.get("seed", 0))
    x = torch.randn(T, D, generator=g)
    scores = torch.rand(T, E, generator=g)
    only = case.get("only_experts")
    if only is not None:  # route every token to these experts only
        mask = torch.full((E,), float("-inf"))
        mask[only] = 0.0
        scores = scores + mask
    idx = scores.topk(k, dim=1).indices
    if case.get("holes"):  # some slots without an expert
        idx[::3, -1] = -1
    w = torch.rand(T, k, generator=g) + 0.1
    gy = torch.randn(T, D, generator=g)
    return x.to(device), idx.to(device), w.to(device), gy.to(device)


def dense_reference(x, idx, w, gy, weights, capacity: Optional[int] = None):
    """``out[t] = sum_j w[t,j] * f_{idx[t,j]}(x[t])`` and the gradients of ``(out * gy).sum()``."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    T, k = idx.shape
    keep = idx >= 0
    if capacity is not None:  # GShard: first choices first, then earlier tokens
        used: Dict[int, int] = {}
        for j in range(k):
            for t in range(T):
                e = int(idx[t, j])
                if e < 0:
                    continue
                if used.get(e, 0) >= capacity:
                    keep[t, j] = False
                else:
                    used[e] = used.get(e, 0) + 1
    # Every expert on every token ([E, T, D]), then each token picks its k results: plain dense
    # math, nothing shared with the dispatch code.
    E = len(weights)
    every = torch.stack([expert_fn(e, x, weights) for e in range(E)])
    t_ids = torch.arange(T, device=x.device)
    out = x * 0 + 0 * w.sum()  # in the graph even when nothing is kept (a rank without tokens)
    for j in range(k):
        pick = every[idx[:, j].clamp(min=0), t_ids]  # [T, D]
        out = out + (w[:, j] * keep[:, j].to(w.dtype)).unsqueeze(1) * pick
    (out * gy).sum().backward()
    return out.detach(), x.grad, w.grad, int((~keep & (idx >= 0)).sum())


def run_case(comm, case: Dict[str, Any], device="cpu") -> Dict[str, Any]:
    """dispatch -> experts -> combine on this rank; errors against the dense reference."""
    from hetcomm.backends import tokens as td

    rank = comm.rank
    owner = case["owner"]
    weights = {e: expert_weight(e, device=device) for e in range(len(owner))}
    x, idx, w, gy = make_inputs(case, rank, device)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    kw = dict(expert_to_rank=owner, capacity=case.get("capacity"), num_chunks=case.get("chunks", 1))
    mine = [e for e in range(len(owner)) if owner[e] == rank]
    if case.get("pieces"):  # split_by_expert: one piece per local expert, outputs as they come
        recv, counts, handle, work = td.dispatch(comm, xg, idx, wg, async_op=True, split_by_expert=True, **kw)
        assert [tuple(p.shape) for p in recv] == [(n, D) for n in counts]
        ys = []
        for c, (lo, hi) in enumerate(handle.chunk_experts):
            work.wait_chunk(c)
            ys += [expert_fn(mine[l], recv[l], weights) for l in range(lo, hi)]
        out = td.combine(comm, ys, handle)
    elif case.get("async"):
        recv_x, counts, handle, work = td.dispatch(comm, xg, idx, wg, async_op=True, **kw)
        ys = []
        off = 0
        for c, n in enumerate(handle.chunk_rows):  # experts start on a chunk once it is in
            work.wait_chunk(c)
            lo, hi = handle.chunk_experts[c]
            part = recv_x[off : off + n].split(counts[lo:hi])
            ys += [expert_fn(mine[lo + i], p, weights) for i, p in enumerate(part)]
            off += n
        y = torch.cat(ys) if ys else recv_x * 0
        out, cw = td.combine(comm, y, handle, async_op=True)
        cw.wait()
    else:
        recv_x, counts, handle = td.dispatch(comm, xg, idx, wg, **kw)
        parts = recv_x.split(counts)
        y = torch.cat([expert_fn(mine[i], p, weights) for i, p in enumerate(parts)]) if parts else recv_x * 0
        out = td.combine(comm, y, handle)
    (out * gy).sum().backward()
    ref_out, ref_gx, ref_gw, ref_dropped = dense_reference(x, idx, w, gy, weights, case.get("capacity"))
    with torch.no_grad():  # the same verbs without autograd
        r2, c2, h2 = td.dispatch(comm, x, idx, w, **kw)
        p2 = r2.split(c2)
        y2 = torch.cat([expert_fn(mine[i], p, weights) for i, p in enumerate(p2)]) if p2 else r2 * 0
        out2 = td.combine(comm, y2, h2)

    def err(a, b):
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

    return {
        "out": err(out.detach(), ref_out),
        "x_grad": err(xg.grad, ref_gx),
        "w_grad": err(wg.grad, ref_gw),
        "no_grad_out": err(out2, ref_out),
        "dropped": handle.num_dropped,
        "ref_dropped": ref_dropped,
        "recv_rows": sum(counts),
        "per_source_ok": [sum(col) for col in zip(*handle.recv_counts_per_source)] == list(counts)
        and handle.send_rows[rank] == 0 and handle.recv_rows[rank] == 0,
        "bytes_sent": handle.bytes_sent,
        "device": str(out.device),
        "out_scale": float(ref_out.abs().max()) if ref_out.numel() else 0.0,
    }


def all_cases(world_size: int) -> List[Dict[str, Any]]:
    """The dispatch/combine cases of the done-when list, for ``world_size`` ranks."""
    W = world_size
    even = [e * W // 8 for e in range(8)]  # 8 experts, evenly
    # Uneven: 7 experts, rank 0 holds most, the last rank none (when W > 1).
    uneven = [min(e // 3, max(W - 2, 0)) for e in range(7)]
    cases = []
    for k in (1, 2, 4):
        cases.append({"name": f"k{k}", "k": k, "owner": even})
    cases += [
        {"name": "uneven_k2", "k": 2, "owner": uneven},
        {"name": "uneven_k4_chunks2_async", "k": 4, "owner": uneven, "chunks": 2, "async": True},
        {"name": "zero_tokens_on_rank1", "k": 2, "owner": even, "tokens": [24, 0, 24, 17][:W] + [24] * 8},
        {"name": "all_to_rank0", "k": 2, "owner": even, "only_experts": [e for e in range(8) if even[e] == 0] or [0, 1]},
        {"name": "holes_capacity", "k": 2, "owner": even, "holes": True, "capacity": 5},
        {"name": "k4_chunks3", "k": 4, "owner": even, "chunks": 3},
        {"name": "k2_pieces", "k": 2, "owner": even, "pieces": True},
        {"name": "k4_chunks3_pieces_capacity", "k": 4, "owner": even, "chunks": 3, "pieces": True, "capacity": 9},
    ]
    return cases


def run_all(rank: int, world_size: int, cases=None, device="cpu", wire=None) -> Dict[str, Dict[str, Any]]:
    """Every case on this rank over the default group (a run_ranks body)."""
    from hetcomm.backends.tokens import GroupComm

    comm = GroupComm.of(None, wire=wire)
    return {c["name"]: run_case(comm, c, device) for c in (cases or all_cases(world_size))}
