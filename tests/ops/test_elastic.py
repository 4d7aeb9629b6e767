"""A node that does not come back: the job finishes on the survivors (issue 20, item 2).

What ``hetcomm launch --nnodes MIN:MAX`` does when a node is lost for good, in pieces that run
in seconds (the whole thing, three launches in network namespaces with torchrun re-rendezvousing,
takes minutes: ``benchmarks/elastic_shrink_run.sh``, recorded in benchmarks/README.md):

* the survivors' workers write the job's cluster without the lost node
  (:func:`hetcomm.ops.job_cluster.job_cluster_yaml`, as ``hetcomm.ops.worker.place`` does);
* the shared tiny run (``demo_run``: 4 ranks of mixed-mini, a checkpoint every 4 steps) stands
  for the attempt that was running when the h800 node died after step 15: its checkpoint
  directory rolled back to step 12 and its metrics cut after step 15;
* the resumed job runs on the 3 remaining ranks (2 A100 + the 910B) from that checkpoint.

Asserted: exit 0/1 (1 = the tiny job's loss verdict), the membership change in the metrics and
the health records (node h800-0 left, 4 -> 3 ranks, 3 steps redone, every expert present), the
experts re-placed on ranks 0-2 only, every step after the checkpoint redone once, and the final
loss close to the uninterrupted run's (loose here; the precise comparison is the benchmark's).
"""

from __future__ import annotations

import json
import math
import os
import shutil

from hetcomm.ops.metrics import read_metrics
from tests.backends.ranks import MIXED_MINI, run_ranks
from tests.ops.jobs import STEPS, TINY, _free_port, _train_rank

KILLED_AFTER = 15
RESUME_AT = 12


def _cut_metrics(src: str, dst: str, last_step: int) -> None:
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for line in f:
            obj = json.loads(line)
            if obj.get("step", 0) <= last_step or obj["kind"] == "run":
                out.write(line)


def test_a_lost_node_leaves_the_job_on_three_ranks_with_every_expert(tmp_path, demo_run):
    from hetcomm.ops.checkpoint_files import step_dir_name
    from hetcomm.ops.job_cluster import job_cluster_yaml
    from hetcomm.ops.membership import read_membership
    from hetcomm.ops.ops_records import read_records, sibling_path
    from hetcomm.ops.safe_fs import write_private
    from hetcomm.train.loop import load_train_config

    _, ref_metrics, ref_ck = demo_run
    ref = {s.step: s.loss for s in read_metrics(ref_metrics).steps}
    prev = read_membership(ref_ck)
    assert prev is not None and prev["world_size"] == 4 and "h800-0" in prev["nodes"]

    ck = str(tmp_path / "ck")
    shutil.copytree(ref_ck, ck)
    write_private(os.path.join(ck, "latest"), step_dir_name(RESUME_AT) + "\n")
    metrics = str(tmp_path / "m.jsonl")
    _cut_metrics(ref_metrics, metrics, KILLED_AFTER)
    yaml3 = tmp_path / "job-cluster.yaml"
    yaml3.write_text(job_cluster_yaml(MIXED_MINI, ["a100-0", "ascend-0"]))

    # balance=False: as the reference run (tests/ops/conftest.py), whose checkpoints hold no cold-move state
    cfg = load_train_config(TINY, steps=STEPS, cluster=str(yaml3), metrics=metrics, checkpoint_dir=ck,
                            checkpoint_every=4, resume=True, balance=False)
    codes = run_ranks(_train_rank, 3, cluster=str(yaml3), args=(cfg, _free_port()), timeout=150)
    assert codes[0] in (0, 1), codes

    log = read_metrics(metrics)
    assert [e.step for e in log.events if e.event == "resume"] == [RESUME_AT]
    change = [e for e in log.events if e.event == "membership"]
    assert len(change) == 1 and change[0].step == RESUME_AT, log.events
    assert "4 -> 3 ranks" in change[0].detail and "h800-0 left" in change[0].detail, change[0].detail
    recs = [r for r in read_records(sibling_path(metrics)) if r["kind"] == "membership"]
    assert len(recs) == 1, recs
    rec = recs[0]
    assert (rec["before"], rec["after"], rec["nodes_left"], rec["nodes_joined"]) == (4, 3, ["h800-0"], [])
    assert [r["model"] for r in rec["left"]] == ["H800"]
    assert rec["steps_redone"] == KILLED_AFTER - RESUME_AT
    assert rec["experts_present"] == rec["experts_total"] == 2 * 4  # 2 layers x 4 experts
    assert "exactly one rank" in rec["experts"]
    for owners in rec["owners"]:  # re-placed for 3 ranks, each expert once
        assert sorted(set(owners)) == [0, 1, 2] and len(owners) == 4
    # Every step after the checkpoint was trained (again) on 3 ranks, once.
    after = [s.step for s in log.all_steps if s.step > RESUME_AT][-(STEPS - RESUME_AT):]
    assert after == list(range(RESUME_AT + 1, STEPS + 1))
    assert len(log.runs) == 2 and log.runs[-1].world_size == 3
    last = log.steps[-1].loss
    assert math.isfinite(last) and abs(last - ref[STEPS]) <= 0.1 * ref[STEPS], (last, ref[STEPS])
    # The next attempt's record: 3 ranks.
    assert read_membership(ck)["world_size"] == 3


