"""``hetcomm train --shrink-in-place`` (hetcomm/train/inplace.py): a rank killed, the survivors go on.

Four real ranks of the tiny job on ``hetcomm train``'s own launcher (it hosts the store, and with
an in-place shrink it stops nobody when a rank dies). Rank 2 (the H800) finishes step
``KILL_AFTER``, waits for that step's peer copies, deletes its own snapshots (so its state can
only come back from its buddy's copy on the 910B) and SIGKILLs itself at the start of the next
step. The three survivors' step fails on the lost peer; the heartbeat confirms it; they call
``dist.shrink_group([2])``, rebuild the job for 3 ranks in the same processes (placement,
layers, optimizer, restore by global expert id from the 4-rank snapshots) and train to the
last step.

Checked: the survivors' pids never changed and their results came back from those processes;
the final losses and every weight are finite; the summary's expert census says every expert is
owned by exactly one of the 3 ranks; at most one step redone (the snapshots' count and the
membership record); the metrics ``membership`` event and the health record say 4 -> 3 with a
cause naming rank 2 (H800 on h800-0); the snapshot directory is gone at the end. Without
``--shrink-in-place`` (today's path, and torch 2.13's) the same kill fails every survivor with
an error naming rank 2: the test's other half.
"""

from __future__ import annotations

import json
import math
import os
import signal
from typing import Callable

import pytest

from hetcomm.backends.reconfigure import supported
from tests.backends.ranks import MIXED_MINI
from tests.ops.jobs import TINY

STEPS, KILL_AFTER, VICTIM = 8, 4, 2
#: What the membership record says each victim was, and which node(s) it names as leaving.
WHO = {2: ("H800 on h800-0", "node(s) h800-0 left"), 0: ("A100-SXM4-80GB on a100-0", "node(s) a100-0 left")}


def check_membership_change(metrics: str, victim: int) -> dict:
    """Assert the run's one membership change, 4 -> 3 after ``victim`` was killed after step
    :data:`KILL_AFTER`, in the metrics (event) and the health record beside them; return the record."""
    from hetcomm.ops.metrics import read_metrics
    from hetcomm.ops.ops_records import sibling_path

    log = read_metrics(metrics)
    change = [e for e in log.events if e.event == "membership"]
    assert len(change) == 1, change
    line = change[0].detail
    what, left = WHO[victim]
    assert line.startswith(f"4 -> 3 ranks after step {change[0].step}: {left}"), line
    assert KILL_AFTER - 1 <= change[0].step <= KILL_AFTER, line
    assert f"cause: rank {victim} exited ({what}) (seen by the heartbeat)" in line and "shrink_group" in line, line
    with open(sibling_path(metrics), encoding="utf-8") as f:
        rec = [json.loads(ln) for ln in f if '"membership"' in ln]
    assert len(rec) == 1 and rec[0]["before"] == 4 and rec[0]["after"] == 3, rec
    assert rec[0]["steps_redone"] is not None and rec[0]["steps_redone"] <= 1, rec
    return rec[0]

needs_214 = pytest.mark.skipif(not supported(), reason="an in-place shrink needs torch >= 2.14 (dist.shrink_group)")


def install_kill_hook(victim: int, on_finish: Callable[[dict], None], kill_after: int = KILL_AFTER) -> None:
    """In this rank's process: rank ``victim`` finishes step ``kill_after``, waits for that step's
    peer copies, deletes its own snapshots (its state can then only come back from its buddy's
    copy) and SIGKILLs itself at the start of the next step; every rank that reaches the end of
    training calls ``on_finish`` with what it ended as (world, rank, shrinks, slots, pid, whether
    every weight is finite, the snapshot directory). Patches the loop's ``_step`` and ``_finish``
    (the loop calls them by module name). Also used by ``tests/cli/test_launch_inplace.py``,
    whose ranks ``hetcomm launch --shrink-in-place`` starts."""
    import torch

    from hetcomm.train import loop

    rank = int(os.environ["RANK"])
    pid = os.getpid()
    real_step, real_finish = loop._step, loop._finish

    def step(job, n: int) -> None:
        if rank == victim and n == kill_after + 1:
            job.snap._join()  # step KILL_AFTER's peer copies are written everywhere
            for name in os.listdir(job.snap.dir):
                if name.startswith(f"r{rank}-"):  # this rank's own memory lost: its buddy's copy serves
                    os.unlink(os.path.join(job.snap.dir, name))
            os.kill(pid, signal.SIGKILL)
        real_step(job, n)

    def finish(job, t0: float) -> int:
        on_finish(dict(world=job.world_size, rank=job.rank, shrinks=job.shrinks, slots=list(job.slots),
                       pid_end=os.getpid(), finite=all(bool(torch.isfinite(p).all()) for p in job.model.parameters()),
                       snap_dir=job.snap.dir if job.snap is not None else None))
        return real_finish(job, t0)

    loop._step, loop._finish = step, finish


def _rank(cfg, victim: int = VICTIM) -> dict:
    """One rank: ``train_worker`` with rank ``victim`` set to die after step ``KILL_AFTER``
    (:func:`install_kill_hook`), and the end of training captured (world, pids, weights)."""
    from hetcomm.train import loop

    rank = int(os.environ["RANK"])
    pid = os.getpid()
    seen: dict = {}
    install_kill_hook(victim, seen.update)
    try:
        code = loop.train_worker(rank, int(os.environ["WORLD_SIZE"]), cfg)
    except BaseException as e:  # noqa: BLE001 - the survivors' failure without an in-place shrink
        return {"pid": pid, "error": f"{type(e).__name__}: {e}"}
    summary = loop.last_summary()
    return {"pid": pid, "code": code, "losses": summary["losses"], "text": summary["text"], **seen}


