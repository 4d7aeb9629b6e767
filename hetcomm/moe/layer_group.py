"""Who a :class:`hetcomm.moe.MoELayer` computes with: its group's ranks, their cluster and
device speeds (the strong ranks, replica candidates and expert-placement weights they give),
and the communicator its tokens travel through.

Everything here is decided once per layer (the communicator at its first forward) from the
process group and the cluster file; the layer keeps the results as attributes.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from hetcomm.backends import tokens as token_dispatch
from hetcomm.errors import ConfigError

__all__ = ["GroupSpeeds", "group_info", "group_speeds", "layer_communicator", "resolve_cluster"]


def group_info(group: Optional[dist.ProcessGroup]) -> Tuple[int, int, List[int]]:
    """(world_size, rank, global ranks) of ``group``; (1, 0, [0]) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, [0]
    W = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if group is None:
        ranks = list(range(W))
    else:
        ranks = [dist.get_global_rank(group, r) for r in range(W)]
    return W, rank, ranks


def resolve_cluster(cluster: Any, global_ranks: Sequence[int]) -> Any:
    """The layer's :class:`~hetcomm.topo.cluster.Cluster`: ``cluster`` itself, loaded when a
    path, or ``$HETCOMM_CLUSTER`` when None and the group has more than one rank (None: none).

    Raises:
        ConfigError: a rank of the group lies outside the cluster (naming the file).
    """
    if isinstance(cluster, str):
        from hetcomm.topo.cluster import load_cluster

        cluster = load_cluster(cluster)
    elif cluster is None:
        from hetcomm.topo.cluster import cluster_from_env

        cluster = cluster_from_env() if len(global_ranks) > 1 else None
    if cluster is not None and max(global_ranks) >= cluster.num_ranks:
        raise ConfigError(
            f"global rank {max(global_ranks)} is in the MoE group but cluster "
            f"'{cluster.name}' has only {cluster.num_ranks} ranks; launch {cluster.num_ranks} "
            f"ranks or pass the matching cluster file",
            path=cluster.path,
        )
    return cluster


@dataclass(frozen=True)
class GroupSpeeds:
    """What the cluster says about each group rank (group ranks, not global ones).

    Attributes:
        strong_ranks: the ranks that hold more experts and replicas.
        replica_candidates: ranks allowed to hold replicas (the YAML's strong flag); which of
            them do is re-chosen by measured speed
            (:func:`~hetcomm.moe.placement.replicate.choose_holders`).
        rank_tflops: ``[W]`` dense FP16 TFLOPS of each rank's device
            (:mod:`hetcomm.topo.compute`; YAML ``device.tflops`` overrides), 1.0 each without
            a cluster.
        rank_weights: ``[W]`` relative speed of each rank: the initial assignment's weights and
            the placement policy's speeds.
    """

    strong_ranks: List[int]
    replica_candidates: List[int]
    rank_tflops: List[float]
    rank_weights: List[float]


def group_speeds(cluster: Any, global_ranks: Sequence[int], rank_weights: str,
                 strong_expert_weight: float) -> GroupSpeeds:
    """The group's :class:`GroupSpeeds` under ``MoEConfig.rank_weights`` (``strong`` or
    ``throughput``) and ``strong_expert_weight``."""
    W = len(global_ranks)
    rank_tflops: List[float] = [1.0] * W
    if cluster is not None:
        from hetcomm.topo.compute import rank_speeds, strong_by_throughput

        strong_global = set(cluster.strong_ranks)
        strong_ranks = [r for r in range(W) if global_ranks[r] in strong_global]
        replica_candidates: List[int] = list(strong_ranks)
        rank_tflops = rank_speeds(cluster, global_ranks)
        if rank_weights == "throughput":
            # Replica holders are the fastest ranks: the strong ones within STRONG_FRACTION of
            # the fastest device (a replica on a slow rank adds work where time is short).
            fast = set(strong_by_throughput(rank_tflops))
            strong_ranks = [r for r in strong_ranks if r in fast] or sorted(fast)
    else:
        strong_ranks = list(range(W))
        replica_candidates = list(range(W))

    if rank_weights == "throughput":
        weights = list(rank_tflops)  # experts in proportion to compute speed
    else:
        weights = [strong_expert_weight if r in strong_ranks else 1.0 for r in range(W)]
    return GroupSpeeds(strong_ranks, replica_candidates, rank_tflops, weights)


def layer_communicator(group, cluster, world_size: int, rank: int) -> token_dispatch.DispatchComm:
    """The communicator a layer's tokens travel through: the group's :class:`Communicator`
    (a ``hetcomm`` group's own), one over ``cluster`` when the layer names another cluster
    than the group's (a gloo group), or a local one when the group has one rank.

    Raises:
        ConfigError: the layer names another cluster than its ``hetcomm`` group uses (one
            wire rule per group: give the backend the same file).
    """
    if world_size == 1:
        return token_dispatch.GroupComm(None, 0, 1)
    from hetcomm.backends.communicator import Communicator, communicator

    comm = communicator(group)
    if cluster is None or _same_cluster(cluster, comm.cluster) or _describes(cluster, comm):
        return comm
    if comm.routed is not None:
        raise ConfigError(
            f"MoELayer (rank {rank}) was given cluster '{cluster.name}' but its hetcomm group uses "
            f"{comm.cluster.name if comm.cluster is not None else 'none'!r}; pass the same cluster to "
            f"the backend (HetcommOptions.cluster / pg_options, or HETCOMM_CLUSTER) or drop cluster=",
            key="moe.cluster",
            path=cluster.path,
        )
    key = (id(comm.group), cluster.path or cluster.name)
    hit = _CLUSTER_COMMS.get(key)
    if hit is None or hit[0]() is not comm.group:
        hit = _CLUSTER_COMMS[key] = (weakref.ref(comm.group), Communicator(comm.group, cluster=cluster))
    return hit[1]


#: Communicators over non-hetcomm groups for layers that name their own cluster, by (group,
#: file); the group held weakly (a destroyed group must not live on until the interpreter exits).
_CLUSTER_COMMS: Dict[Any, Any] = {}


def _describes(cluster, comm) -> bool:
    """Whether ``cluster`` is the group's own view of its communicator's cluster: rank ``r`` of
    ``cluster`` has the device model of the cluster slot the backend placed rank ``r`` at, and
    ranks share a node exactly where their slots do (a group shrunk in place: the backend keeps
    the file and each survivor's slot, the job describes the survivors alone)."""
    have, ranks = comm.cluster, comm.placement.ranks
    if have is None or cluster.num_ranks != len(ranks):
        return False
    slots = [have.rank(p.global_rank) for p in ranks]
    mine = [cluster.rank(r) for r in range(len(ranks))]
    return all(a.model == b.model for a, b in zip(mine, slots)) and all(
        (a.node.name == b.node.name) == (c.node.name == d.node.name)
        for a, c in zip(mine, slots) for b, d in zip(mine, slots))


def _same_cluster(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    if a.path and b.path:
        return os.path.realpath(a.path) == os.path.realpath(b.path)
    return a == b
