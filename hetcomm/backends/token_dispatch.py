"""Token dispatch and combine: DeepEP's two verbs over any process group, with torch's conventions.

``dispatch`` sends each token to the ranks that own its experts and hands the receiver its rows
grouped by local expert; ``combine`` brings the expert outputs back as the weighted sum over
each token's ``k`` experts. Both are autograd functions (the backward of dispatch is a combine
and the backward of combine is a dispatch) and run as plain functions under ``torch.no_grad()``.

Notation:
    T   tokens on this rank;  k  experts per token;  D  hidden size;  E  global experts
    W   ranks in the group;  L  experts this rank owns;  C  chunks (default 1)
    U   *token rows*: distinct ``(destination rank, chunk, token)`` triples. A token whose k
        experts include several on one rank crosses to that rank ONCE; the receiver expands it
        into one row per local expert (that is where the bytes go down: E=64, k=2 on 4 ranks
        under uniform routing sends ~0.88x the rows of a per-copy exchange, k=8 ~0.46x)
    R   rows this rank receives after expansion: one per (token, local expert), expert-major

Layout of one dispatch (the same on every rank, decided by the exchanged counts):
    1. plan (local, vectorised): capacity, one ``torch.unique`` over the keys
       ``(dest * C + chunk) * T + token`` of the valid copies gives the token rows in send order
       (destination-major, then chunk, then token) and, per copy, its token row;
    2. counts (one small int64 ``all_to_all_single``, then ``.tolist()``: the host
       synchronisation every dispatch needs, since the splits of the exchanges below are host
       integers): per destination, its token rows per chunk and its copies per local expert;
    3. metadata (one int32 all-to-all, ``[U, 2k]``): for each token row, the local expert
       index and the float32 weight of each of its ``k`` slots (``-1`` = not for that rank);
    4. rows, one all-to-all per chunk over raw bytes, each peer's segment in that pair's wire
       dtype (``comm.wire_dtype(peer, dtype)``), cast on the wire only. Rows for this rank's
       own experts never enter an exchange: they are read straight from ``x``.
    5. expansion on arrival: ``recv_x[r] = token_rows[expand_index[r]]``, experts in local
       order; inside an expert the rows from other ranks by source rank, then the own rows.

``combine`` runs it backwards: each receiver sums ``w * y`` over the copies of one token row
(so a token's results cross back once per rank too), returns the sums, and the sender adds the
returns of each token. No second count exchange: the :class:`DispatchHandle` holds the layout.

Host synchronisations per dispatch: the count exchange's ``.tolist()``, ``torch.unique``'s
output size (a device sync on CUDA/NPU), and the number of dropped copies when ``capacity`` is
set. Combine has none besides its exchange.

Why hand-written: DeepEP's kernels are CUDA-only (NVLink/RDMA), Megatron's token dispatchers
sit on NCCL's ``all_to_all`` per copy; a cross-vendor group (gloo, the hetcomm backend with a
host bridge) needs the same semantics over ``all_to_all_single``.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hetcomm.backends import rowpool
from hetcomm.backends.checks import splits_agreed
from hetcomm.errors import CollectiveError, HetcommError, UsageError

__all__ = [
    "DispatchComm",
    "GroupComm",
    "DispatchHandle",
    "DispatchWork",
    "CombineWork",
    "dispatch",
    "combine",
    "drop_over_capacity",
    "count_token_rows",
    "counters",
    "reset_counters",
]

_ALIGN = 8  # bytes: every peer's segment starts 8-byte aligned, so it can be viewed as any dtype
_BLOCK_ROWS = 256  # rows per block of the weighted sums (a block and its scratch stay in cache)

_counters = {"calls": 0, "bytes_sent": 0, "bytes_recv": 0, "meta_bytes_sent": 0}


def counters() -> dict:
    """This process's dispatch/combine counters: row bytes to/from other ranks (wire dtypes
    applied, forward and backward) and metadata bytes (counts, expert slots, weights)."""
    return dict(_counters)


def reset_counters() -> None:
    """Zero :func:`counters`."""
    for key in _counters:
        _counters[key] = 0


class DispatchComm(Protocol):
    """What dispatch/combine use of a communicator (``hetcomm.Communicator`` provides it).

    Attributes:
        group: the torch ProcessGroup (gloo, hetcomm, ...); None with ``world_size == 1``.
        rank: this process's rank in ``group``.
        world_size: ``W``.
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int

    def wire_dtype(self, peer: int, dtype: torch.dtype) -> Optional[torch.dtype]:
        """The dtype ``dtype`` rows travel in between this rank and ``peer`` (None: unchanged).
        Both ends of a pair must get the same answer."""


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

    def wire_dtype(self, peer: int, dtype: torch.dtype) -> Optional[torch.dtype]:
        return self.wire


