"""Speed-blind ``--no-balance`` and ``--speed oracle`` (hetcomm.train.speed_modes), the mislabelled
testbed clusters, and the expert FFN share clock (hetcomm.train.expert_time)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe.placement import place_experts
from hetcomm.topo.cluster import load_cluster, load_cluster_text
from hetcomm.train.expert_time import ExpertCpuClock, parse_shares
from hetcomm.train.speed_modes import layer_speed_every, oracle_speeds, placement_weights
from tests.backends.ranks import MIXED_MINI, run_ranks
from tests.ops.jobs import TINY, _free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HALF = os.path.join(REPO, "configs", "clusters", "mislabelled-halfspeed.yaml")
TWIN = os.path.join(REPO, "configs", "clusters", "mislabelled-fullspeed.yaml")


def _cfg(*flags: str):
    from hetcomm.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    return cli.train_config(p.parse_args(["train", "--config", TINY, *flags]))


def _train_summary(rank: int, world_size: int, cfg, port: int):
    import torch.distributed as dist

    from hetcomm.train.loop import last_summary, train_worker

    dist.destroy_process_group()  # train_worker makes its own group, as under torchrun
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = train_worker(rank, world_size, cfg)
    s = last_summary()
    return code, s["speed_decisions"], s["text"]


def _row(text: str, key: str) -> str:
    return next(line[len(key):].strip() for line in text.splitlines() if line.startswith(key))


def test_no_balance_reads_no_speed_on_a_cluster_with_unequal_labels():
    # mixed-mini: strong A100/H800 ranks at 312/989 TFLOPS and a weak 910B. Speed-blind places
    # the experts equally and contiguously (not 2:1 by the strong flag), measures nothing and
    # moves, deals and splits nothing.
    cfg = _cfg("--no-balance", "--cluster", MIXED_MINI, "--steps", "12", "--experts", "8")
    out = run_ranks(_train_summary, 4, cluster=MIXED_MINI, args=(cfg, _free_port()), timeout=180)
    equal = list(place_experts(cfg.experts, 4, rank_weights=[1.0] * 4).owner)
    strong = list(place_experts(cfg.experts, 4, rank_weights=[2.0, 2.0, 2.0, 1.0]).owner)
    assert equal != strong  # the labels would have placed them otherwise
    for code, rec, _ in out:
        assert code in (0, 1)
        assert rec["owners"] == [equal] * 2, rec
        assert rec["measured"] == [False, False] and rec["agreements"] == [0, 0], rec
        assert not rec["cold_enabled"]
    text = out[0][2]
    assert _row(text, "placement by speed (measured busy time evened once per layer)") == "off"
    assert _row(text, "policy: initial weights").startswith("off (--no-balance: speed-blind")
    assert _row(text, "policy: replica holders").endswith("never re-chosen by speed (--no-balance))")
    assert _row(text, "policy: token split").startswith("off")
    for lever in ("migrations", "cold placement"):
        assert _row(text, f"policy: {lever}") == "off (--no-balance)", lever


def test_oracle_places_and_holds_by_the_emulated_speeds():
    # The mislabelled cluster: labels alike, the third node emulated at half speed. The oracle
    # reads emulation.compute_scale: experts by [1, 1, 1, 0.5] (4 steps: before the first
    # agreement, whose placement by speed would re-place them).
    cfg = _cfg("--speed", "oracle", "--cluster", HALF, "--steps", "4", "--experts", "8")
    out = run_ranks(_train_summary, 4, cluster=HALF, args=(cfg, _free_port()), timeout=180)
    weighted = list(place_experts(8, 4, rank_weights=[1.0, 1.0, 1.0, 0.5]).owner)
    assert weighted != list(place_experts(8, 4, rank_weights=[1.0] * 4).owner)
    for code, rec, _ in out:
        assert code in (0, 1)
        assert rec["owners"] == [weighted] * 2, rec
        assert rec["speeds"] == [[1.0, 1.0, 1.0, 0.5]] * 2 and rec["measured"] == [False, False], rec


def test_mislabelled_clusters_hide_the_slow_node_from_every_label():
    from hetcomm.emulate.spec import plan_network, settings_from_cluster
    from hetcomm.topo.compute import rank_speeds
    from hetcomm.moe.policy import cluster_kind

    half, twin = load_cluster(HALF), load_cluster(TWIN)
    for c in (half, twin):
        assert len({c.rank(r).model for r in range(4)}) == 1 and c.strong_ranks == [0, 1, 2, 3]
        assert len(set(rank_speeds(c, range(4)))) == 1 and cluster_kind(c, 4) == "equal"
    # Each rank keeps half a core; its training thread gets three quarters of that at full speed.
    cpus = {n.node: (n.cpus, n.device_cpus) for n in plan_network(half, settings_from_cluster(half, num_cpus=2), "abcdef").nodes}
    assert cpus == {"pair-0": (0.5, 0.375), "solo-0": (0.5, 0.375), "slow-0": (0.5, 0.1875)}
    cpus = {n.node: (n.cpus, n.device_cpus) for n in plan_network(twin, settings_from_cluster(twin, num_cpus=2), "abcdef").nodes}
    assert cpus == {"pair-0": (0.5, 0.375), "solo-0": (0.5, 0.375), "slow-0": (0.5, 0.375)}
    assert oracle_speeds(half, 4) == [1.0, 1.0, 1.0, 0.5] and oracle_speeds(twin, 4) == [1.0] * 4
    # mixed-mini-halfspeed keeps its speeds from device.tflops (no compute_scale).
    assert oracle_speeds(load_cluster(os.path.join(REPO, "configs", "clusters", "mixed-mini-halfspeed.yaml")), 4) \
        == [1.0, 1.0, 1.0, 0.5]


def test_oracle_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(ConfigError) as ei:
        oracle_speeds(None, 4)
    assert ei.value.key == "train.speed" and "--cluster" in str(ei.value)
    text = open(HALF, encoding="utf-8").read().replace("compute_scale: {slow: 0.5}", "compute_scale: {slow: 2}")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as ei:
        oracle_speeds(load_cluster(str(path)), 4)
    assert ei.value.key == "emulation.compute_scale.slow" and str(path) in str(ei.value), str(ei.value)
    bad = load_cluster_text(text.replace("{slow: 2}", "{slowest: 0.5}"), path="x.yaml")
    with pytest.raises(ConfigError) as ei:
        oracle_speeds(bad, 4)
    assert "slowest" in str(ei.value) and "x.yaml" in str(ei.value)


def test_placement_weights_and_speed_every_by_mode():
    blind, oracle, default = _cfg("--no-balance"), _cfg("--speed", "oracle", "--cluster", HALF), _cfg()
    half = load_cluster(HALF)
    assert placement_weights(blind, half, 4, None) == [1.0] * 4
    assert placement_weights(oracle, half, 4, None) == [1.0, 1.0, 1.0, 0.5]
    assert placement_weights(default, half, 4, None) is None  # the layer's own (the strong flag)
    assert placement_weights(blind, half, 4, [3.0, 1.0, 1.0, 1.0]) == [3.0, 1.0, 1.0, 1.0]  # a resume's record
    assert [layer_speed_every(c, 10) for c in (blind, oracle, default)] == [0, 10, 10]
    from hetcomm.train.loop import TrainConfig

    with pytest.raises(ConfigError) as ei:
        TrainConfig(speed="fastest")
    assert ei.value.key == "train.speed"


def test_expert_clock_counts_forward_and_backward_once():
    torch.manual_seed(0)
    clock = ExpertCpuClock()
    a = clock.instrument(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)))
    b = clock.instrument(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)))
    x = torch.randn(256, 64, requires_grad=True)
    for _ in range(3):
        (a(x).sum() + b(x * 2).sum()).backward()
        clock.end_step()
    for expert_s, process_s in clock.per_step:
        assert 0 < expert_s <= process_s * 1.05  # a thread's CPU inside the process's
    assert clock._depth == 0  # every interval it opened, it closed
    text = ExpertCpuClock.summary(clock.gather(1))
    assert text.endswith("steps 2-3)") and len(parse_shares(text)) == 1 and 0 < parse_shares(text)[0] <= 105
    assert parse_shares("no steps") == [] and parse_shares("70/-/60 % of busy CPU") == [70.0, None, 60.0]
