"""The policy record (hetcomm.moe.policy): which heterogeneity levers are on, as a truth table over
the flags, the kind of cluster and the agreed speed verdict; every lever carries a reason."""

from __future__ import annotations

import dataclasses
import os

import pytest

from hetcomm.errors import ConfigError
from hetcomm.moe.policy import LEVERS, PolicyInputs, cluster_is_mixed, cluster_kind, decide, speed_verdict
from hetcomm.topo.cluster import load_cluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Columns of the expected row: initial_weights, replica_holders, token_split, migrations, cold_placement,
# chunks, paging (LEVERS order); 1 on, 0 off.
ROWS = [
    # id, inputs (beyond world_size=4), expected
    ("default-mixed-unmeasured", dict(cluster_kind="mixed"), "1100100"),
    ("default-mixed-differ", dict(cluster_kind="mixed", differ=True), "1110100"),
    ("default-mixed-equal-speeds", dict(cluster_kind="mixed", differ=False), "1100000"),
    ("default-equal-cluster", dict(cluster_kind="equal"), "0100100"),
    ("labels-alike-measured-differ", dict(cluster_kind="equal", differ=True), "0110100"),
    ("differ-experts-half-a-step", dict(cluster_kind="equal", differ=True, expert_share=0.5), "0110100"),
    ("differ-experts-a-few-percent", dict(cluster_kind="equal", differ=True, expert_share=0.05), "0100100"),
    ("strong-flags-only", dict(cluster_kind="strong"), "1100100"),
    ("no-cluster", dict(cluster_kind="none"), "0100100"),
    ("no-cluster-differ", dict(cluster_kind="none", differ=True), "0110100"),
    ("no-balance", dict(cluster_kind="mixed", balance=False), "0100000"),
    ("no-balance-split-asked", dict(cluster_kind="mixed", balance=False, token_split=True), "0110000"),
    ("balance", dict(cluster_kind="mixed", balance=True), "1101000"),
    ("balance-differ", dict(cluster_kind="mixed", balance=True, differ=True), "1111000"),
    ("datasheet", dict(cluster_kind="mixed", speed="datasheet"), "1100000"),
    ("datasheet-differ", dict(cluster_kind="mixed", speed="datasheet", differ=True), "1110000"),
    ("oracle-differ", dict(cluster_kind="mixed", speed="oracle", differ=True), "1110100"),
    ("oracle-equal", dict(cluster_kind="mixed", speed="oracle", differ=False), "1100000"),
    ("oracle-labels-alike", dict(cluster_kind="equal", speed="oracle"), "1100100"),
    ("split-off", dict(cluster_kind="mixed", token_split=False), "1100100"),
    ("split-asked-equal-cluster", dict(cluster_kind="equal", token_split=True), "0110100"),
    ("no-replication", dict(cluster_kind="mixed", replicate=False, token_split=True), "1000100"),
    ("paging", dict(cluster_kind="mixed", page_budget=0.5, token_split=True), "1100001"),
    ("paging-auto", dict(cluster_kind="mixed", page_budget="auto"), "1100001"),
    ("powersgd-experts", dict(cluster_kind="mixed", powersgd_experts=2), "1100000"),
    ("chunks-given", dict(cluster_kind="mixed", chunks=2), "1100110"),
    ("chunks-one", dict(cluster_kind="mixed", chunks=1, device_type="cuda"), "1100100"),
    ("chunks-auto-cuda", dict(cluster_kind="mixed", device_type="cuda"), "1100110"),
    ("one-rank", dict(world_size=1, cluster_kind="mixed", token_split=True, balance=True), "0000000"),
]


