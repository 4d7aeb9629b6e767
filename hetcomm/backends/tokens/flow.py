"""The two directions of a token dispatch, its runs, its Works and its autograd functions
(steps 4-5 of :mod:`hetcomm.backends.tokens`' notation, and ``combine``), for both faces.

``_Send`` moves chunk ``c``'s token rows from senders to receivers (dispatch, and the backward
of combine); ``_Return`` moves them back, summed per token (combine, and the backward of
dispatch). :class:`DispatchRun` and :class:`CombineRun` put them together over the plan's
output rows (expert rows, or the token rows of :meth:`Plan.as_token_rows`); the plan
(:mod:`hetcomm.backends.tokens.plan`) decides every split, nothing here plans.
"""

from __future__ import annotations

import bisect
import time
from typing import List, Optional, Sequence, Tuple

import torch

from hetcomm.backends import rowpool
from hetcomm.backends.tokens.exchange import DispatchComm, RowExchange, count_meta, count_rows
from hetcomm.backends.tokens.plan import Plan
from hetcomm.backends.tokens.wire import WEIGHT_WIRE, exact_wires

_BLOCK_ROWS = 256  # rows per block of the weighted sums (a block and its scratch stay in cache)

__all__ = ["Pieces", "DispatchRun", "CombineRun", "DispatchWork", "CombineWork", "DispatchFn", "CombineFn"]


# ----------------------------------------------------------------------------------------------
# The two directions of one chunk, shared by dispatch, combine and their backwards


class _Send:
    """Chunk ``c``'s token rows of ``src [T, D]`` from senders to receivers (dispatch direction).

    Receiver side: ``full`` (``[U_recv, D]``) holds the rows from other ranks; None when nothing
    came from them. Own rows are never staged: readers take them from ``src`` (``own_src``).
    ``into``: receive straight into these rows (``[U_recv, D]``, contiguous) instead of a
    staging block.
    """

    def __init__(self, comm: DispatchComm, plan: Plan, c: int, src: torch.Tensor, tag: str, into: Optional[torch.Tensor] = None):
        Ur = plan.num_recv(c)
        Us = plan.num_remote_sent(c)
        D = src.size(1)
        self.full = None
        self.ex: Optional[RowExchange] = None
        if Ur:
            self.full = into if into is not None else rowpool.empty((Ur, D), src.dtype, src.device)
        if plan.world_size > 1:  # a collective: every rank takes part, with or without rows
            self.ex = RowExchange(comm, plan.send_splits[c], plan.recv_splits[c], plan.wire, src.dtype, D, tag)
            out = self.full if self.full is not None else src.new_empty((0, D))
            self.ex.start(src, plan.send_token[c][:Us], out)

    def wait(self) -> None:
        if self.ex is not None:
            self.ex.wait()


class _Return:
    """Chunk ``c``'s token rows from other ranks, ``full`` (``[U_recv, D]``, or None with
    ``U_recv == 0``), back to their senders (combine direction), added into ``out [T, D]`` per
    token on :meth:`wait`. The caller adds the own rows' share itself."""

    def __init__(self, comm: DispatchComm, plan: Plan, c: int, full: Optional[torch.Tensor], out: torch.Tensor, tag: str):
        self.plan, self.c, self.out = plan, c, out
        self.Us = plan.num_remote_sent(c)
        self.ex: Optional[RowExchange] = None
        D = out.size(1)
        if plan.world_size > 1:
            self.back = rowpool.empty((self.Us, D), out.dtype, out.device)
            send = full if full is not None else out.new_empty((0, D))
            self.ex = RowExchange(comm, plan.recv_splits[c], plan.send_splits[c], plan.wire, out.dtype, D, tag)
            self.ex.start(send, None, self.back)

    def wait(self) -> None:
        if self.ex is None:
            return
        self.ex.wait()
        if self.Us:
            self.out.index_add_(0, self.plan.send_token[self.c][: self.Us], self.back)
        self.ex = None


def _segments(plan: Plan, c: int):
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


