"""Heartbeats (hetcomm.backends.heartbeat): a killed or stopped peer is named on every survivor
by the heartbeat, not at the group timeout, also when a survivor waits for it inside gloo (a
gloo-rail transfer, the all-gloo split check, the gloo all-to-all); a peer that shuts down
cleanly is not a loss; a peer on another host (no /proc view) is found by its silence, or named
stopped from the beat of a rank that sees it. Outcomes only: the group timeouts are long (60 s;
120 s where the run is ended at 80 s, before gloo's own timeout), so an error that says "named
by the heartbeat" could not have come from them."""

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


def _everyone_past_the_first_collective(rank: int, n: int) -> None:
    """Returns once every rank has left its first collective. A rank that is done with its own
    part may otherwise stop itself while a slower survivor still waits in that collective, and
    the survivor then (rightly) fails collective #1 instead of the one the test watches."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/past-first/{rank}", "1")
    store.wait([f"test/past-first/{r}" for r in range(n)], timedelta(seconds=60))


def _victim_then_wait(rank: int, n: int, how: str) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import heartbeat

    x = torch.arange(n * 2, dtype=torch.float32)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)  # everyone is in and beating
    _everyone_past_the_first_collective(rank, n)
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


def _stop_inside_transfer(rank: int, n: int) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import heartbeat
    from hetcomm.backends.routed import RoutedCollectives

    victim = 2  # the H800 rank: ranks 0 and 1 reach it over the gloo rail, rank 3 over the bridge
    x = torch.arange(n * 64, dtype=torch.float32)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)  # everyone is in and beating
    hb = heartbeat.active()
    if rank == victim:
        exchange = RoutedCollectives.exchange_meta

        def exchange_then_stop(self, *args, **kwargs):
            out = exchange(self, *args, **kwargs)
            # The split check is done: the survivors post their transfers and wait in them
            # (inside gloo, for ranks 0 and 1) while this rank never posts its own.
            time.sleep(1.5)
            os.kill(os.getpid(), signal.SIGSTOP)
            return out

        RoutedCollectives.exchange_meta = exchange_then_stop
    try:
        dist.all_to_all_single(y, x)
    except Exception as e:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"test/survivor/{rank}", "1")
        if rank == 0:  # a stopped process holds its resources: end it once every survivor is done
            store.wait([f"test/survivor/{r}" for r in range(n) if r != victim], timedelta(seconds=60))
            os.kill(hb.local_pids[victim], signal.SIGKILL)
        return {"type": type(e).__name__, "detail": getattr(e, "detail", str(e)), "msg": str(e),
                "peer": getattr(e, "peer", None), "op": getattr(e, "op", None)}
    return {"type": None}


@pytest.mark.timeout(150)
def test_a_peer_stopped_inside_a_gloo_rail_transfer_is_named_by_every_survivor_before_the_timeout():
    # Ranks 0 and 1 wait for rank 2 inside gloo (the rail's transfers block there); a stopped
    # process keeps its sockets open, so only the heartbeat's release ends that wait. The run is
    # ended at 80 s, before gloo's own timeout (0.75 x the 120 s group timeout = 90 s): an error
    # from that timeout cannot arrive, and a survivor still waiting counts as a failure.
    outs = run_ranks_outcomes(_stop_inside_transfer, world_size=4, cluster=MIXED_MINI, timeout=80, pg_timeout=120.0)
    assert outs[2].exitcode == -signal.SIGKILL, outs[2]
    details = set()
    for o in (outs[0], outs[1], outs[3]):
        assert o.ok and o.stopped != "timeout", f"rank {o.rank}: {o.stopped} {o.error_type}: {o.error}\n{o.traceback}"
        r = o.result
        assert r["type"] == "PeerTimeout" and r["peer"] == 2 and r["op"] == "all_to_all_single", r
        assert "rank 2 is stopped" in r["detail"] and "named by the heartbeat" in r["detail"], r
        details.add(r["detail"])
    assert len(details) == 1, details  # every survivor's error reads the same


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


def _wait_for(pred, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(120)
def test_a_stopped_verdict_travels_in_the_beat_to_observers_without_a_pid_view_late_ones_too():
    # Rank 1 (the victim) beats from another process. Rank 0 sees its pid (a same-host peer),
    # rank 2 does not (another host): rank 2 can only learn "stopped" from rank 0's beat. Rank 3
    # starts watching after the stop (a late observer) and learns it the same way; rank 4 starts
    # after the victim was continued and must not call it lost.
    import torch.distributed as dist

    from hetcomm.backends import heartbeat
    from hetcomm.backends.heartbeat import Heartbeat

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    peer = subprocess.Popen([sys.executable, "-c", _PEER.replace("Heartbeat(store, 1, 2,", "Heartbeat(store, 1, 5,"),
                             str(store.port)], stdout=subprocess.PIPE, text=True)
    told = []

    def listener(loss):
        told.append(loss.rank)

    hbs = []
    try:
        assert peer.stdout.readline().strip() == "beating"
        heartbeat.add_listener(listener)
        seer = Heartbeat(store, 0, 5, local_pids={1: peer.pid}, interval_s=0.05, miss_s=0.5).start()
        remote = Heartbeat(store, 2, 5, interval_s=0.05, miss_s=0.5).start()
        hbs += [seer, remote]
        time.sleep(1.0)
        assert seer.lost.get(1) is None and remote.lost.get(1) is None
        os.kill(peer.pid, signal.SIGSTOP)
        assert _wait_for(lambda: 1 in seer.lost and 1 in remote.lost)
        assert seer.lost[1].cause == "stopped" and "pid" in seer.lost[1].detail
        # No pid view and the threshold of a beat seen for 1 s is 3 s: only rank 0's beat says so.
        assert remote.lost[1].cause == "stopped" and "rank 0 sees" in remote.lost[1].detail, remote.lost[1]
        assert remote.lost[1].verdict == seer.lost[1].verdict == "rank 1 is stopped (SIGSTOP or a debugger: state T)"
        assert _wait_for(lambda: told.count(1) == 2), told  # both told the listener (certain losses only)
        late = Heartbeat(store, 3, 5, interval_s=0.05, miss_s=0.5).start()
        hbs.append(late)
        assert _wait_for(lambda: 1 in late.lost) and late.lost[1].cause == "stopped", late.lost
        os.kill(peer.pid, signal.SIGCONT)  # beats again: rank 0's beat stops saying "stopped"
        current = store.get("hetcomm/hb/0")
        assert _wait_for(lambda: b"stopped" not in store.get("hetcomm/hb/0") and store.get("hetcomm/hb/0") != current)
        later = Heartbeat(store, 4, 5, interval_s=0.05, miss_s=0.5).start()
        hbs.append(later)
        time.sleep(4.0)  # past the 3 s threshold of a peer seen only briefly
        assert 1 not in later.lost, later.lost
    finally:
        heartbeat.remove_listener(listener)
        for hb in hbs:
            hb.stop()
        peer.kill()
        peer.wait()


@pytest.mark.timeout(120)
def test_a_late_observer_believes_no_verdict_from_a_beat_that_does_not_move_and_names_the_silent_peer():
    # Rank 0 declared rank 1 stopped and then fell quiet itself (no goodbye): its last beat still
    # says "stopped=1". An observer that starts now must not take that stale word (rank 1 might
    # have been continued since); it names both once their silence passes its threshold.
    import torch.distributed as dist

    from hetcomm.backends.heartbeat import Heartbeat

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    store.set("hetcomm/hb/0", "41 stopped=1")
    store.set("hetcomm/hb/1", "17")
    late = Heartbeat(store, 2, 3, interval_s=0.05, miss_s=0.5).start()
    try:
        assert _wait_for(lambda: len(late.lost) == 2, 30.0), late.lost
        assert {r: x.cause for r, x in late.lost.items()} == {0: "silent", 1: "silent"}, late.lost
    finally:
        late.stop()


_FOUR_NODES = """
name: four-a100-nodes
description: four one-GPU nodes of one vendor, so every pair is on the gloo rail
node_groups:
  - name: a100
    count: 4
    device: {model: A100-SXM4-80GB, count: 1, strong: true}
    fabric: NVLINK
    nics:
      - {class: NET_ROCE_GDR, gbps: 200, count: 1}
