"""Cluster validation (issue 14 item 10): every number's type and range, and size caps, each a
ConfigError naming the file, line and key — never a traceback, a nan plan or a MemoryError."""

from __future__ import annotations

import pytest

from hetcomm.cli.main import main
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import (
    MAX_DEVICES_PER_NODE,
    MAX_LATENCY_US,
    MAX_NICS_PER_NODE,
    MAX_RANKS,
    load_cluster_text,
)

BASE = """\
name: m
node_groups:
  - name: a
    count: {count}
    device: {{model: A100-SXM4-80GB, count: {devices}}}
    fabric_gbps: {fabric}
    nics: [{{class: NET_ROCE_GDR, gbps: {gbps}, count: {nics}}}]
  - name: b
    device: {{model: 910B, count: 2}}
interconnect:
  cross_vendor: {{class: HOST_BRIDGE, gbps: 100, latency_us: {latency}}}
"""
DEFAULTS = dict(count=1, devices=2, fabric=2400, gbps=200, nics=1, latency=30)


def cluster(**values):
    return load_cluster_text(BASE.format(**{**DEFAULTS, **values}), "c.yaml")


def test_defaults_load():
    c = cluster()
    assert c.num_ranks == 4 and c.interconnect.cross_vendor_latency_us == 30.0


@pytest.mark.parametrize(
    "value, needle",
    [
        ('"abc"', "expected a number of microseconds, got str 'abc'"),
        (".nan", "got nan"),
        ("-30", "got -30"),
        (".inf", "got inf"),
        ("true", "got bool"),
        ("[30]", "got list"),
        (str(int(MAX_LATENCY_US) + 1), "at most 1e+06"),
    ],
)
def test_latency_us_is_a_finite_non_negative_number(value, needle):
    # Before: "abc" was a traceback, .nan made every plan "nan ms" with exit 0, -30 a bridge at 165%.
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("+", r"\+")) as e:
        cluster(latency=value)
    assert (e.value.key, e.value.line) == ("interconnect.cross_vendor.latency_us", 11)


def test_zero_latency_is_allowed():
    assert cluster(latency=0).interconnect.cross_vendor_latency_us == 0.0


@pytest.mark.parametrize(
    "field, value, key",
    [
        ("gbps", ".nan", "node_groups[0].nics[0].gbps"),
        ("gbps", ".inf", "node_groups[0].nics[0].gbps"),
        ("gbps", "1.0e+300", "node_groups[0].nics[0].gbps"),
        ("gbps", "99999999999999999999999", "node_groups[0].nics[0].gbps"),
        ("gbps", "0", "node_groups[0].nics[0].gbps"),
        ("fabric", "-1", "node_groups[0].fabric_gbps"),
        ("fabric", "'fast'", "node_groups[0].fabric_gbps"),
    ],
)
def test_rates_are_positive_finite_and_bounded(field, value, key):
    with pytest.raises(ConfigError, match="Gb/s") as e:
        cluster(**{field: value})
    assert e.value.key == key and e.value.line is not None


@pytest.mark.parametrize(
    "field, value, key",
    [
        ("count", 1_000_000_000_000, "node_groups[0].count"),
        ("count", 10_000, "node_groups[0].count"),
        ("count", MAX_RANKS // 2, "node_groups[1].count"),  # 1024 ranks, then group b crosses the cap
        ("devices", MAX_DEVICES_PER_NODE + 1, "node_groups[0].device.count"),
        ("nics", MAX_NICS_PER_NODE + 1, "node_groups[0].nics[0].count"),
        ("count", "1.5", "node_groups[0].count"),
        ("count", "99999999999999999999999999", "node_groups[0].count"),
    ],
)
def test_sizes_are_capped_with_a_clear_message(field, value, key):
    with pytest.raises(ConfigError) as e:
        cluster(**{field: value})
    assert e.value.key == key, e.value
    assert "hetcomm" in str(e.value) or "whole number" in str(e.value) or "ranks" in str(e.value)


def test_the_largest_accepted_cluster_loads():
    c = cluster(count=MAX_RANKS // 2 - 1)  # 1022 + 2 ranks
    assert c.num_ranks == MAX_RANKS


@pytest.mark.parametrize(
    "text, key",
    [
        ("name: " + "x" * 100 + "\nnode_groups: [{name: a, device: {model: cpu, count: 1}}]\n", "name"),
        ("name: m\ndescription: [1]\nnode_groups: [{name: a, device: {model: cpu, count: 1}}]\n", "description"),
        ("name: m\nnode_groups: [{name: a, device: {model: true, count: 1}}]\n", "node_groups[0].device.model"),
        ("name: m\nnode_groups: [{name: a, device: {model: cpu, count: 1, numa_nodes: 65}}]\n", "node_groups[0].device.numa_nodes"),
        ("name: m\nwire_dtype: {NVLINK: [fp16]}\nnode_groups: [{name: a, device: {model: cpu, count: 1}}]\n", "wire_dtype.NVLINK"),
        (
            "name: m\nnode_groups: [{name: a, device: {model: cpu, count: 1}, "
            "nics: [{class: NET_IB, gbps: 100, count: 2, numa: [0, 99999]}]}]\n",
            "node_groups[0].nics[0].numa",
        ),
    ],
)
def test_other_values_are_typed(text, key):
    with pytest.raises(ConfigError) as e:
        load_cluster_text(text, "t.yaml")
    assert e.value.key == key, e.value


def test_ten_thousand_nodes_fail_fast_in_every_command(tmp_path, capsys):
    path = tmp_path / "huge.yaml"
    path.write_text(BASE.format(**{**DEFAULTS, "count": 10_000}))
    for argv in (["simulate", "--cluster", str(path), "--size", "1M"], ["topo", "--cluster", str(path)]):
        assert main(argv) == 2  # before: MemoryError after 94 s, or a hang in topo
        err = capsys.readouterr().err
        assert "node_groups[0].count" in err and f"{path}:4" in err, err


def test_nan_latency_exits_2_in_simulate(tmp_path, capsys):
    path = tmp_path / "nan.yaml"
    path.write_text(BASE.format(**{**DEFAULTS, "latency": ".nan"}))
    assert main(["simulate", "--cluster", str(path), "--size", "1M"]) == 2
    assert "latency_us" in capsys.readouterr().err


@pytest.mark.parametrize("value, needle", [
    ("-5", "expected TFLOPS greater than 0 and at most 100000, got -5"),
    ("0", "got 0"),
    (".nan", "got nan"),
    ("1.0e+9", "at most 100000"),
    ("'fast'", "expected a number of TFLOPS, got str 'fast'"),
])
def test_device_tflops_errors_name_tflops_not_gbps(tmp_path, capsys, value, needle):
    # The device's compute rate used to be checked as a link rate: "expected Gb/s ...".
    path = tmp_path / "tflops.yaml"
    path.write_text(BASE.format(**DEFAULTS).replace("{model: A100-SXM4-80GB, count: 2}",
                                                    f"{{model: A100-SXM4-80GB, count: 2, tflops: {value}}}"))
    assert main(["topo", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:5, key 'node_groups[0].device.tflops': " in err and needle in err, err
    assert "Gb/s" not in err and "Traceback" not in err, err
