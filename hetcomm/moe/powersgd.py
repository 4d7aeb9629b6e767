"""PowerSGD on the slow links only: gradients averaged exactly inside a node, compressed between nodes.

Notation: ``W`` ranks on ``N`` nodes; a node's *leader* is its lowest rank; ``r`` the PowerSGD
rank (``matrix_approximation_rank``).

One averaging of a list of gradients (every rank calls it with tensors of the same shapes):

1. inside each node with more than one rank: one uncompressed ``all_reduce(SUM)`` of the flat
   gradient (NVLink/HCCS-class links: compressing there would cost more than it saves);
2. between the ``N`` leaders: torch's ``powerSGD_hook`` with its ``PowerSGDState`` (low-rank
   ``P``/``Q`` factors, warm start, error feedback; reused, not rewritten) over a group of the
   leaders, so only cross-node pairs, and with them every cross-vendor pair, carry compressed
   bytes. The hook averages over leaders; scaling by ``N / W`` turns that mean of node sums into
   the mean over all ranks;
3. inside each node: the leader broadcasts the result.

The hook expects a DDP ``GradBucket``, which torch does not let Python construct;
:class:`FlatBucket` gives the hook the four methods it calls (``index``, ``buffer``,
``gradients`` as views into the buffer, ``is_last``).

Bytes: ``PowerSGDState`` counts elements before and after compression
(``compression_stats()``); :meth:`SlowLinkPowerSGD.stats` reports them as bytes per averaging on
the compressed (leader) pairs. A ``64 x 64`` matrix at ``r = 4`` sends ``(64 + 64) * 4`` values
instead of 4,096 (8x); vectors (biases, norms) and matrices that would compress less than
``min_compression_rate`` (1.5 here, 2 in torch) go uncompressed, as in torch.
:attr:`SlowLinkPowerSGD.rail_bytes` counts what the rails actually carried: this process's
``hetcomm.stats()`` bytes sent per rail during its compressed averagings (empty off hetcomm).

Teardown: the hook's callbacks run on the gloo group's worker thread and hold the state and the
leader group; the future this thread waits on completes *inside* the last callback, so the
worker frees those closures a moment later, once it gets the GIL. Had this thread meanwhile
dropped every other reference (the job ending, ``destroy_process_group``), the worker would free
the group itself, and ``~ProcessGroupGloo`` joining its own thread aborts the process
(``std::system_error: Resource deadlock avoided``; seen under load on the leader ranks, 9 of 40
runs). Each averaging therefore waits until the worker has let go of the state
(:func:`_wait_until_released`), so a group is only ever freed on the thread that made it. A
hetcomm group's shutdown also waits for the completions still running on gloo's threads
(``hetcomm.backends.delegated._InFlight``): the same abort was seen once more in CI, a gloo thread
still inside a completion while the main thread destroyed the groups.

Two users: ``hetcomm train --powersgd`` (the dense gradients, mean over all ranks) and the
hot-expert replicas' gradient sums (``MoEConfig.replicate_powersgd``,
:mod:`hetcomm.moe.placement.replicate`): a SUM over a subset of the ranks (``members``, the
replica holders and owners), whose bucket layout follows the hot set (:meth:`remap_rows`).
"""

from __future__ import annotations

import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from hetcomm.errors import ConfigError

__all__ = ["FlatBucket", "SlowLinkPowerSGD", "node_ids_of", "rail_bytes_sent"]


def _wait_until_released(obj: object, num_refs: int, timeout_s: float = 2.0) -> None:
    """Yield the GIL until ``obj`` has ``num_refs`` references again (``sys.getrefcount`` as its
    caller measured it: other threads have dropped what they held of ``obj``), for at most
    ``timeout_s``: past it, go on (a worker that slow is stuck elsewhere, and the next
    collective's own timeout names it)."""
    deadline = time.monotonic() + timeout_s
    # - 1: this frame's own reference (the argument ``obj``).
    while sys.getrefcount(obj) - 1 > num_refs and time.monotonic() < deadline:
        time.sleep(0.0001)


class FlatBucket:
    """The part of ``torch.distributed.GradBucket`` that ``powerSGD_hook`` uses.

    Args:
        index: bucket index (keys PowerSGD's per-bucket error and P/Q memory).
        buffer: ``[n]`` flat gradient (float32/float16/bfloat16), modified in place by the hook.
        shapes: shapes of the gradients packed in ``buffer``, in order.
    """

    def __init__(self, index: int, buffer: torch.Tensor, shapes: Sequence[torch.Size]) -> None:
        self._index = index
        self._buffer = buffer
        views, off = [], 0
        for s in shapes:
            n = int(torch.Size(s).numel())
            views.append(buffer[off : off + n].view(s))
            off += n
        if off != buffer.numel():
            raise ConfigError(f"shapes cover {off} elements, the buffer has {buffer.numel()}", key="powersgd.bucket")
        self._views = views

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> List[torch.Tensor]:
        return self._views

    def is_last(self) -> bool:
        return True  # one bucket per averaging: every call is one PowerSGD iteration


