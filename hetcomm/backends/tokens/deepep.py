"""The DeepEP-shaped face of the token engine: ``dispatch``/``combine`` (``Communicator``'s verbs).

``dispatch`` sends each token to the ranks that own its experts and hands the receiver its rows
grouped by local expert; ``combine`` brings the expert outputs back as the weighted sum over
each token's ``k`` experts. Both are autograd functions (the backward of dispatch is a combine
and the backward of combine is a dispatch) and run as plain functions under ``torch.no_grad()``.
The notation and the layout of one dispatch: :mod:`hetcomm.backends.tokens`. Planning, flow and
the wire rule are the engine's (``plan``, ``flow``, ``wire``); this module checks arguments and
shapes the results.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hetcomm.backends.tokens.exchange import DispatchComm
from hetcomm.backends.tokens.flow import CombineFn, CombineRun, CombineWork, DispatchFn, DispatchRun, DispatchWork
from hetcomm.backends.tokens.plan import Plan, drop_over_capacity, exchange_counts, plan_dispatch
from hetcomm.backends.tokens.wire import link_wire_dtype
from hetcomm.errors import UsageError

__all__ = ["GroupComm", "DispatchHandle", "DispatchResult", "dispatch", "combine"]


@dataclass(frozen=True)
class GroupComm:
    """A minimal :class:`DispatchComm` over a plain group: one wire dtype for every pair.

    Args:
        group: process group (None: the default group, or no group when ``world_size == 1``).
        rank: rank in ``group``.
        world_size: ``W``.
        wire: dtype of every pair (None: the tensor's own dtype).
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    wire: Optional[torch.dtype] = None

    @staticmethod
    def of(group: Optional[dist.ProcessGroup] = None, wire: Optional[torch.dtype] = None) -> "GroupComm":
        """The comm of ``group`` (a local one without ``torch.distributed``)."""
        if not (dist.is_available() and dist.is_initialized()):
            return GroupComm(None, 0, 1, wire)
        return GroupComm(group, dist.get_rank(group), dist.get_world_size(group), wire)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, **kwargs) -> "DispatchResult":
        """:func:`dispatch` over this group (the ``Communicator.dispatch`` shape)."""
        return dispatch(self, x, topk_idx, topk_weights, **kwargs)

    def combine(self, y, handle: "DispatchHandle", *, async_op: bool = False):
        """:func:`combine` over this group."""
        return combine(self, y, handle, async_op=async_op)

    def wire_dtype(self, peer: int, dtype: torch.dtype, policy: Optional[str] = None) -> Optional[torch.dtype]:
        """The wire rule towards ``peer``; a plain group has no cluster: under ``cluster`` (the
        default) every link's wire dtype is :attr:`wire`."""
        wire = link_wire_dtype(dtype, "cluster" if policy is None else policy, lambda: self.wire)
        return None if peer == self.rank else wire


@dataclass(frozen=True)
class DispatchHandle:
    """The layout of one dispatch; :func:`combine` needs nothing else (no second count exchange).

    Attributes:
        num_tokens: ``T`` tokens of the sender (rows of ``x`` and of combine's output).
        num_topk: ``k``.
        recv_counts: ``[L]`` rows received per local expert (local order = ascending expert id).
        recv_counts_per_source: ``[W][L]`` of those, per source rank (this rank's own included).
        send_rows: ``[W]`` token rows sent to each rank (0 to itself: its rows never leave).
        recv_rows: ``[W]`` token rows received from each rank (0 from itself).
        chunk_rows: ``[C]`` rows of ``recv_x`` per chunk; chunk ``c`` holds local experts
            ``chunk_experts[c][0] .. chunk_experts[c][1] - 1``.
        chunk_experts: ``[C]`` ``(first, end)`` local expert indices of each chunk.
        recv_weights: ``[R]`` float32 combine weight of each received row (carries the gradient
            of ``topk_weights`` back through dispatch).
        num_dropped: copies dropped by ``capacity`` on this rank.
        bytes_sent: row bytes this dispatch sent to other ranks (wire dtypes applied; combine
            sends the same amount back, to the same ranks).
        bytes_recv: row bytes received from other ranks.
        meta_bytes_sent: bytes of the count and metadata exchanges sent to other ranks.
        dtype: dtype of ``x``.
        device: device of ``x``.
    """

    num_tokens: int
    num_topk: int
    recv_counts: Tuple[int, ...]
    recv_counts_per_source: Tuple[Tuple[int, ...], ...]
    send_rows: Tuple[int, ...]
    recv_rows: Tuple[int, ...]
    chunk_rows: Tuple[int, ...]
    chunk_experts: Tuple[Tuple[int, int], ...]
    recv_weights: torch.Tensor
    num_dropped: int
    bytes_sent: int
    bytes_recv: int
    meta_bytes_sent: int
    dtype: torch.dtype
    device: torch.device
    plan: Plan = field(repr=False)


