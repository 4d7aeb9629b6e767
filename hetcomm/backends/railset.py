"""The rails of one hetcomm group, and which rail carries each peer.

A :class:`RailSet` builds and owns:

* two inner ``ProcessGroupGloo`` over the whole group: ``gloo0`` (:attr:`RailSet.gloo`) carries
  the delegated collectives and the ``gloo`` rail's point-to-point transfers; ``gloo1``
  (:attr:`RailSet.gloo_x`) the collectives the executor issues itself (split checks and
  whole-step all-to-alls): gloo matches collectives by issue order, and only the executor's order
  is the same on every rank for those;
* the doorbell (wake-ups), the ``shm`` rings for same-node peers, the split-check board when the
  whole group shares memory, the ``gloo`` rail (striped over NIC ports when the cluster has them),
  the ``bridge``, and ``nccl``/``hccl`` on first use;
* the choice of rail per peer and device type (:mod:`.select`, with the calibrated choice for
  same-host pairs, :mod:`.calibrate`).

Construction is collective (every rank of the group builds its set at the same time).
"""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo
from torch.distributed import PrefixStore

from hetcomm.backends import checks
from hetcomm.backends.board import MetaBoard
from hetcomm.backends.doorbell import Doorbell
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.rank_placement import Placement
from hetcomm.backends.rails.base import Rail
from hetcomm.backends.rails.bridge import BridgeRail
from hetcomm.backends.rails.gloo import GlooRail
from hetcomm.backends.rails.shm import ShmRail, shm_supported
from hetcomm.backends.rails.striped import StripedRail
from hetcomm.backends.select import choose_rail, shm_possible
from hetcomm.errors import UsageError

if TYPE_CHECKING:
    from hetcomm.backends.calibrate import SameHostRails

__all__ = ["RailSet"]


