"""Load-aware gate calibration: push tokens away from experts that are globally overloaded.

The field recipe: keep an EMA of each expert's *global* load (summed over all ranks by an
all-reduce: local statistics make skew worse, since every rank then corrects for its own noise),

    history_e <- 0.95 * history_e + 0.05 * load_e
    penalty_e  = lag * w_e * log(1 + history_e),   lag = 1 + 0.1 * (max(history) - min(history))
    logits'    = logits - penalty

where ``w`` is a per-expert calibration weight that is an ``nn.Parameter`` frozen during
training (``requires_grad=False``: it is saved with the model and can be tuned between runs, but
the optimizer never moves it), and ``lag`` compensates for the EMA trailing the real load.

``load_e`` is the sum of routing probabilities over every token of the step, on all ranks,
*normalised by the fair share* ``num_tokens / E``: 1.0 means "exactly its share", 10.0 "ten
times its share". A raw sum would make the penalty depend on the batch size, and with
thousands of tokens per step the lag factor ``1 + 0.1 * (max - min)`` would grow into the
hundreds; in fair-share units it is ``~1`` when balanced and ``~2`` for an expert at ten times
its share. The probabilities are the *calibrated* ones (after the penalty): the loop closes on
the load the router actually produces.
"""

from __future__ import annotations


import torch
from torch import nn

__all__ = ["LoadCalibrator"]


class LoadCalibrator(nn.Module):
    """EMA of global per-expert load and the logit penalty derived from it.

    Args:
        num_experts: ``E``.
        decay: EMA decay (0.95 in the field recipe).
        lag_coef: coefficient of the lag compensation (0.1).
        strength: initial value of every calibration weight ``w_e`` (1.5: see ``MoEConfig``).
        enabled: apply the penalty (the history is still tracked when disabled, so that it can be
            switched on later without a cold start).

    Attributes:
        history: buffer ``[E]`` float32, the EMA in fair-share units (starts at 1.0 = balanced).
        weight: frozen parameter ``[E]`` float32, the per-expert calibration weight.
    """

    def __init__(
        self,
        num_experts: int,
        *,
        decay: float = 0.95,
        lag_coef: float = 0.1,
        strength: float = 1.5,
        enabled: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.decay = decay
        self.lag_coef = lag_coef
        self.enabled = enabled
        self.register_buffer("history", torch.ones(num_experts, dtype=torch.float32, device="cpu"))
        self.weight = nn.Parameter(torch.full((num_experts,), float(strength), device="cpu"), requires_grad=False)
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64, device="cpu"))

    def lag_factor(self) -> float:
        """``1 + lag_coef * (max(history) - min(history))``."""
        h = self.history
        return float(1.0 + self.lag_coef * (h.max() - h.min()))

    def penalty(self) -> torch.Tensor:
        """``[E]`` float32 penalty to subtract from the logits (zeros when disabled)."""
        if not self.enabled:
            return torch.zeros_like(self.history)
        h = self.history
        lag = 1.0 + self.lag_coef * (h.max() - h.min())
        return lag * self.weight.detach() * torch.log1p(h)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated logits.

        Args:
            logits: ``[T, E]`` gate logits, any float dtype.
        Returns:
            ``[T, E]`` of ``logits.dtype``: ``logits - penalty`` (the penalty carries no grad).
        """
        if not self.enabled:
            return logits
        return logits - self.penalty().to(logits.dtype)

    @torch.no_grad()
    def update(self, global_prob_sum: torch.Tensor, global_num_tokens: float) -> None:
        """Fold one step's global load into the history.

        Args:
            global_prob_sum: ``[E]`` float, the routing probabilities summed over every token of
                the step on every rank (already all-reduced: identical on all ranks).
            global_num_tokens: tokens of the step over all ranks.
        """
        if global_num_tokens <= 0:
            return
        load = global_prob_sum.float() * (self.num_experts / float(global_num_tokens))
        self.history.mul_(self.decay).add_(load, alpha=1.0 - self.decay)
        self.num_updates += 1

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, decay={self.decay}, lag_coef={self.lag_coef}, enabled={self.enabled}"
