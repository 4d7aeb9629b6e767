"""Cluster YAML text for sched tests: hand-written small clusters and a hypothesis strategy."""

from __future__ import annotations

import os
from typing import Any, Dict, List

from hypothesis import strategies as st

from hetcomm.topo.cluster import Cluster, load_cluster_text

MODELS = ("A100-SXM4-80GB", "H800", "910B", "cpu")
NIC_CLASSES = ("NET_ROCE_GDR", "NET_IB_GDR", "NET_ROCE", "NET_SOCKET")


def cluster_yaml(groups: List[Dict[str, Any]], bridge_gbps: float = 100.0, latency_us: float = 30.0, name: str = "t") -> str:
    """YAML text for ``groups`` (dicts: name, count, model, devices, numa_nodes, fabric_gbps, nics)."""
    lines = [f"name: {name}", "node_groups:"]
    for g in groups:
        lines.append(f"  - name: {g['name']}")
        lines.append(f"    count: {g.get('count', 1)}")
        lines.append(
            f"    device: {{model: {g['model']}, count: {g['devices']}, numa_nodes: {g.get('numa_nodes', 1)}}}"
        )
        if g.get("fabric_gbps"):
            lines.append(f"    fabric_gbps: {g['fabric_gbps']}")
        if g.get("nics"):
            lines.append("    nics:")
            for nic in g["nics"]:
                numa = f", numa: {list(nic['numa'])}" if nic.get("numa") is not None else ""
                lines.append(f"      - {{class: {nic['class']}, gbps: {nic['gbps']}, count: {nic['count']}{numa}}}")
    lines.append("interconnect:")
    lines.append(f"  cross_vendor: {{class: HOST_BRIDGE, gbps: {bridge_gbps}, latency_us: {latency_us}}}")
    return "\n".join(lines) + "\n"


def load(text: str) -> Cluster:
    return load_cluster_text(text, "<test>")


@st.composite
def cluster_specs(draw, max_ranks: int = 14) -> Dict[str, Any]:
    """A random small cluster: 1-4 groups, uneven node sizes, mixed vendors, 0-4 NICs per node."""
    groups = []
    ranks = 0
    for gi in range(draw(st.integers(1, 4))):
        devices = draw(st.integers(1, 4))
        count = draw(st.integers(1, 2))
        if ranks + devices * count > max_ranks:
            break
        ranks += devices * count
        numa_nodes = draw(st.integers(1, 2))
        nics = []
        for _ in range(draw(st.integers(0, 2))):
            ncount = draw(st.integers(1, 3))
            numa = draw(st.one_of(st.none(), st.lists(st.integers(0, numa_nodes - 1), min_size=ncount, max_size=ncount)))
            nics.append(
                {
                    "class": draw(st.sampled_from(NIC_CLASSES)),
                    "gbps": draw(st.sampled_from([25, 100, 200, 400])),
                    "count": ncount,
                    "numa": numa,
                }
            )
        groups.append(
            {
                "name": f"g{gi}",
                "count": count,
                "model": draw(st.sampled_from(MODELS)),
                "devices": devices,
                "numa_nodes": numa_nodes,
                "fabric_gbps": draw(st.one_of(st.none(), st.sampled_from([100, 800, 2400]))),
                "nics": nics,
            }
        )
    if not groups:
        groups.append({"name": "g0", "count": 2, "model": "H800", "devices": 2, "nics": []})
    return {
        "groups": groups,
        "bridge_gbps": draw(st.sampled_from([25, 100, 200])),
        "latency_us": draw(st.sampled_from([0, 5, 30])),
    }


@st.composite
def traffic_for(draw, n: int, max_bytes: int = 1 << 20) -> List[List[int]]:
    """An ``n x n`` byte matrix: zeros, tiny and large entries mixed."""
    entry = st.one_of(st.just(0), st.integers(1, 16), st.integers(1, max_bytes))
    return [[draw(entry) for _ in range(n)] for _ in range(n)]


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(_ROOT, "configs", "clusters", "mixed-mini.yaml")
BIG = os.path.join(_ROOT, "configs", "clusters", "mixed-a100-h800-910b.yaml")