HUNG_AT_STEP = 4


def _train_or_hang(rank: int, world_size: int, cfg, port: int, flags: str):
    """A rank of the tiny job; rank 2 stops itself (SIGSTOP) as it starts step ``HUNG_AT_STEP``.

    A watchdog (a shell, started before the stop) SIGKILLs the stopped rank once the three
    survivors have failed (their flag files), as torchrun's agent would after they exit.
    """
    import signal
    import subprocess

    if rank == 2:
        from hetcomm.train.data import MarkovTask

        orig = MarkovTask.sample
        calls = [0]

        def sample(self, *a, **k):
            calls[0] += 1
            if calls[0] == HUNG_AT_STEP:
                me = os.getpid()
                subprocess.Popen(["sh", "-c", f"i=0; while [ $(ls {flags} | wc -l) -lt 3 ] && [ $i -lt 1500 ]; do "
                                  f"sleep 0.1; i=$((i+1)); done; kill -9 {me}"])
                os.kill(me, signal.SIGSTOP)
            return orig(self, *a, **k)

        MarkovTask.sample = sample
    try:
        return _train_rank(rank, world_size, cfg, port)
    except BaseException as e:
        with open(os.path.join(flags, str(rank)), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise


def test_a_hung_rank_is_named_stopped_by_every_survivor_not_at_the_timeout(tmp_path):
    # The hang variant: a SIGSTOPped rank never answers; the survivors' heartbeats see it
    # stopped (/proc) and every wait on it raises naming it instead of at the group timeout:
    # the all-to-all's wait loop, a delegated collective's cross-rank check (the board's), a
    # blocking delegated collective in gloo (faults.wait_watching), a routed step blocked inside
    # a gloo-rail transfer (the rail releases gloo's waits). A survivor whose wait broke because
    # another survivor raised and exited first names the stopped rank too (faults.blame puts the
    # heartbeat's certain loss first), so all three errors name rank 2. From there
    # recovery is a kill's: torchrun stops the group and restarts it, or continues without the
    # node (test above).
    from tests.backends.ranks import run_ranks_outcomes

    from hetcomm.train.loop import load_train_config

    flags = tmp_path / "failed"
    flags.mkdir()
    cfg = load_train_config(TINY, steps=8, timeout_s=20.0)
    outs = run_ranks_outcomes(_train_or_hang, 4, cluster=MIXED_MINI, args=(cfg, _free_port(), str(flags)), timeout=170)
    assert outs[2].stopped != "timeout" and not outs[2].ok, outs[2]
    for r in (0, 1, 3):
        o = outs[r]
        assert not o.ok and o.stopped != "timeout", (r, o)
        assert "peer 2" in o.error and "rank 2 is stopped" in o.error and "named by the heartbeat" in o.error, (r, o.error)
