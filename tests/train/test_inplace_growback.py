"""``hetcomm train --shrink-in-place --grow-back`` (hetcomm/train/growback.py): a killed rank's slot
taken back in place through ``dist._reconfigure``.

Four real ranks of the tiny job on the launcher as ``hetcomm train`` runs them (its own
:func:`~hetcomm.train.local_ranks.launch_options`: the launcher hosts the store, stops nobody when
a rank dies, and with ``--grow-back`` starts a replacement in a killed rank's slot). Rank 2 (the
H800) finishes step ``KILL_AFTER``, deletes its own snapshots and SIGKILLs itself (the hook of
``test_inplace_shrink.py``). The survivors shrink to 3 and go on; the launcher starts a
replacement with ``HETCOMM_JOIN=1``, which creates a group of one, publishes its handle and
waits; the survivors wait for its handle at the start of step ``WAIT_AT`` if it is not there yet (the test's hook, so
that the grow does not depend on how fast the replacement imports torch), and after that step
they agree to take it in,
reconfigure to 4 (the replacement in slot 2) and every rank rebuilds the job from the 3-rank
snapshots resharded by global expert id.

Checked: rank 2's outcome is the replacement's (a new pid, started to replace the killed one),
and it finished training as rank 2 of 4; the survivors finished in their own processes as ranks
0, 1, 3 of 4 after one shrink; every rank's losses agree (the joiner got the history with the
plan), all finite; every expert owned by exactly one of the 4; the metrics say 4 -> 3 (cause:
rank 2 exited) then 3 -> 4 (cause: cluster rank 2 rejoined), each with at most one step redone
in the health record; the launch's exit code is the job's own verdict, not a failure. And the refusal: ``--grow-back`` without
``--shrink-in-place`` is a usage error naming the fix, before anything starts.
"""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import replace

import pytest

from hetcomm.backends.reconfigure import supported
from tests.backends.ranks import MIXED_MINI
from tests.ops.jobs import TINY
from tests.train.test_inplace_shrink import KILL_AFTER, install_kill_hook

#: The step at whose start the shrunk survivors wait until the replacement's handle is in the
#: store (the test's hook): the grow then comes after that step whatever the machine's load.
STEPS, VICTIM, WAIT_AT = 10, 2, 7

needs_214 = pytest.mark.skipif(not supported(), reason="grow-back needs torch >= 2.14 (shrink_group, _reconfigure)")


def install_wait_hook(victim: int, wait_at: int = WAIT_AT) -> None:
    """In this rank's process: a survivor of a shrink to 3 ranks waits at the start of step
    ``wait_at`` until rank ``victim``'s replacement has published its handle (so that the grow
    comes at the latest after that step, however slowly the replacement starts); a replacement
    waits for nothing. Patches the loop's ``_step``. Also used by ``tests/cli/inplace_launch.py``."""
    from hetcomm.train import growback, loop

    if growback.joining():
        return
    inner = loop._step

    def step(job, n: int) -> None:
        if n == wait_at and job.world_size == 3:
            from datetime import timedelta

            from hetcomm.ops.worker import master_store

            master_store(120.0).wait([f"{growback.KEY}/{victim}/handle"], timedelta(seconds=120))
        inner(job, n)

    loop._step = step


def _rank(cfg, victim: int, joiner_dies: bool = False) -> dict:
    """One rank: ``train_worker``; rank ``victim``'s first process dies after step ``KILL_AFTER``,
    its replacement (``HETCOMM_JOIN``) does not, unless ``joiner_dies``: then it SIGKILLs itself
    when it calls ``dist._reconfigure`` (its handle published, the survivors' plan read); what
    each process ended as."""
    from hetcomm.train import growback, loop

    rank = int(os.environ["RANK"])
    seen: dict = {}
    joiner = growback.joining()
    if joiner and joiner_dies:
        import torch.distributed as dist

        dist._reconfigure = lambda **kw: os.kill(os.getpid(), signal.SIGKILL)
    install_kill_hook(-1 if joiner else victim, seen.update)
    install_wait_hook(victim)
    code = loop.train_worker(rank, int(os.environ["WORLD_SIZE"]), cfg)
    summary = loop.last_summary() or {}
    return {"pid": os.getpid(), "code": code, "joiner": joiner, "grows": growback.grows(),
            "losses": summary.get("losses"), "text": summary.get("text"), **seen}


def _run(tmp_path, joiner_dies: bool = False):
    from hetcomm.launcher import launch
    from hetcomm.train.local_ranks import launch_options
    from hetcomm.train.loop import load_train_config

    metrics = str(tmp_path / "m.jsonl")
    cfg = load_train_config(TINY, steps=STEPS, cluster=MIXED_MINI, metrics=metrics, snapshot_every=1,
                            shrink_in_place=True, grow_back=True, timeout_s=30.0)
    os.makedirs(tmp_path / "shm")
    env = {"HETCOMM_SNAPSHOT_ROOT": str(tmp_path / "shm"), "HETCOMM_JOB_ID": "growback", "HETCOMM_CLUSTER": None}
    # As hetcomm train launches its ranks: the launcher hosts the store, stops nobody when a rank
    # dies, and starts a replacement in a killed rank's slot (rejoin).
    opts = launch_options(cfg, in_place=True)
    assert opts.rejoin == {"HETCOMM_JOIN": "1"} and opts.grace_s is None
    out = launch(_rank, 4, replace(opts, args=(cfg, VICTIM, joiner_dies), env=env, store_timeout_s=30.0, timeout_s=400))
    return out, metrics


