"""Cluster YAML loading: rank placement, link classes, and errors that name file, line and key."""

from __future__ import annotations

import os

import pytest

from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import load_cluster, load_cluster_text
from hetcomm.topo.model import LinkClass

from tests.conftest import REPO_ROOT

CLUSTERS = os.path.join(REPO_ROOT, "configs", "clusters")


def test_mixed_mini_places_ranks_node_by_node():
    c = load_cluster(os.path.join(CLUSTERS, "mixed-mini.yaml"))
    assert c.num_ranks == 4 and c.num_nodes == 3
    assert [c.rank(r).node.name for r in range(4)] == ["a100-0", "a100-0", "h800-0", "ascend-0"]
    assert [c.rank(r).vendor for r in range(4)] == ["nvidia", "nvidia", "nvidia", "ascend"]
    assert c.link_class(0, 1) == LinkClass.NVLINK
    assert c.link_class(1, 2) == LinkClass.NET_ROCE_GDR
    assert c.link_class(2, 3) == LinkClass.HOST_BRIDGE
    assert c.strong_ranks == [0, 1, 2]
    assert c.wire_dtype_for(LinkClass.HOST_BRIDGE) == "fp16"
    assert c.wire_dtype_for(LinkClass.NVLINK) == "fp32"


def test_large_cluster_has_80_ranks_and_nominal_bandwidths():
    c = load_cluster(os.path.join(CLUSTERS, "mixed-a100-h800-910b.yaml"))
    assert c.num_ranks == 80 and c.num_nodes == 10
    # A100 NV12 = 300 GB/s = 2400 Gb/s per direction; H800 NV8 = 1600; 910B HCCS 56 GB/s = 448.
    assert c.link_gbps(0, 1) == 2400
    assert c.link_gbps(32, 33) == 1600
    assert c.link_gbps(64, 65) == 448
    assert c.link_class(0, 8) == LinkClass.NET_ROCE_GDR
    assert c.link_class(0, 64) == LinkClass.HOST_BRIDGE
    assert c.rank(4).numa == 1 and c.rank(3).numa == 0
    topo = c.to_topology()
    assert len(topo.links) == 80 * 79 // 2


@pytest.mark.parametrize(
    "text, key, line, words",
    [
        ("name: x\nnode_groups:\n  - name: a\n    device: {model: H800, count: 2}\n    nics:\n      - {class: NET_ROCE, gbsp: 200}\n",
         "node_groups[0].nics[0].gbsp", 6, "did you mean 'gbps'"),
        ("name: x\nnode_groups:\n  - name: a\n    device: {model: H800, count: 0}\n",
         "node_groups[0].device.count", 4, "positive whole number"),
        ("name: x\nnode_groups:\n  - name: a\n    device: {model: H800, count: 1}\n    fabric: NVLNK\n",
         "node_groups[0].fabric", 5, "unknown link class"),
        ("name: x\nnode_groups: []\n", "node_groups", 2, "non-empty list"),
        ("node_groups:\n  - name: a\n    device: {model: H800, count: 1}\n", "name", None, "missing required key"),
        ("name: x\nnode_groups:\n  - name: a\n    device: {model: Z9000, count: 1}\n",
         "node_groups[0].device.model", 4, "unknown device model"),
    ],
)
def test_errors_name_file_line_and_key(text, key, line, words):
    with pytest.raises(ConfigError) as info:
        load_cluster_text(text, "bad.yaml")
    err = info.value
    assert err.key == key
    assert err.path == "bad.yaml"
    if line is not None:
        assert err.line == line
    assert words in str(err)


def test_invalid_yaml_and_missing_file():
    with pytest.raises(ConfigError, match=r"bad.yaml:3: invalid YAML"):
        load_cluster_text("name: x\nnode_groups: [\n", "bad.yaml")
    with pytest.raises(ConfigError, match="cannot read file"):
        load_cluster("/nonexistent/cluster.yaml")


def test_rank_outside_cluster_is_a_clear_error():
    c = load_cluster(os.path.join(CLUSTERS, "mixed-mini.yaml"))
    with pytest.raises(ConfigError, match="rank 4 is outside cluster 'mixed-mini'"):
        c.rank(4)
