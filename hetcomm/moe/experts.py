"""Experts: the default FFN and the bank of local experts a rank computes.

Notation: ``R`` rows (token copies) received by this rank, sorted by local expert; ``D`` model
dim; ``F`` hidden dim of the FFN; ``L`` local experts.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from hetcomm.errors import ConfigError

__all__ = ["FFNExpert", "ExpertSpec", "build_expert", "ExpertBank"]

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


class ExpertBank(nn.Module):
    """The experts one rank computes, applied to rows sorted by expert.

    Rows of one expert are a contiguous slice, so each expert runs one dense call on exactly its
    tokens: no padding to capacity, no one-hot masks.

    Args:
        experts: the local experts, in local-index order.
    """

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def __len__(self) -> int:
        return len(self.experts)

    def forward_sorted(
        self,
        x: torch.Tensor,
        counts: Sequence[int],
        first: int = 0,
        modules: Optional[Sequence[nn.Module]] = None,
        expert_index: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        """Run experts on consecutive row slices.

        Args:
            x: ``[R, D]`` rows sorted by expert (or in pieces, see ``expert_index``); any float
                dtype.
            counts: rows of each slice, ``sum(counts) == R``.
            first: local index of the expert owning the first slice.
            modules: use these modules instead of the bank's (replicas).
            expert_index: slice ``i`` belongs to expert ``first + expert_index[i]`` (default
                ``i``): several slices may share an expert, e.g. one per source rank.
        Returns:
            ``[R, D]``, same dtype as ``x``.
        """
        mods = self.experts if modules is None else modules
        outs: List[torch.Tensor] = []
        # One split, not a slice per expert: the backward of E slices would allocate and zero-fill
        # E full-size gradient tensors; split's backward is a single cat.
        sizes = [int(n) for n in counts]
        pieces = x.split(sizes, 0) if len(sizes) > 1 else (x,)
        for i, (n, piece) in enumerate(zip(sizes, pieces)):
            if n == 0:
                continue
            outs.append(mods[first + (i if expert_index is None else expert_index[i])](piece))
        if not outs:
            # Keep x in the graph even with no rows, so that every rank's backward has the
            # same collectives (an empty slice still routes a zero-size gradient).
            return x[:0] * 0 if x.size(0) == 0 else x * 0
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