"""


def _stop_before_gloo_collective(rank: int, n: int, skip_check: bool) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import checks, heartbeat

    x = torch.arange(n * 2, dtype=torch.float32)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)  # everyone is in and beating
    _everyone_past_the_first_collective(rank, n)
    hb = heartbeat.active()
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        if skip_check:
            with checks.splits_agreed():  # straight into the gloo all-to-all
                dist.all_to_all_single(y, x)
        else:
            dist.all_to_all_single(y, x)  # the split check: one gloo all_gather
    except Exception as e:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"test/survivor/{rank}", "1")
        if rank == 0:
            store.wait([f"test/survivor/{r}" for r in range(n - 1)], timedelta(seconds=60))
            os.kill(hb.local_pids[n - 1], signal.SIGKILL)
        return {"type": type(e).__name__, "detail": getattr(e, "detail", str(e)), "peer": getattr(e, "peer", None),
                "op": getattr(e, "op", None)}
    return {"type": None}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("skip_check", [False, True], ids=["gloo-split-check", "gloo-all-to-all"])
def test_a_peer_stopped_before_an_all_gloo_collective_ends_the_gloo_wait(tmp_path, skip_check):
    # Every pair on gloo: the split check is one gloo all_gather and the data one gloo
    # all-to-all, both waited on watching the heartbeat (faults.wait_watching). The run ends
    # at 80 s, before gloo's own timeout (90 s of a 120 s group timeout).
    cluster = tmp_path / "four-nodes.yaml"
    cluster.write_text(_FOUR_NODES)
    outs = run_ranks_outcomes(_stop_before_gloo_collective, world_size=4, cluster=str(cluster), args=(skip_check,),
                              timeout=80, pg_timeout=120.0)
    assert outs[3].exitcode == -signal.SIGKILL, outs[3]
    details = set()
    for o in outs[:3]:
        assert o.ok and o.stopped != "timeout", f"rank {o.rank}: {o.stopped} {o.error_type}: {o.error}\n{o.traceback}"
        r = o.result
        want_op = "all_to_all_single" if skip_check else "all_to_all_single (split check)"
        assert r["type"] == "PeerTimeout" and r["peer"] == 3 and r["op"] == want_op, r
        assert "rank 3 is stopped" in r["detail"] and "named by the heartbeat" in r["detail"], r
        details.add(r["detail"])
    assert len(details) == 1, details


@pytest.mark.timeout(120)
def test_blame_names_a_stopped_peer_before_one_that_exited_earlier():
    # The order survivors see: rank 2 freezes, rank 1 raises because of it and exits, and this
    # rank's heartbeat declares rank 1 "exited" before (or in the same sweep as) rank 2 "stopped".
    # The frozen rank is the root cause and is the one named (CI failure of the hung-rank test).
    import torch.distributed as dist

    from hetcomm.backends import heartbeat
    from hetcomm.backends.faults import FaultDiagnosis
    from hetcomm.backends.rank_placement import Placement, RankPlace

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    peers = {r: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]) for r in (1, 2)}
    try:
        hb = heartbeat.start(store, 0, 3, local_pids={r: p.pid for r, p in peers.items()}, interval_s=0.05, miss_s=0.5)
        peers[1].kill()
        peers[1].wait()
        assert _wait_for(lambda: 1 in hb.lost)
        os.kill(peers[2].pid, signal.SIGSTOP)
        assert _wait_for(lambda: 2 in hb.lost)
        assert hb.lost[1].cause == "exited" and hb.lost[2].cause == "stopped"
        assert hb.lost[1].detected_at <= hb.lost[2].detected_at
        ranks = tuple(RankPlace(r, r, "n0", "host", peers[r].pid if r else os.getpid(), "cpu", "cpu", False) for r in range(3))
        faults = FaultDiagnosis(store, Placement(ranks), 0, 3, timedelta(seconds=10), lambda: ["shm"] * 3)
        peer, loss = faults.certain_loss([1, 2])
        assert peer == 2 and loss.cause == "stopped"
        assert faults.certain_loss([1])[0] == 1  # an exited peer alone is still named
    finally:
        heartbeat.stop()
        for p in peers.values():
            p.kill()
            p.wait()
