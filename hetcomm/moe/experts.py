"""Experts: the default FFN and the bank of local experts a rank computes.

Notation: ``R`` rows (token copies) received by this rank, sorted by local expert; ``D`` model
dim; ``F`` hidden dim of the FFN; ``L`` local experts.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hetcomm.errors import ConfigError
from hetcomm.backends import rowpool as buffers

__all__ = ["FFNExpert", "ExpertSpec", "build_expert", "ExpertBank", "split_rows", "cat_rows"]

#: What ``MoELayer(expert=...)`` accepts: a module (deep-copied per expert), a factory
#: ``f(model_dim) -> nn.Module``, or None for the default :class:`FFNExpert`.
ExpertSpec = Union[nn.Module, Callable[[int], nn.Module], None]


class FFNExpert(nn.Module):
    """``Linear(D, F) -> GELU -> Linear(F, D)``.

    Args:
        model_dim: ``D``.
        hidden_dim: ``F`` (default ``4 * D``).
    """

    def __init__(self, model_dim: int, hidden_dim: Optional[int] = None) -> None:
        super().__init__()
        hidden_dim = hidden_dim or 4 * model_dim
        self.fc1 = nn.Linear(model_dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, model_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[N, D]`` -> ``[N, D]``, same dtype."""
        return self.fc2(self.act(self.fc1(x)))


def _reset(module: nn.Module) -> None:
    for m in module.modules():
        fn = getattr(m, "reset_parameters", None)
        if callable(fn):
            fn()