@dataclass(frozen=True)
class DispatchResult:
    """What :func:`dispatch` returns, with or without ``async_op``.

    Attributes:
        recv_x: ``[num_recv_rows, hidden]``, ``x.dtype``, ``x.device``: one row per (token,
            local expert), grouped by local expert; with ``split_by_expert`` a tuple of one
            ``[recv_counts[l], hidden]`` piece per local expert. With ``async_op`` valid only
            after ``work.wait()`` (the rows of chunk ``c`` after ``work.wait_chunk(c)``).
        recv_counts: ``list[int]`` of ``num_local_experts``: rows per local expert.
        handle: the :class:`DispatchHandle` that :func:`combine` takes.
        work: the :class:`DispatchWork` (already waited for when ``async_op`` was False).
        async_op: whether the call returned before the rows arrived.

    Unpacking it in the shape of earlier releases (``recv_x, recv_counts, handle =`` and, with
    ``async_op``, ``..., work =``) still works for one release and warns
    (``DeprecationWarning``): read the attributes instead.
    """

    recv_x: Union[torch.Tensor, Tuple[torch.Tensor, ...]]
    recv_counts: List[int]
    handle: DispatchHandle
    work: DispatchWork
    async_op: bool = False

    def __iter__(self) -> Iterator:
        warnings.warn(
            "unpacking the result of dispatch() as a tuple is deprecated; use its attributes "
            "(res = dispatch(...); res.recv_x, res.recv_counts, res.handle, res.work)",
            DeprecationWarning,
            stacklevel=2,
        )
        yield self.recv_x
        yield self.recv_counts
        yield self.handle
        if self.async_op:
            yield self.work


# ----------------------------------------------------------------------------------------------
# The public verbs


def _check_inputs(comm: DispatchComm, x, topk_idx, topk_weights, num_experts: int, num_chunks: int) -> None:
    where = f"rank {comm.rank} of {comm.world_size}"
    if x.dim() != 2:
        raise UsageError(f"dispatch: x must be [num_tokens, hidden], got shape {tuple(x.shape)} ({where})")
    if not x.is_floating_point():
        raise UsageError(f"dispatch: x must be a float tensor, got {x.dtype} ({where})")
    if topk_idx.dim() != 2 or topk_idx.size(0) != x.size(0):
        raise UsageError(
            f"dispatch: topk_idx must be [num_tokens={x.size(0)}, k], got shape {tuple(topk_idx.shape)} ({where})"
        )
    if topk_idx.dtype != torch.int64:
        raise UsageError(f"dispatch: topk_idx must be torch.int64, got {topk_idx.dtype} ({where}); use .long()")
    if topk_weights.shape != topk_idx.shape or not topk_weights.is_floating_point():
        raise UsageError(
            f"dispatch: topk_weights must be a float tensor shaped like topk_idx {tuple(topk_idx.shape)}, "
            f"got {tuple(topk_weights.shape)} {topk_weights.dtype} ({where})"
        )
    if topk_idx.device != x.device or topk_weights.device != x.device:
        raise UsageError(
            f"dispatch: x, topk_idx and topk_weights must be on one device, got {x.device}, "
            f"{topk_idx.device}, {topk_weights.device} ({where}); move them with .to(x.device)"
        )
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise UsageError(f"dispatch: num_chunks must be a positive integer, got {num_chunks!r} ({where})")
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())  # host synchronisation (validation)
        if lo < -1 or hi >= num_experts:
            raise UsageError(
                f"dispatch: topk_idx holds expert {lo if lo < -1 else hi}, outside -1..{num_experts - 1} "
                f"(-1 = no expert; expert_to_rank names {num_experts} experts) ({where})"
            )


