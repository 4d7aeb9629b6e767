"""The cluster YAML of a launched job: the nodes that joined, in torchrun's node order.

A cluster YAML places ranks node by node in ``node_groups`` order; torchrun numbers the nodes of
an elastic job in rendezvous order and may start without some (``--nnodes MIN:MAX``, a node
ejected by the health check). :func:`job_cluster_yaml` rewrites the groups so that position
``i`` of the file is torchrun's node ``i``.

Node names are kept: a group whose surviving nodes are ``g-0 .. g-(k-1)`` in order stays group
``g`` with ``count: k``; any other node becomes a group of its own named after the node minus
its index suffix plus ``_<index>`` (node ``a100-2`` alone becomes group ``a100_2``, node
``a100_2-0``), because the schema derives node names from group names.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Sequence

import yaml

from hetcomm._yaml import load_yaml
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import load_cluster, load_cluster_text

__all__ = ["job_cluster_yaml", "node_names"]


def node_names(path: str) -> List[str]:
    """Every node name of the cluster YAML at ``path``, in file order."""
    return [n.name for n in load_cluster(path).nodes]


def job_cluster_yaml(path: str, order: Sequence[str]) -> str:
    """The YAML text of the cluster at ``path`` restricted to nodes ``order``, in that order.

    Raises:
        ConfigError: a name in ``order`` is not a node of the cluster, or appears twice.
    """
    cluster = load_cluster(path)
    known = {n.name: n for n in cluster.nodes}
    for name in order:
        if name not in known:
            raise ConfigError(
                f"node {name!r} joined the job but is not in the cluster (nodes: {sorted(known)}); "
                f"pass --node with one of those names",
                path=path,
            )
    if len(set(order)) != len(order):
        raise ConfigError(f"node names joined twice: {list(order)}; give each node's launch its own --node", path=path)
    raw: Dict[str, Any] = load_yaml(path).data
    groups = {g["name"]: g for g in raw["node_groups"]}
    out: List[Dict[str, Any]] = []
    i = 0
    while i < len(order):
        node = known[order[i]]
        gname = node.group.name
        # The longest run g-0, g-1, ... starting here keeps the group's own name.
        j = i
        while j < len(order) and order[j] == f"{gname}-{j - i}":
            j += 1
        entry = copy.deepcopy(groups[gname])
        if j > i:
            entry["count"] = j - i
            i = j
        else:
            entry["name"] = node.name.replace("-", "_")
            entry["count"] = 1
            i += 1
        out.append(entry)
    doc = copy.deepcopy(raw)
    doc["node_groups"] = out
    doc["description"] = f"{raw.get('description', raw['name'])}; launched on {len(order)} node(s): {', '.join(order)}"
    text = yaml.safe_dump(doc, sort_keys=False)
    load_cluster_text(text, path=f"{path} (job of {len(order)} nodes)")  # still a valid cluster
    return text
