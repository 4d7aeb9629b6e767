"""Point-to-point calls that used to break the group (or the process) on hetcomm.

Each case runs on real rank processes and then checks that the group still works: a wrong
peer is refused before any byte moves, and the next send/recv between the same ranks still
delivers.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import run_ranks

PG_TIMEOUT = 20.0


def _bad_peers(rank: int, n: int) -> dict:
    import torch.distributed as dist

    from hetcomm.errors import UsageError

    out = {}
    if rank == 0:
        for name, call in (
            ("send 7", lambda: dist.send(torch.ones(2), 7)),
            ("send -1", lambda: dist.send(torch.ones(2), -1)),
            ("irecv 5", lambda: dist.irecv(torch.empty(2), 5, tag=3)),
        ):
            try:
                call()
                out[name] = "no error"
            except UsageError as e:
                out[name] = str(e)
        dist.send(torch.full((2,), 4.0), 1)  # the pair still works
    else:
        got = torch.empty(2)
        dist.recv(got, 0)
        out["after"] = got.tolist()
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_a_peer_outside_the_group_is_refused_and_the_group_stays_usable():
    # before: rank 0 died with SIGSEGV (dst 7) or SIGABRT (dst -1) inside gloo
    res = run_ranks(_bad_peers, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT)
    for name, peer in (("send 7", "7"), ("send -1", "-1"), ("irecv 5", "5")):
        msg = res[0][name]
        assert f"rank {peer} is not a rank of this group of 2" in msg, msg
        assert "(rank 0, tag" in msg, msg
    assert "tag 3" in res[0]["irecv 5"]
    assert res[1]["after"] == [4.0, 4.0]


def _strided(rank: int, n: int) -> dict:
    import torch.distributed as dist

    base = torch.arange(12.0).reshape(3, 4)
    if rank == 0:
        dist.send(base[:, 1], 1)  # stride 4
        dist.send(base.t(), 1, tag=2)  # a transposed 4x3 view
        dist.send(torch.full((2,), 9.0), 1)  # the pair is still in step
        dist.barrier()
        return {}
    col, tr, after = torch.zeros(3), torch.zeros(4, 3), torch.zeros(2)
    dist.recv(col, 0)
    dest = torch.zeros(4, 6)
    dist.recv(dest[:, ::2], 0, tag=2)  # a strided destination
    dist.recv(after, 0)
    dist.barrier()
    return {"col": col.tolist(), "dest": dest.tolist(), "after": after.tolist()}


@pytest.mark.timeout(120)
def test_strided_sends_and_receives_deliver_the_views_elements():
    # before: gloo refused the strided tensor after the size header had gone, and the group broke
    res = run_ranks(_strided, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT)
    base = torch.arange(12.0).reshape(3, 4)
    assert res[1]["col"] == base[:, 1].tolist()
    dest = torch.zeros(4, 6)
    dest[:, ::2] = base.t()
    assert res[1]["dest"] == dest.tolist()  # the odd columns untouched
    assert res[1]["after"] == [9.0, 9.0]


def _destroy_in_a_p2p_callback(rank: int, n: int) -> dict:
    import threading

    import torch.distributed as dist

    t = torch.full((4,), 5.0) if rank == 0 else torch.zeros(4)
    work = dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)
    done = threading.Event()
    seen = {}

    def destroy(fut) -> None:
        seen["value"] = fut.value()[0].tolist()
        seen["on_main"] = threading.current_thread() is threading.main_thread()
        dist.destroy_process_group()
        seen["destroyed"] = not dist.is_initialized()
        done.set()

    work.get_future().then(destroy)
    if not done.wait(60):
        return {"callback ran": False}
    return seen


@pytest.mark.timeout(120)
def test_destroying_the_group_in_a_p2p_callback():
    # before: a p2p Work had no future ("Work::getFuture not implemented"); with one, the callback
    # destroys the group on the p2p thread that completed the Work, and the process exits cleanly
    res = run_ranks(_destroy_in_a_p2p_callback, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT)
    for rank in range(2):
        assert res[rank]["destroyed"], res[rank]
        assert res[rank]["value"] == [5.0] * 4
