"""The metadata board: real processes exchanging vectors through one shared segment, waking
each other through doorbells."""

from __future__ import annotations

import glob
import os
import random
import time
from datetime import timedelta

import pytest
import torch

from hetcomm.backends.rails.shm import shm_supported
from tests.backends.ranks import mark_done, run_ranks, run_ranks_outcomes, wait_done

pytestmark = pytest.mark.skipif(not shm_supported(), reason="the board needs /dev/shm on x86-64")

WIDTH = 13


def _board(rank: int, n: int, prefix: str):
    import torch.distributed as dist

    from hetcomm.backends.board import MetaBoard
    from hetcomm.backends.doorbell import Doorbell

    pids = [None] * n
    dist.all_gather_object(pids, os.getpid())
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    bell = Doorbell(store, "bell", rank, range(n), timedelta(seconds=20))
    return MetaBoard(store, rank, pids, WIDTH, timedelta(seconds=20), bell), pids


def many_exchanges(rank: int, n: int) -> list:
    board, _ = _board(rank, n, "board-many/")
    rng = random.Random(rank)
    wrong = []
    for step in range(300):
        if rng.random() < 0.1:  # skew the ranks, so that some are two exchanges ahead of others
            time.sleep(rng.random() * 2e-3)
        vec = torch.arange(WIDTH, dtype=torch.int64) * (rank + 1) + 1000 * step
        got = board.exchange(vec, time.monotonic() + 20, "test")
        for r, v in enumerate(got):
            if not torch.equal(v, torch.arange(WIDTH, dtype=torch.int64) * (r + 1) + 1000 * step):
                wrong.append((step, r, v.tolist()))
    board.close()
    return wrong


@pytest.mark.timeout(90)
def test_every_rank_gets_every_vector_of_every_exchange():
    for wrong in run_ranks(many_exchanges, world_size=4, backend="gloo", timeout=60):
        assert wrong == []


def peer_exits(rank: int, n: int) -> dict:
    board, pids = _board(rank, n, "board-exit/")
    board.exchange(torch.zeros(WIDTH, dtype=torch.int64), time.monotonic() + 20, "test")
    if rank == 2:
        os._exit(0)  # gone without a word, like a crash
    t0 = time.monotonic()
    try:
        board.exchange(torch.zeros(WIDTH, dtype=torch.int64), time.monotonic() + 20, "test_op")
    except Exception as e:
        return {"type": type(e).__name__, "peer": e.peer, "op": e.op, "msg": str(e), "seconds": time.monotonic() - t0}
    return {"type": None}


@pytest.mark.timeout(90)
def test_a_peer_that_exits_is_named_at_once():
    outs = run_ranks_outcomes(peer_exits, world_size=4, backend="gloo", timeout=60, pg_timeout=20)
    for o in outs:
        if o.rank == 2:
            continue
        assert o.ok, f"rank {o.rank}: {o.error_type}: {o.error}\n{o.traceback}"
        r = o.result
        assert r["type"] == "CollectiveError" and r["peer"] == 2 and r["op"] == "test_op", r
        assert "rank 2" in r["msg"] and "exited" in r["msg"], r
        assert r["seconds"] < 5, r  # found by the liveness check, not by the 20 s deadline


def peer_silent(rank: int, n: int, marks: str) -> dict:
    board, _ = _board(rank, n, "board-silent/")
    if rank == 1:
        wait_done(marks, [0, 2])  # alive, but never publishes
        return {"type": None}
    try:
        board.exchange(torch.zeros(WIDTH, dtype=torch.int64), time.monotonic() + 1.0, "test_op")
    except Exception as e:
        return {"type": type(e).__name__, "peer": e.peer, "msg": str(e)}
    finally:
        mark_done(marks, rank)
    return {"type": None}


@pytest.mark.timeout(90)
def test_a_silent_peer_is_named_at_the_deadline(tmp_path):
    outs = run_ranks(
        peer_silent, world_size=3, backend="gloo", args=(str(tmp_path),), timeout=60, pg_timeout=20
    )
    for rank in (0, 2):
        r = outs[rank]
        assert r["type"] == "PeerTimeout" and r["peer"] == 1 and "[1]" in r["msg"], r


def exchanges_then_pid(rank: int, n: int) -> int:
    assert many_exchanges(rank, n) == []
    return os.getpid()


def test_no_segment_is_left_behind():
    # Segments and doorbells are named /dev/shm/hetcomm-<creating pid>-* and hetcomm-bell-<pid>-*:
    # only this run's ranks are looked at, so a test running beside this one (pytest-xdist) does not count.
    pids = run_ranks(exchanges_then_pid, world_size=2, backend="gloo", timeout=60)
    assert len(pids) == 2
    left = [p for pid in pids for p in glob.glob(f"/dev/shm/hetcomm-{pid}-*") + glob.glob(f"/dev/shm/hetcomm-bell-{pid}-*")]
    assert left == []
