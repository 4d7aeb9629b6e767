"""``benchmarks/moe_workloads_layer.py``'s host logic: the workload list, EPLB's owners, the
rows/speed model and the ratios it reports, on hand-made per-rank results."""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import moe_workloads_layer as mwl  # noqa: E402
from hetcomm.errors import ConfigError  # noqa: E402


def test_workloads_by_any_name_in_the_order_given():
    assert mwl.parse_workloads("w3,W0,burst") == ["W3_spread", "W0_balanced", "W7_burst"]
    assert len(mwl.parse_workloads("all")) == 8
    with pytest.raises(ConfigError, match="unknown workload 'W9'"):
        mwl.parse_workloads("W1,W9")


def test_eplb_owners_pack_equal_counts_and_weigh_a_copied_expert_by_its_share():
    load = [40.0, 10.0, 10.0, 10.0, 9.0, 9.0, 1.0, 1.0]
    owners = mwl.eplb_owners(load, hot=[], world_size=4)
    assert [owners.count(r) for r in range(4)] == [2, 2, 2, 2]
    assert owners[0] not in (owners[1], owners[2], owners[3])  # the heavy one packed alone with a light one
    assert sorted(e for e in range(8) if owners[e] == owners[0]) in ([0, 6], [0, 7])
    # Copied on every rank, expert 0 weighs 40 / 4 = 10: no longer the heaviest.
    hot = mwl.eplb_owners(load, hot=[0], world_size=4)
    assert hot == [0, 1, 2, 3, 0, 1, 2, 3]  # expert 0 now shares its rank with a 9, as a 10 would


def test_model_makespan_is_the_slowest_rank_at_its_quota():
    assert mwl.model_makespan([100, 100, 100, 100], [1, 1, 1, 0.5]) == 200
    assert mwl.model_makespan([120, 120, 120, 60], [1, 1, 1, 0.5]) == 120


def _rec(step_s, rows, slow_expert_s=0.1):
    return {"step_s": step_s, "rows": rows * len(step_s), "expert_s": [[0.3, 0.3, 0.3, slow_expert_s]] * len(step_s),
            "owners_per_rank": [8, 8, 8, 8], "events": [], "speeds": [1, 1, 1, 1], "cold": "off"}


def test_summary_ratios_are_of_medians_and_the_model_measured_on_token_equal():
    quotas = [1.0, 1.0, 1.0, 0.5]
    equal, balanced = [[100, 100, 100, 100]], [[120, 120, 120, 60]]
    pair = {"token-equal": _rec([2.0, 2.2, 9.0], equal), "EPLB": _rec([3.0, 3.0, 3.0], equal),
            "default": _rec([1.0, 1.1, 1.2], balanced), "oracle": _rec([1.0, 1.0, 1.0], balanced)}
    # token-equal: the half-speed rank's 100 rows are a makespan of 200 and took 3 x 0.1 s forward
    # and backward: c = 0.3 / 200 s per row; o = median(2.0, 2.2, 9.0) - 0.3 = 1.9 s.
    model = mwl.model_step_s(pair, quotas)
    assert model["token-equal"] == pytest.approx(2.2) and model["EPLB"] == pytest.approx(2.2)
    assert model["default"] == pytest.approx(1.9 + 0.3 * 120 / 200)
    out = mwl.summarize({"quotas": quotas, "runs": {"W1_hot_set": [pair]}})["W1_hot_set"]
    assert out["median_s"] == {"token-equal": 2.2, "EPLB": 3.0, "default": 1.1, "oracle": 1.0}
    r = out["ratios"]
    assert r["token-equal"]["measured"] == pytest.approx(2.0)
    assert r["EPLB"]["measured"] == pytest.approx(3.0 / 1.1)
    assert r["token-equal"]["model"] == pytest.approx(2.2 / 2.08)
    assert r["token-equal"]["model_error"] == pytest.approx((2.2 / 2.08) / 2.0 - 1)
    assert r["oracle"]["model"] == pytest.approx(1.0)
    # The half-speed rank's forward expert seconds x 3 over each step, median: 0.3 / 1.1 for the default.
    assert out["slow_expert_share"]["default"] == pytest.approx(0.3 / 1.1)
    text = mwl.render({"W1_hot_set": out}, None, "header")
    assert "| W1_hot_set * | 2.200 (2.200-2.200) |" in text
    assert "2.00 (2.00-2.00) (1.06)" in text  # x token-equal, per pair, model
    assert "1.10 (1.10-1.10) (1.00)" in text  # default / oracle time
    assert "| 27 % / 14 % |" in text  # slow rank's expert share: default / token-equal (0.3 / 2.2)


def test_a_run_comparing_copies_reports_the_default_against_the_other_cadence():
    quotas = [1.0, 1.0, 1.0, 0.5]
    equal, balanced = [[100, 100, 100, 100]], [[120, 120, 120, 60]]
    pair = {"token-equal": _rec([2.0], equal), "EPLB": _rec([3.0], equal), "default": _rec([1.0], balanced),
            "oracle": _rec([1.0], balanced), mwl.COPIES: _rec([1.5], equal)}
    out = mwl.summarize({"quotas": quotas, "copies": "10,0.99", "runs": {"W6_rotating_hotspot": [pair]}})
    assert out["W6_rotating_hotspot"]["ratios"][mwl.COPIES]["measured"] == pytest.approx(1.5)

    class Args:
        compare_copies = "10,0.99"

    text = mwl.render(out, Args, "header")
    assert "| default-copies (10,0.99) | x token-equal (model)" in text
    assert text.splitlines()[5].endswith("| 1.50 (1.50-1.50) |")
    # Without the comparison: the four policies.
    assert mwl.policies_of(None) == mwl.POLICIES
    assert mwl.parse_copies("1,0.5") == (1, 0.5)
    with pytest.raises(SystemExit, match="EVERY,ALPHA"):
        mwl.parse_copies("every step")
