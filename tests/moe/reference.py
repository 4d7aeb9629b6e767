"""A deliberately plain single-process MoE, the yardstick for ``MoELayer``.

Loops over experts with boolean masks: slow, obvious, and independent of the layer's sort-based
routing, chunking, all-to-all and replication code.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn


def reference_moe(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    experts: Sequence[nn.Module],
    k: int,
    capacity_factor: Optional[float],
):
    """Output ``[T, D]`` and l_aux of a top-k MoE on one rank's tokens ``x`` (``[T, D]``).

    ``capacity_factor=None`` means dropless. Capacity is claimed first choices first, then by
    token order (GShard).
    """
    T, D = x.shape
    E = len(experts)
    probs = torch.softmax(x.float() @ gate_weight.float().t(), dim=-1)
    w, idx = probs.topk(k, dim=-1)
    if k > 1:
        w = w / w.sum(-1, keepdim=True)
    keep = torch.ones(T, k, dtype=torch.bool)
    if capacity_factor is not None:
        cap = math.ceil(T * k / E * capacity_factor)
        used = [0] * E
        for j in range(k):
            for t in range(T):
                e = int(idx[t, j])
                if used[e] >= cap:
                    keep[t, j] = False
                else:
                    used[e] += 1
    out = torch.zeros(T, D, dtype=x.dtype)
    for e in range(E):
        for j in range(k):
            m = (idx[:, j] == e) & keep[:, j]
            if m.any():
                rows = m.nonzero().flatten()
                out = out.index_add(0, rows, experts[e](x[rows]) * w[rows, j : j + 1].to(x.dtype))
    picks = torch.bincount(idx.reshape(-1), minlength=E).float()
    l_aux = E * torch.sum(probs.mean(0) * picks / (T * k))
    return out, l_aux, int((~keep).sum())
