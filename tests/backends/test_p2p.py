"""Point-to-point send/recv on hetcomm: sizes checked by the receiver (issue 21.21).

Before: a receive buffer of another size than the send killed the receiving process with SIGABRT
inside gloo. Now the receiver raises CrossRankMismatch naming both sizes, drains the message, and
the group stays usable; matching sends and receives (blocking, isend/irecv rings, batched, any
source, several tags) deliver the right bytes.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import recv_from_any, run_ranks

PG_TIMEOUT = 20.0


def p2p_ok(rank: int, n: int) -> list:
    import torch.distributed as dist

    out = []
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    # blocking, two tags sent in one order and received in the other
    if rank == 0:
        dist.send(torch.full((3,), 7.0), 1, tag=5)
        dist.send(torch.arange(4, dtype=torch.int64), 1, tag=9)
    elif rank == 1:
        a, b = torch.empty(4, dtype=torch.int64), torch.empty(3)
        w = dist.irecv(a, 0, tag=9)
        dist.recv(b, 0, tag=5)
        w.wait()
        out += [a.tolist(), b.tolist()]
    # a ring of isend/irecv through batch_isend_irecv: every send waited before its receive
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), nxt), dist.P2POp(dist.irecv, got, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out.append(got.tolist())
    # any source
    if rank == 0:
        buf = torch.empty(1)
        src = recv_from_any(buf)
        out.append((src, buf.item()))
    elif rank == n - 1:
        dist.send(torch.tensor([42.0]), 0)
    return out


@pytest.mark.timeout(120)
def test_matching_sends_and_receives_deliver():
    res = run_ranks(p2p_ok, world_size=3, timeout=90, pg_timeout=PG_TIMEOUT)
    assert res[0] == [[2.0, 2.0], (2, 42.0)]
    assert res[1] == [[0, 1, 2, 3], [7.0, 7.0, 7.0], [0.0, 0.0]]
    assert res[2] == [[1.0, 1.0]]


def p2p_wrong_size(rank: int, n: int) -> dict:
    import torch.distributed as dist

    out = {}
    if rank == 0:
        dist.send(torch.ones(8), 1)
        dist.send(torch.ones(2, dtype=torch.float64), 1)
        dist.send(torch.full((4,), 3.0), 1)
    else:
        for name, buf in (("count", torch.empty(4)), ("dtype", torch.empty(4, dtype=torch.float32))):
            try:
                dist.recv(buf, 0)
                out[name] = "no error"
            except ValueError as e:
                out[name] = (type(e).__name__, e.field, e.ranks, "8 elements" in str(e) or "torch.float64" in str(e))
        ok = torch.empty(4)
        dist.recv(ok, 0)  # the group is still usable
        out["after"] = ok.tolist()
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_a_receive_of_another_size_raises_instead_of_aborting():
    res = run_ranks(p2p_wrong_size, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT)
    assert res[1]["count"] == ("CrossRankMismatch", "count", [0], True)
    # 2 float64 = 16 bytes = 4 float32: same bytes, other dtype
    assert res[1]["dtype"] == ("CrossRankMismatch", "dtype", [0], True)
    assert res[1]["after"] == [3.0] * 4
