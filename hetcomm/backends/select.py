"""Which rail carries each peer: from the pair's link class, the tensor's device and the options.

Rules, for a pair (this rank, peer) and a tensor on device type ``dev``:

==========================  =========================================================
situation                   rail
==========================  =========================================================
``HOST_BRIDGE`` (NVIDIA <->  ``bridge`` (host staging over ``shm`` or ``gloo``)
Ascend)
``dev == cuda``, both real  ``nccl``
NVIDIA ranks
``dev == npu``, both real   ``hccl``
Ascend ranks
other device tensors        ``bridge`` (nothing else moves device memory between them)
CPU tensors, same node in   ``shm``
the YAML *and* same host
everything else             ``gloo``
==========================  =========================================================

"Same node" comes from the cluster YAML: four processes on one machine that the YAML puts on
three nodes use shm only where the YAML says they share a node, so a run behaves like the
cluster it stands for. A rail missing from ``HetcommOptions.rails`` falls back to ``shm`` (if
the pair could use it) and then ``gloo``; device tensors fall back to ``bridge``.
"""

from __future__ import annotations

from typing import Optional, Sequence

from hetcomm.backends.rank_placement import Placement
from hetcomm.topo.model import LinkClass

__all__ = ["choose_rail", "shm_possible"]


def shm_possible(placement: Placement, a: int, b: int, shm_ok: bool = True) -> bool:
    """True if ranks ``a`` and ``b`` may share memory: same node in the YAML and same real host."""
    return shm_ok and placement.same_node(a, b) and placement.same_host(a, b)


def choose_rail(
    placement: Placement,
    me: int,
    peer: int,
    device_type: str,
    allowed: Optional[Sequence[str]] = None,
    shm_ok: bool = True,
    nccl_ok: bool = False,
    hccl_ok: bool = False,
) -> str:
    """The rail name for sending a ``device_type`` tensor between group ranks ``me`` and ``peer``.

    Args:
        placement: who is where.
        device_type: ``cpu``, ``cuda`` or ``npu``.
        allowed: rails permitted by the options (None = all).
        shm_ok: the shm rail exists for this pair (supported platform, segment set up).
        nccl_ok / hccl_ok: the library is usable in this process.
    """
    want = _preferred(placement, me, peer, device_type, shm_ok, nccl_ok, hccl_ok)
    if allowed is None or want in allowed:
        return want
    if device_type != "cpu":
        return "bridge"
    if "shm" in allowed and shm_possible(placement, me, peer, shm_ok):
        return "shm"
    return "gloo"


def _preferred(placement: Placement, me: int, peer: int, device_type: str, shm_ok: bool, nccl_ok: bool, hccl_ok: bool) -> str:
    a, b = placement.ranks[me], placement.ranks[peer]
    if placement.link_class(me, peer) == LinkClass.HOST_BRIDGE:
        return "bridge"
    if device_type == "cuda":
        real_nvidia = a.vendor == b.vendor == "nvidia" and not (a.label_only or b.label_only)
        return "nccl" if (nccl_ok and real_nvidia) else "bridge"
    if device_type == "npu":
        real_ascend = a.vendor == b.vendor == "ascend" and not (a.label_only or b.label_only)
        return "hccl" if (hccl_ok and real_ascend) else "bridge"
    if device_type != "cpu":
        return "bridge"
    return "shm" if shm_possible(placement, me, peer, shm_ok) else "gloo"
