"""Every collective of the hetcomm backend against plain gloo, 4 real processes, exact equality.

One spawned group per backend: the same deterministic program runs under ``gloo`` and under
``hetcomm`` (on the mixed-mini cluster, so peers use shm, gloo and bridge rails), and every
output must match bit for bit. Collectives gloo cannot do (AVG, uneven list all_to_all) are
compared with values computed independently.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import MIXED_MINI, run_ranks


def _rows(src: int, dst: int, num_rows: int, width: int = 3, dtype=torch.float32) -> torch.Tensor:
    """The rows rank ``src`` sends to ``dst``: distinct values that reveal any misplacement."""
    base = torch.arange(num_rows * width, dtype=torch.float64).reshape(num_rows, width)
    return (base + 1000 * src + 100 * dst).to(dtype)


def _splits(rank: int, n: int):
    # Uneven on purpose, with zeros: rank r sends (r + 2*j) % 5 rows to rank j.
    return [(rank + 2 * j) % 5 for j in range(n)], [(j + 2 * rank) % 5 for j in range(n)]


def _ops_counted() -> float:
    """Collectives ``hetcomm.stats()`` has counted in this process, over every rail."""
    import hetcomm

    return sum(float(v.get("ops", 0)) for v in hetcomm.stats().values())


def program(rank: int, n: int) -> dict:
    """Run every collective once; return the outputs (same program for gloo and hetcomm)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.nn.functional import all_to_all_single as autograd_a2a

    backend = dist.get_backend()
    out = {}
    torch.manual_seed(1234 + rank)
    # all_reduce, every op (AVG where gloo has it: computed as SUM / n for the reference)
    for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
        for dtype in (torch.float32, torch.int64):
            t = (torch.arange(6, dtype=torch.float64) * (rank + 1) - 3 * rank).to(dtype)
            if op == "AVG" and backend == "gloo":
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
                t = t / n if t.is_floating_point() else torch.div(t, n, rounding_mode="trunc")
            else:
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"all_reduce_{op}_{dtype}"] = t
    t = torch.randn(5, 7)
    w = dist.all_reduce(t, async_op=True)
    out["all_reduce_async_future"] = w.get_future().wait()[0].clone()
    # broadcast
    t = torch.arange(8, dtype=torch.float32) + rank
    dist.broadcast(t, src=2)
    out["broadcast"] = t
    # all_gather / all_gather_into_tensor
    t = torch.full((3,), float(rank))
    lst = [torch.empty(3) for _ in range(n)]
    dist.all_gather(lst, t)
    out["all_gather"] = torch.stack(lst)
    big = torch.empty(3 * n)
    dist.all_gather_into_tensor(big, t)
    out["all_gather_into_tensor"] = big
    # reduce_scatter / reduce_scatter_tensor
    ins = [torch.arange(4, dtype=torch.float32) * (rank + 1) + j for j in range(n)]
    o = torch.empty(4)
    dist.reduce_scatter(o, ins)
    out["reduce_scatter"] = o
    o2 = torch.empty(4)
    dist.reduce_scatter_tensor(o2, torch.cat(ins))
    out["reduce_scatter_tensor"] = o2
    # gather / scatter / reduce
    t = torch.full((2,), float(rank) * 3)
    g = [torch.empty(2) for _ in range(n)] if rank == 1 else None
    dist.gather(t, g, dst=1)
    out["gather"] = torch.stack(g) if g is not None else torch.zeros(0)
    s = torch.empty(2)
    dist.scatter(s, [torch.full((2,), float(j) + 0.5) for j in range(n)] if rank == 3 else None, src=3)
    out["scatter"] = s
    t = torch.arange(4, dtype=torch.float32) + rank
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    out["reduce"] = t if rank == 0 else torch.zeros(0)
    dist.barrier()
    # send / recv / isend / irecv in a ring
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    r = torch.empty(3)
    if rank % 2 == 0:
        dist.send(torch.full((3,), float(rank)), nxt, tag=7)
        dist.recv(r, prv, tag=7)
    else:
        dist.recv(r, prv, tag=7)
        dist.send(torch.full((3,), float(rank)), nxt, tag=7)
    out["send_recv"] = r
    r2 = torch.empty(3)
    reqs = [dist.isend(torch.full((3,), float(rank) + 0.25), nxt), dist.irecv(r2, prv)]
    for q in reqs:
        q.wait()
    out["isend_irecv"] = r2
    # all_to_all_single: equal splits, uneven splits, async, every dtype
    x = torch.arange(4 * n, dtype=torch.float32) + 100 * rank
    y = torch.empty(4 * n)
    dist.all_to_all_single(y, x)
    out["a2a_equal"] = y
    in_s, out_s = _splits(rank, n)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        x = torch.cat([_rows(rank, j, in_s[j], dtype=dtype) for j in range(n)])
        y = torch.empty(sum(out_s), 3, dtype=dtype)
        dist.all_to_all_single(y, x, out_s, in_s)
        out[f"a2a_uneven_{dtype}"] = y
    x = torch.cat([_rows(rank, j, in_s[j]) for j in range(n)])
    y = torch.full((sum(out_s), 3), -1.0)
    work = dist.all_to_all_single(y, x, out_s, in_s, async_op=True)
    work.wait()
    out["a2a_async"] = y
    # 3-d rows and a non-contiguous output
    x3 = torch.arange(2 * n * 2 * 2, dtype=torch.float32).reshape(2 * n, 2, 2) + rank * 1000
    y3 = torch.empty(2, 2 * n, 2).transpose(0, 1)  # non-contiguous [2n, 2, 2]
    dist.all_to_all_single(y3, x3)
    if backend != "gloo":  # gloo writes a non-contiguous output as if it were contiguous
        expect = torch.cat([(torch.arange(2 * n * 2 * 2, dtype=torch.float32).reshape(2 * n, 2, 2) + j * 1000)[2 * rank : 2 * rank + 2] for j in range(n)])
        out["a2a_3d_noncontig_ok"] = torch.equal(y3, expect)
    # all_to_all, list form: equal sizes (gloo can), uneven sizes (checked against _rows)
    ins = [torch.full((2,), float(rank * 10 + j)) for j in range(n)]
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_to_all(outs, ins)
    out["a2a_list_equal"] = torch.cat(outs)
    if backend != "gloo":  # gloo refuses uneven list all_to_all
        ins = [_rows(rank, j, in_s[j]) for j in range(n)]
        outs = [torch.empty(out_s[j], 3) for j in range(n)]
        dist.all_to_all(outs, ins)
        expect = [_rows(j, rank, out_s[j]) for j in range(n)]
        out["a2a_list_uneven_ok"] = all(torch.equal(a, b) for a, b in zip(outs, expect))
    # functional collectives (C++ callers through the trampoline and the cxx fallback)
    t = torch.arange(4, dtype=torch.float32) + rank
    out["funcol_all_reduce"] = funcol.all_reduce(t, "sum", dist.group.WORLD) * 1
    ops_before = _ops_counted()
    out["funcol_all_gather"] = funcol.all_gather_tensor(t, 0, dist.group.WORLD) * 1
    out["funcol_reduce_scatter"] = funcol.reduce_scatter_tensor(torch.arange(4.0 * n) * (rank + 1), "sum", 0, dist.group.WORLD) * 1
    if backend != "gloo":  # served by hetcomm's own path (counted), not gloo entered with the GIL held
        out["funcol_gather_scatter_ops"] = _ops_counted() - ops_before
    x = torch.cat([_rows(rank, j, in_s[j]) for j in range(n)])
    out["funcol_a2a"] = funcol.all_to_all_single(x, out_s, in_s, dist.group.WORLD) * 1
    # autograd all_to_all_single: forward rows, backward routes the gradient back
    x = torch.cat([_rows(rank, j, in_s[j]) for j in range(n)]).requires_grad_(True)
    y = autograd_a2a(torch.empty(sum(out_s), 3), x, out_s, in_s)
    (y * (rank + 1)).sum().backward()
    out["autograd_a2a_y"] = y.detach()
    out["autograd_a2a_grad"] = x.grad
    return out


