"""Whole MoE step model: all-to-alls + per-rank expert compute."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm.cli._placement_report import placement_owner, placement_report
from hetcomm.errors import UsageError
from hetcomm.sched.step import MoEWorkload, expert_flops, routing_traffic, simulate_moe_step, zipf_load
from hetcomm.topo.cluster import load_cluster

HALF = "configs/clusters/mixed-mini-halfspeed.yaml"


def test_traffic_follows_the_placement_and_routing():
    wl = MoEWorkload(tokens_per_rank=100, k=2, model_dim=8, hidden_dim=16, wire_bytes=2)
    T = routing_traffic([0, 0, 1, 2], [0.25, 0.25, 0.25, 0.25], wl, 3)
    # every rank sends half its copies to rank 0, a quarter to 1 and 2: 100*2*share*8*2 bytes
    assert T.tolist() == [[1600, 800, 800]] * 3
    assert expert_flops(wl) == 3 * 4 * 8 * 16


def test_speed_aware_placement_beats_equal_on_the_half_speed_cluster():
    c = load_cluster(HALF)
    wl = MoEWorkload(tokens_per_rank=2048, k=2, model_dim=256, hidden_dim=1024)
    load = np.full(16, 1 / 16)
    equal = simulate_moe_step(c, placement_owner(c, "equal", 16), load, wl)
    fast = simulate_moe_step(c, placement_owner(c, "throughput", 16), load, wl)
    assert equal.slowest_rank == 3  # the 910B at half speed holds as many experts as the others
    assert placement_owner(c, "throughput", 16).count(3) < placement_owner(c, "equal", 16).count(3)
    assert fast.compute_max_s < equal.compute_max_s
    # compute halves with double speed, everything else equal
    doubled = simulate_moe_step(c, placement_owner(c, "equal", 16), load, wl, tflops=[200, 200, 200, 100])
    assert doubled.compute_s == pytest.approx(equal.compute_s / 2)


def test_report_on_the_80_rank_preset():
    wl = MoEWorkload(tokens_per_rank=1024, k=8, model_dim=2048, hidden_dim=8192)
    doc = placement_report("configs/clusters/mixed-a100-h800-910b.yaml", ["equal", "throughput"], num_experts=160, workload=wl)
    rows = {r["placement"]: r for r in doc["placements"]}
    assert rows["throughput"]["experts_per_rank"]["H800"] > rows["equal"]["experts_per_rank"]["H800"]
    assert all(r["step_s"] >= r["alltoall_s"] > 0 for r in rows.values())


def test_bad_inputs_are_usage_errors():
    c = load_cluster(HALF)
    wl = MoEWorkload(tokens_per_rank=8)
    with pytest.raises(UsageError):
        simulate_moe_step(c, [0, 9], [1, 1], wl)
    with pytest.raises(UsageError):
        simulate_moe_step(c, [0, 1], [1, 1], wl, tflops=[1, 1, 1])
    with pytest.raises(UsageError):
        MoEWorkload(tokens_per_rank=8, efficiency=0)
    assert zipf_load(5, 1.2).sum() == pytest.approx(1.0)


def test_simulate_cli_compares_placements(capsys):
    from hetcomm.cli.main import main

    code = main(["simulate", "--cluster", "configs/clusters/mixed-a100-h800-910b.yaml", "--placement",
                 "equal,strong,throughput", "--tokens", "512", "--hidden-dim", "4096", "--plans", "flat"])
    out = capsys.readouterr().out
    assert code == 0
    assert "equal" in out and "throughput" in out and "80 ranks" in out
    assert main(["simulate", "--cluster", HALF, "--placement", "fastest"]) == 2
