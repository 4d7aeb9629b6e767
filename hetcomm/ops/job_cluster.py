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

__all__ = ["job_cluster_yaml", "node_names", "survivors_cluster_yaml"]


def node_names(path: str) -> List[str]:
    """Every node name of the cluster YAML at ``path``, in file order."""
    return [n.name for n in load_cluster(path).nodes]


def job_cluster_yaml(path: str, order: Sequence[str]) -> str:
    """The YAML text of the cluster at ``path`` restricted to nodes ``order``, in that order.

    Raises:
        ConfigError: a name in ``order`` is not a node of the cluster, or appears twice.
    """
    return _restricted(path, order, {})


def survivors_cluster_yaml(path: str, slots: Sequence[int]) -> str:
    """The YAML text of the cluster at ``path`` restricted to its ranks ``slots`` (ascending): the
    cluster of a group shrunk in place, whose new rank ``i`` stands for old rank ``slots[i]``.

    A node that keeps every rank keeps its group as :func:`job_cluster_yaml` does; a node that
    keeps some becomes a group of its own (named as a lone node there) with that many devices;
    a node that keeps none is left out.

    Raises:
        ConfigError: a slot out of range, repeated or out of order.
    """
    cluster = load_cluster(path)
    if list(slots) != sorted(set(slots)) or not slots or slots[0] < 0 or slots[-1] >= cluster.num_ranks:
        raise ConfigError(f"survivor ranks {list(slots)} are not ascending distinct ranks of the cluster's "
                          f"{cluster.num_ranks}", path=path)
    kept: Dict[str, int] = {}
    for s in slots:
        name = cluster.rank(s).node.name
        kept[name] = kept.get(name, 0) + 1
    order = [n.name for n in cluster.nodes if n.name in kept]
    partial = {n.name: kept[n.name] for n in cluster.nodes if 0 < kept.get(n.name, 0) < n.num_devices}
    return _restricted(path, order, partial)


def _restricted(path: str, order: Sequence[str], partial: Dict[str, int]) -> str:
    """:func:`job_cluster_yaml`; a node in ``partial`` keeps only that many devices (a group of its own)."""
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
        while j < len(order) and order[j] == f"{gname}-{j - i}" and order[j] not in partial:
            j += 1
        entry = copy.deepcopy(groups[gname])
        if j > i:
            entry["count"] = j - i
            i = j
        else:
            entry["name"] = node.name.replace("-", "_")
            entry["count"] = 1
            if node.name in partial:
                entry["device"] = dict(entry["device"], count=partial[node.name])
            i += 1
        out.append(entry)
    doc = copy.deepcopy(raw)
    doc["node_groups"] = out
    doc["description"] = f"{raw.get('description', raw['name'])}; launched on {len(order)} node(s): {', '.join(order)}"
    text = yaml.safe_dump(doc, sort_keys=False)
    load_cluster_text(text, path=f"{path} (job of {len(order)} nodes)")  # still a valid cluster
    return text
