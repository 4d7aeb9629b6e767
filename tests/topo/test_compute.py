"""The compute table: names as tools print them resolve, every number has a source, overrides win."""

from __future__ import annotations

import pytest

from hetcomm.errors import ConfigError
from hetcomm.topo import compute
from hetcomm.topo.cluster import load_cluster, load_cluster_text


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-PCIE-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
        ("NVIDIA H800", "H800-SXM"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA L40S", "L40S"),
        ("910B3", "910B3"),
        ("Ascend910B2C", "910B2"),
        ("910B", "910B"),
        ("cpu", "cpu"),
    ],
)
def test_tool_names_resolve(name: str, key: str) -> None:
    assert compute.device_spec(name).model == key


def test_every_entry_has_dense_numbers_and_a_source() -> None:
    for spec in compute.DEVICE_SPECS.values():
        assert spec.sources and all(s.strip() for s in spec.sources), spec.model
        assert spec.fp16_tflops > 0 and spec.mem_bw_gbs > 0, spec.model
    # dense, not the sparse headline: H100 SXM is 1,979 with sparsity, 989.5 without
    assert compute.throughput_tflops("H100-SXM5-80GB") == pytest.approx(989.5)
    assert compute.throughput_tflops("H800") / compute.throughput_tflops("A100-SXM4-80GB") == pytest.approx(3.17, abs=0.01)


def test_unknown_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        compute.device_spec("GeForce 256")
    assert "device.tflops" in str(err.value)


def test_cluster_override_and_relative_speed() -> None:
    half = load_cluster("configs/clusters/mixed-mini-halfspeed.yaml")
    assert compute.rank_speeds(half) == [100.0, 100.0, 100.0, 50.0]
    assert compute.relative_speed(half) == {"a100-0": 1.0, "h800-0": 1.0, "ascend-0": 0.5}
    table = load_cluster("configs/clusters/mixed-mini.yaml")
    speeds = compute.rank_speeds(table)
    assert speeds[2] == max(speeds)  # the H800
    assert compute.strong_by_throughput(speeds) == [2]
    assert compute.strong_by_throughput([100, 100, 100, 50]) == [0, 1, 2, 3]


def test_bad_tflops_names_the_key() -> None:
    text = "name: x\nnode_groups:\n  - name: g\n    device: {model: H800, count: 1, tflops: -3}\n"
    with pytest.raises(ConfigError) as err:
        load_cluster_text(text)
    assert "node_groups[0].device.tflops" in str(err.value)
