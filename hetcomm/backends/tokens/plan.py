"""Planning of one token dispatch: capacity, the token rows of every destination, the count and
metadata exchanges (steps 1-3 of :mod:`hetcomm.backends.tokens`' notation).

Everything here is decided once per dispatch, for both faces (``Communicator.dispatch`` and
``TokenSwitch.dispatch``): :func:`plan_dispatch` returns a :class:`Plan`, which the exchanges of
the dispatch, its combine and both backwards read without planning again.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hetcomm.backends.tokens.exchange import DispatchComm, count_meta_bytes, count_plan, exchange_ints
from hetcomm.backends.tokens.wire import decode_weights, dtype_code, dtype_name, encode_weights, row_wires
from hetcomm.errors import CrossRankMismatch, UsageError

__all__ = ["Plan", "Counts", "exchange_counts", "plan_dispatch", "drop_over_capacity", "count_token_rows"]


@dataclass(frozen=True)
class Plan:
    """Per-chunk layout of one dispatch, on both sides (see the package notation).

    For chunk ``c``, this rank's *token rows* are, as a sender, the remote rows in send order
    (destination-major, then token) followed by the rows for its own experts; as a receiver,
    the rows received from every other rank (source-major) followed by those same own rows.

    The *output rows* (``chunk_rows``, ``runs``, ``remote_src``, ``own_src``, ``own_expand``)
    are the expert rows (one per (token, local expert), expert-major) of a plan from
    :func:`plan_dispatch`, or the token rows themselves in one from :meth:`as_token_rows`. The
    copies (``slot_index``, ``recv_weights``, ``recv_counts``) are the expert rows' in both.
    """

    num_tokens: int
    num_topk: int
    rank: int
    world_size: int
    send_splits: Tuple[Tuple[int, ...], ...]  # [C][W] token rows sent to each rank (0 to self)
    recv_splits: Tuple[Tuple[int, ...], ...]  # [C][W] token rows from each rank (0 from self)
    send_token: Tuple[torch.Tensor, ...]  # [C] of [U_c] int64: remote rows, then own rows
    num_own: Tuple[int, ...]  # [C] own rows (the tail of send_token[c] and of the received rows)
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
    chunk_rows: Tuple[int, ...]  # [C] R_c output rows
    wire: Tuple[torch.dtype, ...]  # [W] wire dtype per peer (the row dtype for self)
    recv_weights: torch.Tensor  # [R] float32 combine weight of each expert row
    recv_counts: Tuple[int, ...]  # [L] expert rows per local expert
    recv_counts_per_source: Tuple[Tuple[int, ...], ...]  # [W][L] of those, per source rank
    chunk_experts: Tuple[Tuple[int, int], ...]  # [C] (first, end) local experts of each chunk
    meta_bytes: int  # bytes of the count and metadata exchanges sent to other ranks
    token_rows: bool = False  # the output rows are the token rows (as_token_rows)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_rows)

    def num_recv(self, c: int) -> int:
        """Token rows chunk ``c`` receives from other ranks."""
        return sum(self.recv_splits[c])

    def num_remote_sent(self, c: int) -> int:
        """Token rows chunk ``c`` sends to other ranks (the head of ``send_token[c]``)."""
        return self.send_token[c].numel() - self.num_own[c]

    def as_token_rows(self) -> "Plan":
        """The same exchange with the token rows as output rows: no expansion per expert.

        Chunk ``c``'s output rows are the rows received from other ranks (by source rank), then
        this rank's own token rows: one run, read from the received block and from the tokens.
        ``TokenSwitch``'s ``flat`` layout.
        """
        runs, remote_src, own_src, own_expand, rows = [], [], [], [], []
        for c in range(self.num_chunks):
            Ur, Us = self.num_recv(c), self.num_remote_sent(c)
            own = self.send_token[c][Us:]
            runs.append(((0, Ur, self.num_own[c]),))
            remote_src.append(torch.arange(Ur, device=own.device) if Ur else None)
            own_src.append(own)
            own_expand.append(None if Ur else own)
            rows.append(Ur + self.num_own[c])
        return dataclasses.replace(
            self, runs=tuple(runs), remote_src=tuple(remote_src), own_src=tuple(own_src),
            own_expand=tuple(own_expand), chunk_rows=tuple(rows), token_rows=True,
        )



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
# Agreement of the arguments that must match on every rank: two digests, each riding in an
# exchange the dispatch makes anyway (no extra collective). The routing's (k, C, E, owners, and
# the rows and copies every rank sends) rides in the count exchange; the call's (hidden size,
# dtype, wire dtypes, the caller's room) in the metadata exchange, ahead of the metadata rows.

_WIRE_BITS = 4  # bits per peer of the packed wire-dtype row (code + 1, 0 = unknown)
_PEERS_PER_WORD = 60 // _WIRE_BITS
_ROUTE_FIELDS = 5  # flag, k, num_chunks, num_experts, crc of expert_to_rank
_CALL_FIELDS = 4  # flag, room, hidden, dtype; then the wire words


def _route_digest(flag: int, k: int, num_chunks: int, owners: List[int]) -> List[int]:
    """The routing's digest: an error flag, ``k``, ``num_chunks``, ``num_experts`` and a CRC of
    ``expert_to_rank``."""
    crc = zlib.crc32(b",".join(str(r).encode() for r in owners))
    return [int(flag), int(k), int(num_chunks), len(owners), crc]


def _call_digest(flag: int, room: int, hidden: int, dtype: torch.dtype, wire) -> List[int]:
    """The call's digest: an error flag, the caller's room, hidden size, row dtype and this
    rank's wire dtype towards every peer (4 bits per peer, 15 peers per word)."""
    words = [0] * ((len(wire) + _PEERS_PER_WORD - 1) // _PEERS_PER_WORD)
    for p, w in enumerate(wire):
        words[p // _PEERS_PER_WORD] |= (dtype_code(w) + 1) << (_WIRE_BITS * (p % _PEERS_PER_WORD))
    return [int(flag), int(room), int(hidden), dtype_code(dtype)] + words


def _wire_of(digest: Sequence[int], peer: int) -> int:
    word = digest[_CALL_FIELDS + peer // _PEERS_PER_WORD]
    return ((word >> (_WIRE_BITS * (peer % _PEERS_PER_WORD))) & ((1 << _WIRE_BITS) - 1)) - 1


def _check_flags(comm: DispatchComm, digests: List[List[int]], problem: Optional[str], op: str) -> None:
    """Raise :class:`UsageError` on every rank when some rank rejected its arguments (flag 1):
    that rank with its own ``problem``, the others naming it."""
    where = f"rank {comm.rank} of {comm.world_size}"
    if problem is not None:
        raise UsageError(f"{op}: {problem} ({where})")
    failed = [r for r, d in enumerate(digests) if d[0]]
    if failed:
        raise UsageError(f"{op}: rank(s) {failed} rejected their arguments ({where}); see their errors")


#: (label, the argument it comes from, index in its digest, how to show it); label -> the
#: CrossRankMismatch.field vocabulary.
_ROUTE_CHECKS = (("k", "topk_idx.size(1)", 1, str), ("num_chunks", "num_chunks", 2, str), ("num_experts", "len(expert_to_rank)", 3, str))
_CALL_CHECKS = (("hidden size", "x.size(1)", 2, str), ("dtype", "x.dtype", 3, dtype_name))
_KIND = {"hidden size": "shape", "dtype": "dtype", "k": "shape", "wire dtype": "dtype"}


def _check_digests(comm: DispatchComm, digests: List[List[int]], route: bool, op: str) -> None:
    """Raise :class:`CrossRankMismatch` when the ranks' arguments differ.

    ``digests[s]`` is rank ``s``'s routing digest (``route``) or call digest, as its exchange
    delivered it. Every rank holds every rank's digest, so every rank decides the same and
    raises the same message, before any row moves; the group stays usable (no exchange is left
    half done).
    """
    W = comm.world_size
    problems: List[str] = []
    odd: set = set()
    first_field = None

    def differ(label: str, values: List[str], what: str) -> None:
        nonlocal first_field
        groups: dict = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        if len(groups) < 2:
            return
        majority = max(groups.values(), key=len)
        odd.update(r for g in groups.values() if g is not majority for r in g)
        problems.append(f"{label} ({what}): " + "; ".join(f"ranks {g}: {v}" for v, g in groups.items()))
        first_field = first_field or label

    for label, what, i, show in _ROUTE_CHECKS if route else _CALL_CHECKS:
        differ(label, [show(d[i]) for d in digests], what)
    if route and not problems:  # the same number of experts: compare the maps themselves
        differ("expert_to_rank", [f"crc32 {d[4]:08x}" for d in digests], "the owner of each expert")
    if not route and not problems:
        for a in range(W):
            for b in range(a + 1, W):
                wa, wb = _wire_of(digests[a], b), _wire_of(digests[b], a)
                if wa != wb:
                    odd.update((a, b))
                    problems.append(
                        f"wire dtype of pair {a}-{b}: rank {a} sends {dtype_name(wa)}, rank {b} sends {dtype_name(wb)}"
                    )
                    first_field = first_field or "wire dtype"
    if problems:
        raise CrossRankMismatch(
            f"{op}: the ranks called with different arguments (rank {comm.rank} of {W}): "
            + " | ".join(problems)
            + "; every rank must dispatch the same layer with the same hidden size, dtype, k, "
            "num_chunks and expert_to_rank (and a wire-dtype policy that both ends of a pair share)",
            op="dispatch",
            rank=comm.rank,
            ranks=sorted(odd),
            field=_KIND.get(first_field or "", "arguments"),
        )


# ----------------------------------------------------------------------------------------------
# Planning with communication: counts (step 2), then metadata (step 3) and the layout


@dataclass(frozen=True)
class Counts:
    """What the count exchange of one routing decided (step 2 of the package notation); a
    dispatch's :func:`plan_dispatch` needs nothing else of the routing.

    Every rank holds the same ``recv_rows``/``recv_copies``: each rank sent every other rank
    its token rows and copies towards every destination, so that a face can check every rank's
    room on every rank (``TokenSwitch``) without another collective.
    """

    topk_idx: torch.Tensor  # [T, k] int64, -1 = none
    num_chunks: int
    per_rank: Tuple[int, ...]  # [W] experts per rank
    local: torch.Tensor  # [E] int64 local index of each expert on its owner
    valid_pos: torch.Tensor  # [V] int64 token-major positions of the valid copies
    copy_expert: torch.Tensor  # [V] int64 expert of each valid copy
    row_of_copy: torch.Tensor  # [V] int64 token row of each valid copy
    row_cell: torch.Tensor  # [U] int64 dest * C + chunk of each token row
    row_tok: torch.Tensor  # [U] int64 token of each token row
    counts_from: Tuple[Tuple[int, ...], ...]  # [W][C + L] rows per chunk, copies per local expert, from each source
    rows_to: Tuple[Tuple[int, ...], ...]  # [W][C] token rows this rank sends to each rank, per chunk
    recv_rows: Tuple[int, ...]  # [W] token rows every rank receives (its own included)
    recv_copies: Tuple[int, ...]  # [W] copies (expert rows) every rank receives
    meta_bytes: int  # bytes of the count exchange sent to other ranks

    @property
    def copies_per_local_expert(self) -> List[int]:
        """``[L]`` copies this rank's local experts receive (every source)."""
        C = self.num_chunks
        L = len(self.counts_from[0]) - C
        return [sum(row[C + l] for row in self.counts_from) for l in range(L)]


def exchange_counts(
    comm: DispatchComm,
    topk_idx: Optional[torch.Tensor],
    *,
    expert_to_rank: Union[Sequence[int], torch.Tensor],
    num_chunks: int,
    problem: Optional[str] = None,
    op: str = "dispatch",
    device: Optional[torch.device] = None,
) -> Counts:
    """Plan the token rows of a routing and exchange the counts (collective; steps 1-2).

    Args:
        comm: the communicator.
        topk_idx: ``[T, k]`` int64 expert ids, ``-1`` = none (capacity already applied); None
            with ``problem``.
        expert_to_rank: ``[E]`` owner of each expert.
        num_chunks: ``C``.
        problem: this rank rejected its arguments (the message): it takes part with nothing to
            send, and every rank raises :class:`UsageError` after the exchange.
        op: the verb named in errors.
        device: where the tables live when ``topk_idx`` is None.

    Raises:
        UsageError: ``problem`` on some rank (every rank raises).
        CrossRankMismatch: ``k``, ``num_chunks`` or ``expert_to_rank`` differ (every rank raises).
    """
    W, rank = comm.world_size, comm.rank
    C = num_chunks
    if topk_idx is None:
        topk_idx = torch.full((0, 1), -1, dtype=torch.int64, device=device)
    T, k = topk_idx.shape
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
    rows_wc = torch.bincount(key // Tm, minlength=W * C).view(W, C)
    first_slot = [sum(per_rank[:r]) for r in range(W)]
    slot = torch.tensor(first_slot, dtype=torch.int64, device=dev)[owner[e]] + local[e]
    copies_per_slot = torch.bincount(slot, minlength=E)  # rank-major expert order
    copies_to = torch.bincount(owner[e], minlength=W)

    # 2. Counts, per destination: [the routing's digest, the rows and copies this rank sends to
    # every rank (W + W), its C token-row counts, its L_d copy counts]. Every rank sees every
    # other rank's arguments and sends before any row moves, and all raise the same error.
    digest = _route_digest(problem is not None, k, C, own)
    head = torch.cat([torch.tensor(digest, dtype=torch.int64, device=dev), rows_wc.sum(1), copies_to])
    H = head.numel()
    send_counts = torch.cat(
        [torch.cat([head, rows_wc[d], copies_per_slot[first_slot[d] : first_slot[d] + per_rank[d]]]) for d in range(W)]
    )
    meta_bytes = 0
    if W > 1:
        got = torch.empty(W * (H + C + L), dtype=torch.int64, device=dev)
        send_split = [H + C + per_rank[d] for d in range(W)]
        # Not inside splits_agreed(): this exchange is the one the backend checks, and every
        # split after it follows from it.
        dist.all_to_all_single(got, send_counts, [H + C + L] * W, send_split, group=comm.group)
        meta_bytes += sum(send_split[d] for d in range(W) if d != rank) * 8
        rows_from = got.view(W, H + C + L).tolist()  # host synchronisation (the splits below)
    else:
        rows_from = [send_counts.tolist()]
    digests = [r[:_ROUTE_FIELDS] for r in rows_from]
    _check_flags(comm, digests, problem, op)
    _check_digests(comm, digests, True, op)
    n = _ROUTE_FIELDS
    count_meta_bytes(meta_bytes)
    return Counts(
        topk_idx=topk_idx,
        num_chunks=C,
        per_rank=tuple(per_rank),
        local=local,
        valid_pos=valid_pos,
        copy_expert=e,
        row_of_copy=row_of_copy,
        row_cell=key // Tm,
        row_tok=key % Tm,
        counts_from=tuple(tuple(r[H:]) for r in rows_from),
        rows_to=tuple(tuple(r) for r in rows_wc.tolist()),
        recv_rows=tuple(sum(r[n + d] for r in rows_from) for d in range(W)),
        recv_copies=tuple(sum(r[n + W + d] for r in rows_from) for d in range(W)),
        meta_bytes=meta_bytes,
    )


def plan_dispatch(
    comm: DispatchComm,
    counts: Counts,
    topk_weights: Optional[torch.Tensor],
    *,
    dtype: torch.dtype,
    hidden: int,
    wire_policy: Optional[str] = None,
    room: int = 0,
    check_rooms: Optional[Callable[[List[int]], None]] = None,
    problem: Optional[str] = None,
    op: str = "dispatch",
) -> Plan:
    """Plan one dispatch of a routing (collective: the metadata exchange; step 3 and the layout).

    Args:
        comm: the communicator.
        counts: the routing's :func:`exchange_counts`.
        topk_weights: ``[T, k]`` float; they travel exactly (:mod:`~hetcomm.backends.tokens.wire`);
            None with ``problem``.
        dtype: the rows' dtype; hidden: ``D``: the call's digest (and the rows' wire dtypes).
        wire_policy: the rows' wire-dtype policy (None: the communicator's own).
        room: this rank's receive room (a face's; ``check_rooms`` gets every rank's).
        check_rooms: called with ``[W]`` every rank's ``room`` before any row moves (it raises
            on every rank alike).
        problem: this rank rejected its arguments (the message): it takes part, and every rank
            raises :class:`UsageError`.
        op: the verb named in errors.

    Returns:
        The :class:`Plan` (expert rows as output rows); counted in :func:`counters`.

    Raises:
        UsageError: ``problem`` on some rank (every rank raises).
        CrossRankMismatch: the ranks' hidden sizes, dtypes or wire dtypes differ (every rank).
    """
    W, rank = comm.world_size, comm.rank
    idx = counts.topk_idx
    T, k = idx.shape
    C = counts.num_chunks
    dev = idx.device
    per_rank = list(counts.per_rank)
    L = per_rank[rank]
    counts_from, rows_to = counts.counts_from, counts.rows_to
    valid_pos, e, row_of_copy = counts.valid_pos, counts.copy_expert, counts.row_of_copy
    row_cell, row_tok = counts.row_cell, counts.row_tok
    if problem is not None or topk_weights is None:
        topk_weights = torch.zeros((T, k), dtype=torch.float32, device=dev)

    # Metadata per token row, [U, k, 2] int32: (float32 bits of the weight, local expert or -1).
    U = row_cell.numel()
    meta = torch.full((U, k, 2), -1, dtype=torch.int32, device=dev)
    if U:
        meta[row_of_copy, valid_pos % k, 0] = encode_weights(topk_weights.reshape(-1)[valid_pos])
        meta[row_of_copy, valid_pos % k, 1] = counts.local[e].to(torch.int32)

    recv_rows = [[counts_from[s][c] if s != rank else 0 for s in range(W)] for c in range(C)]
    send_rows = [[rows_to[d][c] if d != rank else 0 for d in range(W)] for c in range(C)]
    num_own = [rows_to[rank][c] for c in range(C)]
    recv_counts = [sum(counts_from[s][C + l] for s in range(W)) for l in range(L)]
    bounds = _chunk_bounds(L, C)

    # 3. Metadata of the remote rows (destination-major, then chunk, then token), each peer's
    # block behind the call's digest: one exchange of int32 words.
    wire = row_wires(comm, dtype, wire_policy)
    digest = _call_digest(problem is not None, room, hidden, dtype, wire)
    head = torch.tensor(digest, dtype=torch.int64, device=dev).view(torch.int32)  # [2H] words
    Hw = head.numel()
    remote = (row_cell // C) != rank
    meta_bytes = counts.meta_bytes
    if W > 1:
        send_split = [sum(rows_to[d]) * 2 * k if d != rank else 0 for d in range(W)]
        recv_split = [sum(counts_from[s][:C]) * 2 * k if s != rank else 0 for s in range(W)]
        rows = meta[remote].reshape(-1)
        parts, off = [], 0
        for d in range(W):
            if d != rank:
                parts += [head, rows[off : off + send_split[d]]]
            off += send_split[d]
        # Pairs of int32 words (every block is an even number of them): 8-byte rows, which the
        # exchange sends and receives in place.
        got = exchange_ints(
            comm, torch.cat(parts).view(-1, 2), [(n + Hw) // 2 if d != rank else 0 for d, n in enumerate(send_split)],
            [(n + Hw) // 2 if s != rank else 0 for s, n in enumerate(recv_split)], 2, "metadata",
        ).view(-1)
        meta_bytes += (sum(send_split) + Hw * (W - 1)) * 4
        heads, blocks, off = [], [], 0
        for s in range(W):
            if s != rank:
                heads.append(got[off : off + Hw])
                blocks.append(got[off + Hw : off + Hw + recv_split[s]])
                off += Hw + recv_split[s]
        theirs = torch.stack(heads).view(torch.int64).tolist()  # host synchronisation (the checks)
        digests = theirs[:rank] + [digest] + theirs[rank:]
        rmeta = torch.cat(blocks).view(-1, k, 2)
        recv_split = [n // (2 * k) if k else 0 for n in recv_split]
    else:
        digests = [digest]
        recv_split = [0]
        rmeta = meta[:0]
    _check_flags(comm, digests, problem, op)
    if check_rooms is not None:
        check_rooms([d[1] for d in digests])
    _check_digests(comm, digests, False, op)
    src_off = [sum(recv_split[:s]) for s in range(W)]

    row_chunk = row_cell % C
    send_token, slot_index, own_expand, chunk_rows, recv_w = [], [], [], [], []
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
        wts = decode_weights(m[:, :, 0].reshape(-1))
        sel = (loc >= 0).nonzero().flatten()
        sidx = sel[torch.argsort(loc[sel], stable=True)]  # expert-major; inside: other sources in order, own rows last
        rows = sidx // k  # [R_c] each copy's row in the received token rows (own rows last)
        slot_index.append(sidx)
        recv_w.append(wts[sidx])
        chunk_rows.append(sum(recv_counts[bounds[c][0] : bounds[c][1]]))
        # Nothing received from other ranks: expand straight from x (no gather of own rows).
        Ur = sum(recv_rows[c])
        own_expand.append(own_tok[rows] if Ur == 0 else None)
        rc, a = [], 0
        for l in range(bounds[c][0], bounds[c][1]):
            n_own = counts_from[rank][C + l]
            n_rem = sum(counts_from[s][C + l] for s in range(W)) - n_own
            rc.append((a, n_rem, n_own))
            a += n_rem + n_own
        runs.append(tuple(rc))
        if Ur:
            # Stable: the remote positions first, in order (expert by expert), then the own ones.
            order = torch.argsort((rows >= Ur).to(torch.int8), stable=True)
            n_rem_all = sum(r[1] for r in rc)
            remote_src.append(rows[order[:n_rem_all]])
            own_src.append(own_tok[rows[order[n_rem_all:]] - Ur])
        else:
            remote_src.append(None)
            own_src.append(own_expand[-1])  # every run is own rows: the same tokens, expert by expert
    count_plan(meta_bytes - counts.meta_bytes)
    return Plan(
        num_tokens=T,
        num_topk=k,
        rank=rank,
        world_size=W,
        send_splits=tuple(tuple(r) for r in send_rows),
        recv_splits=tuple(tuple(r) for r in recv_rows),
        send_token=tuple(send_token),
        num_own=tuple(num_own),
        slot_index=tuple(slot_index),
        own_expand=tuple(own_expand),
        runs=tuple(runs),
        remote_src=tuple(remote_src),
        own_src=tuple(own_src),
        chunk_rows=tuple(chunk_rows),
        wire=wire,
        recv_weights=torch.cat(recv_w),
        recv_counts=tuple(recv_counts),
        recv_counts_per_source=tuple(tuple(counts_from[s][C:]) for s in range(W)),
        chunk_experts=tuple(bounds),
        meta_bytes=meta_bytes,
    )