class Pieces:
    """The ``[R, D]`` rows of one side of a dispatch, held as one tensor or as ``L`` per-expert
    pieces (``split_by_expert``): :meth:`rows` reads any run of rows inside one piece, so that
    expert outputs and their gradients never need a concatenation.

    Args:
        parts: one ``[R', D]`` tensor (``R' >= R``: rows past the plan's are never read), or
            ``L`` tensors ``[sizes[l], D]``.
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


def _weighted_rows(y: torch.Tensor, wc: torch.Tensor, index: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """``out[index[i]] += wc[i] * y[i]`` (``wc``: ``[S, 1]`` in ``y``'s dtype), block by block
    through ``scratch`` (``[_BLOCK_ROWS, D]``; a block stays in cache)."""
    S = y.size(0)
    for i in range(0, S, _BLOCK_ROWS):
        j = min(S, i + _BLOCK_ROWS)
        out.index_add_(0, index[i:j], torch.mul(y[i:j], wc[i:j], out=scratch[: j - i]))


def _slots_back(comm: DispatchComm, plan: Plan, grad_w: torch.Tensor) -> torch.Tensor:
    """``[R]`` float32 gradients of the received weights -> ``[T, k]`` float32, per slot."""
    T, k = plan.num_tokens, plan.num_topk
    dev = grad_w.device
    gw = torch.zeros(T * k, dtype=WEIGHT_WIRE, device=dev)
    slots = torch.arange(k, dtype=torch.int64, device=dev)
    off = 0
    for c in range(plan.num_chunks):
        n = int(plan.slot_index[c].numel())  # the expert rows of chunk c
        g = grad_w[off : off + n]
        off += n
        Ur = plan.num_recv(c)
        full = torch.zeros(((Ur + plan.num_own[c]) * k,), dtype=WEIGHT_WIRE, device=dev)
        full.index_add_(0, plan.slot_index[c], g)
        tok = plan.send_token[c]
        rows = full.view(-1, k)
        if plan.world_size > 1:
            back = torch.empty((plan.num_remote_sent(c), k), dtype=WEIGHT_WIRE, device=dev)
            ex = RowExchange(comm, plan.recv_splits[c], plan.send_splits[c], exact_wires(comm, WEIGHT_WIRE), WEIGHT_WIRE, k, "weights-backward")
            ex.start(rows[:Ur], None, back)
            ex.wait()
            count_meta(ex, plan.rank)
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


class DispatchRun:
    """One dispatch of rows over a plan: launched by :meth:`launch`, completed chunk by chunk
    (:meth:`finish_chunk`); what it keeps for backward.

    Args:
        comm: the communicator.
        plan: the plan; its output rows are what :meth:`launch` fills.
        weight_dtype: the dtype of the routing weights (their gradient's dtype).
        rows: rows of the output :meth:`launch` allocates (None: the plan's; more: the rows
            past the plan's are zeros).
        tag: names the exchange in errors.
    """

    def __init__(self, comm: DispatchComm, plan: Plan, weight_dtype: torch.dtype = WEIGHT_WIRE, rows: Optional[int] = None, tag: str = "dispatch"):
        self.comm, self.plan, self.weight_dtype = comm, plan, weight_dtype
        self.rows, self.tag = rows, tag
        self.sends: List[Optional[_Send]] = []
        self.x: Optional[torch.Tensor] = None
        self.recv_x: Optional[torch.Tensor] = None
        self.bytes_sent = self.bytes_recv = 0

    def launch(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Start sending ``x [T, D]``'s rows; returns the output rows (``out`` if given:
        ``[R' >= R, D]`` contiguous, rows past the plan's zeroed), valid per chunk after
        :meth:`finish_chunk`."""
        plan = self.plan
        self.x = x
        R = sum(plan.chunk_rows)
        if out is None:
            out = rowpool.empty((self.rows or R, x.size(1)), x.dtype, x.device)
        if out.size(0) > R:
            with torch.no_grad():
                out[R:].zero_()
        # Chunks are written after the output has left autograd's hands, while earlier chunks may
        # already be saved for backward by the experts: write through an alias with a version
        # counter of its own, or autograd would call those saved slices modified. Safe because
        # no row is read before its chunk's wait.
        self.recv_x = _alias(out)
        off = 0
        for c, n in enumerate(plan.chunk_rows):
            # Token rows as output rows: the rows from other ranks land in place, no staging.
            into = self.recv_x[off : off + plan.num_recv(c)] if plan.token_rows else None
            self.sends.append(_Send(self.comm, plan, c, x, self.tag, into))
            off += n
        for snd in self.sends:
            sent, recv = count_rows(snd.ex, plan.rank)
            self.bytes_sent += sent
            self.bytes_recv += recv
        return out

    def finish_chunk(self, c: int) -> None:
        """Wait for chunk ``c``'s rows and put them in place (idempotent)."""
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
                        if remote and plan.token_rows:
                            continue  # received in place
                        torch.index_select(snd.full if remote else self.x, 0, idx, out=dst[start : start + n])
        self.sends[c] = None
        if all(v is None for v in self.sends):
            self.x = None  # do not keep the input alive past the last chunk

    def finish(self) -> None:
        """Every chunk (:meth:`finish_chunk`)."""
        for c in range(len(self.sends)):
            self.finish_chunk(c)


class DispatchWork:
    """Completion of an async :func:`dispatch`.

    Rows of chunk ``c`` in ``recv_x`` are valid after :meth:`wait_chunk` ``(c)``; :meth:`wait`
    waits for every chunk. Chunks can be waited in any order; each rank's waits are local (the
    exchanges were all launched by :func:`dispatch`).

    Attributes:
        exposed_s: seconds spent blocked in waits so far.
    """

    def __init__(self, state: DispatchRun) -> None:
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


class CombineRun:
    """One combine of rows over a plan: each receiver sums its output rows per token row
    (weighted, or not), returns the sums, the sender adds them per token.

    Args:
        comm: the communicator.
        plan: the plan whose output rows are summed.
        tag: names the exchange in errors.
    """

    def __init__(self, comm: DispatchComm, plan: Plan, tag: str = "combine"):
        self.comm, self.plan, self.tag = comm, plan, tag
        self.returns: List[_Return] = []
        self.bytes_sent = self.bytes_recv = 0

    def launch(self, y: Pieces, w: Optional[torch.Tensor], ref: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Start the combine of the output rows ``y`` (``[R, D]`` in pieces) weighted by
        ``w [R]`` (None: unweighted); ``ref`` gives the output dtype, width and device.
        Returns the ``[T, D]`` output (``out`` if given, overwritten), complete after
        :meth:`finish`."""
        plan = self.plan
        D, dt, dev = ref.size(1), ref.dtype, ref.device
        if out is None:
            result = rowpool.zeros((plan.num_tokens, D), dt, dev)
        else:
            result = out
            with torch.no_grad():
                result.zero_()
        acc = _alias(result)  # returns are added after the fact (see DispatchRun.launch)
        wc = None if w is None else w.unsqueeze(1).to(dt)
        scratch = None if w is None else torch.empty((_BLOCK_ROWS, D), dtype=dt, device=dev)
        off = 0
        for c, n in enumerate(plan.chunk_rows):
            Ur = plan.num_recv(c)
            full = None
            if Ur and plan.token_rows and wc is None:
                full = y.rows(off, Ur).contiguous()  # the token rows themselves go back
            elif Ur:
                full = rowpool.zeros((Ur, D), dt, dev)
            for start, m, remote, idx in _segments(plan, c):
                if remote and full is not None and plan.token_rows and wc is None:
                    continue
                a = off + start
                dst = full if remote else acc
                if wc is None:
                    dst.index_add_(0, idx, y.rows(a, m))
                else:
                    _weighted_rows(y.rows(a, m), wc[a : a + m], idx, dst, scratch)
            off += n
            ret = _Return(self.comm, plan, c, full, acc, self.tag)
            sent, recv = count_rows(ret.ex, plan.rank)
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

    def __init__(self, state: CombineRun) -> None:
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


class DispatchFn(torch.autograd.Function):
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
        w_out = recv_w.view_as(recv_w)
        if not ctx.needs_input_grad[1]:
            # Weights without a gradient: a combine over them then skips the weight gradients.
            ctx.mark_non_differentiable(w_out)
        return (w_out,) + tuple(outs)

    @staticmethod
    def backward(ctx, grad_recv_w, *grads):  # type: ignore[override]
        st: DispatchRun = ctx.state
        plan, comm = st.plan, st.comm
        gx = gw = None
        if ctx.needs_input_grad[0]:
            g = [t.contiguous() for t in grads]
            ref = g[0].new_empty((0, ctx.width))
            run = CombineRun(comm, plan, "dispatch-backward")
            gx = run.launch(Pieces(g, ctx.sizes or [g[0].size(0)]), None, ref)
            run.finish()
        if ctx.needs_input_grad[1]:
            gw = _slots_back(comm, plan, grad_recv_w.float()).to(st.weight_dtype)
        return gx, gw, None, None, None


class CombineFn(torch.autograd.Function):
    """``(recv_weights [R] or None, y [R', D] or its per-expert pieces) -> out [T, D]``, per
    token the sum of ``w * y`` (or of ``y``) over its output rows. Backward (a dispatch):
    ``grad_y = w * grad_out[token]`` (in the pieces' shapes, views of one buffer; rows past the
    plan's get zeros), ``grad_w = <grad_out[token], y>``."""

    @staticmethod
    def forward(ctx, recv_w, state, sizes, *ys):  # type: ignore[override]
        ctx.state, ctx.sizes = state, sizes
        ctx.weighted, ctx.num_parts, ctx.rows = recv_w is not None, len(ys), ys[0].size(0)
        if recv_w is not None:  # the weight gradients read y; unweighted, nothing is kept
            ctx.save_for_backward(recv_w, *ys)
        return state.launch(Pieces(ys, sizes or [ys[0].size(0)]), recv_w, ys[0])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        st: CombineRun = ctx.state
        plan, comm = st.plan, st.comm
        w, *ys = ctx.saved_tensors if ctx.weighted else (None,)
        y = Pieces(ys, ctx.sizes or [ctx.rows]) if ys else None
        grad_out = grad_out.contiguous()
        need_w, need_y = ctx.weighted and ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:])
        R = sum(plan.chunk_rows)
        rows = R if ctx.sizes else max(R, ctx.rows)
        gy = rowpool.empty((rows, grad_out.size(1)), grad_out.dtype, grad_out.device) if need_y else None
        if gy is not None and rows > R:
            gy[R:].zero_()
        gw = torch.empty(R, dtype=torch.float32, device=grad_out.device) if need_w else None
        wc = w.unsqueeze(1).to(grad_out.dtype) if w is not None else None
        # Token rows, unweighted: the gradient rows from other ranks are the result, in place.
        in_place = plan.token_rows and wc is None and gy is not None
        sends, off = [], 0
        for c in range(plan.num_chunks):
            into = gy[off : off + plan.num_recv(c)] if in_place else None
            sends.append(_Send(comm, plan, c, grad_out, "combine-backward", into))
            off += plan.chunk_rows[c]
        dt, dev, D = grad_out.dtype, grad_out.device, grad_out.size(1)
        # Per block of 256 copies: the gradient of each copy's token sum, gathered once into a
        # scratch that stays in cache, then both products.
        gb_all = torch.empty((_BLOCK_ROWS, D), dtype=dt, device=dev)
        prod_all = torch.empty((_BLOCK_ROWS, D), dtype=dt, device=dev) if need_w else None
        off = 0
        for c, snd in enumerate(sends):
            count_rows(snd.ex, plan.rank)
            snd.wait()
            for start, m, remote, idx in _segments(plan, c):
                src = snd.full if remote else grad_out
                if wc is None:  # unweighted: the gradient rows themselves
                    if need_y and not (remote and in_place):
                        torch.index_select(src, 0, idx, out=gy[off + start : off + start + m])
                    continue
                ym = y.rows(off + start, m) if need_w else None
                for i in range(0, m, _BLOCK_ROWS):
                    j = min(m, i + _BLOCK_ROWS)
                    a, b = off + start + i, off + start + j
                    gb = torch.index_select(src, 0, idx[i:j], out=gb_all[: j - i])
                    if need_w:
                        prod = torch.mul(gb, ym[i:j], out=prod_all[: j - i])
                        torch.sum(prod, 1, dtype=torch.float32, out=gw[a:b])
                    if need_y:
                        torch.mul(gb, wc[a:b], out=gy[a:b])
            off += plan.chunk_rows[c]
        if gy is None:
            gys: Tuple[Optional[torch.Tensor], ...] = (None,) * ctx.num_parts
        else:
            gys = (gy,) if ctx.sizes is None else tuple(gy.split(ctx.sizes))
        return (gw, None, None) + gys