@needs_214
@pytest.mark.timeout(600)
def test_killed_rank_is_replaced_and_the_job_grows_back_in_place(tmp_path):
    from hetcomm.ops.metrics import read_metrics
    from hetcomm.ops.ops_records import sibling_path
    from hetcomm.train.local_ranks import exit_code

    out, metrics = _run(tmp_path)
    ranks = list(out.ranks)
    bad = [o.describe() + "\n" + (o.traceback or "") for o in ranks if not o.ok]
    assert not bad, "\n".join(bad)
    victim = ranks[VICTIM]
    assert victim.replaced is not None and victim.replaced[1] == -signal.SIGKILL, victim
    assert victim.replaced[0] != victim.pid
    res = [o.result for o in ranks]
    for r, got in enumerate(res):
        assert got["pid"] == got["pid_end"] == ranks[r].pid, (r, got)
        assert (got["world"], got["rank"], got["slots"]) == (4, r, [0, 1, 2, 3]), (r, got)
        assert got["joiner"] == (r == VICTIM) and got["grows"] == 1, (r, got)
        assert got["shrinks"] == 1, (r, got)  # the joiner carries the job's count with the plan
        assert got["finite"], f"rank {r}: a weight is not finite"
        assert len(got["losses"]) == STEPS and all(math.isfinite(x) for x in got["losses"]), (r, got["losses"])
        assert got["losses"] == res[0]["losses"], r
    assert "every expert owned by exactly one rank" in res[0]["text"], res[0]["text"]
    # The launch's exit code is the job's own loss verdict (10 steps do not reach the demo's
    # target: 1), as for a job that lost nobody; no failure report.
    assert exit_code(out, True) == res[0]["code"] == (0 if "PASS:" in res[0]["text"] else 1)

    events = [e for e in read_metrics(metrics).events if e.event == "membership"]
    assert [e.detail.split(" ranks")[0] for e in events] == ["4 -> 3", "3 -> 4"], [e.detail for e in events]
    shrink, grow = events
    assert "cause: rank 2 exited (H800 on h800-0) (seen by the heartbeat)" in shrink.detail, shrink.detail
    assert "node(s) h800-0 joined" in grow.detail, grow.detail
    assert "cause: cluster rank 2 (H800 on h800-0) rejoined" in grow.detail and "_reconfigure" in grow.detail, grow.detail
    assert KILL_AFTER - 1 <= shrink.step <= KILL_AFTER and shrink.step < grow.step <= WAIT_AT, (shrink.step, grow.step)
    with open(sibling_path(metrics), encoding="utf-8") as f:
        recs = [json.loads(ln) for ln in f if '"membership"' in ln]
    assert [(r["before"], r["after"]) for r in recs] == [(4, 3), (3, 4)], recs
    for rec in recs:
        assert rec["steps_redone"] is not None and rec["steps_redone"] <= 1, rec
        assert rec["experts_present"] == rec["experts_total"], rec
    assert not os.path.exists(res[0]["snap_dir"]), os.listdir(res[0]["snap_dir"])


@needs_214
@pytest.mark.timeout(600)
def test_a_replacement_that_dies_before_joining_leaves_the_survivors_on_the_smaller_world(tmp_path, capfd):
    """The replacement publishes its handle and is SIGKILLed when it would reconfigure: every
    survivor's agreement ends at the job's timeout naming its handle, and the survivors go on
    with the shrunk job (which the failed change left as it was) and finish on 3 ranks."""
    from hetcomm.ops.metrics import read_metrics
    from hetcomm.train.local_ranks import exit_code

    out, metrics = _run(tmp_path, joiner_dies=True)
    ranks = list(out.ranks)
    victim = ranks[VICTIM]
    assert victim.exitcode == -signal.SIGKILL and victim.replaced is not None, victim
    assert victim.replaced[1] == -signal.SIGKILL and victim.replaced[0] != victim.pid, victim
    survivors = [r for r in range(4) if r != VICTIM]
    bad = [ranks[r].describe() + "\n" + (ranks[r].traceback or "") for r in survivors if not ranks[r].ok]
    assert not bad, "\n".join(bad)
    for new, r in enumerate(survivors):
        got = ranks[r].result
        assert got["pid"] == got["pid_end"] == ranks[r].pid, (r, got)
        assert (got["world"], got["rank"], got["slots"], got["grows"]) == (3, new, survivors, 0), (r, got)
        assert len(got["losses"]) == STEPS and got["finite"], (r, got)
    events = [e for e in read_metrics(metrics).events if e.event == "membership"]
    assert [e.detail.split(" ranks")[0] for e in events] == ["4 -> 3"], [e.detail for e in events]
    err = capfd.readouterr().err
    assert "--grow-back: the replacement(s) for cluster rank(s) [2] did not join (PeerTimeout" in err, err[-3000:]
    assert "going on with 3 ranks" in err and "cluster rank(s) [2] did not come back" in err, err[-3000:]
    # the replacement died by a signal, every survivor finished: the survivors' verdict
    assert exit_code(out, True) == ranks[0].result["code"]


def test_grow_back_without_shrink_in_place_is_refused(capsys):
    """Before anything starts: exit 2 and the fix named (the same for a YAML's ``grow_back``)."""
    from hetcomm.cli.main import main as hetcomm_main
    from hetcomm.errors import ConfigError
    from hetcomm.train.loop import TrainConfig

    code = hetcomm_main(["train", "--config", TINY, "--cluster", MIXED_MINI, "--grow-back"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--grow-back" in err and "add --shrink-in-place" in err, err
    with pytest.raises(ConfigError, match="needs shrink_in_place: true"):
        TrainConfig(grow_back=True)
