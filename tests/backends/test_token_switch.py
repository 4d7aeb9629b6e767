"""Conformance of ``hetcomm.TokenSwitch`` to torch's ``TokenSwitch`` contract, on real ranks.

Written from torch's documented contract (``torch.distributed._token_switch``), not from our
implementation: every check reads only what the contract promises (the slots' rows, their
``out_topk_idx``/``out_topk_weights``, the unweighted combine, autograd through both), never the
order of slots inside a layout. The conformance tests take the implementation as a parameter:
ours always, torch's ``TokenSwitchNCCL`` where a GPU and torch >= 2.14 exist, so the same tests
check torch's on a GPU machine. A deliberately wrong implementation (its combine weights the
slots) must fail them: :func:`test_wrong_implementation_is_caught`.

Reference: a dense single-process model of every rank's tokens (each rank rebuilds all ranks'
inputs from one seed). Data "exact" is small integers and dyadic weights, whose sums are exact
in any order and in fp16: compared bit for bit. Data "random" is normal floats over an exact
(fp32) wire: within 1e-6.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import hetcomm
from hetcomm.backends.tokens import switch as ts_mod
from tests.backends.ranks import MIXED_MINI, run_ranks, run_ranks_outcomes

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= 1

IMPLS = [
    pytest.param("hetcomm", id="hetcomm"),
    pytest.param(
        "torch-nccl",
        id="torch-nccl",
        marks=pytest.mark.skipif(
            not (HAS_GPU and ts_mod.HAS_TORCH_TOKEN_SWITCH),
            reason="torch's TokenSwitchNCCL needs a GPU and torch >= 2.14",
        ),
    ),
]



def _torch_has_layouts() -> bool:
    """Whether the installed torch's ``TokenSwitch.create_routing`` takes ``layout=`` (2.14.1's
    does not: torch's implementation then has the flat layout only)."""
    if not ts_mod.HAS_TORCH_TOKEN_SWITCH:
        return False
    from torch.distributed._token_switch import TokenSwitch as TorchTokenSwitch

    return "layout" in inspect.signature(TorchTokenSwitch.create_routing).parameters


#: (implementation, layout) pairs; torch's implementation has expert_major only where it takes layout=.
IMPL_LAYOUTS = [
    pytest.param(impl.values[0], layout, id=f"{impl.id}-{layout}",
                 marks=[*impl.marks, *([pytest.mark.skipif(not _torch_has_layouts(),
                                                           reason="this torch's TokenSwitch has one layout")]
                                     if impl.values[0] == "torch-nccl" and layout != "flat" else [])])
    for impl in IMPLS for layout in ("flat", "expert_major")
]

#: The group's per-link wire dtypes from the cluster YAML (mixed-mini: fp16 over the bridge).
CLUSTER_WIRE = {"HETCOMM_WIRE_DTYPE": "cluster"}

MAX_N = 32  # tokens per rank at most: column 0 of an "exact" token encodes (source, token)


# ----------------------------------------------------------------------------------------------
# Implementations under test


class WeightedCombine(ts_mod.TokenSwitch):
    """Deliberately wrong: combine weights each slot by its dispatched weights (the contract
    says unweighted). The suite must reject it."""

    def dispatch(self, routing, tokens, topk_weights, max_recv_tokens=None, *, out=None):
        res = super().dispatch(routing, tokens, topk_weights, max_recv_tokens, out=out)
        self._slot_w = res[1].detach().sum(1, keepdim=True)
        return res

    def combine(self, routing, expert_tokens, *, out=None):
        w = self._slot_w[: expert_tokens.size(0)].to(expert_tokens.dtype)
        return super().combine(routing, expert_tokens * w, out=out)


def _device(impl: str) -> torch.device:
    if impl == "torch-nccl":
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _make(impl: str, E: int, max_n: int, max_recv: int, max_bytes: int):
    if impl == "hetcomm":
        return hetcomm.TokenSwitch(None, E, max_n, max_recv, max_bytes)
    if impl == "weighted-combine":
        return WeightedCombine(None, E, max_n, max_recv, max_bytes)
    if impl == "torch-nccl":
        from torch.distributed._token_switch import TokenSwitchNCCL

        torch.cuda.set_device(_device(impl))
        return TokenSwitchNCCL(dist.group.WORLD, E, max_n, max_recv, max_bytes)
    raise AssertionError(impl)


