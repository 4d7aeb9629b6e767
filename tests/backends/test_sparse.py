"""Sparse all_reduce (COO, SUM/AVG) and DDP with sparse gradients on hetcomm equal gloo (issue 23.2).

Before: every rank failed in the delegated collectives' staging ("COO only supports memory format
Preserve"), which tried to copy the sparse tensor into a contiguous buffer. A sparse tensor on
one rank beside a dense one on another fails on every rank (the cross-rank check compares the
layout) instead of hanging until the group timeout.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import run_ranks

PG_TIMEOUT = 30.0


def sparse_all_reduce(rank: int, n: int, ops: tuple) -> list:
    import torch.distributed as dist

    out = []
    for op in (getattr(dist.ReduceOp, name) for name in ops):
        # rank-dependent indices, a duplicate index, and a rank with no entries at all
        idx = torch.tensor([[rank % 3, (rank + 1) % 5, rank % 3], [0, 2, 0]])
        val = torch.tensor([1.0 + rank, 2.0 * rank, 0.5])
        t = torch.sparse_coo_tensor(idx, val, (5, 3))
        if rank == n - 1:
            t = torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.long), torch.empty(0), (5, 3))
        dist.all_reduce(t, op=op)
        out.append(t.coalesce().to_dense())
        # async, through the future, 2-D values (rows of an embedding gradient)
        e = torch.sparse_coo_tensor(torch.tensor([[rank, 0]]), torch.full((2, 4), float(rank + 1)), (n + 1, 4))
        fut = dist.all_reduce(e, op=op, async_op=True).get_future()
        out.append(fut.wait()[0].coalesce().to_dense())
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sparse_all_reduce_matches_gloo(world_size):
    # gloo sums sparse tensors only; hetcomm's AVG is that sum divided by the group size
    ref = run_ranks(sparse_all_reduce, world_size=world_size, backend="gloo", args=(("SUM",),), timeout=90, pg_timeout=PG_TIMEOUT)
    got = run_ranks(sparse_all_reduce, world_size=world_size, args=(("SUM", "AVG"),), timeout=90, pg_timeout=PG_TIMEOUT)
    for rank in range(world_size):
        assert len(got[rank]) == 4
        for a, b in zip(got[rank][:2], ref[rank]):
            assert torch.equal(a, b), f"rank {rank}: {a} != gloo's {b}"
        for a, b in zip(got[rank][2:], ref[rank]):
            assert torch.allclose(a, b / world_size), f"rank {rank}: AVG {a} != gloo's SUM / {world_size}"
    assert not torch.equal(got[0][0], torch.zeros(5, 3))


def sparse_refused(rank: int, n: int) -> str:
    import torch.distributed as dist

    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2,))
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM)
    except ValueError as e:
        return type(e).__name__
    return "no error"


@pytest.mark.timeout(120)
def test_sparse_max_is_refused_on_every_rank():
    assert run_ranks(sparse_refused, world_size=2, timeout=60, pg_timeout=PG_TIMEOUT) == ["CrossRankMismatch"] * 2


def sparse_ddp(rank: int, n: int) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8, sparse=True), torch.nn.Linear(8, 2))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(4):
        ids = torch.randint(0, 20, (6,), generator=g)
        loss = ddp(ids).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        assert model[0].weight.grad.is_sparse
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_with_sparse_gradients_matches_gloo(world_size):
    ref = run_ranks(sparse_ddp, world_size=world_size, backend="gloo", timeout=120, pg_timeout=PG_TIMEOUT, start_method="spawn")
    got = run_ranks(sparse_ddp, world_size=world_size, timeout=120, pg_timeout=PG_TIMEOUT, start_method="spawn")
    for rank in range(world_size):
        for a, b in zip(got[rank], ref[rank]):
            assert torch.equal(a, b), f"rank {rank}: parameters differ from DDP over gloo"


def sparse_dense_mix(rank: int, n: int) -> dict:
    import torch.distributed as dist

    from hetcomm.backends.process_group import backend_subclassable

    out = {}
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2,))
    mine = sparse if rank == 0 else torch.ones(2)
    calls = (
        ("all_reduce", lambda: dist.all_reduce(mine)),
        ("broadcast", lambda: dist.broadcast(mine, 0)),
        ("all_gather", lambda: dist.all_gather([torch.zeros(2) for _ in range(n)], mine)),
    )
    for name, call in calls[:1] if backend_subclassable() else calls:
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = (type(e).__name__, e.field, e.ranks, str(e))
    if backend_subclassable() and rank == 0:
        # torch >= 2.14: c10d's ProcessGroup dispatches through the c10d:: operators, which
        # have no SparseCPU kernel but all_reduce's: the sparse rank raises before any backend
        # sees the call, so only that rank calls here (docs/BACKEND.md, "The c10d Backend")
        for name, call in calls[1:]:
            try:
                call()
                out[name] = "no error"
            except NotImplementedError as e:
                out[name] = str(e).split(".")[0]
    t = torch.ones(2)
    dist.all_reduce(t)  # the group is still usable
    out["after"] = t.tolist()
    return out


@pytest.mark.timeout(120)
def test_a_sparse_tensor_beside_a_dense_one_fails_on_every_rank():
    # before: the all_reduce passed the check (same kind, dtype and shape) and both ranks hung in
    # gloo until the group timeout; the broadcast raised on rank 0 only and rank 1 waited for it
    from hetcomm.backends.process_group import backend_subclassable

    res = run_ranks(sparse_dense_mix, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT)
    for rank in range(2):
        kind, field, ranks, msg = res[rank]["all_reduce"]
        assert (kind, field) == ("CrossRankMismatch", "layout"), msg
        assert "rank 0 passes a sparse COO tensor" in msg and "rank 1 passes a dense (strided) tensor" in msg, msg
        assert res[rank]["after"] == [2.0, 2.0]
    if backend_subclassable():
        for name in ("broadcast", "all_gather"):
            assert res[0][name].startswith(f"Could not run 'c10d::{name.replace('_', '')}_' with arguments from the 'SparseCPU' backend"), res[0][name]
        return
    for rank in range(2):
        for name in ("broadcast", "all_gather"):
            kind, field, ranks, msg = res[rank][name]
            assert (kind, field, ranks) == ("CrossRankMismatch", "arguments", [0]), msg
        assert "to_dense()" in res[0]["broadcast"][3]
        assert res[rank]["after"] == [2.0, 2.0]