@dataclass(frozen=True)
class _Plan:
    """Per-chunk layout of one dispatch, on both sides (see the module notation).

    For chunk ``c``, this rank's *token rows* are, as a sender, the remote rows in send order
    (destination-major, then token) followed by the rows for its own experts; as a receiver,
    the rows received from every other rank (source-major) followed by those same own rows.
    """

    num_tokens: int
    num_topk: int
    rank: int
    world_size: int
    send_splits: Tuple[Tuple[int, ...], ...]  # [C][W] token rows sent to each rank (0 to self)
    recv_splits: Tuple[Tuple[int, ...], ...]  # [C][W] token rows from each rank (0 from self)
    send_token: Tuple[torch.Tensor, ...]  # [C] of [U_c] int64: remote rows, then own rows
    num_own: Tuple[int, ...]  # [C] own rows (the tail of send_token[c] and of the received rows)
    expand_index: Tuple[torch.Tensor, ...]  # [C] of [R_c] int64 into the received token rows
    slot_index: Tuple[torch.Tensor, ...]  # [C] of [R_c] int64: row * k + slot of each copy
    # [C] of [R_c] int64 token ids when nothing came from other ranks (one gather from x), or None
    own_expand: Tuple[Optional[torch.Tensor], ...]
    # Inside each local expert's run the rows from other ranks come first, then the own rows.
    # The own rows are read from (and written to) the tokens directly, never staged:
    # runs[c] = ((start, n_remote, n_own) per expert), remote_src[c] = [sum n_remote] rows of
    # the received block (None: nothing received), own_src[c] = [sum n_own] tokens.
    runs: Tuple[Tuple[Tuple[int, int, int], ...], ...]
    remote_src: Tuple[Optional[torch.Tensor], ...]
    own_src: Tuple[Optional[torch.Tensor], ...]
    chunk_rows: Tuple[int, ...]  # [C] R_c
    wire: Tuple[torch.dtype, ...]  # [W] wire dtype per peer (the row dtype for self)


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
    plan: _Plan = field(repr=False)


# ----------------------------------------------------------------------------------------------
# Planning (pure, no communication)


def drop_over_capacity(topk_idx: torch.Tensor, num_experts: int, capacity: int) -> Tuple[torch.Tensor, int]:
    """Drop the copies beyond ``capacity`` per expert, in GShard's order.

    First choices claim capacity before second choices, earlier tokens before later ones: the
    copy's position in a stable sort of the choice-major copies by expert.

    Args:
        topk_idx: ``[T, k]`` int64 expert ids, ``-1`` = none.
        num_experts: ``E``.
        capacity: copies kept per expert.
    Returns:
        ``[T, k]`` int64 with dropped copies set to ``-1``, and how many were dropped (a host
        synchronisation).
    """
    T, k = topk_idx.shape
    dev = topk_idx.device
    e = topk_idx.t().reshape(-1)  # choice-major: a = j * T + t
    key = torch.where(e >= 0, e, torch.full_like(e, num_experts))
    order = torch.argsort(key, stable=True)
    sk = key[order]
    counts = torch.bincount(key, minlength=num_experts + 1)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(e.numel(), device=dev) - start[sk]
    drop_sorted = (pos >= capacity) & (sk < num_experts)
    drop = torch.empty_like(drop_sorted)
    drop[order] = drop_sorted
    kept = torch.where(drop, torch.full_like(e, -1), e)
    return kept.view(k, T).t().contiguous(), int(drop.sum())


def _expert_tables(expert_to_rank: Union[Sequence[int], torch.Tensor], world_size: int, device: torch.device):
    """``(owner [E], local index [E], experts per rank, owners as host ints)``; local order =
    ascending id. Built from host integers (pass a list: a device tensor costs a sync)."""
    own = [int(r) for r in (expert_to_rank.tolist() if torch.is_tensor(expert_to_rank) else expert_to_rank)]
    if not own:
        raise UsageError("expert_to_rank must be a non-empty [E] sequence of ranks")
    bad = [e for e, r in enumerate(own) if not 0 <= r < world_size]
    if bad:
        raise UsageError(
            f"expert_to_rank maps expert {bad[0]} to rank {own[bad[0]]}, outside the group "
            f"of {world_size} ranks; every expert needs an owner in 0..{world_size - 1}"
        )
    per_rank = [0] * world_size
    local = []
    for r in own:
        local.append(per_rank[r])
        per_rank[r] += 1
    owner = torch.tensor(own, dtype=torch.int64, device=device)
    return owner, torch.tensor(local, dtype=torch.int64, device=device), per_rank, own


