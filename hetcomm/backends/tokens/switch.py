"""``hetcomm.TokenSwitch``: torch's expert-parallel ``TokenSwitch`` over hetcomm's token engine.

torch 2.14 standardised expert-parallel dispatch/combine as
``torch.distributed._token_switch.TokenSwitch`` (``create_routing`` -> ``dispatch`` -> expert
compute -> ``combine``). Where torch has it, :class:`TokenSwitch` is a subclass of it; on torch
2.13 it is the same class over a same-shaped base of ours. Either way it is a face of the token
engine that ``Communicator.dispatch``/``combine`` use too (:mod:`hetcomm.backends.tokens`: the
same plan, runs, autograd functions and wire rule); this module adds torch's argument and room
checks and the slots' metadata, on whatever device the tensors are on.

Notation (as in :mod:`hetcomm.backends.tokens`):
    N   tokens on this rank (``topk_idx.shape[0]``);  K  experts per token;  H  hidden size
    E   ``num_experts``;  W  ranks;  L = E / W  experts per rank (rank ``r`` owns experts
        ``r*L .. r*L + L - 1``; local id = global id - r*L)
    M   receive slots of this rank (``max_recv_tokens``, or the ``out=`` buffers' rows)

Layouts of the receive slots (rows past the used ones: tokens 0, weights 0, ids -1):
    ``flat`` (default)   one slot per (source token, this rank): a token whose K experts include
                         several here arrives once; ``out_topk_idx[s, j]`` is the local id of
                         slot ``j``'s expert, or -1 where that expert is elsewhere (or none).
                         Slots: the rows from other ranks by source rank, then this rank's own.
    ``expert_major``     one slot per (token, local expert), grouped by local expert (inside an
                         expert: other ranks by source rank, then this rank's own rows); column 0
                         of ``out_topk_idx``/``out_topk_weights`` holds the slot's local expert
                         and weight, the other columns -1 / 0 (torch 2.14.1 allocates ``[M, K]``
                         whatever the layout; torch main gives expert_major a 1-D ``[M]``).

``combine`` is the *unweighted* sum of a token's slots (the experts apply the weights).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from hetcomm.backends.tokens.flow import CombineFn, CombineRun, DispatchFn, DispatchRun, Pieces
from hetcomm.backends.tokens.plan import Counts, Plan, exchange_counts, plan_dispatch
from hetcomm.errors import RecvCapacityError, UsageError

__all__ = ["TokenSwitch", "Routing", "LAYOUTS", "HAS_TORCH_TOKEN_SWITCH"]

LAYOUTS = ("flat", "expert_major")

try:  # torch >= 2.14: subclass the standard class (imports no CUDA: the NCCL EP part loads lazily)
    from torch.distributed._token_switch import Routing as _TorchRouting
    from torch.distributed._token_switch import TokenSwitch as _TorchTokenSwitch

    HAS_TORCH_TOKEN_SWITCH = True
except ImportError:  # torch 2.13: a base of the same shape
    HAS_TORCH_TOKEN_SWITCH = False

    @dataclass(frozen=True)
    class _TorchRouting:  # type: ignore[no-redef]
        """torch 2.14's ``Routing`` fields: an implementation's ``handle`` and the ``topk_idx``."""

        handle: object
        topk_idx: torch.Tensor

    class _TorchTokenSwitch(abc.ABC):  # type: ignore[no-redef]
        """torch 2.14's abstract ``TokenSwitch`` (``create_routing``, ``_dispatch``, ``_combine``);
        :class:`TokenSwitch` supplies ``dispatch``/``combine`` itself on both torch versions."""

        @abc.abstractmethod
        def create_routing(
            self, topk_idx: torch.Tensor, per_expert_token_counts: Optional[torch.Tensor] = None
        ) -> Any:
            raise NotImplementedError

        @abc.abstractmethod
        def _dispatch(
            self, routing, tokens, topk_weights, out_tokens, out_topk_weights, out_topk_idx
        ) -> None:
            raise NotImplementedError

        @abc.abstractmethod
        def _combine(self, routing, expert_tokens, out_tokens) -> None:
            raise NotImplementedError


@dataclass(frozen=True)
class Routing(_TorchRouting):
    """What :meth:`TokenSwitch.create_routing` returns (torch's ``Routing`` plus the layout).

    Attributes:
        handle: hetcomm's state of this routing (its plan once dispatched); opaque.
        topk_idx: ``[N, K]`` the expert ids it was made from (-1 = no expert).
        layout: ``"flat"`` or ``"expert_major"``.
    """

    layout: str = "flat"

    @property
    def num_recv_tokens(self) -> int:
        """Receive slots this rank uses (the rows of a dispatch's output that hold tokens)."""
        return self.handle.recv[self.handle.rank]  # type: ignore[attr-defined]

    @property
    def recv_tokens_per_rank(self) -> List[int]:
        """``[W]``: receive slots every rank uses under this routing."""
        return list(self.handle.recv)  # type: ignore[attr-defined]


def _desc(t: Any) -> str:
    """``shape dtype`` of a tensor, the type of anything else (for error messages)."""
    return f"{tuple(t.shape)} {t.dtype}" if torch.is_tensor(t) else type(t).__name__


class _RoutingState:
    """The mutable part of a :class:`Routing`: counts agreed at creation, the latest plan."""

    def __init__(self, switch: "TokenSwitch", counts: Counts, recv: List[int], layout: str) -> None:
        self.switch = switch
        self.rank = switch.rank
        self.counts = counts  # the engine's count exchange of this routing
        self.idx = counts.topk_idx  # [N, K] int64 (the engine's index dtype)
        self.recv = recv
        self.layout = layout
        self.ex: Optional[_Exchange] = None  # the latest dispatch's plan


class _Exchange:
    """One engine plan of a routing and its slots; dispatch, combine and both backwards of the
    routing read it without planning again.

    ``plan`` has the slots as output rows: the expert rows (``expert_major``) or the token rows
    (``flat``, :meth:`Plan.as_token_rows`); ``used`` of them.
    """

    def __init__(self, comm: Any, plan: Plan, layout: str) -> None:
        self.comm, self.layout = comm, layout
        self.copies = plan  # expert rows: each copy's weight, local expert and slot
        self.plan = plan if layout == "expert_major" else plan.as_token_rows()
        self.used = sum(self.plan.chunk_rows)

    def fill_meta(self, out_w: torch.Tensor, out_idx: torch.Tensor) -> None:
        """``out_topk_weights``/``out_topk_idx`` of the slots (see the module's layouts)."""
        M, K = out_idx.shape
        plan = self.copies
        dev = out_idx.device
        counts = torch.tensor(plan.recv_counts, dtype=torch.int64, device=dev)
        # Local expert of every expert row (the engine groups rows by local expert).
        row_expert = torch.repeat_interleave(torch.arange(len(plan.recv_counts), device=dev), counts)
        idx = torch.full((M, K), -1, dtype=torch.int64, device=dev)
        w = torch.zeros((M, K), dtype=torch.float32, device=out_w.device)
        R = row_expert.numel()
        if self.layout == "expert_major":
            idx[:R, 0] = row_expert
            w[:R, 0] = plan.recv_weights
        else:
            # slot_index: (token row * K + slot) of each expert row.
            si = plan.slot_index[0]
            idx.view(-1)[si] = row_expert
            w.view(-1)[si] = plan.recv_weights
        out_idx.copy_(idx)
        out_w.copy_(w)

    def dispatch(self, tokens: torch.Tensor, rows: int) -> torch.Tensor:
        """``tokens [N, H]`` into ``[rows, H]`` slots (autograd: backward = the unweighted combine)."""
        run = DispatchRun(self.comm, self.plan, rows=rows, tag="token-switch-dispatch")
        # No topk_weights input: routing metadata, no gradient (torch's contract).
        _, out = DispatchFn.apply(tokens, None, self.plan.recv_weights, run, None)
        run.finish()
        return out

    def dispatch_into(self, tokens: torch.Tensor, out: torch.Tensor) -> None:
        """``tokens [N, H]`` into the slots ``out [M, H]`` (no autograd)."""
        run = DispatchRun(self.comm, self.plan, tag="token-switch-dispatch")
        dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        run.launch(tokens.detach(), dst)
        run.finish()
        if dst is not out:
            out.copy_(dst)

    def combine(self, expert_tokens: torch.Tensor) -> torch.Tensor:
        """Unweighted sums of each token's slots ``expert_tokens [M, H]`` (autograd: backward =
        a dispatch of the gradient; rows past the slots get zeros)."""
        run = CombineRun(self.comm, self.plan, "token-switch-combine")
        out = CombineFn.apply(None, run, None, expert_tokens)
        run.finish()
        return out

    def combine_into(self, expert_tokens: torch.Tensor, out: torch.Tensor) -> None:
        """The same into ``out [N, H]`` (no autograd)."""
        run = CombineRun(self.comm, self.plan, "token-switch-combine")
        y = expert_tokens.detach().contiguous()
        run.launch(Pieces([y], [y.size(0)]), None, y, out)
        run.finish()


class TokenSwitch(_TorchTokenSwitch):
    """torch's expert-parallel ``TokenSwitch`` over hetcomm's token engine (any group, any device).

    Args:
        process_group: the expert-parallel group (None: the default group); every rank of it
            constructs the switch, with the same arguments (checked: a difference raises
            :class:`~hetcomm.errors.UsageError` on every rank, naming each argument's range).
        num_experts: ``E``, a multiple of the group size; rank ``r`` owns experts
            ``r*E/W .. (r+1)*E/W - 1``.
        max_dispatch_tokens_per_rank: most tokens (``N``) one rank routes per call.
        max_recv_tokens_per_rank: most receive slots any rank may need under a routing; a
            routing over it raises :class:`~hetcomm.errors.RecvCapacityError` on every rank.
        max_token_bytes: most bytes of one token row (``H * tokens.element_size()``).
        wire_dtype: wire-dtype policy of the token rows (hetcomm's; torch has none): a name of
            :data:`hetcomm.backends.options.WIRE_DTYPES`, as ``Communicator.dispatch`` takes it;
            None = the group's own (``HETCOMM_WIRE_DTYPE``, default ``exact``; ``cluster`` gives
            each link its cluster YAML's wire dtype, e.g. fp16 over a cross-vendor bridge).
            Weights and ids always travel exactly.

    Usage (collective; every rank, same order)::

        ts = hetcomm.TokenSwitch(group, E, max_tokens, max_recv, H * 4)
        routing = ts.create_routing(topk_idx)                    # [N, K] int64
        x, w, idx = ts.dispatch(routing, tokens, topk_weights, max_recv)
        y = experts(x, w, idx)                                   # weights applied here
        out = ts.combine(routing, y)                             # [N, H], unweighted sum

    Costs: the engine's own exchanges, no more. :meth:`create_routing` makes the engine's count
    exchange (with every rank's rows and copies towards every rank, so an overflow raises on
    every rank), each :meth:`dispatch` its metadata exchange (with every rank's room) and the
    rows, :meth:`combine` the return of the rows.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup],
        num_experts: int,
        max_dispatch_tokens_per_rank: int,
        max_recv_tokens_per_rank: int,
        max_token_bytes: int,
        *,
        wire_dtype: Optional[str] = None,
    ) -> None:
        from hetcomm.backends.communicator import communicator  # lazy: rails, executor

        self.comm = communicator(process_group)
        self.group = self.comm.group
        self.rank: int = self.comm.rank
        self.world_size: int = self.comm.world_size
        self.num_experts = num_experts
        self.max_dispatch_tokens_per_rank = max_dispatch_tokens_per_rank
        self._max_recv_tokens_per_rank = max_recv_tokens_per_rank  # torch's attribute name
        self.max_token_bytes = max_token_bytes
        self.wire_dtype = wire_dtype
        W = self.world_size
        args = [num_experts, max_dispatch_tokens_per_rank, max_recv_tokens_per_rank, max_token_bytes]
        names = [
            "num_experts", "max_dispatch_tokens_per_rank", "max_recv_tokens_per_rank", "max_token_bytes"
        ]
        bad = [
            f"{n}={v!r} (must be an integer >= 0)"
            for n, v in zip(names, args)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0
        ]
        if not bad and (num_experts < 1 or num_experts % W):
            bad.append(f"num_experts={num_experts} (must be a positive multiple of the {W} ranks)")
        # One agreement at construction: the lowest and highest value of every argument (and of
        # a local error flag), so that a rank with other arguments fails every rank, not a hang.
        # host: no tensor exists yet to name a device; hetcomm and gloo groups reduce host tensors
        vals = [1 if bad else 0] + [0 if bad else int(v) for v in args]
        vec = torch.tensor(vals, dtype=torch.int64)  # host: see above
        lo, hi = vec.clone(), vec.clone()
        if self.world_size > 1:
            lo.neg_()
            dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=self.group)
            lo.neg_()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        where = f"rank {self.rank} of {W}"
        if bad:
            raise UsageError(f"TokenSwitch: bad arguments: {'; '.join(bad)} ({where})")
        if int(hi[0]):
            raise UsageError(
                f"TokenSwitch: another rank rejected its arguments ({where}); see that rank's error"
            )
        differ = [
            f"{n} ranges {int(lo[i + 1])}..{int(hi[i + 1])}"
            for i, n in enumerate(names)
            if lo[i + 1] != hi[i + 1]
        ]
        if differ:
            raise UsageError(
                f"TokenSwitch: the ranks were constructed with different arguments: "
                f"{'; '.join(differ)} ({where}); construct it with the same values on every rank"
            )
        self.num_local_experts = num_experts // self.world_size
        self._owners = [e // self.num_local_experts for e in range(num_experts)]

    # -- routing -------------------------------------------------------------------------------
    def create_routing(
        self,
        topk_idx: torch.Tensor,
        per_expert_token_counts: Optional[torch.Tensor] = None,
        *,
        layout: str = "flat",
    ) -> Routing:
        """The routing of one step (collective): counts every rank's receive slots, checks them.

        Args:
            topk_idx: ``[N, K]`` integer (int64 or int32) expert ids, ``-1`` = no expert; ``N <=
                max_dispatch_tokens_per_rank``.
            per_expert_token_counts: optional 1-D integer tensor of length ``>= L``: filled with
                the slots each local expert receives (``[:L]``; the rest untouched).
            layout: ``"flat"`` or ``"expert_major"`` (see the module's layouts).

        Returns:
            a :class:`Routing` for :meth:`dispatch` / :meth:`combine`.

        Raises:
            UsageError: bad ``topk_idx``/``layout``/counts on some rank (every rank raises).
            RecvCapacityError: some rank would need more than ``max_recv_tokens_per_rank`` slots
                (every rank raises, naming it).
        """
        W, L = self.world_size, self.num_local_experts
        problem = self._check_routing_args(topk_idx, per_expert_token_counts, layout)
        dev = topk_idx.device if torch.is_tensor(topk_idx) else torch.device("cpu")
        # The engine's count exchange: every rank learns every rank's token rows (flat slots)
        # and copies (expert_major slots), so an overflow raises on every rank; a rank that
        # rejected its arguments takes part with nothing, and every rank raises.
        counts = exchange_counts(
            self.comm, topk_idx.to(torch.int64) if problem is None else None,
            expert_to_rank=self._owners, num_chunks=1, problem=problem,
            op="TokenSwitch.create_routing", device=dev,
        )
        recv = list(counts.recv_rows if layout == "flat" else counts.recv_copies)
        self._check_room(
            "create_routing", recv, [self._max_recv_tokens_per_rank] * W, "max_recv_tokens_per_rank",
            f"construct the TokenSwitch with max_recv_tokens_per_rank >= {max(recv)}",
        )
        if per_expert_token_counts is not None:
            dst = per_expert_token_counts
            mine = torch.tensor(counts.copies_per_local_expert, dtype=dst.dtype, device=dst.device)
            dst[:L].copy_(mine)
        state = _RoutingState(self, counts, recv, layout)
        return Routing(handle=state, topk_idx=topk_idx, layout=layout)

    def _check_routing_args(self, topk_idx, counts, layout) -> Optional[str]:
        if layout not in LAYOUTS:
            return f"layout must be one of {LAYOUTS}, got {layout!r}"
        if (
            not torch.is_tensor(topk_idx)
            or topk_idx.dim() != 2
            or topk_idx.dtype not in (torch.int64, torch.int32)
        ):
            return f"topk_idx must be a [num_tokens, k] int64 or int32 tensor, got {_desc(topk_idx)}"
        if topk_idx.size(0) > self.max_dispatch_tokens_per_rank:
            return (
                f"topk_idx routes {topk_idx.size(0)} tokens, over max_dispatch_tokens_per_rank="
                f"{self.max_dispatch_tokens_per_rank}; construct the TokenSwitch with a larger one"
            )
        if topk_idx.numel():
            lo, hi = int(topk_idx.min()), int(topk_idx.max())  # host synchronisation (validation)
            if lo < -1 or hi >= self.num_experts:
                bad = lo if lo < -1 else hi
                return f"topk_idx holds expert {bad}, outside -1..{self.num_experts - 1}"
        if counts is not None and (
            not torch.is_tensor(counts)
            or counts.dim() != 1
            or counts.numel() < self.num_local_experts
            or counts.is_floating_point()
            or counts.is_complex()
        ):
            return (
                f"per_expert_token_counts must be a 1-D integer tensor of length >= "
                f"{self.num_local_experts} (the local experts), got {_desc(counts)}"
            )
        return None

    def _check_room(self, verb: str, recv: List[int], room: List[int], what: str, fix: str) -> None:
        over = [r for r in range(self.world_size) if recv[r] > room[r]]
        if over:
            detail = ", ".join(f"rank {r} needs {recv[r]} > {room[r]}" for r in over)
            raise RecvCapacityError(
                f"TokenSwitch.{verb}: receive slots over {what}: {detail} (rank {self.rank} of "
                f"{self.world_size}; nothing was sent); {fix}",
                rank=self.rank,
                ranks=over,
                needed=[recv[r] for r in over],
                room=[room[r] for r in over],
            )

    # -- the exchanges -------------------------------------------------------------------------
    def _state(self, routing: Routing, verb: str) -> _RoutingState:
        st = getattr(routing, "handle", None)
        if not isinstance(st, _RoutingState) or st.switch is not self:
            raise UsageError(
                f"TokenSwitch.{verb}: the routing was not made by this TokenSwitch's "
                f"create_routing (rank {self.rank}); call ts.create_routing(topk_idx) on it"
            )
        return st

    def _make_plan(self, st: _RoutingState, weights, dtype: torch.dtype, hidden: int, **checks) -> _Exchange:
        """The engine's plan of this routing (collective: its metadata exchange)."""
        plan = plan_dispatch(
            self.comm, st.counts, weights, dtype=dtype, hidden=hidden, wire_policy=self.wire_dtype, **checks
        )
        st.ex = _Exchange(self.comm, plan, st.layout)
        return st.ex

    def _prepare_dispatch(self, routing: Routing, tokens, topk_weights, room, out) -> _Exchange:
        """Check the arguments, then plan with the engine; every rank's room and arguments ride
        in the engine's metadata exchange, so a short room or a bad argument on one rank raises
        on every rank before any row moves (collective)."""
        st = self._state(routing, "dispatch")
        problem = self._check_dispatch_args(st, tokens, topk_weights, room, out)
        what = "the output buffers' rows (out=)" if out is not None else "max_recv_tokens"

        def check_rooms(rooms: List[int]) -> None:
            self._check_room(
                "dispatch", st.recv, rooms, f"each rank's {what}",
                "pass max_recv_tokens (or out= buffers with rows) >= routing.num_recv_tokens on every rank",
            )

        if problem is not None:
            return self._make_plan(st, None, torch.float32, 0, problem=problem, op="TokenSwitch.dispatch")
        mine = out[0].size(0) if out is not None else room
        return self._make_plan(
            st, topk_weights, tokens.dtype, tokens.size(1), room=mine, check_rooms=check_rooms, op="TokenSwitch.dispatch"
        )

    def _check_dispatch_args(self, st: _RoutingState, tokens, topk_weights, room, out) -> Optional[str]:
        N, K = st.idx.shape
        if (
            not torch.is_tensor(tokens)
            or tokens.dim() != 2
            or tokens.size(0) != N
            or not tokens.is_floating_point()
        ):
            return f"tokens must be a float [{N}, hidden] tensor (a row per routed token), got {_desc(tokens)}"
        nbytes = tokens.size(1) * tokens.element_size()
        if nbytes > self.max_token_bytes:
            return (
                f"a token row is {nbytes} bytes, over max_token_bytes={self.max_token_bytes}; "
                f"construct the TokenSwitch with a larger one"
            )
        if (
            not torch.is_tensor(topk_weights)
            or tuple(topk_weights.shape) != (N, K)
            or not topk_weights.is_floating_point()
        ):
            return f"topk_weights must be a float [{N}, {K}] tensor (like topk_idx), got {_desc(topk_weights)}"
        if tokens.device != st.idx.device or topk_weights.device != st.idx.device:
            return (
                f"tokens, topk_weights and topk_idx must be on one device, got {tokens.device}, "
                f"{topk_weights.device}, {st.idx.device}; move them with .to()"
            )
        if out is None:
            if room is None:
                return "max_recv_tokens is required when out= is not provided"
            if isinstance(room, bool) or not isinstance(room, int) or room < 0:
                return f"max_recv_tokens must be an integer >= 0, got {room!r}"
            return None
        if not isinstance(out, (tuple, list)) or len(out) != 3 or not all(torch.is_tensor(t) for t in out):
            return "out= must be a tuple (out_tokens, out_topk_weights, out_topk_idx) of tensors"
        ot, ow, oi = out
        H = tokens.size(1)
        if ot.dim() != 2 or ot.size(1) != H or ot.dtype != tokens.dtype:
            return f"out_tokens must be [rows, {H}] {tokens.dtype}, got {_desc(ot)}"
        M = ot.size(0)
        if tuple(ow.shape) != (M, K) or not ow.is_floating_point():
            return f"out_topk_weights must be a float [{M}, {K}] tensor, got {_desc(ow)}"
        if tuple(oi.shape) != (M, K) or oi.is_floating_point():
            return f"out_topk_idx must be an integer [{M}, {K}] tensor, got {_desc(oi)}"
        if any(t.device != tokens.device for t in out):
            return f"out= buffers must be on {tokens.device}, got {[str(t.device) for t in out]}"
        return None

    def _exchange_of(self, routing: Routing, expert_tokens: torch.Tensor) -> _Exchange:
        st = self._state(routing, "combine")
        ex = st.ex
        if ex is None:
            # A combine without a dispatch before it: plan now (collective like every plan);
            # a combine needs no weights.
            w = torch.zeros(st.idx.shape, dtype=torch.float32, device=st.idx.device)
            ex = self._make_plan(st, w, expert_tokens.dtype, expert_tokens.size(1))
        if (
            expert_tokens.dim() != 2
            or expert_tokens.size(0) < ex.used
            or not expert_tokens.is_floating_point()
        ):
            raise UsageError(
                f"TokenSwitch.combine: expert_tokens must be a float [rows >= {ex.used}, hidden] "
                f"tensor (this rank's used receive slots), got {_desc(expert_tokens)} "
                f"(rank {self.rank} of {self.world_size})"
            )
        return ex

    def _dispatch(self, routing, tokens, topk_weights, out_tokens, out_topk_weights, out_topk_idx) -> None:
        """torch's primitive: dispatch into the given buffers (no autograd)."""
        out = (out_tokens, out_topk_weights, out_topk_idx)
        ex = self._prepare_dispatch(routing, tokens, topk_weights, None, out)
        with torch.no_grad():
            ex.dispatch_into(tokens, out_tokens)
            ex.fill_meta(out_topk_weights, out_topk_idx)

    def _combine(self, routing, expert_tokens, out_tokens) -> None:
        """torch's primitive: combine into ``out_tokens`` (no autograd)."""
        ex = self._exchange_of(routing, expert_tokens)
        N = self._state(routing, "combine").idx.size(0)
        if tuple(out_tokens.shape) != (N, expert_tokens.size(1)):
            raise UsageError(
                f"TokenSwitch.combine: out must be [{N}, {expert_tokens.size(1)}], got "
                f"{_desc(out_tokens)} (rank {self.rank} of {self.world_size})"
            )
        with torch.no_grad():
            ex.combine_into(expert_tokens, out_tokens)

    def dispatch(  # type: ignore[override]
        self,
        routing: Routing,
        tokens: torch.Tensor,
        topk_weights: torch.Tensor,
        max_recv_tokens: Optional[int] = None,
        *,
        out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Send every token to the ranks of its experts (collective).

        Args:
            routing: from :meth:`create_routing`.
            tokens: ``[N, H]`` float (any dtype; its rows travel in each link's wire dtype).
            topk_weights: ``[N, K]`` float: the gate weights (travel exactly, as float32; no
                gradient flows to them: routing metadata, as in torch).
            max_recv_tokens: ``M``, the rows of the outputs (required without ``out``); every
                rank's used slots must fit (else :class:`RecvCapacityError` on every rank).
            out: ``(out_tokens [M, H] tokens.dtype, out_topk_weights [M, K] float,
                out_topk_idx [M, K] integer)`` to fill instead (no autograd).

        Returns:
            ``(out_tokens [M, H] tokens.dtype, out_topk_weights [M, K] topk_weights.dtype,
            out_topk_idx [M, K] topk_idx.dtype)``: the first ``routing.num_recv_tokens`` rows
            hold slots (see the module's layouts), the rest tokens 0, weights 0, ids -1.
            Without ``out``, ``out_tokens`` carries autograd (backward: the unweighted combine).
        """
        if out is not None:
            self._dispatch(routing, tokens, topk_weights, *out)
            return out
        ex = self._prepare_dispatch(routing, tokens, topk_weights, max_recv_tokens, None)
        out_tokens = ex.dispatch(tokens, max_recv_tokens)
        M, K = max_recv_tokens, topk_weights.size(1)
        out_w = torch.empty((M, K), dtype=topk_weights.dtype, device=tokens.device)
        out_idx = torch.empty((M, K), dtype=routing.topk_idx.dtype, device=tokens.device)
        ex.fill_meta(out_w, out_idx)  # routing metadata: no gradient
        return out_tokens, out_w, out_idx

    def combine(  # type: ignore[override]
        self,
        routing: Routing,
        expert_tokens: torch.Tensor,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Bring the slots back to their tokens: ``out[t]`` = the unweighted sum of token ``t``'s
        slots (collective; zeros for a token routed nowhere).

        Args:
            routing: the routing of the dispatch whose slots these are.
            expert_tokens: ``[M, H]`` float, ``M >= routing.num_recv_tokens`` (rows past the used
                slots are ignored; e.g. the dispatch's whole output).
            out: ``[N, H]`` to fill instead (no autograd).

        Returns:
            ``[N, H]``, ``expert_tokens.dtype``; without ``out`` with autograd (backward: a
            dispatch of the gradient over the same plan; unused rows get zeros).
        """
        if out is not None:
            self._combine(routing, expert_tokens, out)
            return out
        return self._exchange_of(routing, expert_tokens).combine(expert_tokens)

    def __repr__(self) -> str:
        return (
            f"hetcomm.TokenSwitch(rank={self.rank}, world_size={self.world_size}, "
            f"num_experts={self.num_experts}, max_recv_tokens_per_rank={self._max_recv_tokens_per_rank})"
        )
