"""Where a :class:`hetcomm.moe.MoELayer`'s local experts live: the one interface the layer calls
(:class:`ExpertStore`) and its resident form (:class:`ResidentExperts`, every expert where its
module put it). The paged form is :class:`hetcomm.moe.paged_experts.PagedExperts`; the layer
holds one store, chosen by its ``page_budget``.

A store is the layer's ``experts`` submodule: an :class:`~hetcomm.moe.experts.ExpertBank`, so
the experts' state-dict keys stay ``experts.experts.<local index>.<name>`` (checkpoints,
snapshots and DCP restores name them so). See ``docs/MOE.md`` ("Where the experts live").
"""

from __future__ import annotations

import abc
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from hetcomm.backends import tokens as token_dispatch
from hetcomm.errors import ConfigError
from hetcomm.moe.experts import ExpertBank
from hetcomm.moe.overlap import PipelineTimes

__all__ = ["ExpertStore", "ExpertOutput", "ResidentExperts", "join_graph"]

#: What :meth:`ExpertStore.compute` returns for the combine: one ``[n_l, D]`` output per local
#: expert (rows delivered split by expert) or ``[R, D]`` for all of them.
ExpertOutput = Union[torch.Tensor, List[torch.Tensor]]


def join_graph(y: ExpertOutput) -> ExpertOutput:
    """``y`` in the autograd graph whenever gradients are on, so every rank's output has a
    ``grad_fn`` and every rank runs the combine's backward, the exchange its peers wait on.

    A rank whose experts got no rows, from an input that needs no gradient (a frozen gate over
    frozen embeddings), has nothing in ``y`` that requires grad; a zero scalar leaf that does is
    added to its first tensor (same values, its gradient never read). ``y`` unchanged otherwise.
    """
    parts = y if isinstance(y, list) else [y]
    if not torch.is_grad_enabled() or not parts or any(t.requires_grad for t in parts):
        return y
    anchor = torch.zeros((), dtype=parts[0].dtype, device=parts[0].device, requires_grad=True)
    return [parts[0] + anchor] + parts[1:] if isinstance(y, list) else y + anchor