class RailSet:
    """Every rail of one group on this rank.

    Args:
        store: the group's store.
        rank / size: this process in the group.
        timeout: the group timeout (setup waits, shm and board waits).
        inner_timeout: gloo's own timeout of every wait (a fraction of ``timeout``, so that
            fault diagnosis still ends within the group timeout).
        options: the agreed options.
        placement: who is where.
        wire_dtype: ``(peer, dtype) -> wire dtype or None`` (the communicator's policy).
        group_id: for thread names.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        inner_timeout: timedelta,
        options: HetcommOptions,
        placement: Placement,
        wire_dtype: Callable[[int, torch.dtype], Optional[torch.dtype]],
        shm_peers: Optional[Sequence[int]] = None,
    ):
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.inner_timeout = inner_timeout
        self.options = options
        self.placement = placement
        self.gloo = ProcessGroupGloo(PrefixStore("hetcomm/gloo0/", store), rank, size, inner_timeout)
        self.gloo_x = ProcessGroupGloo(PrefixStore("hetcomm/gloo1/", store), rank, size, inner_timeout)
        allowed = options.rails
        local = [r for r in range(size) if shm_possible(placement, rank, r)] if shm_supported() else [rank]
        #: Same-host peers (this rank included) that may share memory.
        self.local = local
        # Wakes the executor: rung by same-node peers after shared-memory progress and by rail
        # threads when a transfer completes (doorbell.py); a plain Event where there is no /dev/shm.
        self.wakeup = Doorbell(store, "hetcomm/bell", rank, local, timeout) if shm_supported() else threading.Event()
        self.shm: Optional[ShmRail] = None
        shm_members = local if shm_peers is None else sorted(set(shm_peers) | {rank})
        if (allowed is None or "shm" in allowed) and len(shm_members) >= 2:
            self.shm = ShmRail(
                store, rank, shm_members, [p.pid for p in placement.ranks],
                placement.ranks[rank].node, options.ring_bytes, timeout, bell=self.wakeup,
            )
        # Split checks through shared memory when the whole group shares memory: one YAML node on
        # one host (board.py). Not across emulated nodes: those have separate /dev/shm mounts.
        self.board: Optional[MetaBoard] = None
        if size >= 2 and len(local) == size:
            self.board = MetaBoard(
                store, rank, [p.pid for p in placement.ranks], checks.meta_width(size), timeout, self.wakeup
            )
        global_ranks = [p.global_rank for p in placement.ranks]
        self.gloo_rail = GlooRail(self.gloo, rank, self.wakeup, timeout=inner_timeout, global_ranks=global_ranks)
        self.striped: Optional[StripedRail] = self._make_nic_rails()
        # No reference cycles through self (see hetcomm.backends.process_group): the bridge holds us weakly.
        me = weakref.proxy(self)
        # Staging pieces of the agreed chunk size: both ends of a pair must cut alike.
        self.bridge = BridgeRail(rank, lambda peer: me.bridge_transport(peer), wire_dtype, chunk_bytes=options.chunk_bytes)
        self._device_rails: Dict[str, Rail] = {}
        self._routes: Dict[str, List[str]] = {}
        self._uniform_gloo: Optional[bool] = None
        #: ``host|node`` -> the way CPU tensors travel between the ranks that share memory there,
        #: per size class (calibrated, :class:`~.calibrate.SameHostRails`; a unit not listed uses shm).
        self.same_host: Dict[str, "SameHostRails"] = {}
        #: The whole group's size classes when the way depends on the call (several ways, or the
        #: single-copy path): :meth:`RoutedCollectives.all_to_all_single` then picks per call.
        self.size_routes: Optional["SameHostRails"] = None

    def set_same_host_rails(self, choice: Dict[str, "SameHostRails"]) -> None:
        """Adopt the (agreed) same-host ways of every host; before the first collective."""
        self.same_host = dict(choice)
        self._routes.clear()
        self._uniform_gloo = None
        self.size_routes = None
        if self.board is not None and len(choice) == 1:
            (classes,) = choice.values()
            self.size_routes = classes if classes.per_call else None

    def _shm_allowed(self, a: int, b: int) -> bool:
        """Whether the pair's CPU tensors may use shm: same node and host, and the host's
        calibrated ways use shared memory. The same answer on every rank (from agreed inputs)."""
        p = self.placement.ranks[a]
        classes = self.same_host.get(f"{p.host}|{p.node}")
        return shm_possible(self.placement, a, b) and (classes is None or classes.pair_rail == "shm")

    def _make_nic_rails(self) -> Optional[StripedRail]:
        """One gloo group per NIC port, when the cluster YAML gives every node of the group
        ``R >= 2`` ports and this rank knows its interfaces (``HetcommOptions.nic_ifnames``)."""
        ifnames = self.options.nic_ifnames
        cluster = self.placement.cluster
        if not ifnames or cluster is None or self.size < 2:
            return None
        num_ports = min(cluster.node_of(p.global_rank).num_nics for p in self.placement.ranks)
        if num_ports < 2:
            return None
        if len(ifnames) < num_ports:
            raise UsageError(
                f"hetcomm (rank {self.rank}): the cluster YAML gives every node {num_ports} NIC ports but "
                f"HETCOMM_IFNAMES lists {len(ifnames)} ({','.join(ifnames)}); list one interface per port"
            )
        rails = []
        for k in range(num_ports):
            opts = ProcessGroupGloo._Options()
            opts._devices = [ProcessGroupGloo.create_device(interface=ifnames[k])]
            opts._timeout = self.inner_timeout
            pg = ProcessGroupGloo(PrefixStore(f"hetcomm/nic{k}/", self.store), self.rank, self.size, opts)
            rails.append(GlooRail(pg, self.rank, self.wakeup, name=f"gloo-nic{k}", timeout=self.inner_timeout,
                                  global_ranks=[p.global_rank for p in self.placement.ranks]))
        return StripedRail(rails, self.rank)

    # -- which rail -----------------------------------------------------------------------------
    def rail_names(self, device_type: str = "cpu") -> List[str]:
        """The rail name for every group rank (``"self"`` for this rank) for ``device_type`` tensors."""
        if device_type not in self._routes:
            from hetcomm.backends.rails.hccl import hccl_available
            from hetcomm.backends.rails.nccl import nccl_available

            me = self.rank
            shm_peers = {p for p in self.shm.peers if self._shm_allowed(me, p)} if self.shm else set()
            nccl_ok = device_type == "cuda" and nccl_available()
            hccl_ok = device_type == "npu" and hccl_available()
            names = []
            for p in range(self.size):
                if p == me:
                    names.append("self")
                    continue
                names.append(
                    choose_rail(
                        self.placement, me, p, device_type, self.options.rails,
                        shm_ok=p in shm_peers, nccl_ok=nccl_ok, hccl_ok=hccl_ok,
                    )
                )
            self._routes[device_type] = names
        return self._routes[device_type]

    def rail(self, name: str) -> Rail:
        """The rail called ``name`` (device rails are created on first use)."""
        if name == "shm":
            assert self.shm is not None
            return self.shm
        if name == "gloo":
            return self.striped if self.striped is not None else self.gloo_rail
        if name == "bridge":
            return self.bridge
        if name not in self._device_rails:
            vendor = "nvidia" if name == "nccl" else "ascend"
            members = [r.group_rank for r in self.placement.ranks if r.vendor == vendor and not r.label_only]
            if name == "nccl":
                from hetcomm.backends.rails.nccl import NcclRail

                self._device_rails[name] = NcclRail(self.store, self.rank, members, self.timeout)
            else:
                from hetcomm.backends.rails.hccl import HcclRail

                self._device_rails[name] = HcclRail(self.store, self.rank, members, self.timeout)
        return self._device_rails[name]

    def rail_of(self, device_type: str) -> Callable[[int], Rail]:
        """``peer -> rail`` for ``device_type`` tensors."""
        names = self.rail_names(device_type)
        return lambda peer: self.rail(names[peer])

    def bridge_transport(self, peer: int) -> Rail:
        """The host rail under the bridge for ``peer``: shm when it shares memory, else gloo."""
        if self.shm is not None and peer in self.shm.peers:
            return self.shm
        return self.rail("gloo")

    def plan_rail_for(self, peer: int, hint: Optional[str], device_type: str = "cpu") -> Rail:
        """The rail of a plan's transfer to ``peer`` whose plan names rail ``hint``, for a
        ``device_type`` tensor: the pair's own rail for that device (a device tensor between
        real devices of one vendor takes nccl/hccl, any other the bridge), with a host hint
        (``shm``/``gloo``) honoured for host tensors and a port hint (``nicK``) wherever the
        pair's rail is gloo over several ports."""
        names = self.rail_names(device_type)
        if device_type == "cpu" and hint in ("shm", "gloo") and (hint != "shm" or (self.shm is not None and peer in self.shm.peers)):
            if self.options.rails is None or hint in self.options.rails:
                return self.rail(hint)
        name = names[peer]
        if hint and hint.startswith("nic") and hint[3:].isdigit() and self.striped is not None and name == "gloo":
            return self.striped.rails[int(hint[3:]) % len(self.striped.rails)]  # the port the plan chose
        if device_type == "cpu" and name in ("nccl", "hccl"):
            name = "gloo"
        return self.rail(name)

    def every_pair_on_gloo(self) -> bool:
        """True when every pair of the group (not just this rank's) uses the gloo rail for CPU
        tensors; every rank computes the same answer from the same placement and options."""
        if self._uniform_gloo is None:
            n = self.size
            shm = shm_supported() and (self.options.rails is None or "shm" in self.options.rails)
            self._uniform_gloo = all(
                choose_rail(self.placement, a, b, "cpu", self.options.rails, shm_ok=shm and self._shm_allowed(a, b)) == "gloo"
                for a in range(n) for b in range(n) if a != b
            )
        return self._uniform_gloo

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release every rail (shm segments, waiter threads, the doorbell). Idempotent."""
        for rail in [self.shm, self.board, self.gloo_rail, self.striped, *self._device_rails.values()]:
            if rail is not None:
                rail.close()
        if isinstance(self.wakeup, Doorbell):
            self.wakeup.close()