def node_ids_of(cluster, world_size: int) -> List[int]:
    """Node index of each rank from a :class:`~hetcomm.topo.cluster.Cluster`."""
    names: Dict[str, int] = {}
    out = []
    for r in range(world_size):
        name = cluster.node_of(r).name
        out.append(names.setdefault(name, len(names)))
    return out


def rail_bytes_sent() -> Dict[str, int]:
    """This process's ``hetcomm.stats()`` bytes sent per rail (empty when nothing ran on hetcomm)."""
    from hetcomm.backends.stats import stats

    return {rail: int(c.get("bytes_sent", 0)) for rail, c in stats().items()}


class SlowLinkPowerSGD:
    """Average (or sum) gradients over ranks, PowerSGD-compressed on cross-node pairs only.

    Collective constructor: every rank of the job creates the node and leader groups (in the
    same order), members or not.

    Args:
        node_ids: ``[W]`` node index of every rank of the job (:func:`node_ids_of`).
        matrix_approximation_rank: PowerSGD ``r`` (4).
        start_iter: plain averaging for the first iterations (torch requires >= 2 with error
            feedback or warm start; 10 lets the error buffers start from real gradients).
        min_compression_rate: matrices compressing less than this go uncompressed (1.5; torch's
            default is 2: on the slow links a thin matrix that shrinks 1.5-2x, such as an MoE
            gate ``[E, D]``, is still worth compressing; the demo's dense gradients shrink 8.3x at
            rank 4 with 1.5 and 7.7x with 2).
        seed: PowerSGD's random seed for the initial ``Q``.
        backend: backend of the subgroups (None = the default group's).
        members: global ranks taking part in the reductions (None: all ``W``); the others only
            help create the groups.
    """

    def __init__(
        self,
        node_ids: Sequence[int],
        matrix_approximation_rank: int = 4,
        start_iter: int = 10,
        min_compression_rate: float = 1.5,
        seed: int = 0,
        backend: Optional[str] = None,
        members: Optional[Sequence[int]] = None,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ConfigError(f"must be >= 1, got {matrix_approximation_rank}", key="powersgd.rank")
        if start_iter < 2:
            raise ConfigError(f"must be >= 2 (torch's error feedback needs it), got {start_iter}", key="powersgd.start_iter")
        W = dist.get_world_size()
        self.rank = dist.get_rank()
        if len(node_ids) != W:
            raise ConfigError(f"{len(node_ids)} node ids for {W} ranks", key="powersgd.node_ids")
        ranks = sorted(set(range(W) if members is None else (int(r) for r in members)))
        if not ranks or ranks[0] < 0 or ranks[-1] >= W:
            raise ConfigError(f"members {list(ranks)} must be ranks of the {W}-rank job", key="powersgd.members")
        #: Ranks the reductions run over (the mean divides by their number).
        self.members = ranks
        self.world_size = len(ranks)
        self.is_member = self.rank in ranks
        self.node_ids = list(node_ids)
        nodes = sorted({node_ids[r] for r in ranks})
        self.num_nodes = len(nodes)
        by_node = {n: [r for r in ranks if node_ids[r] == n] for n in nodes}
        self.leaders = [by_node[n][0] for n in nodes]
        self.node_members = by_node.get(node_ids[self.rank], [])
        self.is_leader = self.is_member and self.rank == self.node_members[0]
        # new_group is collective over the whole world, in the same order on every rank.
        self.node_group = None
        for n in nodes:
            g = dist.new_group(by_node[n], backend=backend) if len(by_node[n]) > 1 else None
            if self.is_member and n == node_ids[self.rank]:
                self.node_group = g
        self.leader_group = dist.new_group(self.leaders, backend=backend) if self.num_nodes > 1 else None
        self.state: Optional[PowerSGDState] = None
        if self.is_leader and self.leader_group is not None:
            self.state = PowerSGDState(
                process_group=self.leader_group,
                matrix_approximation_rank=matrix_approximation_rank,
                start_powerSGD_iter=start_iter,
                min_compression_rate=min_compression_rate,
                use_error_feedback=True,
                warm_start=True,
                random_seed=seed,
                compression_stats_logging_frequency=10**9,
            )
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_iter = start_iter
        self.calls = 0
        self.compressed_calls = 0
        self._bytes_uncompressed = 0
        self._bytes_compressed = 0
        #: This process's rail bytes sent (``hetcomm.stats()``) during its compressed calls, per
        #: rail: what the node and leader links carried once compression ran.
        self.rail_bytes: Dict[str, int] = {}

    @property
    def compresses(self) -> bool:
        """True when some pair of members crosses nodes (else every reduction is exact)."""
        return self.leader_group is not None

    def all_reduce_mean(self, grads: List[torch.Tensor]) -> None:
        """Replace each of ``grads`` (same shapes on every member) by its mean over the members."""
        self.all_reduce(grads, average=True)

    def all_reduce(self, grads: List[torch.Tensor], average: bool = True) -> None:
        """Replace each of ``grads`` (same shapes on every member) by its sum (``average=False``)
        or mean over the members. Collective over the members; non-members must not call it.

        Args:
            grads: float32/float16/bfloat16 tensors of any shapes (matrices, and tensors viewed
                as ``[shape[0], -1]``, are the compressed ones); one PowerSGD bucket (index 0).
        """
        if not grads:
            return
        if not self.is_member:
            raise ConfigError(f"rank {self.rank} is not one of the members {self.members}", key="powersgd.members")
        flat = torch.cat([g.reshape(-1) for g in grads])
        compressing = self.calls >= self.start_iter and self.leader_group is not None
        rails0 = rail_bytes_sent() if compressing else None
        if self.node_group is not None:
            dist.all_reduce(flat, group=self.node_group)
        if self.state is not None:
            before = (self.state.total_numel_before_compression, self.state.total_numel_after_compression)
            num_refs = sys.getrefcount(self.state)
            fut = powerSGD_hook(self.state, FlatBucket(0, flat, [g.shape for g in grads]))
            flat = fut.wait()
            del fut
            _wait_until_released(self.state, num_refs)  # see "Teardown" above
            # The hook averages over the leaders: back to the sum of node sums, then the mean.
            flat.mul_(self.num_nodes / self.world_size if average else float(self.num_nodes))
            if compressing:
                el = flat.element_size()
                self._bytes_uncompressed += (self.state.total_numel_before_compression - before[0]) * el
                self._bytes_compressed += (self.state.total_numel_after_compression - before[1]) * el
        elif self.leader_group is None and average:
            flat.div_(self.world_size)  # one node: nothing crosses a slow link
        if self.node_group is not None:
            dist.broadcast(flat, src=self.node_members[0], group=self.node_group)
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off : off + n].view_as(g))
            off += n
        if rails0 is not None:
            self.compressed_calls += 1
            for rail, b in rail_bytes_sent().items():
                self.rail_bytes[rail] = self.rail_bytes.get(rail, 0) + b - rails0.get(rail, 0)
        self.calls += 1

    def remap_rows(self, keep: Sequence[Optional[int]], row_numel: int) -> None:
        """The bucket's layout changed to rows of ``row_numel`` elements (one per hot expert):
        new row ``j`` takes the error feedback of old row ``keep[j]`` (None: zeros); the
        warm-start factors restart from random ``Q`` (the same on every leader: their
        ``PowerSGDState`` RNGs advance together). Call it on every member at the same point."""
        if self.state is None:
            return
        err = self.state.error_dict.get(0)
        if err is not None:
            new = torch.zeros(len(keep) * row_numel, dtype=err.dtype, device=err.device)
            for j, i in enumerate(keep):
                if i is not None and (i + 1) * row_numel <= err.numel():
                    new[j * row_numel : (j + 1) * row_numel] = err[i * row_numel : (i + 1) * row_numel]
            self.state.error_dict[0] = new
        self.state.p_memory_dict.pop(0, None)
        self.state.q_memory_dict.pop(0, None)

    def stats(self) -> Dict[str, float]:
        """On a leader: bytes of the compressed averagings on the leader pairs, without and with
        compression (PowerSGD's element counts), and their ratio (zeros elsewhere and before
        ``start_iter``)."""
        return {
            "compressed_calls": float(self.compressed_calls),
            "uncompressed_bytes": float(self._bytes_uncompressed),
            "compressed_bytes": float(self._bytes_compressed),
            "reduction": (self._bytes_uncompressed / self._bytes_compressed) if self._bytes_compressed else 0.0,
        }

    def state_dict(self) -> Dict[str, object]:
        """PowerSGD's error feedback and warm-start factors (this rank's; leaders only hold any)."""
        if self.state is None:
            return {"calls": self.calls}
        return {"calls": self.calls, "powersgd": self.state.__getstate__()}

    def load_state_dict(self, sd: Dict[str, object]) -> None:
        self.calls = int(sd["calls"])
        if self.state is not None and "powersgd" in sd:
            group = self.state.process_group
            self.state.__setstate__(dict(sd["powersgd"]))
            self.state.process_group = group
