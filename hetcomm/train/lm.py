"""A small decoder-only transformer whose feed-forward blocks are hetcomm MoE layers.

Notation: B batch, T sequence length, D model width, V vocabulary, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hetcomm.moe import MoELayer

__all__ = ["LMConfig", "MoETransformerLM"]


@dataclass(frozen=True)
class LMConfig:
    """Shape of the demo model; defaults sized to train in under 3 minutes on 2 cores x 4 ranks."""

    vocab_size: int = 256
    seq_len: int = 64
    model_dim: int = 64  # small: 4 processes share 2 cores
    num_heads: int = 4
    num_layers: int = 2
    num_experts: int = 8
    hidden_dim: int = 128  # expert FFN width
    k: int = 2
    capacity_factor: float = 1.25


class _Block(nn.Module):
    """Pre-norm attention + MoE feed-forward, both residual."""

    def __init__(self, cfg: LMConfig, moe: MoELayer) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.model_dim)
        self.attn = nn.MultiheadAttention(cfg.model_dim, cfg.num_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.model_dim)
        self.moe = moe

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)  # (B, T, D)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.moe(self.ln2(x))  # (B, T, D)


class MoETransformerLM(nn.Module):
    """Token embedding -> ``num_layers`` x (attention, MoE FFN) -> tied output projection.

    Args:
        cfg: model shape.
        make_moe: builds one MoE layer (the caller decides group, replication, wire dtype, ...).
    """

    def __init__(self, cfg: LMConfig, make_moe) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.model_dim))
        self.blocks = nn.ModuleList([_Block(cfg, make_moe(i)) for i in range(cfg.num_layers)])
        self.ln_f = nn.LayerNorm(cfg.model_dim)
        # Small embeddings: the output projection is tied to them, so logits start near zero and
        # the first loss is ~log(V) instead of a huge value from unit-variance embeddings.
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    @property
    def moe_layers(self) -> List[MoELayer]:
        return [b.moe for b in self.blocks]

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """Logits ``[B, T, V]`` float32, and the mean cross-entropy when ``targets`` (``[B, T]``) is given."""
        b, t = tokens.shape
        x = self.embed(tokens) + self.pos[:t]  # (B, T, D)
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.ln_f(x) @ self.embed.weight.t()  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
