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
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from hetcomm.errors import ConfigError

__all__ = ["FlatBucket", "SlowLinkPowerSGD", "node_ids_of"]


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


class SlowLinkPowerSGD:
    """Average gradients over all ranks, PowerSGD-compressed on cross-node pairs only.

    Collective constructor (creates the node and leader groups on every rank).

    Args:
        node_ids: ``[W]`` node index of every rank (:func:`node_ids_of`).
        matrix_approximation_rank: PowerSGD ``r`` (4).
        start_iter: plain averaging for the first iterations (torch requires >= 2 with error
            feedback or warm start; 10 lets the error buffers start from real gradients).
        min_compression_rate: matrices compressing less than this go uncompressed (1.5; torch's
            default is 2: on the slow links a thin matrix that shrinks 1.5-2x, such as an MoE
            gate ``[E, D]``, is still worth compressing; the demo's dense gradients shrink 8.3x at
            rank 4 with 1.5 and 7.7x with 2).
        seed: PowerSGD's random seed for the initial ``Q``.
        backend: backend of the subgroups (None = the default group's).
    """

    def __init__(
        self,
        node_ids: Sequence[int],
        matrix_approximation_rank: int = 4,
        start_iter: int = 10,
        min_compression_rate: float = 1.5,
        seed: int = 0,
        backend: Optional[str] = None,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ConfigError(f"must be >= 1, got {matrix_approximation_rank}", key="powersgd.rank")
        if start_iter < 2:
            raise ConfigError(f"must be >= 2 (torch's error feedback needs it), got {start_iter}", key="powersgd.start_iter")
        self.world_size = W = dist.get_world_size()
        self.rank = dist.get_rank()
        if len(node_ids) != W:
            raise ConfigError(f"{len(node_ids)} node ids for {W} ranks", key="powersgd.node_ids")
        self.node_ids = list(node_ids)
        nodes = sorted(set(node_ids))
        self.num_nodes = len(nodes)
        members = {n: [r for r in range(W) if node_ids[r] == n] for n in nodes}
        self.leaders = [members[n][0] for n in nodes]
        self.node_members = members[node_ids[self.rank]]
        self.is_leader = self.rank == self.node_members[0]
        # new_group is collective over the whole world, in the same order on every rank.
        self.node_group = None
        for n in nodes:
            g = dist.new_group(members[n], backend=backend) if len(members[n]) > 1 else None
            if n == node_ids[self.rank]:
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
        self.calls = 0
        self.compressed_calls = 0
        self._bytes_uncompressed = 0
        self._bytes_compressed = 0

    def all_reduce_mean(self, grads: List[torch.Tensor]) -> None:
        """Replace each of ``grads`` (same shapes on every rank) by its mean over all ranks."""
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.node_group is not None:
            dist.all_reduce(flat, group=self.node_group)
        if self.state is not None:
            before = (self.state.total_numel_before_compression, self.state.total_numel_after_compression)
            compressing = self.state.iter >= self.state.start_powerSGD_iter
            fut = powerSGD_hook(self.state, FlatBucket(0, flat, [g.shape for g in grads]))
            flat = fut.wait()
            flat.mul_(self.num_nodes / self.world_size)
            if compressing:
                self.compressed_calls += 1
                el = flat.element_size()
                self._bytes_uncompressed += (self.state.total_numel_before_compression - before[0]) * el
                self._bytes_compressed += (self.state.total_numel_after_compression - before[1]) * el
        elif self.leader_group is None:
            flat.div_(self.world_size)  # one node: nothing crosses a slow link
        if self.node_group is not None:
            dist.broadcast(flat, src=self.node_members[0], group=self.node_group)
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off : off + n].view_as(g))
            off += n
        self.calls += 1

    def stats(self) -> Dict[str, float]:
        """On a leader: bytes per compressed averaging on the leader pairs, without and with
        compression, and their ratio (zeros elsewhere and before ``start_iter``)."""
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
