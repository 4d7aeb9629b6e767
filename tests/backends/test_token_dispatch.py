"""dispatch/combine (hetcomm.backends.token_dispatch) against a dense single-process reference.

1, 2 and 4 real rank processes; k in {1, 2, 4}; uneven placements (a rank without experts); a
rank with zero tokens; every token routed to one rank; empty slots (-1) with capacity; chunks;
the async path; torch.no_grad(). FP32 wire: outputs and input gradients within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from hetcomm.backends import token_dispatch as td
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