@pytest.mark.parametrize("inputs,expected", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_truth_table(inputs, expected):
    policy = decide(PolicyInputs(**{"world_size": 4, **inputs}))
    got = "".join("1" if lever.on else "0" for _, lever in policy.levers())
    assert got == expected, "\n".join(f"{n}: {lv}" for n, lv in policy.levers())
    for name, lever in policy.levers():
        assert 0 < len(lever.reason) <= 110, (name, lever.reason)  # a short sentence, one summary row


def test_chunk_count_follows_the_chunks_lever():
    assert decide(PolicyInputs(4, chunks="auto", device_type="cpu")).num_chunks == 1
    assert decide(PolicyInputs(4, chunks="auto", device_type="npu")).num_chunks is None  # measured at the start
    assert decide(PolicyInputs(4, chunks=3)).num_chunks == 3


def test_verdict_changes_the_cold_and_split_levers_and_says_so():
    def changed(p, q):
        return [n for (n, a), (_, b) in zip(p.levers(), q.levers()) if a != b]

    p = decide(PolicyInputs(4, cluster_kind="mixed"))
    assert p.with_verdict(None) is p
    q = p.with_verdict(False)
    assert changed(p, q) == ["token_split", "cold_placement"] and not q.cold_placement.on
    assert not q.token_split.on and "equal" in q.token_split.reason  # still off, now for the verdict's reason
    assert "equal" in q.cold_placement.reason and q.line().endswith("speed verdict: ranks equal")
    r = p.with_verdict(True)  # measured beyond noise: the split turns on, the cold move says why it acts
    assert changed(p, r) == ["token_split", "cold_placement"] and r.token_split.on and r.cold_placement.on
    assert "differ" in r.token_split.reason and r.line().endswith("speed verdict: ranks differ")
    assert [n for n, _ in p.levers()] == list(LEVERS)
    assert [f.name for f in dataclasses.fields(p)][1:1 + len(LEVERS)] == list(LEVERS)  # one field per lever
    assert [k for k, _ in p.rows()][0] == "policy: initial weights"


def test_bad_inputs_name_the_key():
    for kw, key in ((dict(speed="guessed"), "policy.speed"), (dict(balance="sometimes"), "policy.balance"),
                    (dict(token_split="maybe"), "policy.token_split"), (dict(cluster_kind="odd"), "policy.cluster_kind"),
                    (dict(world_size=0), "policy.world_size")):
        with pytest.raises(ConfigError) as ei:
            PolicyInputs(**{"world_size": 4, **kw})
        assert ei.value.key == key


def test_cluster_kinds_of_the_shipped_clusters():
    def kind(name, w=4):
        return cluster_kind(load_cluster(os.path.join(REPO, "configs", "clusters", name)), w)

    assert kind("mixed-mini.yaml") == "mixed" and kind("mixed-mini-halfspeed.yaml") == "mixed"
    # mixed-mini-equal declares one rate everywhere, but its device models still differ
    assert cluster_is_mixed(load_cluster(os.path.join(REPO, "configs", "clusters", "mixed-mini-equal.yaml")), 4)
    assert cluster_kind(None, 4) == "none"
    assert kind("mixed-mini.yaml", 2) == "equal"  # the first two ranks: the two A100s, both strong


class _Agreed:
    """The fields of an agreed meter the verdict reads (a real agreement needs a group: the
    2-rank tests in test_measured_loop.py run that)."""

    def __init__(self, differ):
        self.differ = differ


_Meter = _Agreed


def test_expert_share_is_the_busiest_rank_over_its_forward_and_moves_the_split_only_across_the_floor():
    from hetcomm.moe.policy import SPLIT_MIN_EXPERT_SHARE, expert_share
    from hetcomm.moe.speed import SpeedMeter, SpeedSnapshot

    def meter(busy, forward):
        m = SpeedMeter(2, 0, [1.0, 1.0])
        m.agreed = SpeedSnapshot((1.0, 1.0), (0.1, 0.1), True, measured=True, agreements=2,
                                 seconds_per_step=tuple(busy), forward_seconds=tuple(forward))
        return m

    assert expert_share([SpeedMeter(2, 0, [1.0, 1.0])]) is None  # nothing agreed yet
    assert expert_share([meter([0.01, 0.02], [0.0, 0.1])]) is None  # a rank without a forward time
    # two layers: rank 1 busy 0.02 + 0.04 s in forwards of 0.1 + 0.1 s
    assert expert_share([meter([0.01, 0.02], [0.1, 0.1]), meter([0.01, 0.04], [0.1, 0.1])]) == pytest.approx(0.3)
    p = decide(PolicyInputs(4, cluster_kind="equal", differ=True, expert_share=0.05))
    assert not p.token_split.on and "5% of the MoE forward" in p.token_split.reason
    assert p.with_verdict(True, 0.06) is p  # the share moved, no lever did: the same decision
    q = p.with_verdict(True, SPLIT_MIN_EXPERT_SHARE + 0.2)
    assert q.token_split.on and q.inputs.expert_share == SPLIT_MIN_EXPERT_SHARE + 0.2
    assert q.with_verdict(True, None) is q  # not measured this time: the last share stands


def test_speed_verdict_waits_for_every_meter_and_reads_slow_ranks():
    from hetcomm.moe.speed import SpeedMeter

    assert speed_verdict([]) is None
    assert speed_verdict([SpeedMeter(2, 0, [1.0, 1.0])]) is None  # not agreed yet
    assert speed_verdict([SpeedMeter(2, 0, [100.0, 50.0], every=0)]) is True  # given speeds: known from the start
    assert speed_verdict([SpeedMeter(2, 0, [100.0, 100.0], every=0)]) is False
    assert speed_verdict([_Meter(True), _Meter(None)]) is None  # one layer still waits
    assert speed_verdict([_Meter(False)]) is False  # equal within noise
    assert speed_verdict([_Meter(False), _Meter(True)]) is True
