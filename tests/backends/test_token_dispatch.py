"""dispatch/combine (hetcomm.backends.tokens) against a dense single-process reference.

1, 2 and 4 real rank processes; k in {1, 2, 4}; uneven placements (a rank without experts); a
rank with zero tokens; every token routed to one rank; empty slots (-1) with capacity; chunks;
the async path; torch.no_grad(). FP32 wire: outputs and input gradients within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from hetcomm.backends import tokens as td
from hetcomm.errors import UsageError
from tests.backends import token_cases
from tests.backends.ranks import run_ranks

TOL = 1e-5


def _check(per_rank):
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            for key in ("out", "x_grad", "w_grad", "no_grad_out"):
                assert r[key] <= TOL, (rank, name, key, r)
            assert r["dropped"] == r["ref_dropped"], (rank, name, r)
            assert r["per_source_ok"], (rank, name, r)


def test_one_rank_equals_dense_reference():
    _check([token_cases.run_all(0, 1)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_equal_dense_reference(world_size):
    res = run_ranks(token_cases.run_all, world_size=world_size, backend="hetcomm", timeout=100)
    _check(res)
    # Uneven placement: the last rank owns no expert and receives nothing.
    assert res[-1]["uneven_k2"]["recv_rows"] == 0
    # Everything to rank 0: the others receive nothing, rank 0 everything.
    assert all(r["all_to_rank0"]["recv_rows"] == 0 for r in res[1:])
    assert res[0]["all_to_rank0"]["recv_rows"] == 24 * world_size * 2


def _fp16_wire(rank, world_size):
    cases = [c for c in token_cases.all_cases(world_size) if c["name"] in ("k2", "uneven_k4_chunks2_async")]
    fp32 = token_cases.run_all(rank, world_size, cases)
    fp16 = token_cases.run_all(rank, world_size, cases, wire=torch.float16)
    return fp32, fp16


@pytest.mark.timeout(90)
def test_fp16_wire_halves_the_row_bytes_and_rounds():
    res = run_ranks(_fp16_wire, world_size=2, backend="gloo", timeout=80)
    for fp32, fp16 in res:
        for name in fp32:
            assert fp16[name]["bytes_sent"] * 2 == fp32[name]["bytes_sent"], name
            assert 0 < fp16[name]["out"] < 2e-2 * max(1.0, fp16[name]["out_scale"]), (name, fp16[name])


def test_a_token_crosses_to_a_rank_once():
    # Token 0 picks experts 0 and 1 (both on rank 0) and 2 (rank 1): 1 row to each rank.
    idx = torch.tensor([[0, 1, 2], [3, 2, -1]])
    rows = td.count_token_rows(idx, [0, 0, 1, 1], world_size=2)
    assert rows.tolist() == [1, 2]
    # With two chunks, experts 0 and 1 of rank 0 travel in different chunks.
    assert td.count_token_rows(idx, [0, 0, 1, 1], world_size=2, num_chunks=2).tolist() == [2, 3]


def test_capacity_drops_in_gshard_order():
    idx = torch.tensor([[0, 1], [0, 1], [1, 0]])
    kept, dropped = td.drop_over_capacity(idx, 2, 2)
    # First choices claim capacity first: expert 0 keeps tokens 0, 1 (first choices); token 2's
    # second choice of 0 is dropped; expert 1 keeps token 2 (first) and token 0 (second).
    assert kept.tolist() == [[0, 1], [0, -1], [1, -1]]
    assert dropped == 2


def test_bad_input_is_named_before_anything_moves():
    comm = td.GroupComm(None, 0, 1)
    x = torch.randn(4, 8)
    w = torch.rand(4, 2)
    with pytest.raises(UsageError, match="int64"):
        td.dispatch(comm, x, torch.zeros(4, 2, dtype=torch.int32), w, expert_to_rank=[0, 0])
    with pytest.raises(UsageError, match=r"expert 5, outside -1..1"):
        td.dispatch(comm, x, torch.full((4, 2), 5), w, expert_to_rank=[0, 0])
    with pytest.raises(UsageError, match="maps expert 1 to rank 3"):
        td.dispatch(comm, x, torch.zeros(4, 2, dtype=torch.int64), w, expert_to_rank=[0, 3])
    recv_x, counts, h = td.dispatch(comm, x, torch.zeros(4, 1, dtype=torch.int64), w[:, :1], expert_to_rank=[0, 0])
    with pytest.raises(UsageError, match=r"y must be \[4, hidden\]"):
        td.combine(comm, recv_x[:3], h)
    with pytest.raises(UsageError, match=r"one \[rows, hidden\] tensor per local expert with rows \[4, 0\]"):
        td.combine(comm, [recv_x], h)


def _readme_example(rank, world_size):
    """The README's "Your own MoE over hetcomm" block, run as written on every rank."""
    import os
    import re

    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    section = text.split("## Your own MoE over hetcomm", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    torch.manual_seed(rank)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    x, out = scope["x"], scope["out"]
    return {"shape": tuple(out.shape), "finite": bool(torch.isfinite(out).all()), "x_grad": x.grad is not None}


@pytest.mark.timeout(90)
def test_readme_example_runs_on_two_ranks():
    for r in run_ranks(_readme_example, world_size=2, backend="hetcomm", timeout=80):
        assert r == {"shape": (128, 64), "finite": True, "x_grad": True}, r


def test_capacity_must_be_a_count():
    comm = td.GroupComm(None, 0, 1)
    x, w = torch.randn(4, 8), torch.rand(4, 2)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    for bad in (-1, 2.5, True):
        with pytest.raises(UsageError, match=r"capacity must be None .* or an integer >= 0") as e:
            td.dispatch(comm, x, idx, w, expert_to_rank=[0, 0], capacity=bad)
        assert repr(bad) in str(e.value)
    res = td.dispatch(comm, x, idx, w, expert_to_rank=[0, 0], capacity=0)  # 0 is a capacity: all dropped
    assert res.handle.num_dropped == 8 and res.recv_counts == [0, 0]


def test_dispatch_result_is_one_type_and_unpacks_the_old_way_with_a_warning():
    comm = td.GroupComm(None, 0, 1)
    x, w = torch.randn(4, 8), torch.rand(4, 1)
    idx = torch.zeros(4, 1, dtype=torch.int64)
    sync = td.dispatch(comm, x, idx, w, expert_to_rank=[0])
    asyn = td.dispatch(comm, x, idx, w, expert_to_rank=[0], async_op=True)
    assert type(sync) is type(asyn) is td.DispatchResult
    assert sync.work.is_completed()
    asyn.work.wait()
    assert torch.equal(sync.recv_x, asyn.recv_x) and sync.recv_counts == [4]
    with pytest.warns(DeprecationWarning, match="res.recv_x"):
        a, b, c = sync
    with pytest.warns(DeprecationWarning):
        a, b, c, d = asyn
    assert d is asyn.work and c is asyn.handle


def _mismatched(rank, world_size, what):
    """Rank 1 dispatches with one argument different; every rank reports what it raised."""
    from hetcomm.backends.tokens import GroupComm, dispatch
    from hetcomm.errors import CrossRankMismatch

    comm = GroupComm.of(None)
    D, k, owner, dtype = 8, 2, [0, 0, 1, 1], torch.float32
    if rank == 1:
        if what == "hidden":
            D = 16
        elif what == "dtype":
            dtype = torch.float64
        elif what == "k":
            k = 1
        elif what == "owner":
            owner = [1, 0, 0, 1]  # the same experts per rank, another map
    x = torch.randn(6, D, dtype=dtype)
    idx = torch.arange(6 * k).remainder(4).view(6, k)
    w = torch.rand(6, k)
    out = {}
    try:
        dispatch(comm, x, idx, w, expert_to_rank=owner)
        out["raised"] = None
    except CrossRankMismatch as e:
        out.update(raised=str(e), ranks=e.ranks, field=e.field, rank=e.rank)
    # The group stays usable: a correct dispatch right after works on every rank.
    x = torch.randn(6, 8)
    res = dispatch(comm, x, torch.arange(12).remainder(4).view(6, 2), torch.rand(6, 2), expert_to_rank=[0, 0, 1, 1])
    out["after"] = sum(res.recv_counts)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what,needle", [
    ("hidden", "hidden size (x.size(1)): ranks [0]: 8; ranks [1]: 16"),
    ("dtype", "dtype (x.dtype): ranks [0]: float32; ranks [1]: float64"),
    ("k", "k (topk_idx.size(1)): ranks [0]: 2; ranks [1]: 1"),
    ("owner", "expert_to_rank (the owner of each expert)"),
])
def test_arguments_that_differ_across_ranks_raise_on_every_rank(what, needle):
    res = run_ranks(_mismatched, world_size=2, backend="gloo", timeout=100, args=(what,))
    for r, out in enumerate(res):
        assert out["raised"] is not None and needle in out["raised"], (r, out)
        assert out["rank"] == r and 1 in out["ranks"] or out["ranks"] == [0, 1], out
        assert out["after"] == 12, out