def build_expert(spec: ExpertSpec, model_dim: int, global_id: int, seed: int) -> nn.Module:
    """Build global expert ``global_id``, initialised from ``(seed, global_id)`` alone.

    Every expert's initial weights depend only on the seed and its id, never on the rank or the
    placement: a layer spread over 4 ranks starts from exactly the weights of the same layer on 1.

    Raises:
        ConfigError: ``spec`` is neither a module, a callable nor None, or the factory returned
            something that is not an ``nn.Module``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + 7919 * (global_id + 1))
        if spec is None:
            return FFNExpert(model_dim)
        if isinstance(spec, nn.Module):
            m = copy.deepcopy(spec)
            # A deep copy alone would give E identical experts (a symmetric, degenerate MoE);
            # re-initialise each copy from its own seed.
            _reset(m)
            return m
        if callable(spec):
            m = spec(model_dim)
            if not isinstance(m, nn.Module):
                raise ConfigError(
                    f"the expert factory returned {type(m).__name__}, not an nn.Module; pass a "
                    f"callable f(model_dim) -> nn.Module",
                    key="moe.expert",
                )
            return m
    raise ConfigError(
        f"expert must be an nn.Module, a factory f(model_dim) -> nn.Module or None, got "
        f"{type(spec).__name__}",
        key="moe.expert",
    )


def _block_offsets(counts: Sequence[Sequence[int]]) -> Tuple[List[List[int]], List[List[int]], List[int]]:
    """Offsets of the ``(source s, expert l)`` blocks of ``counts[s][l]`` rows.

    Returns:
        ``(src_off, exp_off, rows_of_expert)``: ``src_off[s][l]`` the block's first row in
        source-major order (``s`` outer, as rows arrive), ``exp_off[s][l]`` in expert-major order
        (``l`` outer, as experts consume them), and each expert's row count.
    """
    W, L = len(counts), len(counts[0]) if counts else 0
    src_off = [[0] * L for _ in range(W)]
    exp_off = [[0] * L for _ in range(W)]
    acc = 0
    for s in range(W):
        for l in range(L):
            src_off[s][l] = acc
            acc += counts[s][l]
    acc = 0
    rows_of_expert = [0] * L
    for l in range(L):
        for s in range(W):
            exp_off[s][l] = acc
            acc += counts[s][l]
            rows_of_expert[l] += counts[s][l]
    return src_off, exp_off, rows_of_expert


def _copy_blocks(dst: torch.Tensor, src: torch.Tensor, counts, dst_off, src_off) -> None:
    for s, row in enumerate(counts):
        for l, n in enumerate(row):
            if n:
                dst.narrow(0, dst_off[s][l], n).copy_(src.narrow(0, src_off[s][l], n))


class _ToExperts(torch.autograd.Function):
    """``[R, D]`` rows in ``(source, expert)`` blocks, source-major -> one ``[n_l, D]`` per expert.

    With one source the blocks already are expert-major and the outputs are views of the input;
    otherwise one pass of block copies into a recycled buffer. Backward: the reverse block copies
    into a recycled buffer (autograd's split would allocate and zero-fill a fresh ``[R, D]``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts, layout) -> Tuple[torch.Tensor, ...]:  # type: ignore[override]
        src_off, exp_off, rows = layout
        ctx.counts, ctx.layout, ctx.shape, ctx.dtype, ctx.device = counts, layout, x.shape, x.dtype, x.device
        if len(counts) > 1:
            em = buffers.empty(x.shape, x.dtype, x.device)
            _copy_blocks(em, x, counts, exp_off, src_off)
            x = em
        return tuple(x.split(rows, 0))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        src_off, exp_off, rows = ctx.layout
        g = buffers.empty(ctx.shape, grads[0].dtype if grads else ctx.dtype, ctx.device)
        if len(ctx.counts) > 1:
            for s, row in enumerate(ctx.counts):
                for l, n in enumerate(row):
                    if n:
                        start = exp_off[s][l] - exp_off[0][l]
                        g.narrow(0, src_off[s][l], n).copy_(grads[l].narrow(0, start, n))
        else:
            off = 0
            for gl, n in zip(grads, rows):
                if n:
                    g.narrow(0, off, n).copy_(gl)
                off += n
        return g, None, None


class _FromExperts(torch.autograd.Function):
    """One ``[n_l, D]`` output per expert -> ``[R, D]`` in ``(source, expert)`` blocks,
    source-major (the order they travel back in), written into a recycled buffer.

    Backward: the reverse; with one source the gradients are views of the incoming gradient.
    """

    @staticmethod
    def forward(ctx, counts, layout, *outs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        src_off, exp_off, rows = layout
        ctx.counts, ctx.layout = counts, layout
        R = sum(rows)
        ref = next(o for o, n in zip(outs, rows) if n)  # an expert that ran: the output dtype
        y = buffers.empty((R,) + tuple(ref.shape[1:]), ref.dtype, ref.device)
        for s, row in enumerate(counts):
            for l, n in enumerate(row):
                if n:
                    start = exp_off[s][l] - exp_off[0][l]
                    y.narrow(0, src_off[s][l], n).copy_(outs[l].narrow(0, start, n))
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        src_off, exp_off, rows = ctx.layout
        if len(ctx.counts) > 1:
            em = buffers.empty(grad.shape, grad.dtype, grad.device)
            _copy_blocks(em, grad, ctx.counts, exp_off, src_off)
            grad = em
        return (None, None) + tuple(grad.split(rows, 0))


def split_rows(x: torch.Tensor, sizes: Sequence[int]) -> Tuple[torch.Tensor, ...]:
    """``x.split(sizes)`` whose backward writes into a recycled buffer.

    Args:
        x: ``[R, D]``; ``sum(sizes) == R``.
    Returns:
        Views ``[sizes[i], D]`` of ``x``.
    """
    sizes = [int(n) for n in sizes]
    return _ToExperts.apply(x, [sizes], _block_offsets([sizes]))


def cat_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts, 0)`` into a recycled buffer (backward: views of the gradient)."""
    sizes = [int(p.size(0)) for p in parts]
    return _FromExperts.apply([sizes], _block_offsets([sizes]), *parts)


class ExpertBank(nn.Module):
    """The experts one rank computes, applied to rows grouped by expert.

    Each expert runs one dense call on exactly its rows: no padding to capacity, no one-hot
    masks. Rows may arrive as ``(source rank, expert)`` blocks (source-major, as an all-to-all
    delivers them): one pass of block copies then makes each expert's rows contiguous, and one
    more puts the outputs back in arrival order. That is cheaper than running every expert once
    per source: at 128 rows per block (E=64, D=1024, F=256, 4 ranks) the per-block calls cost
    ~15% more CPU than one call per expert, mostly in four times as many weight-gradient
    products and their accumulation.

    Args:
        experts: the local experts, in local-index order.
    """

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def __len__(self) -> int:
        return len(self.experts)

    def forward_blocks(
        self,
        x: torch.Tensor,
        counts: Sequence[Sequence[int]],
        first: int = 0,
        modules: Optional[Sequence[nn.Module]] = None,
    ) -> torch.Tensor:
        """Run experts ``first .. first + L - 1`` on rows in ``(source, expert)`` blocks.

        Args:
            x: ``[R, D]`` rows, any float dtype: the blocks ``counts[0][0], counts[0][1], ...,
                counts[1][0], ...`` one after another (source-major).
            counts: ``[W][L]`` rows from source ``s`` for local expert ``first + l``.
            first: local index of the expert of column 0.
            modules: use these modules instead of the bank's (replicas).
        Returns:
            ``[R, D]`` outputs in the same block order as ``x``, same dtype.
        """
        mods = self.experts if modules is None else modules
        counts = [[int(n) for n in row] for row in counts]
        layout = _block_offsets(counts)
        rows = layout[2]
        if sum(rows) == 0:
            # Keep x in the graph even with no rows, so that every rank's backward has the
            # same collectives (an empty slice still routes a zero-size gradient).
            return x * 0
        if len(counts) == 1 and sum(1 for n in rows if n) == 1:
            # One source, one expert with rows: its output already is the whole result.
            l = next(i for i, n in enumerate(rows) if n)
            return mods[first + l](x)
        pieces = _ToExperts.apply(x, counts, layout)
        outs = []
        for l, (n, piece) in enumerate(zip(rows, pieces)):
            # An expert without rows is not called; its block is empty on every side.
            outs.append(mods[first + l](piece) if n else piece)
        return _FromExperts.apply(counts, layout, *outs)

    def forward_pieces(
        self,
        pieces: Sequence[torch.Tensor],
        first: int = 0,
        modules: Optional[Sequence[nn.Module]] = None,
    ) -> List[torch.Tensor]:
        """Run expert ``first + l`` on ``pieces[l]``: the per-expert form that
        ``hetcomm.backends.tokens.dispatch(split_by_expert=True)`` delivers and ``combine`` takes.

        Nothing is copied: each expert reads its piece and its output goes to the combine as
        it is (:meth:`forward_sorted` copies the outputs into one ``[R, D]`` block and, in
        backward, the input gradients into another: two full passes over the rows, ~7 ms of
        CPU per step at 8,192 x 1,024 FP32).

        Args:
            pieces: ``[n_l, D]`` rows of each expert, any float dtype.
            first: local index of the expert of ``pieces[0]``.
            modules: use these modules instead of the bank's (replicas).
        Returns:
            ``[n_l, D]`` outputs, one per piece; an expert without rows is not called and its
            (empty) piece is passed through, so it stays in the graph.
        """
        mods = self.experts if modules is None else modules
        return [mods[first + l](p) if p.size(0) else p for l, p in enumerate(pieces)]

    def forward_sorted(
        self,
        x: torch.Tensor,
        counts: Sequence[int],
        first: int = 0,
        modules: Optional[Sequence[nn.Module]] = None,
    ) -> torch.Tensor:
        """Run experts on consecutive row slices (:meth:`forward_blocks` with one source).

        Args:
            x: ``[R, D]`` rows sorted by expert; any float dtype.
            counts: rows of each expert, ``sum(counts) == R``.
            first: local index of the expert owning the first slice.
            modules: use these modules instead of the bank's (replicas).
        Returns:
            ``[R, D]``, same dtype as ``x``.
        """
        return self.forward_blocks(x, [list(counts)], first, modules)