class ExpertStore(ExpertBank, metaclass=abc.ABCMeta):
    """This rank's experts and how the layer runs them: what every store does for the layer.

    Args:
        experts: the local experts, in local-index order (the placement's order); each
            parameter is marked ``p.hetcomm_expert = True`` (rank-local).
        ids: their global ids, in the same order.

    Attributes:
        ids: global id of each local expert (``experts[i]`` is global expert ``ids[i]``).
    """

    def __init__(self, experts: Sequence[nn.Module], ids: Sequence[int]) -> None:
        super().__init__(experts)
        self.ids = tuple(int(e) for e in ids)
        for p in self.parameters():
            # Like DeepSpeed's ``allreduce = False``: data-parallel gradient averaging must skip
            # these (each rank holds different experts); see ``MoELayer.expert_parameters``.
            p.hetcomm_expert = True

    # -- the experts -------------------------------------------------------------------------
    def sorted_ids(self) -> List[int]:
        """This rank's experts' global ids in ascending order (the dispatch's local order)."""
        return sorted(self.ids)

    def modules_by_id(self) -> List[nn.Module]:
        """This rank's experts in ascending global id (the dispatch's local-expert order)."""
        return [self.experts[i] for i in sorted(range(len(self.ids)), key=lambda i: self.ids[i])]

    def adopt(self, modules: Sequence[nn.Module], ids: Sequence[int]) -> None:
        """Hold ``modules`` as global experts ``ids`` (a placement change: a migration's or a
        restored checkpoint's), in local order."""
        self.ids = tuple(int(e) for e in ids)
        self.experts = nn.ModuleList(modules)
        for p in self.experts.parameters():
            p.hetcomm_expert = True  # a module built for the move is an expert like the others

    # -- one forward -------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def pager(self) -> Any:
        """The :class:`~hetcomm.moe.paging.ExpertPager` over the experts, or None (resident,
        or not built yet)."""

    @abc.abstractmethod
    def begin_forward(self, device: torch.device) -> None:
        """Start of a forward whose rows are on ``device`` (before the replica refresh)."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Wait for every transfer of the experts' weights in flight (before anything reads
        them outside a step: a checkpoint, a replica refresh, a migration)."""

    @abc.abstractmethod
    def prefetch_own(self, send_counts: torch.Tensor) -> None:
        """This rank's own rows are routed (``send_counts``: ``[E]`` int64 copies per global
        expert); called before the dispatch's count exchange."""

    @abc.abstractmethod
    def dispatch_modules(self, extra: Sequence[nn.Module]) -> List[nn.Module]:
        """The module of each local expert in dispatch order, then ``extra`` (the per-step
        split's replicas), when the rows should arrive as one piece per expert; ``[]`` when
        they should arrive as one ``[R, D]`` block."""

    @abc.abstractmethod
    def compute(self, res: token_dispatch.DispatchResult, mods: Sequence[nn.Module], times: PipelineTimes,
                speed: Any, device: torch.device) -> ExpertOutput:
        """Run the experts on the rows of ``res`` (an async dispatch: wait chunk by chunk),
        ``mods`` as :meth:`dispatch_modules` gave them; add the seconds spent to
        ``times.expert_s`` and the rows to ``speed`` (a :class:`~hetcomm.moe.speed.SpeedMeter`
        timing on ``device``, the layer input's).
        Returns what the combine takes (rows of every expert, in the dispatch's layout)."""

    @abc.abstractmethod
    def backward_callback(self) -> Optional[Callable[[], None]]:
        """What must run once the whole backward of this forward is done, or None."""

    @abc.abstractmethod
    def step_stats(self, rows_per_expert: Sequence[int]) -> Dict[str, Any]:
        """This forward's store fields of :class:`~hetcomm.moe.step_stats.StepStats`
        (``page_*``; empty for a resident store)."""

    # -- between steps -----------------------------------------------------------------------
    @abc.abstractmethod
    def end_step(self) -> None:
        """Close the training step (after ``optimizer.step()``)."""

    @abc.abstractmethod
    def attach_optimizer(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """The optimizer over the experts (its per-element state moves with them)."""

    @abc.abstractmethod
    def page_stats(self) -> Dict[str, float]:
        """Cumulative paging counters since the layer was built (empty for a resident store)."""

    def warm(self, expert_share: torch.Tensor, num_experts: int) -> List[int]:
        """Bring in the experts a known routing uses most (``hetcomm launch --warmup-from``: a
        previous run's per-expert load; a paged store hints its predictor and pages in this
        rank's hottest experts, as many as the free slots take, building the pager on the
        experts' device if the first forward has not).

        Args:
            expert_share: ``[num_experts]`` float, any device: each global expert's share of the load.
        Returns:
            Global ids of the experts resident afterwards because of it, hottest first (none
            for a resident store).
        Raises:
            ConfigError: ``expert_share`` is not ``[num_experts]`` (``key='moe.page_budget'``).
        """
        if tuple(expert_share.shape) != (num_experts,):
            raise ConfigError(
                f"expert_share has shape {tuple(expert_share.shape)}; expected ({num_experts},), one share per "
                f"global expert",
                key="moe.page_budget",
            )
        return self._warm(expert_share)

    @abc.abstractmethod
    def _warm(self, expert_share: torch.Tensor) -> List[int]:
        """:meth:`warm` once the shape is checked."""

    @abc.abstractmethod
    def take_migration_requests(self) -> List[int]:
        """Global ids of the experts asked to move to another rank since the last call."""


class ResidentExperts(ExpertStore):
    """Every local expert stays where its module put it (``page_budget`` 0).

    The rows arrive as one piece per local expert (``dispatch(split_by_expert=True)``) and the
    outputs go to the combine as they come: no ``[R, D]`` concatenation of rows or gradients.
    """

    @property
    def pager(self) -> None:
        return None

    def begin_forward(self, device: torch.device) -> None:
        pass

    def sync(self) -> None:
        pass

    def prefetch_own(self, send_counts: torch.Tensor) -> None:
        pass

    def dispatch_modules(self, extra: Sequence[nn.Module]) -> List[nn.Module]:
        return self.modules_by_id() + list(extra)

    def compute(self, res: token_dispatch.DispatchResult, mods: Sequence[nn.Module], times: PipelineTimes,
                speed: Any, device: torch.device) -> ExpertOutput:
        recv_x, counts, handle, work = res.recv_x, res.recv_counts, res.handle, res.work
        if mods:
            y_recv: List[torch.Tensor] = []
            for c, (lo, hi) in enumerate(handle.chunk_experts):
                work.wait_chunk(c)
                te = time.perf_counter()
                mark = speed.begin(device)
                y_recv += self.forward_pieces(recv_x[lo:hi], modules=mods[lo:hi])
                speed.end(mark, sum(counts[lo:hi]))
                times.expert_s += time.perf_counter() - te
            return y_recv
        # A rank without experts takes the whole (empty) block, which keeps x in its
        # backward's graph.
        work.wait()
        return recv_x * 0

    def backward_callback(self) -> Optional[Callable[[], None]]:
        return None

    def step_stats(self, rows_per_expert: Sequence[int]) -> Dict[str, Any]:
        return {}

    def end_step(self) -> None:
        pass

    def attach_optimizer(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        pass

    def page_stats(self) -> Dict[str, float]:
        return {}

    def _warm(self, expert_share: torch.Tensor) -> List[int]:
        return []

    def take_migration_requests(self) -> List[int]:
        return []