def dispatch(
    comm: DispatchComm,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    expert_to_rank: Union[Sequence[int], torch.Tensor],
    capacity: Optional[int] = None,
    async_op: bool = False,
    num_chunks: int = 1,
    split_by_expert: bool = False,
    wire_dtype: Optional[str] = None,
) -> DispatchResult:
    """Send every token to the ranks that own its experts, once per rank (collective).

    Every rank of ``comm.group`` must call it, in the same order as its other collectives, with
    the same hidden size, dtype, ``k``, ``expert_to_rank`` and ``num_chunks``: digests of them
    ride in the count and metadata exchanges, and a difference raises :class:`CrossRankMismatch`
    on every rank before any row moves.

    Arguments:
        comm: a :class:`DispatchComm` (``hetcomm.Communicator``, or :class:`GroupComm`).
        x: ``[num_tokens, hidden]`` any float dtype, any device: this rank's tokens.
        topk_idx: ``[num_tokens, num_topk]`` ``torch.int64``, same device: the experts each token
            goes to; ``-1`` means no expert in that slot.
        topk_weights: ``[num_tokens, num_topk]`` float, same device: the weight of each choice in
            the combine (travels as float32; its gradient comes back through this dispatch).
        expert_to_rank: ``[num_experts]`` ints (list or int64 tensor): the owner of each expert.
            A rank's *local experts* are the experts it owns in ascending id order.
        capacity: at most this many copies per expert from this rank (GShard order: first
            choices, then earlier tokens, first), an integer >= 0; None keeps every copy.
        async_op: return before the rows arrive (see Returns).
        num_chunks: ``C``: each rank's local experts are cut into ``C`` contiguous groups and
            each group's rows travel in their own exchange, so that experts can start on a
            chunk that has arrived. A token crosses once per (rank, chunk).
        split_by_expert: return ``recv_x`` as a tuple of ``num_local_experts`` tensors, one per
            local expert (``[recv_counts[l], hidden]``, views of one buffer), instead of one
            ``[num_recv_rows, hidden]`` tensor. Their gradients then flow back without a
            concatenation, and :func:`combine` takes the experts' outputs in the same form:
            at E=64, D=1024 this saves two ``[R, D]`` copies per step. The pieces must not be
            modified in place.
        wire_dtype: the wire-dtype policy of this dispatch's rows (a name of
            :data:`hetcomm.backends.options.WIRE_DTYPES`, passed to ``comm.wire_dtype``; e.g.
            the MoE layer's ``wire_dtype`` option); None: the communicator's own. Its combine
            and both backwards use the same wire dtypes.

    Returns:
        A :class:`DispatchResult` (the same type whatever ``async_op`` is):

        - ``recv_x``: ``[num_recv_rows, hidden]``, ``x.dtype``, ``x.device``: one row per
          (token, local expert), grouped by local expert (inside an expert: the rows from
          other ranks by source rank, then this rank's own rows; each by token); with
          ``async_op`` valid only after the work's ``wait()`` (or ``wait_chunk(c)`` for the rows
          of chunk ``c``). With ``split_by_expert``: a tuple of one such block per local expert.
        - ``recv_counts``: ``list[int]`` of length ``num_local_experts``: rows per local expert
          (``recv_x.split(recv_counts)`` gives each expert its rows).
        - ``handle``: the :class:`DispatchHandle` that :func:`combine` takes.
        - ``work``: the :class:`DispatchWork` (``wait()``/``wait_chunk(c)``; done already
          without ``async_op``).

    Raises:
        UsageError: bad shapes, dtypes, devices, expert ids, owners or capacity (before any
            byte moves).
        CrossRankMismatch: the ranks' hidden sizes, dtypes, ``k``, ``num_chunks``, number of
            experts or ``expert_to_rank`` differ (every rank raises, naming each difference).
        CollectiveError: an exchange failed or timed out.
    """
    owner_len = len(expert_to_rank)
    _check_inputs(comm, x, topk_idx, topk_weights, owner_len, num_chunks)
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise UsageError(
            f"dispatch: capacity must be None (keep every copy) or an integer >= 0 copies per "
            f"expert, got {capacity!r} (rank {comm.rank} of {comm.world_size})"
        )
    num_dropped = 0
    if capacity is not None:
        topk_idx, num_dropped = drop_over_capacity(topk_idx, owner_len, capacity)
    counts = exchange_counts(comm, topk_idx, expert_to_rank=expert_to_rank, num_chunks=num_chunks)
    plan = plan_dispatch(comm, counts, topk_weights, dtype=x.dtype, hidden=x.size(1), wire_policy=wire_dtype)
    recv_counts = plan.recv_counts
    state = DispatchRun(comm, plan, topk_weights.dtype)
    recv_weights, *outs = DispatchFn.apply(x, topk_weights, plan.recv_weights, state, list(recv_counts) if split_by_expert else None)
    recv_x = tuple(outs) if split_by_expert else outs[0]
    work = DispatchWork(state)
    if not async_op:
        work.wait()
    handle = DispatchHandle(
        num_tokens=plan.num_tokens,
        num_topk=plan.num_topk,
        recv_counts=tuple(recv_counts),
        recv_counts_per_source=plan.recv_counts_per_source,
        send_rows=tuple(sum(plan.send_splits[c][d] for c in range(len(plan.chunk_rows))) for d in range(plan.world_size)),
        recv_rows=tuple(sum(plan.recv_splits[c][s] for c in range(len(plan.chunk_rows))) for s in range(plan.world_size)),
        chunk_rows=plan.chunk_rows,
        chunk_experts=plan.chunk_experts,
        recv_weights=recv_weights,
        num_dropped=num_dropped,
        bytes_sent=state.bytes_sent,
        bytes_recv=state.bytes_recv,
        meta_bytes_sent=plan.meta_bytes,
        dtype=x.dtype,
        device=x.device,
        plan=plan,
    )
    return DispatchResult(recv_x, list(recv_counts), handle, work, async_op)


