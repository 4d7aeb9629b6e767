"""The single-copy all-to-all (hetcomm/backends/rails/cma.py): every rank reads its rows straight
from its peers' inputs with process_vm_readv; the results equal gloo's, the cross-rank check still
stops a mismatch on every rank, and a failed read raises on every rank."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from hetcomm.backends.rails import cma
from tests.backends.ranks import run_ranks

pytestmark = pytest.mark.skipif(not cma.cma_available(), reason="no process_vm_readv on this platform")


def _cases(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import hetcomm

    n = world_size
    checks = {}
    # Uneven splits with an empty pair (rank 0 sends nothing to rank 1), rows of shape [3].
    ins = [0 if (rank, j) == (0, 1) else rank + j + 1 for j in range(n)]
    outs = [0 if (i, rank) == (0, 1) else i + rank + 1 for i in range(n)]
    x = torch.cat([torch.full((ins[j], 3), float(100 * rank + j)) for j in range(n)])
    y = torch.empty(sum(outs), 3)
    hetcomm.reset_stats()
    dist.all_to_all_single(y, x, outs, ins)
    checks["uneven"] = torch.equal(y, torch.cat([torch.full((outs[i], 3), float(100 * i + rank)) for i in range(n)]))
    sent = sum(ins[j] for j in range(n) if j != rank) * 12
    checks["stats"] = hetcomm.stats()["shm"]["bytes_sent"] == sent and "gloo" not in hetcomm.stats()
    # A dtype gloo refuses (uint16: rows travel as bytes), into a non-contiguous output, async.
    xb = (torch.arange(n * 4 * 2, dtype=torch.int32).reshape(n * 4, 2) + 1000 * rank).to(torch.uint16)
    yb = torch.empty(2, n * 4, dtype=torch.uint16).t()
    dist.all_to_all_single(yb, xb, async_op=True).wait()
    want = torch.cat([(torch.arange(8, dtype=torch.int32).reshape(4, 2) + 8 * rank + 1000 * i) for i in range(n)])
    checks["strided_uint16"] = torch.equal(yb.to(torch.int32), want)
    # A split mismatch (rank 0 expects 2 elements from rank 1 and none from rank 2, which each
    # send 1) is caught on every rank before any byte moves.
    out_splits = [1, 2, 0] + [1] * (n - 3) if rank == 0 else [1] * n
    try:
        dist.all_to_all_single(torch.empty(n), torch.empty(n), out_splits, [1] * n)
        checks["mismatch"] = False
    except ValueError as e:
        checks["mismatch"] = "split" in type(e).__name__.lower() or getattr(e, "field", None) == "splits"
    # The group stays usable afterwards.
    z = torch.full((n,), float(rank))
    w = torch.empty(n)
    dist.all_to_all_single(w, z)
    checks["after"] = torch.equal(w, torch.arange(float(n)))
    return {"ok": all(checks.values()), "checks": checks, "way": str(next(iter(hetcomm.communicator().same_host_rail.values())))}


def test_single_copy_moves_every_shape_and_checks():
    out = run_ranks(_cases, world_size=3, timeout=120, env={"HETCOMM_SAME_HOST_RAIL": "cma"})
    assert all(o["ok"] and o["way"] == "cma" for o in out), out


def _failed_read(rank: int, world_size: int) -> list:
    import time

    import hetcomm

    board = hetcomm.communicator().routed.rails.board
    error = cma.CmaError(0, errno.EFAULT) if rank == 1 else None
    return cma.finish(board, rank, world_size, "test", 1, error, time.monotonic() + 30)


def test_a_failed_read_is_reported_to_every_rank():
    out = run_ranks(_failed_read, world_size=2, timeout=60, env={"HETCOMM_SAME_HOST_RAIL": "cma"})
    assert out == [[(1, 0, errno.EFAULT)], [(1, 0, errno.EFAULT)]]


def test_reads_refuse_bad_addresses_and_missing_processes():
    dst = torch.zeros(4, dtype=torch.int64)
    src = torch.arange(4, dtype=torch.int64)
    cma.read_from(0, os.getpid(), dst.data_ptr(), src.data_ptr(), 32)
    assert torch.equal(dst, src)
    with pytest.raises(cma.CmaError) as e:
        cma.read_from(3, os.getpid(), dst.data_ptr(), 8, 32)  # page 0 is never mapped
    assert e.value.errno == errno.EFAULT and e.value.peer == 3
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    with pytest.raises(cma.CmaError) as e:
        cma.read_from(1, gone, dst.data_ptr(), src.data_ptr(), 32)
    assert e.value.errno == errno.ESRCH
