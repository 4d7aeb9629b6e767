"""Membership change of a hetcomm group through torch 2.14's API (hetcomm/backends/reconfigure.py).

Real processes over one store: four members and a joiner (tests/backends/membership_ranks.py).
kill -9 of rank 3, ``dist.shrink_group([3])`` on the survivors, then a new process joins through
``dist._reconfigure``; all_reduce, all_to_all_single and broadcast after each change equal
gloo's on the same membership (gloo, which cannot shrink on torch 2.14, shrinks by a reconfigure
over the survivors' handles). Bad requests raise naming the rank, and a silent member ends the
wait at the group timeout, naming it.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hetcomm.backends.reconfigure import supported
from hetcomm.launcher import launch
from tests.backends.membership_ranks import collectives, member
from tests.backends.ranks import MIXED_MINI, run_ranks_outcomes

needs_214 = pytest.mark.skipif(not supported(), reason="membership change needs torch >= 2.14 (shrink_group, _reconfigure)")


def _run(backend: str):
    # mixed-mini: ranks 0-1 A100 on one node, 2 H800, 3 the 910B (rails shm, gloo, bridge)
    out = launch(member, 5, args=(backend,), start="forkserver", store=True, timeout_s=120, grace_s=None,
                 kill_grace_s=1.0, name="reconfigure", env={"HETCOMM_CLUSTER": MIXED_MINI})
    return list(out.ranks)


@needs_214
def test_kill_shrink_grow_equals_gloo():
    runs = {b: _run(b) for b in ("gloo", "hetcomm")}
    for backend, ranks in runs.items():
        assert ranks[3].exitcode == -9, f"{backend}: rank 3 was to die by SIGKILL: {ranks[3].describe()}"
        bad = [o.describe() + "\n" + (o.traceback or "") for r, o in enumerate(ranks) if r != 3 and not o.ok]
        assert not bad, f"{backend}: " + "\n".join(bad)
    gloo, het = ([o.result for o in runs[b]] for b in ("gloo", "hetcomm"))
    for r in (0, 1, 2):
        for phase in ("four", "three", "grown"):
            assert het[r][phase] == gloo[r][phase], (r, phase)
        assert het[r]["three"]["size"] == [3.0] and het[r]["grown"]["size"] == [4.0]
    # The shrunk and the grown group are hetcomm's (hetcomm.communicator() included), over their
    # new membership, each rank placed where it stood in the cluster file: the joiner took the
    # 910B's place (rank 3), reached over the bridge.
    rails = {0: ("self,shm,gloo", "self,shm,gloo,bridge"), 1: ("shm,self,gloo", "shm,self,gloo,bridge"),
             2: ("gloo,gloo,self", "gloo,gloo,self,bridge")}
    for r, (three, grown) in rails.items():
        assert het[r]["served"] == {"three": f"HetcommBackend/3 {three}", "grown": f"HetcommBackend/4 {grown}"}
    assert het[4]["grown"] == gloo[4]["grown"] and het[4]["grown"]["rank"] == [3.0]
    assert het[4]["served"] == {"grown": "HetcommBackend/4 bridge,bridge,bridge,self"}
    assert gloo[0]["served"]["three"] == "ProcessGroupGloo"


def bad_requests(rank: int, world_size: int) -> dict:
    """Every member: requests refused before anything is published, then a shrink that rank 2
    never joins (ranks 0 and 1 time out naming it), then the real shrink, then a collective."""
    from hetcomm.backends import hetcomm_group
    from hetcomm.backends.reconfigure import Handle
    from hetcomm.errors import PeerTimeout, UsageError

    store = dist.distributed_c10d._world.pg_map[dist.distributed_c10d._get_default_group()][1]
    seen = {}
    face = hetcomm_group()
    for name, call in (
        ("self", lambda: face.shrink([rank])),
        ("range", lambda: face.shrink([7])),
        ("torch-self", lambda: dist.shrink_group([rank])),
        ("gloo-handle", lambda: dist._reconfigure(uuid=5, handles=["gloo:0:-1:0:127.0.0.1:1"])),
        ("damaged", lambda: dist._reconfigure(uuid=6, handles=[face.get_reconfigure_handle() + "x"])),
        ("not-mine", lambda: dist._reconfigure(uuid=7, handles=[Handle("elsewhere", "node-z", 1).encode()])),
    ):
        try:
            call()
            seen[name] = "no error"
        except (UsageError, ValueError, RuntimeError) as e:
            seen[name] = f"{type(e).__name__}: {e}"
    dist.barrier()
    if rank in (0, 1):  # rank 2 stays out of this shrink: 0 and 1 must name it, not hang
        try:
            dist.shrink_group([3])
            seen["silent"] = "no error"
        except PeerTimeout as e:
            seen["silent"] = f"{type(e).__name__} peer={e.peer}: {e}"
        store.set(f"test/silent-done/{rank}", "1")
    else:  # the others wait for that outside any collective (whose timeout is as short)
        store.wait(["test/silent-done/0", "test/silent-done/1"])
    if rank == 3:
        dist.barrier()  # the last collective of the four (after the failed shrink)
        return seen
    dist.barrier()
    dist.shrink_group([3])
    seen["after"] = collectives(1)
    return seen


@needs_214
def test_bad_requests_name_the_rank_and_nothing_hangs():
    outs = run_ranks_outcomes(bad_requests, 4, backend="hetcomm", pg_timeout=4.0, timeout=90)
    assert all(o.ok for o in outs), "\n".join(o.describe() + "\n" + (o.traceback or "") for o in outs if not o.ok)
    res = [o.result for o in outs]
    for r in range(4):
        assert f"rank {r} excludes itself" in res[r]["self"] and res[r]["self"].startswith("UsageError")
        assert "rank 7 in ranks_to_exclude is not a rank of this group (0..3)" in res[r]["range"]
        assert f"Current rank {r} is in the exclusion list" in res[r]["torch-self"]  # torch's own check first
        assert "handle 0 is 'gloo:0" in res[r]["gloo-handle"] and res[r]["gloo-handle"].startswith("UsageError")
        assert "handle 0" in res[r]["damaged"] and "is damaged" in res[r]["damaged"]
        assert "this process's handle (pid" in res[r]["not-mine"] and "is not in the list of 1" in res[r]["not-mine"]
    for r in (0, 1):
        assert res[r]["silent"].startswith("PeerTimeout peer=2"), res[r]["silent"]
        assert "rank 2 (old numbering) did not answer within 4 s" in res[r]["silent"]
    # the refusals and the timeout left the group usable: the real shrink works afterwards
    assert res[0]["after"]["size"] == [3.0] and res[0]["after"]["all_reduce"] == res[2]["after"]["all_reduce"]


@pytest.mark.skipif(supported(), reason="what torch 2.13 says (no membership-change API there)")
def test_torch_213_reports_no_support():
    """On 2.13 hetcomm groups are Python ProcessGroups without the API: nothing claims support."""
    outs = run_ranks_outcomes(_supports, 2, backend="hetcomm", timeout=60)
    assert [o.result for o in outs] == [False, False]


def _supports(rank: int, world_size: int) -> bool:
    from hetcomm.backends import hetcomm_group

    return bool(hetcomm_group().supports_reconfigure)


@needs_214
def test_supports_flags_are_truthful():
    outs = run_ranks_outcomes(_flags, 2, backend="hetcomm", timeout=60)
    assert [o.result for o in outs] == [{"reconfigure": True, "shrinking": True, "handle": "hetcomm:1:"}] * 2


def _flags(rank: int, world_size: int) -> dict:
    import torch

    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return {"reconfigure": dist._supports_reconfigure(), "shrinking": bool(backend.supports_shrinking),
            "handle": dist._get_reconfigure_handle()[:10]}


def subgroup_changes(rank: int, world_size: int) -> dict:
    """A hetcomm subgroup of ranks 0-2 (rank 3 outside it) shrinks to 0-1 (rank 2 leaves it);
    a reconfigure that would renumber a non-default group is refused."""
    import torch

    from hetcomm.backends import hetcomm_group
    from hetcomm.backends.reconfigure import Handle

    sub = dist.new_group([0, 1, 2], backend="hetcomm")
    out: dict = {}
    if rank in (0, 1):
        small = dist.shrink_group([2], group=sub)
        t = torch.full((3,), float(rank + 1), device="cpu")  # host: CPU groups
        dist.all_reduce(t, group=small)
        out["sum"] = t.tolist()
        out["size"] = small.size()
        out["served"] = type(hetcomm_group(small)).__name__ + f"/{hetcomm_group(small).communicator.world_size}"
        joiners = [Handle(f"elsewhere-{i}", "node-z", i + 1, slot=5 + i).encode() for i in range(2)]  # size 3 now
        try:
            dist._reconfigure(uuid=9, handles=[hetcomm_group(small).get_reconfigure_handle(), *joiners], group=small)
            out["renumber"] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out["renumber"] = f"{type(e).__name__}: {e}"
    dist.barrier()  # the default group is untouched by the subgroup's changes
    return out


@needs_214
def test_a_subgroup_shrinks_and_is_not_renumbered_by_reconfigure():
    outs = run_ranks_outcomes(subgroup_changes, 4, backend="hetcomm", pg_timeout=20.0, timeout=90)
    assert all(o.ok for o in outs), "\n".join(o.describe() + "\n" + (o.traceback or "") for o in outs if not o.ok)
    for r in (0, 1):
        res = outs[r].result
        assert res["sum"] == [3.0, 3.0, 3.0] and res["size"] == 2 and res["served"] == "HetcommBackend/2"
        assert res["renumber"].startswith("UsageError") and "not the default group" in res["renumber"], res["renumber"]
