"""Top-k softmax gating with capacity, a dropless mode and optional load-aware calibration.

Notation: ``T`` tokens on this rank, ``E`` experts, ``k`` experts per token, ``D`` model dim.

Capacity (per expert, per rank, in token copies) is ``ceil(T * k / E * capacity_factor)``.
Copies beyond it are dropped: that expert contributes nothing for the token, and a token whose
every copy is dropped comes out of the layer as zeros, so the block's residual (``x + moe(x)``)
passes it through unchanged. First choices claim capacity before second choices, and earlier
tokens before later ones (GShard's order). ``dropless=True`` never drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hetcomm.backends import rowpool as buffers
from hetcomm.moe.gate_calibration import LoadCalibrator

__all__ = ["GateOutput", "TopKGate", "expert_capacity"]


class _RouterLinear(torch.autograd.Function):
    """``x @ weight.T`` whose input gradient lands in a recycled buffer.

    The input gradient is a full ``[T, D]`` tensor every step (16 MiB at T=4096, D=1024); a fresh
    one is page-faulted in anew each time (see :mod:`hetcomm.backends.rowpool`).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = buffers.empty(x.shape, grad.dtype, grad.device)
            torch.mm(grad, weight, out=gx)
        if ctx.needs_input_grad[1]:
            gw = grad.t().mm(x)
        return gx, gw


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """``ceil(num_tokens * k / num_experts * capacity_factor)``: token copies one expert takes."""
    return int(math.ceil(num_tokens * k / num_experts * capacity_factor))


@dataclass
class GateOutput:
    """What the gate decided for ``T`` tokens.

    Attributes:
        topk_idx: ``[T, k]`` int64, chosen experts, best first.
        topk_weights: ``[T, k]`` float32, combine weights (with grad).
        probs: ``[T, E]`` float32, routing probabilities after calibration (with grad).
        capacity: token copies per expert, or None in dropless mode.
        l_aux: scalar float32 load-balancing loss (Switch/GShard form), with grad.
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    probs: torch.Tensor
    capacity: Optional[int]
    l_aux: torch.Tensor


class TopKGate(nn.Module):
    """Linear router + top-k softmax.

    Args:
        model_dim: ``D``.
        num_experts: ``E``.
        k: experts per token (``1 <= k <= E``).
        capacity_factor: slack over a perfectly even split.
        dropless: never drop a token (capacity ignored).
        normalize_topk: rescale the ``k`` weights of a token to sum to 1 (for ``k > 1``).
        calibrator: a :class:`LoadCalibrator`, or None for no calibration.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 2,
        capacity_factor: float = 1.25,
        dropless: bool = False,
        normalize_topk: bool = True,
        calibrator: Optional[LoadCalibrator] = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.dropless = dropless
        self.normalize_topk = normalize_topk
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.calibrator = calibrator

    def forward(self, x: torch.Tensor) -> GateOutput:
        """Route ``x``.

        Args:
            x: ``[T, D]`` tokens, any float dtype.
        Returns:
            A :class:`GateOutput`; routing math is done in float32 whatever ``x.dtype`` is.
        """
        # Routing in fp32: top-k on fp16 logits flips near-ties differently per rank/dtype.
        logits = _RouterLinear.apply(x.float(), self.wg.weight.float())
        if self.calibrator is not None:
            logits = self.calibrator.apply(logits)
        probs = torch.softmax(logits, dim=-1)
        topk_weights, topk_idx = probs.topk(self.k, dim=-1)
        if self.normalize_topk and self.k > 1:
            topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True).clamp_min(1e-20)
        T = x.size(0)
        if T > 0:
            # Switch/GShard auxiliary loss: E * sum_e mean_prob_e * fraction_of_picks_e.
            picks = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts).float()
            l_aux = self.num_experts * torch.sum(probs.mean(0) * picks / (T * self.k))
        else:
            l_aux = probs.sum() * 0.0
        capacity = None if self.dropless else expert_capacity(T, self.num_experts, self.k, self.capacity_factor)
        return GateOutput(topk_idx, topk_weights, probs, capacity, l_aux)
