"""CostParams, calibration from measured output, and the resource model of a cluster."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetcomm.errors import ConfigError
from hetcomm.sched import plan_all_to_all, simulate
from hetcomm.sched.cost import CostParams, fit_alpha_beta, load_cost_params, resource_model
from hetcomm.sched.traffic import uniform
from hetcomm.topo.cluster import load_cluster
from hetcomm.topo.model import LinkClass
from tests.sched.clusters import BIG, MINI


def test_fit_recovers_alpha_and_rate():
    sizes = [1 << 16, 1 << 20, 1 << 24, 1 << 28]
    times = [12.0 + s / 25e3 for s in sizes]  # 25 kB/us = 25 GB/s = 200 Gb/s
    alpha, rate = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(12.0, rel=1e-6)
    assert rate == pytest.approx(200.0, rel=1e-9)
    # a single point: no latency can be told apart, the rate goes through the origin
    assert fit_alpha_beta([1e6], [10.0]) == (0.0, pytest.approx(800.0))
    with pytest.raises(ConfigError):
        fit_alpha_beta([], [])


def test_calibrate_from_bench_json_rows(tmp_path):
    rows = [{"op": "alltoall", "size_bytes": s, "time_us": 8.0 + s / 12.5e3} for s in (1 << 18, 1 << 22, 1 << 26)]
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"measurements": rows}))
    params = load_cost_params(str(p), link_class="net_roce_gdr")
    assert dict(params.gbps)["NET_ROCE_GDR"] == pytest.approx(100.0)
    assert dict(params.latency_us)["NET_ROCE_GDR"] == pytest.approx(8.0)
    # a slower port makes every plan slower, never faster
    big = load_cluster(BIG)
    T = uniform(80, 64 << 20)
    for strategy in ("flat", "multirail"):
        plan = plan_all_to_all(big, T, strategy)
        assert simulate(plan, big, params).time_s >= simulate(plan, big).time_s


def test_calibrate_from_a_hetcomm_bench_document(tmp_path):
    # the shape `hetcomm bench alltoall --json` writes: busbw in GB/s, as nccl-tests prints it
    rows = []
    for size in (1 << 20, 1 << 24, 1 << 26):
        t_us = 4.0 + size * 3 / 4 / 25e3  # 4 ranks: 3/4 of the bytes cross, 25 GB/s
        busbw = size / (t_us * 1e-6) / 1e9 * 3 / 4
        rows.append({"size": size, "count": size // 4, "type": "float",
                     "out_of_place": {"time_us": t_us, "algbw_gbps": busbw * 4 / 3, "busbw_gbps": busbw, "wrong": 0},
                     "in_place": {"time_us": t_us, "algbw_gbps": 0, "busbw_gbps": 0, "wrong": None}})
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"tool": "hetcomm bench", "num_ranks": 4, "rows": rows}))
    params = load_cost_params(str(p), "SHM")
    assert dict(params.gbps)["SHM"] == pytest.approx(200.0)
    assert dict(params.latency_us)["SHM"] == pytest.approx(4.0, abs=1e-6)


def test_calibrate_from_nccl_tests_output(tmp_path, fixture_path):
    text = open(fixture_path("nccltests_alltoall_perf_b300_1node_2node.txt")).read()
    with pytest.raises(ConfigError, match="2 nccl-tests result tables"):
        load_cost_params(fixture_path("nccltests_alltoall_perf_b300_1node_2node.txt"), "NET_ROCE_GDR")
    two_node = text[text.index("## All-to-All - 2 Nodes") :]
    p = tmp_path / "a2a.txt"
    p.write_text(two_node)
    params = load_cost_params(str(p), "NET_ROCE_GDR")
    # busbw 180.98 GB/s in the 2-node run: that is the per-rank rate the fit must return
    assert dict(params.gbps)["NET_ROCE_GDR"] == pytest.approx(180.98 * 8, rel=1e-3)


def test_parameter_files_and_their_errors(tmp_path):
    p = tmp_path / "cost.json"
    p.write_text(json.dumps({"gbps": {"HOST_BRIDGE": 50}, "overhead_us": {"HOST_BRIDGE": 0}, "uplink_fraction": 0.5}))
    params = load_cost_params(str(p))
    assert dict(params.gbps) == {"HOST_BRIDGE": 50.0} and params.uplink_fraction == 0.5
    p.write_text(json.dumps({"gbsp": {}}))
    with pytest.raises(ConfigError, match="unknown key 'gbsp'"):
        load_cost_params(str(p))
    p.write_text(json.dumps({"gbps": {"NVLNK": 5}}))
    with pytest.raises(ConfigError, match="unknown link class 'NVLNK'"):
        load_cost_params(str(p))
    p.write_text("hello\n")
    with pytest.raises(ConfigError, match="not a cost file"):
        load_cost_params(str(p), "NVLINK")
    p.write_text(json.dumps([{"size_bytes": 1, "time_us": 1}]))
    with pytest.raises(ConfigError, match="which link class"):
        load_cost_params(str(p))
    with pytest.raises(ConfigError, match="cannot read"):
        load_cost_params(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="positive"):
        CostParams.make(gbps={"NVLINK": 0})


def test_resource_model_of_the_big_cluster():
    big = load_cluster(BIG)
    m = resource_model(big)
    assert resource_model(big) is m  # cached per cluster object
    assert m.num_ranks == 80 and m.num_nodes == 10 and len(m.nic_node) == 80
    # rank k of a node uses port k (4 ports and 4 devices per NUMA node)
    assert (m.default_nic == np.arange(80)).all()
    assert [m.nearest_device(g) for g in range(8)] == list(range(8))
    src = np.arange(80)
    dst = (src + 8) % 80
    assert (m.link_classes(src, dst) == [int(big.link_class(a, b)) for a, b in zip(src, dst)]).all()
    # NVLink A100: 12 x 25 GB/s; HCCS: 7 pairs x 56 GB/s per 910B; bridge 200 Gb/s = 25 GB/s
    assert m.cap[m.fab_out(0)] == pytest.approx(300e9)
    assert m.cap[m.fab_out(79)] == pytest.approx(7 * 56e9)
    assert m.bridge_cap[9] == pytest.approx(25e9)
    P = m.paths(np.array([0]), np.array([79]), np.array([-1]), np.array([False]))[0]
    names = [m.name(r) for r in P if r >= 0]
    assert names == ["rank0 pcie up", "rank79 pcie down", "a100-0 bridge out", "ascend-1 bridge in"]
    P = m.paths(np.array([0]), np.array([13]), np.array([m.node_nics[0][6]]), np.array([True]))[0]
    names = [m.name(r) for r in P if r >= 0]
    # rank 0 is on NUMA 0, nic6 on NUMA 1: the socket link is crossed
    assert names == ["rank0 pcie up", "rank13 pcie down", "a100-0/nic6 tx", "a100-1/nic5 rx", "a100-0 uplink out",
                     "a100-1 uplink in", "a100-0 sys out", "rank0 copy"]


def test_mini_cluster_latencies_follow_the_yaml():
    mini = load_cluster(MINI)
    m = resource_model(mini)
    assert m.latency[int(LinkClass.HOST_BRIDGE)] == pytest.approx(30e-6)
    m2 = resource_model(mini, CostParams.make(latency_us={"HOST_BRIDGE": 5}))
    assert m2.latency[int(LinkClass.HOST_BRIDGE)] == pytest.approx(5e-6)