def _backend(impl: str) -> str:
    return "nccl" if impl == "torch-nccl" else "hetcomm"


def _routing(ts, idx, counts=None, layout="flat"):
    if layout == "flat" and "layout" not in inspect.signature(ts.create_routing).parameters:
        return ts.create_routing(idx, counts)  # torch 2.14.1: one layout, no keyword
    return ts.create_routing(idx, counts, layout=layout)


# ----------------------------------------------------------------------------------------------
# Cases and the dense reference


def _case(seed: int, W: int, E: int, K: int, H: int, ns: List[int], exact: bool,
          skip_rank: Optional[int]):
    """Every rank's ``(x [N, H], idx [N, K], w [N, K])`` and the experts' ``(a [E, H], b [E, H])``.

    Some slots are -1, some tokens go nowhere, and with ``skip_rank`` no token picks that
    rank's experts (an empty receiver)."""
    g = torch.Generator().manual_seed(seed)
    L = E // W
    allowed = [e for e in range(E) if skip_rank is None or e // L != skip_rank]
    data = []
    for s, n in enumerate(ns):
        assert n <= MAX_N
        if exact:
            x = torch.randint(-8, 9, (n, H), generator=g).float()
            x[:, 0] = s * MAX_N + torch.arange(n)  # (source, token): unique, exact in fp16
            w = torch.randint(1, 7, (n, K), generator=g).float() / 4  # 0.25 .. 1.5, dyadic
        else:
            x = torch.randn(n, H, generator=g)
            w = torch.rand(n, K, generator=g) + 0.1
        idx = torch.empty(n, K, dtype=torch.int64)
        for t in range(n):
            pick = torch.randperm(len(allowed), generator=g)[:K]
            idx[t] = torch.tensor([allowed[i] for i in pick])
        # Fewer than k experts: about a third of the slots empty, one token with none at all.
        idx[torch.rand(n, K, generator=g) < 0.3] = -1
        if n > 2:
            idx[n // 2] = -1
        data.append((x, idx, w))
    if exact:
        a = torch.randint(1, 4, (E, H), generator=g).float()
        b = torch.randint(-4, 5, (E, H), generator=g).float()
    else:
        a = torch.randn(E, H, generator=g)
        b = torch.randn(E, H, generator=g)
    return data, a, b


def _experts(rows: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, a, b, first: int):
    """What a user's experts make of received slots: ``sum_j w_j * (row * a_e + b_e)`` over the
    slot's valid columns (``e = first + idx``). Works for both layouts."""
    out = torch.zeros_like(rows)
    for j in range(idx.size(1)):
        ok = idx[:, j] >= 0
        e = (idx[:, j].clamp(min=0) + first).cpu()
        f = rows * a[e].to(rows.device) + b[e].to(rows.device)
        term = w[:, j : j + 1].to(rows.dtype) * f
        out = out + torch.where(ok.unsqueeze(1), term, torch.zeros_like(f))
    return out


def _dense(x, idx, w, a, b):
    """The single-process reference of one rank's tokens: ``sum_j w_j * f_{e_j}(x)``."""
    return _experts(x, w, idx, a, b, 0)


def _expected_slots(data, rank: int, L: int, layout: str):
    """The multiset of this rank's slots: ``(source, token, local ids, weights)`` per slot."""
    want = []
    for s, (x, idx, w) in enumerate(data):
        for t in range(idx.size(0)):
            here = [(int(idx[t, j]) - rank * L, float(w[t, j])) for j in range(idx.size(1))
                    if idx[t, j] >= 0 and int(idx[t, j]) // L == rank]
            if not here:
                continue
            if layout == "flat":
                want.append((s, t, tuple(sorted(here))))
            else:
                want.extend((s, t, (h,)) for h in here)
    return sorted(want)


# ----------------------------------------------------------------------------------------------
# The rank programs


def _conformance(rank, W, impl, layout, modes, ns, skip_rank, seed):
    """:func:`_conform` once per data mode (one launch of ranks for all)."""
    return [_conform(rank, W, impl, layout, exact, ns, skip_rank, seed) for exact in modes]


def _conform(rank, W, impl, layout, exact, ns, skip_rank, seed):
    """Dispatch, check the slots, experts, combine and backward against the reference; again
    with out= buffers. Raises AssertionError on any difference."""
    E, K, H = 2 * W, min(3, 2 * W), 8
    dev = _device(impl)
    data, a, b = _case(seed, W, E, K, H, ns, exact, skip_rank)
    L = E // W
    x, idx, w = (t.to(dev) for t in data[rank])
    total = sum(ns) * K
    max_recv = max(total, 1) + 2  # room for every copy, plus rows that must stay unused
    ts = _make(impl, E, MAX_N, max_recv, H * 4)
    counts = torch.full((L + 1,), -5, dtype=torch.int32, device=dev)
    routing = _routing(ts, idx, counts, layout)
    want = _expected_slots(data, rank, L, layout)
    per_expert = [sum(1 for s in want for h in s[2] if h[0] == l) for l in range(L)]
    assert counts[:L].tolist() == per_expert, (
        f"per_expert_token_counts {counts.tolist()} != {per_expert}"
    )
    assert int(counts[L]) == -5, "per_expert_token_counts was written past the local experts"

    def check(out_tokens, out_w, out_idx, name):
        # torch 2.14.1's shapes and dtypes: [M, H] tokens', [M, K] weights' and topk_idx's.
        for t, shape, dtype in ((out_tokens, (max_recv, H), x.dtype), (out_w, (max_recv, K), w.dtype),
                                (out_idx, (max_recv, K), idx.dtype)):
            assert t.shape == shape and t.dtype == dtype, f"{name}: {tuple(t.shape)} {t.dtype}"
        used = (out_idx >= 0).any(1)
        n = int(used.sum())
        assert n == len(want), f"{name}: rank {rank} got {n} slots, expected {len(want)}"
        if impl != "torch-nccl":
            # hetcomm's own promise (torch's contract leaves it open): slots first, then padding.
            assert bool(used[:n].all()), f"{name}: the used slots are not the first {n} rows"
            assert not out_tokens[n:].any() and not out_w[n:].any() and bool((out_idx[n:] == -1).all())
        if not exact:
            return
        got = []
        for r in used.nonzero().flatten().tolist():
            s, t = divmod(int(out_tokens[r, 0]), MAX_N)
            assert torch.equal(out_tokens[r].cpu(), data[s][0][t]), f"{name}: slot {r} is not {s}:{t}"
            here = [(int(out_idx[r, j]), float(out_w[r, j])) for j in range(K) if out_idx[r, j] >= 0]
            assert all(0 <= h[0] < L for h in here), f"{name}: slot {r} names local experts {here}"
            got.append((s, t, tuple(sorted(here))))
        assert sorted(got) == want, f"{name}: rank {rank} slots {sorted(got)} != {want}"

    def compare(got, ref, name):
        if exact:
            diff = (got.cpu() - ref).abs().max() if got.numel() else 0
            assert torch.equal(got.cpu(), ref), f"{name}: rank {rank} max diff {diff}"
        else:
            torch.testing.assert_close(got.cpu(), ref, atol=1e-6, rtol=1e-6,
                                       msg=lambda m: f"{name}: rank {rank}: {m}")

    # Forward and backward against the dense reference.
    xg = x.clone().requires_grad_(True)
    out_tokens, out_w, out_idx = ts.dispatch(routing, xg, w, max_recv)
    check(out_tokens.detach(), out_w, out_idx, "dispatch")
    y = _experts(out_tokens, out_w, out_idx, a, b, rank * L)
    out = ts.combine(routing, y)
    assert out.shape == (x.size(0), H) and out.dtype == x.dtype
    xr = data[rank][0].clone().requires_grad_(True)
    ref = _dense(xr, data[rank][1], data[rank][2], a, b)
    compare(out.detach(), ref.detach(), "combine")
    gen = torch.Generator().manual_seed(seed + rank)
    G = torch.randint(-3, 4, (x.size(0), H), generator=gen).float()
    (out * G.to(dev)).sum().backward()
    (ref * G).sum().backward()
    compare(xg.grad, xr.grad, "backward")

    # The same through out= buffers, prefilled with garbage (no autograd on this path).
    bufs = (torch.full((max_recv, H), 7.0, device=dev), torch.full((max_recv, K), 7.0, device=dev),
            torch.full((max_recv, K), 7, dtype=idx.dtype, device=dev))
    routing2 = _routing(ts, idx, None, layout)
    got = ts.dispatch(routing2, x, w, out=bufs)
    assert all(g is o for g, o in zip(got, bufs)), "dispatch(out=) must return its buffers"
    check(*bufs, "dispatch(out=)")
    y2 = _experts(bufs[0], bufs[1], bufs[2], a, b, rank * L)
    res = torch.full((x.size(0), H), 7.0, device=dev)
    assert ts.combine(routing2, y2, out=res) is res
    compare(res, ref.detach(), "combine(out=)")
    return len(want)


def _bridge_wire(rank, W):
    """Each pair's rows travel in that link's wire dtype: 1/3 from a bridge peer arrives as
    fp16's 1/3, from any other as float32's."""
    E, H = W, 4
    comm = hetcomm.communicator()
    ts = hetcomm.TokenSwitch(None, E, MAX_N, W, H * 4)
    idx = torch.arange(E).view(1, E)  # one token to every rank's expert
    x = torch.full((1, H), 1.0 / 3.0)
    routing = ts.create_routing(idx)
    out_tokens, _w, out_idx = ts.dispatch(routing, x, torch.ones(1, E), W)
    third = torch.tensor(1.0 / 3.0)
    wires = {}
    for s in range(W):
        # Flat slots from other ranks come by source rank, then the own row: check by value.
        wire = comm.wire_dtype(s, torch.float32) if s != rank else None
        wires[s] = str(wire)
    got = sorted(float(v) for v in out_tokens[:W, 0])
    half = float(third.to(torch.float16).float())
    want = sorted(half if wires[s] == "torch.float16" else float(third) for s in range(W))
    assert got == want, f"rank {rank}: rows {got}, wires {wires}, want {want}"
    return wires


def _too_many(rank, W, which):
    """A routing or dispatch over some rank's room fails on every rank; the group stays usable."""
    E, K, H = 2 * W, 2, 4
    ts = hetcomm.TokenSwitch(None, E, MAX_N, 4, H * 4)
    n = 3 if rank == 0 else 1
    x, w = torch.ones(n, H), torch.ones(n, K)
    err = None
    try:
        if which == "routing":
            # expert_major: rank 0 receives 3*2 + 1*2 = 8 slots, over max_recv_tokens_per_rank=4.
            ts.create_routing(torch.tensor([[0, 1]] * n), layout="expert_major")
        else:
            # flat: both ranks receive 4 slots; rank 1 offers only 3 rows.
            routing = ts.create_routing(torch.tensor([[0, 2]] * n))
            ts.dispatch(routing, x, w, 4 if rank == 0 else 3)
    except hetcomm.errors.RecvCapacityError as e:
        err = (type(e).__name__, str(e), e.ranks, e.needed, e.room)
    # Still usable: a routing that fits (one slot per token, on rank 0).
    routing = ts.create_routing(torch.tensor([[0, -1]]))
    out, _, _ = ts.dispatch(routing, x[:1], w[:1], 4)
    assert torch.equal(ts.combine(routing, out), x[:1])
    return err


def _bad_args(rank, W):
    """One rank's bad argument fails every rank (no hang); so do constructions that differ."""
    try:
        hetcomm.TokenSwitch(None, 2 * W, MAX_N, 64 + rank, 64)
        return None
    except hetcomm.errors.UsageError as e:
        assert "max_recv_tokens_per_rank ranges 64..65" in str(e), str(e)
    ts = hetcomm.TokenSwitch(None, 2 * W, MAX_N, 64, 64)
    idx = torch.tensor([[0, 2 * W if rank == 1 else 1]])
    try:
        ts.create_routing(idx)
    except hetcomm.errors.UsageError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------------------------------
# Tests


CASES = [
    # (world size, tokens per rank, rank whose experts nobody picks, cluster)
    pytest.param(1, [7], None, None, id="w1"),
    pytest.param(2, [9, 0], None, None, id="w2-empty-sender"),
    pytest.param(4, [5, 0, 12, 3], 2, None, id="w4-uneven-empty-receiver"),
]


@pytest.mark.parametrize("impl,layout", IMPL_LAYOUTS)
@pytest.mark.parametrize("W,ns,skip,cluster", CASES)
def test_conformance(impl, layout, W, ns, skip, cluster):
    got = run_ranks(_conformance, world_size=W, backend=_backend(impl), cluster=cluster, timeout=60,
                    args=(impl, layout, (True, False), ns, skip, 11 + W))
    assert sum(sum(g) for g in got) > 0


@pytest.mark.parametrize("layout", ["flat", "expert_major"])
def test_conformance_over_the_bridge(layout):
    # mixed-mini: rank 3 (Ascend) reaches the others over the host bridge in fp16 (wire policy
    # "cluster"); integer tokens and dyadic weights are exact in fp16, so the bridge pairs are
    # compared bit for bit too.
    run_ranks(_conformance, world_size=4, cluster=MIXED_MINI, timeout=60, env=CLUSTER_WIRE,
              args=("hetcomm", layout, (True,), [4, 6, 0, 5], None, 5))


def test_per_link_wire_dtypes():
    wires = run_ranks(_bridge_wire, world_size=4, cluster=MIXED_MINI, timeout=60, env=CLUSTER_WIRE)
    assert "torch.float16" in wires[3].values(), f"expected an fp16 bridge pair, got {wires}"


def test_wrong_implementation_is_caught():
    outs = run_ranks_outcomes(_conformance, world_size=2, timeout=60,
                              args=("weighted-combine", "flat", (True,), [6, 5], None, 3))
    assert not all(o.ok for o in outs), "a combine that weights its slots passed the suite"
    caught = [o for o in outs if o.error_type == "AssertionError" and "combine" in (o.error or "")]
    assert caught, [o.describe() for o in outs]


@pytest.mark.parametrize("which", ["routing", "dispatch"])
def test_receive_over_room_fails_on_every_rank(which):
    errs = run_ranks(_too_many, world_size=2, timeout=60, args=(which,))
    assert all(e is not None and e[0] == "RecvCapacityError" for e in errs), errs
    for e in errs:
        if which == "routing":
            assert e[2:] == ([0], [8], [4]) and "max_recv_tokens_per_rank" in e[1], e
        else:
            assert e[2:] == ([1], [4], [3]) and "max_recv_tokens" in e[1], e


def test_bad_argument_fails_on_every_rank():
    errs = run_ranks(_bad_args, world_size=2, timeout=60)
    assert "outside -1..3" in errs[1] and "rank(s) [1]" in errs[0], errs


def test_is_torchs_class_where_torch_has_it():
    if ts_mod.HAS_TORCH_TOKEN_SWITCH:
        from torch.distributed._token_switch import Routing, TokenSwitch

        assert issubclass(hetcomm.TokenSwitch, TokenSwitch)
        assert issubclass(ts_mod.Routing, Routing)
    else:
        assert not hasattr(dist, "_token_switch") or not hasattr(dist._token_switch, "TokenSwitch")
    assert hetcomm.TokenSwitch is ts_mod.TokenSwitch


def _docs_example(rank, W, src):
    ns: Dict[str, object] = {}
    exec(compile(src, "docs/MOE.md", "exec"), ns)
    torch.manual_seed(0)  # the same router and experts on every rank
    block = ns["SwitchMoE"](8, 16, 2 * W, 2, max_tokens=10)
    x = torch.randn(6 + rank, 8, requires_grad=True)
    out = block(x)
    out.square().sum().backward()
    assert out.shape == x.shape and x.grad is not None and torch.isfinite(x.grad).all()
    return [p.grad is not None for p in block.experts.parameters()]


def test_docs_moe_example_runs():
    # docs/MOE.md's MoE block over hetcomm.TokenSwitch, as printed there: forward and backward.
    import os
    import re

    from tests.backends.ranks import REPO_ROOT

    text = open(os.path.join(REPO_ROOT, "docs", "MOE.md")).read()
    sec = text[text.index("## A MoE block over `hetcomm.TokenSwitch`"):]
    src = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    grads = run_ranks(_docs_example, world_size=2, timeout=60, args=(src,))
    assert all(any(g) for g in grads), grads
