"""What the MoE benchmarks share: Zipf(s)-skewed routing that any top-k gate reproduces exactly,
and the expert FFN of the issue (``Linear(D, F) + GELU + Linear(F, D)``).

Imported by ``moe_vs_deepspeed.py`` and ``moe_emulated.py`` (run as scripts, so this directory is
on ``sys.path``).
"""

from __future__ import annotations

ZIPF_S = 1.2


def zipf_probs(num_experts: int, s: float = ZIPF_S):
    """``[E]`` float64 Zipf(s) probabilities ``p_e ~ (e + 1)^-s``."""
    import torch

    p = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -s
    return p / p.sum()


def zipf_gate_weight(num_experts: int, model_dim: int):
    """``[E, D]`` float32 gate weight that turns :func:`zipf_input` into Zipf routing.

    With input feature 0 constant 1 and features ``1..E`` i.i.d. Gumbel(0, 1), this weight makes
    the logits ``log p_e + g_e``: by the Gumbel-max trick the first choice is exactly
    Zipf(1.2)-distributed and the second a draw without replacement from the rest (Plackett-Luce).
    The gate has no bias, so the constant feature carries the bias ``log p_e``.

    Raises:
        ConfigError: ``model_dim < num_experts + 1``.
    """
    import torch

    from hetcomm.errors import ConfigError

    if model_dim < num_experts + 1:
        raise ConfigError(
            f"Zipf routing needs model_dim >= num_experts + 1 (one constant feature plus one Gumbel "
            f"feature per expert), got D={model_dim}, E={num_experts}; pick a wider layer",
            key="bench.model_dim",
        )
    w = torch.zeros(num_experts, model_dim)
    w[:, 0] = torch.log(zipf_probs(num_experts)).float()
    w[:, 1 : 1 + num_experts] = torch.eye(num_experts)
    return w


def zipf_input(num_tokens: int, num_experts: int, model_dim: int, generator):
    """``[T, D]`` float32 tokens: N(0, 1) features, feature 0 = 1, features ``1..E`` Gumbel(0, 1)."""
    import torch

    x = torch.randn(num_tokens, model_dim, generator=generator)
    x[:, 0] = 1.0
    u = torch.rand(num_tokens, num_experts, generator=generator).clamp(1e-9, 1 - 1e-9)
    x[:, 1 : 1 + num_experts] = -torch.log(-torch.log(u))
    return x


def expert_ffn(model_dim: int, hidden_dim: int):
    """The issue's expert: ``Sequential(Linear(D, F), GELU(), Linear(F, D))``."""
    from torch import nn

    return nn.Sequential(nn.Linear(model_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, model_dim))
