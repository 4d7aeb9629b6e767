"""Who is where: the device kind, node and host of every rank of a group.

With a cluster YAML (``HetcommOptions.cluster`` / ``$HETCOMM_CLUSTER``) ranks are placed node by
node, device by device, as torchrun numbers them; the device kinds it names are *labels* when the
process has no such device (a CPU process standing for an A100). Without one, the default group
*detects* its cluster (``hetcomm.topo.discover.discover_cluster``: each host probed once, every
rank's facts exchanged through the store, the same :class:`Cluster` assembled on every rank);
``HETCOMM_DETECT=0`` turns that off, and subgroups, or a job whose ranks are not numbered host by
host, fall back to hostname placement (ranks on the same host form one node).

Either way every rank publishes ``(hostname, pid, device kind)`` through the group's store: the
shm rail needs the real host (a YAML node is only shared memory if the processes really share a
host) and fault diagnosis needs the pid of same-host peers.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from hetcomm import settings
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import Cluster, load_cluster
from hetcomm.topo.model import LinkClass

__all__ = ["RankPlace", "Placement", "build_placement", "local_device_kind"]


@dataclass(frozen=True)
class RankPlace:
    """One rank of a group.

    Attributes:
        group_rank: rank in the group.
        global_rank: rank in the default group.
        node: node name (YAML node, or the hostname without a YAML).
        host: the real hostname of the process.
        pid: its process id.
        vendor: ``nvidia``, ``ascend`` or ``cpu`` (what the rank stands for).
        model: device model (``A100-SXM4-80GB``, ``910B``, ``cpu``).
        label_only: True when the device kind comes from a YAML and the process lacks that device.
    """

    group_rank: int
    global_rank: int
    node: str
    host: str
    pid: int
    vendor: str
    model: str
    label_only: bool


@dataclass(frozen=True)
class Placement:
    """Every rank of a group and the link class of each pair.

    Attributes:
        ranks: one :class:`RankPlace` per group rank.
        cluster: the cluster YAML it came from, the detected cluster, or None (hostname placement).
        discovered: the :class:`hetcomm.topo.discover.DiscoveredCluster` of the default group
            (its findings -- ``cluster-mismatch`` ones when a file was given too --, notes and
            per-pair classes), else None.
    """

    ranks: Tuple[RankPlace, ...]
    cluster: Optional[Cluster] = None
    discovered: Optional[Any] = None

    def __len__(self) -> int:
        return len(self.ranks)

    def same_host(self, a: int, b: int) -> bool:
        return self.ranks[a].host == self.ranks[b].host

    def same_node(self, a: int, b: int) -> bool:
        return self.ranks[a].node == self.ranks[b].node

    def link_class(self, a: int, b: int) -> LinkClass:
        """Class of the path between group ranks ``a`` and ``b`` (from the YAML when there is one)."""
        if self.cluster is not None:
            return self.cluster.link_class(self.ranks[a].global_rank, self.ranks[b].global_rank)
        va, vb = self.ranks[a].vendor, self.ranks[b].vendor
        if {va, vb} == {"nvidia", "ascend"}:
            return LinkClass.HOST_BRIDGE
        return LinkClass.SHM if self.same_host(a, b) else LinkClass.NET_SOCKET

    def wire_dtype(self, a: int, b: int) -> str:
        """The cluster's wire dtype policy for the pair (``fp32`` without a cluster YAML)."""
        if self.cluster is None:
            return "fp16" if self.link_class(a, b) == LinkClass.HOST_BRIDGE else "fp32"
        return self.cluster.wire_dtype_for(self.link_class(a, b))

    def describe(self, r: int) -> str:
        """``A100-SXM4-80GB (label) on node a100-0, host h, pid 123``."""
        p = self.ranks[r]
        kind = f"{p.model} ({'label, CPU process' if p.label_only else 'real'})"
        return f"{kind} on node {p.node}, host {p.host}, pid {p.pid}"


def local_device_kind() -> Tuple[str, str]:
    """``(vendor, model)`` of the accelerator this process can use, ``("cpu", "cpu")`` if none."""
    try:
        if torch.cuda.is_available():
            return "nvidia", torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:  # a broken CUDA install must not stop a CPU job
        pass
    npu = getattr(torch, "npu", None)
    try:
        if npu is not None and npu.is_available():
            return "ascend", str(npu.get_device_name(npu.current_device()))
    except Exception:
        pass
    return "cpu", "cpu"