def _run(tmp_path, in_place: bool, victim: int = VICTIM):
    from hetcomm.launcher import launch
    from hetcomm.train.loop import load_train_config

    metrics = str(tmp_path / "m.jsonl")
    cfg = load_train_config(TINY, steps=STEPS, cluster=MIXED_MINI, metrics=metrics, snapshot_every=1,
                            shrink_in_place=in_place, timeout_s=30.0)
    env = {"HETCOMM_SNAPSHOT_ROOT": str(tmp_path / "shm"), "HETCOMM_JOB_ID": "inplace",
           "HETCOMM_CLUSTER": None}
    os.makedirs(tmp_path / "shm")
    # As hetcomm train launches its ranks (train/local_ranks.launch_options): the launcher hosts the store;
    # grace_s=None: a dead rank stops nobody.
    out = launch(_rank, 4, args=(cfg, victim), store=True, store_timeout_s=30.0, timeout_s=400, grace_s=None,
                 name="train", env=env)
    return out, metrics


@needs_214
@pytest.mark.parametrize("victim", [VICTIM, 0])  # 0: half of a node lost, and the rank that hosts no store here
def test_killed_rank_survivors_shrink_in_place_and_finish(tmp_path, victim):
    out, metrics = _run(tmp_path, in_place=True, victim=victim)
    ranks = list(out.ranks)
    assert ranks[victim].exitcode == -signal.SIGKILL, ranks[victim].describe()
    survivors = [r for r in range(4) if r != victim]
    bad = [ranks[r].describe() + "\n" + (ranks[r].traceback or "") for r in survivors if not ranks[r].ok]
    assert not bad, "\n".join(bad)
    res = {r: ranks[r].result for r in survivors}
    for new, r in enumerate(survivors):
        got = res[r]
        assert "error" not in got, got
        # in place: the process that started rank r finished as new rank `new` of 3
        assert got["pid"] == got["pid_end"] == ranks[r].pid, (r, got["pid"], ranks[r].pid)
        assert (got["world"], got["rank"], got["shrinks"], got["slots"]) == (3, new, 1, survivors), got
        assert got["finite"], f"rank {r}: a weight is not finite"
        assert len(got["losses"]) == STEPS and all(math.isfinite(x) for x in got["losses"]), got["losses"]
    first = res[survivors[0]]
    assert all(res[r]["losses"] == first["losses"] for r in survivors)
    text = first["text"]
    assert "every expert owned by exactly one rank" in text, text
    row = next(ln for ln in text.splitlines() if "restores / steps lost" in ln)
    assert "1 / 0" in row or "1 / 1" in row, row  # at most one step redone
    assert "from peers" in row and f"[{victim}]" in row, row  # the victim's state came from its buddy's copy

    rec = check_membership_change(metrics, victim)
    assert f"rank {victim} exited" in rec["cause"], rec
    assert rec["experts_present"] == rec["experts_total"], rec
    assert rec["down_s"] is not None and rec["down_s"] > 0, rec  # measured in place
    # the job's snapshots (the 4-rank world's and rank 2's peer copies included) are gone
    assert not os.path.exists(first["snap_dir"]), os.listdir(first["snap_dir"])


@pytest.mark.parametrize("in_place", [False] + ([True] if not supported() else []))
def test_without_shrink_in_place_the_survivors_fail_naming_the_rank(tmp_path, in_place):
    """Without the flag (and on torch 2.13 with it, which has no shrink_group): the survivors
    raise, naming rank 2, and a restart (hetcomm launch) is what continues the job."""
    out, _ = _run(tmp_path, in_place=in_place)
    ranks = list(out.ranks)
    assert ranks[VICTIM].exitcode == -signal.SIGKILL, ranks[VICTIM].describe()
    for r in (0, 1, 3):
        got = ranks[r].result if ranks[r].ok else {"error": ranks[r].error or ""}
        assert "error" in got and "rank 2" in got["error"], (r, got)


def test_exit_code_of_a_job_that_shrank_in_place():
    """``hetcomm train``'s verdict after an in-place shrink: the lowest survivor's when every
    failed rank was killed by a signal; anything else is the old failure report (None)."""
    from hetcomm.launcher import LaunchOutcome, RankOutcome
    from hetcomm.train.inplace import outcome_code

    def run(*ranks):
        return LaunchOutcome(ranks=tuple(ranks), first_failure=None, timed_out=(), end_order=(), wall_s=1.0)

    ok = [RankOutcome(r, True, result=0, exitcode=0) for r in range(4)]
    killed = RankOutcome(0, False, exitcode=-9)
    assert outcome_code(run(killed, *ok[1:])) == 0
    assert outcome_code(run(killed, RankOutcome(1, True, result=1, exitcode=0), *ok[2:])) == 1  # the loss check failed
    raised = RankOutcome(0, False, error_type="CollectiveError", error="peer lost", exitcode=1)
    assert outcome_code(run(raised, *ok[1:])) is None  # a survivor that raised: a failure, as before
    assert outcome_code(run(*ok)) is None
    assert outcome_code(run(killed, RankOutcome(1, False, exitcode=-9))) is None  # nobody finished