def _chunk_bounds(num_local: int, num_chunks: int) -> List[Tuple[int, int]]:
    return [((c * num_local) // num_chunks, ((c + 1) * num_local) // num_chunks) for c in range(num_chunks)]


def _chunk_of_local(per_rank: List[int], num_chunks: int, owners: List[int], device) -> torch.Tensor:
    """``[E]`` chunk of every expert: which of :func:`_chunk_bounds` of its owner holds it."""
    chunk, seen = [], [0] * len(per_rank)
    bounds = [_chunk_bounds(L, num_chunks) for L in per_rank]
    for r in owners:  # local index = order of appearance (ascending id)
        l = seen[r]
        seen[r] += 1
        chunk.append(next(c for c, (lo, hi) in enumerate(bounds[r]) if lo <= l < hi))
    return torch.tensor(chunk, dtype=torch.int64, device=device)


def count_token_rows(
    topk_idx: torch.Tensor,
    expert_to_rank: Union[Sequence[int], torch.Tensor],
    world_size: int,
    num_chunks: int = 1,
) -> torch.Tensor:
    """Token rows a dispatch of ``topk_idx`` sends to each rank (no communication).

    Args:
        topk_idx: ``[T, k]`` int64, ``-1`` = none.
        expert_to_rank: ``[E]`` owner of each expert.
        world_size: ``W``.
        num_chunks: ``C``.
    Returns:
        ``[W]`` int64 rows per destination (this rank's own entry included).
    """
    T, _ = topk_idx.shape
    owner, local, per_rank, own = _expert_tables(expert_to_rank, world_size, topk_idx.device)
    chunk_of = _chunk_of_local(per_rank, num_chunks, own, topk_idx.device)
    e = topk_idx.reshape(-1)
    valid = e >= 0
    e = e[valid]
    tok = torch.arange(T, device=topk_idx.device).repeat_interleave(topk_idx.size(1))[valid]
    key = torch.unique((owner[e] * num_chunks + chunk_of[e]) * max(T, 1) + tok)
    return torch.bincount(key // (max(T, 1) * num_chunks), minlength=world_size)


# ----------------------------------------------------------------------------------------------
# Exchanges of rows over bytes, one wire dtype per peer


def _pad(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Rows:
    """One ``all_to_all_single`` of rows with uneven splits, each peer's segment in its wire dtype.

    Everything travels as ``torch.uint8`` so that every rank makes the same call whatever its
    own peers' dtypes are. When every peer of this rank uses the row dtype and a row is a
    multiple of 8 bytes, the rows are gathered straight into the send buffer and received
    straight into the destination: no copy besides the gather.
    """

    def __init__(self, comm: DispatchComm, send_splits, recv_splits, wire, dtype: torch.dtype, width: int, tag: str):
        self.comm, self.tag = comm, tag
        self.send_splits, self.recv_splits = list(send_splits), list(recv_splits)
        self.dtype, self.width = dtype, width
        self.wire = list(wire)
        row = width * dtype.itemsize
        self.direct = row % _ALIGN == 0 and all(w == dtype for p, w in enumerate(self.wire) if p != comm.rank)
        self.send_bytes = [_pad(n * width * self.wire[p].itemsize) for p, n in enumerate(self.send_splits)]
        self.recv_bytes = [_pad(n * width * self.wire[p].itemsize) for p, n in enumerate(self.recv_splits)]
        self.work = None
        self.finish = None
        self.keep = None

    @property
    def bytes_sent(self) -> int:
        return sum(self.send_bytes)

    @property
    def bytes_recv(self) -> int:
        return sum(self.recv_bytes)

    def start(self, src: torch.Tensor, index: Optional[torch.Tensor], out: torch.Tensor) -> None:
        """Send ``src[index]`` (or ``src``), grouped by destination; fill ``out`` on :meth:`wait`.

        Args:
            src: ``[N, width]`` of ``self.dtype``.
            index: ``[S]`` int64 rows of ``src`` to send, destination-major, or None (send
                ``src`` itself, ``S == N``).
            out: ``[sum(recv_splits), width]`` contiguous, ``self.dtype``; valid after wait.
        """
        dev = src.device
        S = sum(self.send_splits)
        if self.direct:
            if index is None:
                send = src.contiguous()
            else:
                send = rowpool.empty((S, self.width), self.dtype, dev)
                torch.index_select(src, 0, index, out=send)
            sbuf = send.view(-1).view(torch.uint8) if send.numel() else torch.empty(0, dtype=torch.uint8, device=dev)
            rbuf = out.view(-1).view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8, device=dev)
            self.finish = None
        else:
            sbuf = rowpool.empty((self.bytes_sent,), torch.uint8, dev)
            rbuf = rowpool.empty((self.bytes_recv,), torch.uint8, dev)
            off = row = 0
            for p, n in enumerate(self.send_splits):
                if n:
                    seg = sbuf[off : off + n * self.width * self.wire[p].itemsize].view(self.wire[p]).view(n, self.width)
                    if index is None:
                        seg.copy_(src[row : row + n])
                    elif self.wire[p] == self.dtype:
                        torch.index_select(src, 0, index[row : row + n], out=seg)
                    else:
                        seg.copy_(src.index_select(0, index[row : row + n]))  # the cast is the copy
                off += self.send_bytes[p]
                row += n

            def finish() -> None:
                off = row = 0
                for p, n in enumerate(self.recv_splits):
                    if n:
                        seg = rbuf[off : off + n * self.width * self.wire[p].itemsize].view(self.wire[p])
                        out[row : row + n].copy_(seg.view(n, self.width))
                    off += self.recv_bytes[p]
                    row += n

            self.finish = finish
        self.keep = (sbuf, rbuf)
        with splits_agreed():  # every split here follows from the (checked) count exchange
            self.work = dist.all_to_all_single(
                rbuf, sbuf, self.recv_bytes, self.send_bytes, group=self.comm.group, async_op=True
            )
        _counters["calls"] += 1

    def wait(self) -> None:
        """Block until the rows are in ``out`` (idempotent)."""
        if self.work is None:
            return
        try:
            self.work.wait()
        except HetcommError:
            raise
        except RuntimeError as e:
            raise CollectiveError(
                f"token {self.tag} exchange failed (sending {self.send_splits} rows, expecting "
                f"{self.recv_splits}): {e}; check that every rank runs the same dispatch/combine "
                f"calls in the same order and that no rank died",
                op="all_to_all_single",
                rank=self.comm.rank,
            ) from e
        self.work = None
        if self.finish is not None:
            with torch.no_grad():
                self.finish()
        self.finish = self.keep = None


def _remote_bytes(ex: _Rows, rank: int) -> Tuple[int, int]:
    return (
        sum(b for p, b in enumerate(ex.send_bytes) if p != rank),
        sum(b for p, b in enumerate(ex.recv_bytes) if p != rank),
    )


def _wires(comm: DispatchComm, dtype: torch.dtype) -> Tuple[torch.dtype, ...]:
    out = []
    for p in range(comm.world_size):
        w = None if p == comm.rank else comm.wire_dtype(p, dtype)
        # A wire never widens, and only floating-point rows are cast.
        if w is None or not dtype.is_floating_point or w.itemsize >= dtype.itemsize:
            w = dtype
        out.append(w)
    return tuple(out)


def _exchange_ints(comm: DispatchComm, send: torch.Tensor, send_splits, recv_splits, width: int, tag: str) -> torch.Tensor:
    """Synchronous all-to-all of integer rows ``[S, width]`` (metadata); returns ``[sum(recv_splits), width]``."""
    out = torch.empty((sum(recv_splits), width), dtype=send.dtype, device=send.device)
    ex = _Rows(comm, send_splits, recv_splits, [send.dtype] * comm.world_size, send.dtype, width, tag)
    ex.start(send.reshape(-1, width), None, out)
    ex.wait()
    return out


# ----------------------------------------------------------------------------------------------
# Planning with communication: counts and metadata (steps 1-3 of the module notation)


def _plan(comm: DispatchComm, topk_idx, topk_weights, expert_to_rank, num_chunks: int, dtype: torch.dtype):
    """Returns ``(plan, recv_weights [R] float32, recv_counts [L], chunk bounds, metadata bytes sent)``."""
    W, rank = comm.world_size, comm.rank
    T, k = topk_idx.shape
    C = num_chunks
    dev = topk_idx.device
    owner, local, per_rank, own = _expert_tables(expert_to_rank, W, dev)
    chunk_of = _chunk_of_local(per_rank, C, own, dev)
    E = owner.numel()
    L = per_rank[rank]

    # 1. Token rows: unique (dest, chunk, token) over the valid copies, in that order.
    flat = topk_idx.reshape(-1)  # token-major: i = t * k + j
    valid_pos = (flat >= 0).nonzero().flatten()
    e = flat[valid_pos]
    Tm = max(T, 1)
    cell = owner[e] * C + chunk_of[e]
    key, row_of_copy = torch.unique(cell * Tm + valid_pos // k, sorted=True, return_inverse=True)
    row_cell = key // Tm
    row_tok = key % Tm
    rows_wc = torch.bincount(row_cell, minlength=W * C).view(W, C)
    first_slot = [sum(per_rank[:r]) for r in range(W)]
    slot = torch.tensor(first_slot, dtype=torch.int64, device=dev)[owner[e]] + local[e]
    copies_per_slot = torch.bincount(slot, minlength=E)  # rank-major expert order

    # Metadata per token row, [U, k, 2] int32: (float32 bits of the weight, local expert or -1).
    U = key.numel()
    meta = torch.full((U, k, 2), -1, dtype=torch.int32, device=dev)
    if U:
        w32 = topk_weights.detach().reshape(-1)[valid_pos].to(torch.float32).contiguous()
        meta[row_of_copy, valid_pos % k, 0] = w32.view(torch.int32)
        meta[row_of_copy, valid_pos % k, 1] = local[e].to(torch.int32)

    # 2. Counts, per destination: [its C token-row counts, its L_d copy counts].
    send_counts = torch.cat(
        [torch.cat([rows_wc[d], copies_per_slot[first_slot[d] : first_slot[d] + per_rank[d]]]) for d in range(W)]
    )
    meta_bytes = 0
    if W > 1:
        got = torch.empty(W * (C + L), dtype=torch.int64, device=dev)
        send_split = [C + per_rank[d] for d in range(W)]
        # Not inside splits_agreed(): this exchange is the one the backend checks, and every
        # split after it follows from it.
        dist.all_to_all_single(got, send_counts, [C + L] * W, send_split, group=comm.group)
        meta_bytes += sum(send_split[d] for d in range(W) if d != rank) * 8
        counts_from = got.view(W, C + L).tolist()  # host synchronisation (the splits below)
        rows_to = rows_wc.tolist()
    else:
        counts_from = [send_counts.tolist()]
        rows_to = [counts_from[0][:C]]
    recv_rows = [[counts_from[s][c] if s != rank else 0 for s in range(W)] for c in range(C)]
    send_rows = [[rows_to[d][c] if d != rank else 0 for d in range(W)] for c in range(C)]
    num_own = [rows_to[rank][c] for c in range(C)]
    recv_counts = [sum(counts_from[s][C + l] for s in range(W)) for l in range(L)]
    bounds = _chunk_bounds(L, C)

    # 3. Metadata of the remote rows (destination-major, then chunk, then token): one exchange.
    remote = (row_cell // C) != rank
    if W > 1:
        send_split = [sum(rows_to[d]) if d != rank else 0 for d in range(W)]
        recv_split = [sum(counts_from[s][:C]) if s != rank else 0 for s in range(W)]
        rmeta = _exchange_ints(comm, meta[remote].reshape(-1, 2 * k), send_split, recv_split, 2 * k, "metadata")
        rmeta = rmeta.view(-1, k, 2)
        meta_bytes += sum(send_split) * 2 * k * 4
    else:
        recv_split = [0]
        rmeta = meta[:0]
    src_off = [sum(recv_split[:s]) for s in range(W)]

    row_chunk = row_cell % C
    send_token, expand_index, slot_index, own_expand, chunk_rows, recv_w = [], [], [], [], [], []
    runs, remote_src, own_src = [], [], []
    for c in range(C):
        in_c = row_chunk == c
        own_tok = row_tok[in_c & ~remote]
        send_token.append(torch.cat([row_tok[in_c & remote], own_tok]))
        # The receiver's token rows of chunk c: each source's chunk-c block, then the own rows.
        parts = [
            rmeta[src_off[s] + sum(counts_from[s][:c]) :][: recv_rows[c][s]]
            for s in range(W)
            if s != rank and recv_rows[c][s]
        ]
        parts.append(meta[in_c & ~remote])
        m = torch.cat(parts) if len(parts) > 1 else parts[0]  # [U_c, k, 2]
        loc = m[:, :, 1].reshape(-1).to(torch.int64)  # index row * k + slot
        wts = m[:, :, 0].reshape(-1).contiguous().view(torch.float32)
        sel = (loc >= 0).nonzero().flatten()
        sidx = sel[torch.argsort(loc[sel], stable=True)]  # expert-major; inside: other sources in order, own rows last
        expand_index.append(sidx // k)
        slot_index.append(sidx)
        recv_w.append(wts[sidx])
        chunk_rows.append(sum(recv_counts[bounds[c][0] : bounds[c][1]]))
        # Nothing received from other ranks: expand straight from x (no gather of own rows).
        Ur = sum(recv_rows[c])
        own_expand.append(own_tok[sidx // k] if Ur == 0 else None)
        rc, a = [], 0
        for l in range(bounds[c][0], bounds[c][1]):
            n_own = counts_from[rank][C + l]
            n_rem = sum(counts_from[s][C + l] for s in range(W)) - n_own
            rc.append((a, n_rem, n_own))
            a += n_rem + n_own
        runs.append(tuple(rc))
        if Ur:
            rows = sidx // k
            # Stable: the remote positions first, in order (expert by expert), then the own ones.
            order = torch.argsort((rows >= Ur).to(torch.int8), stable=True)
            n_rem_all = sum(r[1] for r in rc)
            remote_src.append(rows[order[:n_rem_all]])
            own_src.append(own_tok[rows[order[n_rem_all:]] - Ur])
        else:
            remote_src.append(None)
            own_src.append(own_expand[-1])  # every run is own rows: the same tokens, expert by expert
    plan = _Plan(
        num_tokens=T,
        num_topk=k,
        rank=rank,
        world_size=W,
        send_splits=tuple(tuple(r) for r in send_rows),
        recv_splits=tuple(tuple(r) for r in recv_rows),
        send_token=tuple(send_token),
        num_own=tuple(num_own),
        expand_index=tuple(expand_index),
        slot_index=tuple(slot_index),
        own_expand=tuple(own_expand),
        runs=tuple(runs),
        remote_src=tuple(remote_src),
        own_src=tuple(own_src),
        chunk_rows=tuple(chunk_rows),
        wire=_wires(comm, dtype),
    )
    per_source = tuple(tuple(counts_from[s][C:]) for s in range(W))
    return plan, torch.cat(recv_w), recv_counts, bounds, meta_bytes, per_source


# ----------------------------------------------------------------------------------------------
# The two directions of one chunk, shared by dispatch, combine and their backwards


class _Send:
    """Chunk ``c``'s token rows of ``src [T, D]`` from senders to receivers (dispatch direction).

    Receiver side: ``full`` (``[U_recv, D]``) holds the rows from other ranks; None when nothing
    came from them. Own rows are never staged: readers take them from ``src`` (``own_src``).
    """

    def __init__(self, comm: DispatchComm, plan: _Plan, c: int, src: torch.Tensor, wire, tag: str):
        Ur = sum(plan.recv_splits[c])
        own = plan.num_own[c]
        tok = plan.send_token[c]
        Us = tok.numel() - own
        D = src.size(1)
        self.full = None
        self.ex: Optional[_Rows] = None
        if Ur:
            self.full = rowpool.empty((Ur, D), src.dtype, src.device)
        if plan.world_size > 1:  # a collective: every rank takes part, with or without rows
            self.ex = _Rows(comm, plan.send_splits[c], plan.recv_splits[c], wire, src.dtype, D, tag)
            out = self.full if self.full is not None else src.new_empty((0, D))
            self.ex.start(src, tok[:Us], out)

    def wait(self) -> None:
        if self.ex is not None:
            self.ex.wait()


class _Return:
    """Chunk ``c``'s token rows from other ranks, ``full`` (``[U_recv, D]``, or None with
    ``U_recv == 0``), back to their senders (combine direction), added into ``out [T, D]`` per
    token on :meth:`wait`. The caller adds the own rows' share itself."""

    def __init__(self, comm: DispatchComm, plan: _Plan, c: int, full: Optional[torch.Tensor], out: torch.Tensor, wire, tag: str):
        self.plan, self.c, self.out = plan, c, out
        Ur = sum(plan.recv_splits[c])
        tok = plan.send_token[c]
        self.Us = tok.numel() - plan.num_own[c]
        self.ex: Optional[_Rows] = None
        D = out.size(1)
        if plan.world_size > 1:
            self.back = rowpool.empty((self.Us, D), out.dtype, out.device)
            send = full if full is not None else out.new_empty((0, D))
            self.ex = _Rows(comm, plan.recv_splits[c], plan.send_splits[c], wire, out.dtype, D, tag)
            self.ex.start(send, None, self.back)

    def wait(self) -> None:
        if self.ex is None:
            return
        self.ex.wait()
        if self.Us:
            self.out.index_add_(0, self.plan.send_token[self.c][: self.Us], self.back)
        self.ex = None


def _segments(plan: _Plan, c: int):
    """``(start, n, from_remote, index)`` per run of chunk ``c``: rows ``start .. start + n - 1``
    of the chunk read ``remote[index]`` (the received block) or ``tokens[index]`` (own rows).
    Every run lies inside one local expert's rows (a piece of ``split_by_expert``)."""
    ro = oo = 0
    for start, n_rem, n_own in plan.runs[c]:
        if n_rem:
            yield start, n_rem, True, plan.remote_src[c][ro : ro + n_rem]
        if n_own:
            yield start + n_rem, n_own, False, plan.own_src[c][oo : oo + n_own]
        ro += n_rem
        oo += n_own


class _Pieces:
    """The ``[R, D]`` rows of one side of a dispatch, held as one tensor or as ``L`` per-expert
    pieces (``split_by_expert``): :meth:`rows` reads any run of rows inside one piece, so that
    expert outputs and their gradients never need a concatenation.

    Args:
        parts: one ``[R, D]`` tensor, or ``L`` tensors ``[sizes[l], D]``.
        sizes: rows of each part.
    """

    def __init__(self, parts: Sequence[torch.Tensor], sizes: Sequence[int]) -> None:
        self.parts = list(parts)
        self.starts, a = [], 0
        for n in sizes:
            self.starts.append(a)
            a += int(n)

    def rows(self, a: int, n: int) -> torch.Tensor:
        """Rows ``a .. a + n - 1`` (``n > 0``; they lie inside one part: one expert's run)."""
        if len(self.parts) == 1:
            return self.parts[0].narrow(0, a, n)
        i = bisect.bisect_right(self.starts, a) - 1  # the last part starting at or before a
        return self.parts[i].narrow(0, a - self.starts[i], n)


def _count_rows(ex: Optional[_Rows], rank: int) -> Tuple[int, int]:
    if ex is None:
        return 0, 0
    sent, recv = _remote_bytes(ex, rank)
    _counters["bytes_sent"] += sent
    _counters["bytes_recv"] += recv
    return sent, recv


def _weighted_rows(y: torch.Tensor, wc: torch.Tensor, index: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """``out[index[i]] += wc[i] * y[i]`` (``wc``: ``[S, 1]`` in ``y``'s dtype), block by block
    through ``scratch`` (``[_BLOCK_ROWS, D]``; a block stays in cache)."""
    S = y.size(0)
    for i in range(0, S, _BLOCK_ROWS):
        j = min(S, i + _BLOCK_ROWS)
        out.index_add_(0, index[i:j], torch.mul(y[i:j], wc[i:j], out=scratch[: j - i]))


def _slots_back(comm: DispatchComm, plan: _Plan, grad_w: torch.Tensor) -> torch.Tensor:
    """``[R]`` float32 gradients of the received weights -> ``[T, k]`` float32, per slot."""
    T, k = plan.num_tokens, plan.num_topk
    dev = grad_w.device
    gw = torch.zeros(T * k, dtype=torch.float32, device=dev)
    slots = torch.arange(k, dtype=torch.int64, device=dev)
    off = 0
    for c, n in enumerate(plan.chunk_rows):
        g = grad_w[off : off + n]
        off += n
        Ur = sum(plan.recv_splits[c])
        full = torch.zeros(((Ur + plan.num_own[c]) * k,), dtype=torch.float32, device=dev)
        full.index_add_(0, plan.slot_index[c], g)
        tok = plan.send_token[c]
        Us = tok.numel() - plan.num_own[c]
        rows = full.view(-1, k)
        if plan.world_size > 1:
            back = torch.empty((Us, k), dtype=torch.float32, device=dev)
            ex = _Rows(comm, plan.recv_splits[c], plan.send_splits[c], [torch.float32] * plan.world_size, torch.float32, k, "weights-backward")
            ex.start(rows[:Ur], None, back)
            ex.wait()
            _counters["meta_bytes_sent"] += _remote_bytes(ex, plan.rank)[0]
            rows = torch.cat([back, rows[Ur:]])
        gw.index_add_(0, (tok.unsqueeze(1) * k + slots).reshape(-1), rows.reshape(-1))
    return gw.view(T, k)


# ----------------------------------------------------------------------------------------------
# In-flight state and Works


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory with its own autograd version counter."""
    a = torch.empty(0, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        a.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return a


class _DispatchState:
    """What a dispatch keeps between launch, the waits and backward."""

    def __init__(self, comm: DispatchComm, plan: _Plan, weight_dtype: torch.dtype):
        self.comm, self.plan, self.weight_dtype = comm, plan, weight_dtype
        self.sends: List[Optional[_Send]] = []
        self.x: Optional[torch.Tensor] = None
        self.recv_x: Optional[torch.Tensor] = None
        self.bytes_sent = self.bytes_recv = 0

    def launch(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        self.x = x
        recv_x = rowpool.empty((sum(plan.chunk_rows), x.size(1)), x.dtype, x.device)
        # Chunks are written after recv_x has left autograd's hands, while earlier chunks may
        # already be saved for backward by the experts: write through an alias with a version
        # counter of its own, or autograd would call those saved slices modified. Safe because
        # no row is read before its chunk's wait.
        self.recv_x = _alias(recv_x)
        self.sends = [_Send(self.comm, plan, c, x, plan.wire, "dispatch") for c in range(len(plan.chunk_rows))]
        for snd in self.sends:
            sent, recv = _count_rows(snd.ex, plan.rank)
            self.bytes_sent += sent
            self.bytes_recv += recv
        return recv_x

    def finish_chunk(self, c: int) -> None:
        snd = self.sends[c]
        if snd is None:
            return
        snd.wait()
        plan = self.plan
        off, n = sum(plan.chunk_rows[:c]), plan.chunk_rows[c]
        if n:
            dst = self.recv_x[off : off + n]
            with torch.no_grad():  # filling an autograd output in place, after the fact
                if snd.full is None:
                    torch.index_select(self.x, 0, plan.own_expand[c], out=dst)
                else:
                    for start, n, remote, idx in _segments(plan, c):
                        torch.index_select(snd.full if remote else self.x, 0, idx, out=dst[start : start + n])
        self.sends[c] = None
        if all(v is None for v in self.sends):
            self.x = None  # do not keep the input alive past the last chunk


class DispatchWork:
    """Completion of an async :func:`dispatch`.

    Rows of chunk ``c`` in ``recv_x`` are valid after :meth:`wait_chunk` ``(c)``; :meth:`wait`
    waits for every chunk. Chunks can be waited in any order; each rank's waits are local (the
    exchanges were all launched by :func:`dispatch`).

    Attributes:
        exposed_s: seconds spent blocked in waits so far.
    """

    def __init__(self, state: _DispatchState) -> None:
        self._state = state
        self._done = [False] * len(state.plan.chunk_rows)
        self.exposed_s = 0.0

    def wait_chunk(self, c: int) -> None:
        """Block until chunk ``c`` has arrived and is expanded into ``recv_x``.

        Raises:
            CollectiveError: the exchange failed or timed out (names this rank).
        """
        if not self._done[c]:
            t0 = time.perf_counter()
            self._state.finish_chunk(c)
            self.exposed_s += time.perf_counter() - t0
            self._done[c] = True

    def wait(self, timeout=None) -> bool:
        """Block until every chunk is in ``recv_x``; returns True (the shape of torch's
        ``Work.wait``; the group's own timeout bounds every exchange, ``timeout`` is ignored)."""
        for c in range(len(self._done)):
            self.wait_chunk(c)
        return True

    def is_completed(self) -> bool:
        """True once every chunk has been waited for."""
        return all(self._done)


class _CombineState:
    """What a combine keeps between launch and wait."""

    def __init__(self, comm: DispatchComm, plan: _Plan):
        self.comm, self.plan = comm, plan
        self.returns: List[_Return] = []
        self.bytes_sent = self.bytes_recv = 0

    def launch(self, y: "_Pieces", w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """Start the combine of the expert outputs ``y`` (``[R, D]`` in pieces) weighted by
        ``w [R]``; ``ref`` gives the output dtype, width and device. Returns the ``[T, D]``
        output, complete after :meth:`finish`."""
        plan = self.plan
        D, dt, dev = ref.size(1), ref.dtype, ref.device
        result = rowpool.zeros((plan.num_tokens, D), dt, dev)
        out = _alias(result)  # returns are added after the fact (see _DispatchState.launch)
        wc = w.unsqueeze(1).to(dt)
        scratch = torch.empty((_BLOCK_ROWS, D), dtype=dt, device=dev)
        off = 0
        for c, n in enumerate(plan.chunk_rows):
            Ur = sum(plan.recv_splits[c])
            full = rowpool.zeros((Ur, D), dt, dev) if Ur else None
            for start, m, remote, idx in _segments(plan, c):
                a = off + start
                _weighted_rows(y.rows(a, m), wc[a : a + m], idx, full if remote else out, scratch)
            off += n
            ret = _Return(self.comm, plan, c, full, out, plan.wire, "combine")
            sent, recv = _count_rows(ret.ex, plan.rank)
            self.bytes_sent += sent
            self.bytes_recv += recv
            self.returns.append(ret)
        return result

    def finish(self) -> None:
        with torch.no_grad():  # adding into an autograd output in place, after the fact
            for ret in self.returns:
                ret.wait()
        self.returns = []


class CombineWork:
    """Completion of an async :func:`combine`: the output is valid after :meth:`wait`.

    Attributes:
        exposed_s: seconds spent blocked in :meth:`wait`.
    """

    def __init__(self, state: _CombineState) -> None:
        self._state = state
        self._done = False
        self.exposed_s = 0.0

    def wait(self, timeout=None) -> bool:
        """Block until the output holds every rank's contribution; returns True.

        Raises:
            CollectiveError: the exchange failed or timed out (names this rank).
        """
        if not self._done:
            t0 = time.perf_counter()
            self._state.finish()
            self.exposed_s += time.perf_counter() - t0
            self._done = True
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` has returned."""
        return self._done


# ----------------------------------------------------------------------------------------------
# Autograd functions


class _DispatchFn(torch.autograd.Function):
    """``(x [T, D], topk_weights [T, k]) -> (recv_weights [R], recv_x [R, D])``, or with
    ``sizes`` ``(recv_weights, *pieces)``: ``recv_x`` split per local expert (views of one
    buffer), whose gradients then come back without a concatenation.

    Backward (a combine without weights): every receiver sums the gradients of a token row's
    copies, sends the sums back once per row, and the sender adds them per token; the weight
    gradients travel back per slot.
    """

    @staticmethod
    def forward(ctx, x, topk_weights, recv_w, state, sizes):  # type: ignore[override]
        ctx.state, ctx.sizes = state, sizes
        ctx.width, ctx.dtype, ctx.device = x.size(1), x.dtype, x.device
        recv_x = state.launch(x)
        outs = (recv_x,) if sizes is None else recv_x.split(sizes)
        return (recv_w.view_as(recv_w),) + tuple(outs)

    @staticmethod
    def backward(ctx, grad_recv_w, *grads):  # type: ignore[override]
        st: _DispatchState = ctx.state
        plan, comm = st.plan, st.comm
        gx = gw = None
        if ctx.needs_input_grad[0]:
            dt = grads[0].dtype if grads else ctx.dtype
            g = _Pieces([t.contiguous() for t in grads], ctx.sizes or [sum(plan.chunk_rows)])
            gx = rowpool.zeros((plan.num_tokens, ctx.width), dt, ctx.device)
            rets, off = [], 0
            for c, n in enumerate(plan.chunk_rows):
                Ur = sum(plan.recv_splits[c])
                full = rowpool.zeros((Ur, ctx.width), dt, ctx.device) if Ur else None
                for start, m, remote, idx in _segments(plan, c):
                    (full if remote else gx).index_add_(0, idx, g.rows(off + start, m))
                off += n
                rets.append(_Return(comm, plan, c, full, gx, plan.wire, "dispatch-backward"))
                _count_rows(rets[-1].ex, plan.rank)
            for r in rets:
                r.wait()
        if ctx.needs_input_grad[1]:
            gw = _slots_back(comm, plan, grad_recv_w.float()).to(st.weight_dtype)
        return gx, gw, None, None, None


class _CombineFn(torch.autograd.Function):
    """``(recv_weights [R], y [R, D] or its per-expert pieces) -> out [T, D]``, per token the
    sum of ``w * y`` over its copies. Backward (a dispatch): ``grad_y = w * grad_out[token]``
    (in the pieces' shapes, views of one buffer), ``grad_w = <grad_out[token], y>``."""

    @staticmethod
    def forward(ctx, recv_w, state, sizes, *ys):  # type: ignore[override]
        ctx.state, ctx.sizes = state, sizes
        ctx.save_for_backward(recv_w, *ys)
        return state.launch(_Pieces(ys, sizes or [ys[0].size(0)]), recv_w, ys[0])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        st: _CombineState = ctx.state
        plan, comm = st.plan, st.comm
        w, *ys = ctx.saved_tensors
        y = _Pieces(ys, ctx.sizes or [ys[0].size(0)])
        grad_out = grad_out.contiguous()
        need_w, need_y = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:])
        R = sum(plan.chunk_rows)
        gy = rowpool.empty((R, grad_out.size(1)), grad_out.dtype, grad_out.device) if need_y else None
        gw = torch.empty(R, dtype=torch.float32, device=grad_out.device) if need_w else None
        sends = [_Send(comm, plan, c, grad_out, plan.wire, "combine-backward") for c in range(len(plan.chunk_rows))]
        dt, dev, D = grad_out.dtype, grad_out.device, grad_out.size(1)
        wc = w.unsqueeze(1).to(dt)
        # Per block of 256 copies: the gradient of each copy's token sum, gathered once into a
        # scratch that stays in cache, then both products.
        gb_all = torch.empty((_BLOCK_ROWS, D), dtype=dt, device=dev)
        prod_all = torch.empty((_BLOCK_ROWS, D), dtype=dt, device=dev) if need_w else None
        off = 0
        for c, snd in enumerate(sends):
            _count_rows(snd.ex, plan.rank)
            snd.wait()
            for start, m, remote, idx in _segments(plan, c):
                src = snd.full if remote else grad_out
                ym = y.rows(off + start, m) if need_w else None
                for i in range(0, m, _BLOCK_ROWS):
                    j = min(m, i + _BLOCK_ROWS)
                    gb = torch.index_select(src, 0, idx[i:j], out=gb_all[: j - i])
                    a, b = off + start + i, off + start + j
                    if need_w:
                        prod = torch.mul(gb, ym[i:j], out=prod_all[: j - i])
                        torch.sum(prod, 1, dtype=torch.float32, out=gw[a:b])
                    if need_y:
                        torch.mul(gb, wc[a:b], out=gy[a:b])
            off += plan.chunk_rows[c]
        if gy is None:
            gys: Tuple[Optional[torch.Tensor], ...] = (None,) * len(ys)
        else:
            gys = (gy,) if ctx.sizes is None else tuple(gy.split(ctx.sizes))
        return (gw, None, None) + gys


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
):
    """Send every token to the ranks that own its experts, once per rank (collective).

    Every rank of ``comm.group`` must call it, in the same order as its other collectives, with
    the same ``expert_to_rank`` and ``num_chunks``.

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
            choices, then earlier tokens, first); None keeps every copy.
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

    Returns:
        ``(recv_x, recv_counts, handle)``, plus a :class:`DispatchWork` when ``async_op``:

        - ``recv_x``: ``[num_recv_rows, hidden]``, ``x.dtype``, ``x.device``: one row per
          (token, local expert), grouped by local expert (inside an expert: the rows from
          other ranks by source rank, then this rank's own rows; each by token); with
          ``async_op`` valid only after the work's ``wait()`` (or ``wait_chunk(c)`` for the rows
          of chunk ``c``). With ``split_by_expert``: a tuple of one such block per local expert.
        - ``recv_counts``: ``list[int]`` of length ``num_local_experts``: rows per local expert
          (``recv_x.split(recv_counts)`` gives each expert its rows).
        - ``handle``: the :class:`DispatchHandle` that :func:`combine` takes.

    Raises:
        UsageError: bad shapes, dtypes, devices, expert ids or owners (before any byte moves).
        CollectiveError: an exchange failed or timed out.
    """
    owner_len = len(expert_to_rank)
    _check_inputs(comm, x, topk_idx, topk_weights, owner_len, num_chunks)
    num_dropped = 0
    if capacity is not None:
        topk_idx, num_dropped = drop_over_capacity(topk_idx, owner_len, int(capacity))
    meta0 = _counters["meta_bytes_sent"]
    plan, recv_w, recv_counts, bounds, meta_bytes, per_source = _plan(
        comm, topk_idx, topk_weights, expert_to_rank, num_chunks, x.dtype
    )
    _counters["meta_bytes_sent"] = meta0 + meta_bytes
    _counters["calls"] += 1
    state = _DispatchState(comm, plan, topk_weights.dtype)
    recv_weights, *outs = _DispatchFn.apply(x, topk_weights, recv_w, state, list(recv_counts) if split_by_expert else None)
    recv_x = tuple(outs) if split_by_expert else outs[0]
    work = DispatchWork(state)
    if not async_op:
        work.wait()
    handle = DispatchHandle(
        num_tokens=plan.num_tokens,
        num_topk=plan.num_topk,
        recv_counts=tuple(recv_counts),
        recv_counts_per_source=per_source,
        send_rows=tuple(sum(plan.send_splits[c][d] for c in range(len(plan.chunk_rows))) for d in range(plan.world_size)),
        recv_rows=tuple(sum(plan.recv_splits[c][s] for c in range(len(plan.chunk_rows))) for s in range(plan.world_size)),
        chunk_rows=plan.chunk_rows,
        chunk_experts=tuple(bounds),
        recv_weights=recv_weights,
        num_dropped=num_dropped,
        bytes_sent=state.bytes_sent,
        bytes_recv=state.bytes_recv,
        meta_bytes_sent=meta_bytes,
        dtype=x.dtype,
        device=x.device,
        plan=plan,
    )
    if async_op:
        return recv_x, list(recv_counts), handle, work
    return recv_x, list(recv_counts), handle


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
    state = _CombineState(comm, handle.plan)
    out = _CombineFn.apply(handle.recv_weights, state, sizes, *parts)
    work = CombineWork(state)
    if async_op:
        return out, work
    work.wait()
    return out