@pytest.mark.timeout(240)
def test_every_collective_matches_gloo():
    ref = run_ranks(program, world_size=4, backend="gloo", timeout=120)
    got = run_ranks(program, world_size=4, backend="hetcomm", cluster=MIXED_MINI, timeout=120)
    for rank in range(4):
        assert got[rank].pop("a2a_list_uneven_ok") is True, f"rank {rank}: uneven list all_to_all wrong"
        assert got[rank].pop("a2a_3d_noncontig_ok") is True, f"rank {rank}: non-contiguous output wrong"
        assert got[rank].pop("funcol_gather_scatter_ops") >= 2, f"rank {rank}: funcol all_gather/reduce_scatter bypassed hetcomm"
        assert set(got[rank]) == set(ref[rank])
        for key in ref[rank]:
            a, b = got[rank][key], ref[rank][key]
            assert a.dtype == b.dtype and a.shape == b.shape, f"rank {rank} {key}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
            assert torch.equal(a, b), f"rank {rank} {key}: hetcomm {a} != gloo {b}"
    # the uneven all_to_all_single really is uneven and lands where the splits say
    in_s, out_s = _splits(0, 4)
    assert torch.equal(got[0]["a2a_uneven_torch.float32"], torch.cat([_rows(j, 0, out_s[j]) for j in range(4)]))
