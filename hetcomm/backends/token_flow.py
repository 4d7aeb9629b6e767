"""The two directions of a token dispatch, its in-flight state, its Works and its autograd
functions (steps 4-5 of :mod:`hetcomm.backends.token_dispatch`'s notation, and ``combine``).

``_Send`` moves chunk ``c``'s token rows from senders to receivers (dispatch, and the backward
of combine); ``_Return`` moves them back, summed per token (combine, and the backward of
dispatch). The plan (:mod:`hetcomm.backends.token_plan`) decides every split; nothing here plans.
"""

from __future__ import annotations

import bisect
import time
from typing import List, Optional, Sequence, Tuple

import torch

from hetcomm.backends import rowpool
from hetcomm.backends.token_exchange import _BLOCK_ROWS, DispatchComm, _counters, _remote_bytes, _Rows
from hetcomm.backends.token_plan import _Plan

__all__ = ["DispatchWork", "CombineWork"]


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


