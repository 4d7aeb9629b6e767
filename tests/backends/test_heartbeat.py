"""Heartbeats (hetcomm.backends.heartbeat): a killed or stopped peer is named on every survivor
by the heartbeat, not at the group timeout; a peer that shuts down cleanly is not a loss; a peer
on another host (no /proc view) is found by its silence. Outcomes only: the group timeout is
long (60 s), so an error that says "named by the heartbeat" could not have come from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from tests.backends.ranks import MIXED_MINI, run_ranks_outcomes


def _victim_then_wait(rank: int, n: int, how: str) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import heartbeat

    x = torch.arange(n * 2, dtype=torch.float32)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)  # everyone is in and beating
    hb = heartbeat.active()
    assert hb is not None and hb.world_size == n
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(120)  # a stopped rank never gets here before it is killed
    try:
        dist.all_to_all_single(y, x)
    except Exception as e:
        deadline = time.monotonic() + 30  # a killed peer's sockets may close before the next beat
        while n - 1 not in hb.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        loss = hb.lost.get(n - 1)
        if how == "stop":  # a stopped process holds its resources: end it once every survivor is done
            store = dist.distributed_c10d._get_default_store()
            store.set(f"test/survivor/{rank}", "1")
            if rank == 0:
                store.wait([f"test/survivor/{r}" for r in range(n - 1)], timedelta(seconds=60))
                os.kill(hb.local_pids[n - 1], signal.SIGKILL)
        return {"type": type(e).__name__, "msg": str(e), "peer": getattr(e, "peer", None),
                "cause": loss.cause if loss else None, "lost": sorted(hb.lost)}
    return {"type": None}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_killed_or_stopped_peer_is_named_by_the_heartbeat_on_every_survivor(how):
    outs = run_ranks_outcomes(_victim_then_wait, world_size=4, cluster=MIXED_MINI, args=(how,), timeout=120,
                              pg_timeout=60.0)
    assert outs[3].exitcode == -signal.SIGKILL
    for o in outs[:3]:
        assert o.ok, f"rank {o.rank}: {o.error_type}: {o.error}\n{o.traceback}"
        r = o.result
        assert r["peer"] == 3 and r["lost"] == [3], r
        if how == "stop":
            # Only the heartbeat knows a stopped process: its sockets stay open.
            assert r["type"] == "PeerTimeout" and r["cause"] == "stopped", r
            assert "named by the heartbeat" in r["msg"] and "rank 3" in r["msg"] and "all_to_all_single" in r["msg"], r
        else:
            # A killed peer's sockets close too: whichever comes first names it.
            assert r["type"] in ("CollectiveError", "PeerTimeout") and "rank 3" in r["msg"], r
            assert r["cause"] == "exited", r


def _clean_exit(rank: int, n: int) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import heartbeat

    x = torch.ones(4)
    dist.all_reduce(x)
    hb = heartbeat.active()
    if rank == 0:
        time.sleep(2.0)  # the others leave first, cleanly
    return {"lost": sorted(hb.lost)}


@pytest.mark.timeout(120)
def test_peers_that_leave_cleanly_are_not_lost():
    outs = run_ranks_outcomes(_clean_exit, world_size=4, cluster=MIXED_MINI, timeout=90)
    for o in outs:
        assert o.ok and o.exitcode == 0, f"rank {o.rank}: {o.error}"
    assert outs[0].result["lost"] == []


_PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from hetcomm.backends.heartbeat import Heartbeat
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
hb = Heartbeat(store, 1, 2, interval_s=0.05, miss_s=0.5).start()
print("beating", flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(120)
def test_a_remote_peer_that_stops_beating_is_declared_silent():
    import torch.distributed as dist

    from hetcomm.backends.heartbeat import Heartbeat

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(store.port)], stdout=subprocess.PIPE, text=True)
    hb = None
    try:
        assert peer.stdout.readline().strip() == "beating"
        # No local pid: as for a peer on another host, only its beats tell.
        hb = Heartbeat(store, 0, 2, interval_s=0.05, miss_s=0.5).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not store.check(["hetcomm/hb/1"]):
            time.sleep(0.05)
        time.sleep(1.0)
        assert hb.lost == {}  # beating: fine
        os.kill(peer.pid, signal.SIGSTOP)
        while time.monotonic() < deadline and not hb.lost:
            time.sleep(0.05)
        assert list(hb.lost) == [1] and hb.lost[1].cause == "silent", hb.lost
        assert hb.lost_among([0, 1]) == [hb.lost[1]] and hb.lost_among([0]) == []
    finally:
        if hb is not None:
            hb.stop()
        peer.kill()
        peer.wait()