def build_placement(
    store: "torch.distributed.Store",
    group_rank: int,
    group_size: int,
    global_ranks: Sequence[int],
    cluster_path: "Optional[Union[str, Cluster]]",
    timeout: timedelta,
) -> Placement:
    """Exchange ``(host, pid, device)`` through ``store`` and place every rank.

    Args:
        store: the group's (prefixed) store.
        group_rank / group_size: this process in the group.
        global_ranks: global rank of each group rank (empty = identity, the default group).
        cluster_path: cluster YAML, a loaded (or detected) :class:`Cluster`, or None for
            hostname placement.
        timeout: how long to wait for the other ranks' entries.

    Raises:
        ConfigError: the YAML cannot be loaded or does not have as many ranks as the job.
        torch.distributed.DistStoreError: a rank did not publish its entry within ``timeout``.
    """
    # An empty list means the default group, which must match the cluster exactly; a subgroup
    # (new_group) names its global ranks and may cover part of the cluster.
    is_default_group = not list(global_ranks)
    global_ranks = list(global_ranks) or list(range(group_size))
    vendor, model = local_device_kind()
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "vendor": vendor, "model": model}
    store.set(f"hetcomm/place/{group_rank}", json.dumps(mine))
    keys = [f"hetcomm/place/{r}" for r in range(group_size)]
    store.wait(keys, timeout)
    entries = [json.loads(store.get(k).decode()) for k in keys]

    cluster = None
    if cluster_path:
        cluster = cluster_path if isinstance(cluster_path, Cluster) else load_cluster(cluster_path)
        world = max(global_ranks) + 1
        if cluster.num_ranks < world or (is_default_group and cluster.num_ranks != group_size):
            raise ConfigError(
                f"cluster '{cluster.name}' has {cluster.num_ranks} ranks but the job has "
                f"{max(world, group_size)}; launch with --nproc-per-node/WORLD_SIZE={cluster.num_ranks} "
                f"or point HETCOMM_CLUSTER at a matching file",
                path=cluster.path,
            )
    discovered = None
    if is_default_group and detection_enabled():
        from hetcomm.topo.discover import compare_with_cluster, discover_cluster

        try:
            discovered = discover_cluster(store, group_rank, group_size, timeout)
        except ConfigError as e:
            # Ranks not numbered host by host, unreadable captures: the job still runs, placed by
            # hostname (or by the file) as before detection existed; say why once.
            if group_rank == 0:
                warnings.warn(f"hetcomm: cluster detection off for this group: {e}", RuntimeWarning, stacklevel=2)
        else:
            if cluster is None:
                cluster = discovered.cluster
            else:
                # The file wins (it may label CPU processes); where the probe contradicts it on
                # real devices, say so once (a YAML claiming NVLink over PCIe cards).
                found = compare_with_cluster(discovered, cluster)
                if found and group_rank == 0:
                    lines = "; ".join(f"[{f.severity}] {f.subject}: {f.message}" for f in found[:4])
                    warnings.warn(
                        f"hetcomm: cluster file '{cluster.name}' contradicts the probed machines "
                        f"({len(found)} cluster-mismatch finding(s)): {lines}; run `hetcomm discover "
                        f"--cluster {cluster.path or cluster.name}` for all of them",
                        RuntimeWarning,
                        stacklevel=2,
                    )
    places: List[RankPlace] = []
    for r, e in enumerate(entries):
        if cluster is not None:
            info = cluster.rank(global_ranks[r])
            label_only = info.vendor != e["vendor"]
            places.append(
                RankPlace(r, global_ranks[r], info.node.name, e["host"], int(e["pid"]), info.vendor, info.model, label_only)
            )
        else:
            places.append(
                RankPlace(r, global_ranks[r], e["host"], e["host"], int(e["pid"]), e["vendor"], e["model"], False)
            )
    return Placement(tuple(places), cluster, discovered)


def detection_enabled() -> bool:
    """False when ``$HETCOMM_DETECT`` is ``0``/``false``/``no``/``off`` (default: on)."""
    return settings.DETECT.get()
