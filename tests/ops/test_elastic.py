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

    cfg = load_train_config(TINY, steps=STEPS, cluster=str(yaml3), metrics=metrics, checkpoint_dir=ck,
                            checkpoint_every=4, resume=True)
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
