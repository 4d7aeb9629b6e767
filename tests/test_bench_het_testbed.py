"""benchmarks/het_testbed.py's steady pace, read from a real run's metrics file."""

import json
import os
import statistics
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
METRICS = os.path.join(REPO, "tests", "fixtures_bench", "metrics_demo_cold_move.jsonl")


def test_steady_pace_times_only_the_steps_after_the_given_one():
    from het_testbed import steady_pace

    steps = [json.loads(x) for x in open(METRICS) if '"kind":"step"' in x]
    by = {s["step"]: s for s in steps}
    last = max(by)
    tok_s, spread, head = steady_pace(METRICS, 5, first=4)
    assert head == pytest.approx(sum(by[s]["tokens"] for s in range(1, 5)) / by[4]["time_s"])  # an N-step run
    after = [s for s in steps if s["step"] > 5]
    assert tok_s == pytest.approx(sum(s["tokens"] for s in after) / (by[last]["time_s"] - by[5]["time_s"]))
    e = [s["expert_s_by_rank"] for s in after]
    assert spread == pytest.approx(statistics.median(max(x) / (sum(x) / len(x)) for x in e))
    # A run that ended before the step: nothing to time.
    nan = steady_pace(METRICS, last, first=last + 1)
    assert all(v != v for v in nan)


@pytest.mark.parametrize("argv, steps", [(["--first", "200"], "120"), (["--first", "50", "--steps", "40"], "40")])
def test_a_first_window_the_runs_cannot_fill_is_refused_before_any_emulation(argv, steps):
    import subprocess

    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "het_testbed.py"), *argv],
                         capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert out.returncode == 2 and f"--first {argv[1]}: give a number from 1 to the run's {steps} steps" in out.stderr
