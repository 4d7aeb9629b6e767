"""``hetcomm bench moe --workload``: the per-rank time model of the skew workloads."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "hetcomm", "bench", "moe", *args], capture_output=True, text=True, timeout=300)


def test_bench_moe_one_workload_json():
    p = _run("--workload", "hot_rank", "--speeds", "100,100,100,50", "--moe-steps", "4", "--moe-experts", "16", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    (row,) = doc["rows"]
    assert row["workload"] == "W2_hot_rank"
    # The split balances time on the half-speed rank; static and token-equal do not.
    assert row["hetcomm_max_over_mean"] < 1.10 < row["token-equal_max_over_mean"]
    assert row["hetcomm_x_static"] > 1.3 and row["hetcomm_over_oracle"] < 1.05


def test_bench_moe_unknown_workload_names_the_choices():
    p = _run("--workload", "W9")
    assert p.returncode != 0
    assert "W0_balanced" in p.stderr and "workload" in p.stderr