def combine(comm: DispatchComm, y: torch.Tensor, handle: DispatchHandle, *, async_op: bool = False):
    """The weighted sum of each token's expert outputs, back on the token's rank (collective).

    Each receiver first sums ``w * y`` over the rows of one token row (so results cross back
    once per (rank, chunk), like the tokens came), then the sender adds what every rank sent.

    Arguments:
        comm: the communicator the dispatch used.
        y: ``[num_recv_rows, hidden]`` float (any dtype; the output takes it), in ``recv_x``'s
            row order: the expert outputs; or, as ``dispatch(split_by_expert=True)`` delivers
            them, a sequence of one ``[recv_counts[l], hidden]`` tensor per local expert (no
            concatenation needed; their gradients come back as views of one buffer).
        handle: the :class:`DispatchHandle` of the dispatch.
        async_op: return ``(out, CombineWork)``; ``out`` is valid after the work's ``wait()``.

    Returns:
        ``out``: ``[num_tokens, hidden]``, ``y.dtype``, ``y.device``: ``out[t] = sum_j
        topk_weights[t, j] * expert_{topk_idx[t, j]}(x[t])`` over the kept copies; a token with
        none is zeros. With ``async_op``: ``(out, work)``.

    Raises:
        UsageError: ``y`` does not have one row per received row.
        CollectiveError: an exchange failed or timed out.
    """
    R = sum(handle.chunk_rows)
    if torch.is_tensor(y):
        if y.dim() != 2 or y.size(0) != R:
            raise UsageError(
                f"combine: y must be [{R}, hidden] (one row per row dispatch delivered), got "
                f"{tuple(y.shape)} (rank {comm.rank})"
            )
        parts, sizes = [y.contiguous()], None
    else:
        parts, want = list(y), list(handle.recv_counts)
        got = [tuple(p.shape) for p in parts]
        if not parts or len(parts) != len(want) or any(
            p.dim() != 2 or p.size(0) != n or p.size(1) != parts[0].size(1) for p, n in zip(parts, want)
        ):
            raise UsageError(
                f"combine: y as pieces must be one [rows, hidden] tensor per local expert with rows "
                f"{want} (handle.recv_counts), got shapes {got} (rank {comm.rank}); a rank without "
                f"local experts passes a [0, hidden] tensor"
            )
        if len({(p.dtype, p.device) for p in parts}) > 1:
            raise UsageError(
                f"combine: the pieces of y must share one dtype and device, got "
                f"{sorted({(str(p.dtype), str(p.device)) for p in parts})} (rank {comm.rank})"
            )
        parts, sizes = [p.contiguous() for p in parts], want
    state = CombineRun(comm, handle.plan)
    out = CombineFn.apply(handle.recv_weights, state, sizes, *parts)
    work = CombineWork(state)
    if async_op:
        return out, work
    work.wait()
    return out
