"""Topology: what each link is (model, parsers, live probes, cluster files, audit)."""

from hetcomm.topo.cluster import Cluster, load_cluster, load_cluster_text, cluster_from_env
from hetcomm.topo.model import Device, Finding, Link, LinkClass, Measurement, Nic, Topology, Vendor

__all__ = [
    "Cluster",
    "Device",
    "Finding",
    "Link",
    "LinkClass",
    "Measurement",
    "Nic",
    "Topology",
    "Vendor",
    "cluster_from_env",
    "load_cluster",
    "load_cluster_text",
]
