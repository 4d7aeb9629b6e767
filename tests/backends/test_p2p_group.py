"""Point-to-point calls that used to break the group (or the process) on hetcomm.

Each case runs on real rank processes and then checks that the group still works: a wrong
peer is refused before any byte moves, and the next send/recv between the same ranks still
delivers.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import recv_from_any, run_ranks

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


def _timed_out_receive(rank: int, n: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from hetcomm.errors import PeerTimeout

    out = {}
    if rank == 1:
        early = torch.zeros(1)
        work = dist.irecv(early, 0, tag=3)
        try:
            work.wait(timedelta(seconds=0.5))  # rank 0 sends only after the barrier below
            out["timeout"] = "no timeout"
        except PeerTimeout as e:
            out["timeout"] = (e.rank, e.peer, str(e))
        dist.barrier()
        first, second = torch.zeros(1), torch.zeros(1)
        dist.recv(first, 0, tag=3)
        dist.recv(second, 0, tag=3)
        out["got"] = [early.item(), first.item(), second.item()]
        # the same once more with any source, and a receive posted after a header was kept
        any_early = torch.zeros(1)
        work = dist.irecv(any_early, tag=4)
        try:
            work.wait(timedelta(seconds=0.5))
        except PeerTimeout:
            pass
        dist.barrier()
        dist.barrier()  # rank 0's message has been sent (its header may be waiting here)
        late = torch.zeros(1)
        src = recv_from_any(late, tag=4)
        out["any"] = [any_early.item(), late.item(), src]
    else:
        dist.barrier()
        dist.send(torch.tensor([1.0]), 1, tag=3)
        dist.send(torch.tensor([2.0]), 1, tag=3)
        dist.barrier()
        work = dist.isend(torch.tensor([7.0]), 1, tag=4)
        dist.barrier()
        work.wait()
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_a_timed_out_receive_is_cancelled_and_the_next_receive_gets_the_next_message():
    # before: the timed-out receive stayed posted and took message 1.0 into its buffer, the
    # next receive got 2.0 and the one after waited for a message that never came
    res = run_ranks(_timed_out_receive, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT)
    r, peer, msg = res[1]["timeout"]
    assert (r, peer) == (1, 0), msg
    assert "tag 3" in msg and "group of 2" in msg and "cancelled" in msg, msg
    assert res[1]["got"] == [0.0, 1.0, 2.0]
    assert res[1]["any"] == [0.0, 7.0, 0]


def _destroy_with_a_lane_waiting(rank: int, n: int) -> dict:
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from hetcomm.errors import PeerTimeout, UsageError

    out = {}
    if rank == 1:
        work = dist.irecv(torch.zeros(1), 0, tag=5)
        try:
            work.wait(timedelta(seconds=0.2))  # rank 0 never sends with tag 5
        except PeerTimeout:
            out["cancelled"] = True
        pending = dist.irecv(torch.zeros(1), 0, tag=6)  # never waited, never matched
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1:
        try:
            pending.wait(timedelta(seconds=30))
            out["pending"] = "completed"
        except UsageError as e:
            out["pending"] = str(e)
    # a thread still blocked in gloo when the interpreter finalises aborts the process
    out["recv threads"] = [t.name for t in threading.enumerate() if t.name == "hetcomm-recv" and t.is_alive()]
    return out


@pytest.mark.timeout(120)
def test_destroy_ends_the_receive_threads_still_waiting_in_gloo():
    res = run_ranks(_destroy_with_a_lane_waiting, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT)
    assert res[1]["cancelled"]
    assert "the group was destroyed while this receive waited" in res[1]["pending"], res[1]
    assert res[0]["recv threads"] == [] and res[1]["recv threads"] == [], res
