"""``benchmarks/het_equal.py`` reads a run's balancing actions from its metrics file and its CPU
per step from its summary: checked on the metrics of a real demo run whose cold move happened
(``tests/fixtures/metrics_demo_cold_move.jsonl``: 20 steps of ``hetcomm train --config
configs/train/demo.yaml --metrics``; layer 0 moved experts [3, 4, 5, 6] at step 20) and on
copies of it with one kind of line changed."""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import het_equal  # noqa: E402

FIXTURE = os.path.join(REPO, "tests", "fixtures", "metrics_demo_cold_move.jsonl")
MOVED = "layer 0 at step 20: experts [3, 4, 5, 6] moved; layer 1 at step 20: nothing to move"
NOTHING = "layer 0 at step 20: nothing to move; layer 1 at step 20: nothing to move"


def _lines():
    with open(FIXTURE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _write(tmp_path, lines, name="m.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return het_equal.read_log(str(path))


def _event(step, event, detail=""):
    return {"kind": "event", "step": step, "event": event, "detail": detail, "marks": {}}


def test_the_real_cold_move_is_a_move():
    log = het_equal.read_log(FIXTURE)
    assert het_equal.actions_of(log, MOVED) == ["move"]
    assert het_equal.actions_of(log) == ["move"]  # the migration event alone says so
    assert het_equal.verdict_of(log) == "ranks differ"


def test_without_the_migration_event_nothing_happened(tmp_path):
    quiet = [x for x in _lines() if not (x["kind"] == "event" and x["event"] == "migration")]
    log = _write(tmp_path, quiet)
    assert het_equal.actions_of(log, NOTHING) == []
    assert het_equal.actions_of(log, MOVED) == ["move"]  # the summary row still counts
    assert het_equal.actions_of(None, NOTHING) == []
    assert het_equal.verdict_of(None) == "-"


def test_experts_landed_in_a_step_record_is_a_move(tmp_path):
    lines = [x for x in _lines() if not (x["kind"] == "event" and x["event"] == "migration")]
    for x in lines:
        if x["kind"] == "step" and x["step"] == 20:
            x["migrations"] = 2
    assert het_equal.actions_of(_write(tmp_path, lines)) == ["move"]


def test_the_split_turned_on_is_a_split_change(tmp_path):
    lines = [x for x in _lines() if not (x["kind"] == "event" and x["event"] == "migration")]
    last = max(i for i, x in enumerate(lines) if x["kind"] == "event" and x["event"] == "policy")
    lines[last]["detail"] = lines[last]["detail"].replace("token_split off", "token_split on")
    assert het_equal.actions_of(_write(tmp_path, lines)) == ["split"]


def test_speeds_that_move_under_a_split_are_a_split_change(tmp_path):
    lines = [x for x in _lines() if not (x["kind"] == "event" and x["event"] == "migration")]
    for x in lines:
        if x["kind"] == "event" and x["event"] == "policy":
            x["detail"] = x["detail"].replace("token_split off", "token_split on")
    # The real run's agreed vector changes at steps 10 and 20: a split on from the start follows it.
    assert het_equal.actions_of(_write(tmp_path, lines, "on.jsonl")) == ["split"]
    steady = [x for x in lines if x["kind"] != "step" or x["step"] < 10]
    assert het_equal.actions_of(_write(tmp_path, steady, "steady.jsonl")) == []


def test_other_events_count_by_kind_bookkeeping_does_not(tmp_path):
    quiet = [x for x in _lines() if not (x["kind"] == "event" and x["event"] == "migration")]
    log = _write(tmp_path, quiet + [_event(20, "checkpoint", "step-20"), _event(20, "snapshots", "kept: 2")])
    assert het_equal.actions_of(log) == []
    log = _write(tmp_path, quiet + [_event(12, "deal", "rank 3 takes 12 of 16 rows")], "deal.jsonl")
    assert het_equal.actions_of(log) == ["deal"]


def test_busy_cpu_per_step_is_summed_over_ranks():
    row = ("9/7/8/4 % of busy CPU by rank (expert 6.7/4.9/5.0/2.3 ms, busy 71.6/66.2/65.8/57.3 ms CPU per step, "
           "steps 3-20)")
    assert abs(het_equal.busy_ms(row) - (71.6 + 66.2 + 65.8 + 57.3)) < 1e-9
    assert het_equal.busy_ms("") is None
    rows = het_equal.summary_rows(f"expert FFN share (fwd + bwd)   {row}\n"
                                  f"{het_equal.tb.COLD}  {MOVED}\n")
    assert rows["expert FFN share (fwd + bwd)"] == row
    assert rows[het_equal.tb.COLD] == MOVED
