"""When to page experts, and whether the copies can hide: ``MoEConfig(page_budget="auto")``.

- **Page only when the experts do not fit.** A rank's experts cost their parameters plus, while
  training, a gradient and Adam's two moments: ``4 x`` the parameter bytes
  (:data:`TRAINING_BYTES_PER_PARAM_BYTE`). On CUDA/NPU the budget is the device's free memory
  (``mem_get_info``) times :data:`MEMORY_FRACTION` (room for activations and the all-to-all
  buffers); when the experts fit there, nothing is paged (budget 0 = off), otherwise the budget is
  the fraction that fits (at least one expert). On CPU ranks host and "device" are the same
  memory, so ``auto`` never pages: the budget is the one a user gives (``page_budget=0.4``).
- **Can the copies hide?** (Megatron-Core's expert-offload rule.) Paging an expert in moves its
  parameter bytes ``2 D F x bytes`` over host-to-device; computing its ``N`` tokens takes
  ``6 N D F`` FLOPs forward + backward. The copy hides behind the compute when
  ``N >= peak FLOPS x bytes_per_param x 2 / (6 x H2D bytes/s)``, i.e. tokens per expert ``>=``
  ``peak FLOPS / H2D bandwidth`` up to the constant; :func:`hide_threshold_tokens` returns the
  plain ratio the issue quotes (A100: 312e12 / 25e9 = 12,480 tokens over PCIe Gen4).
  :func:`copies_can_hide` applies it to a step's tokens per expert; the bandwidth is measured
  (:func:`measure_h2d_bytes_per_s`, a timed pinned copy on the device) or given.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
from torch import nn

__all__ = [
    "MEMORY_FRACTION",
    "TRAINING_BYTES_PER_PARAM_BYTE",
    "auto_page_budget",
    "auto_page_budget_of",
    "hide_threshold_tokens",
    "copies_can_hide",
    "measure_h2d_bytes_per_s",
]

#: Share of the device's free memory the experts may take (the rest: activations, buffers).
MEMORY_FRACTION = 0.8
#: Parameters + gradient + Adam's two moments, per parameter byte.
TRAINING_BYTES_PER_PARAM_BYTE = 4


def auto_page_budget(expert_param_bytes: int, num_local_experts: int, free_device_bytes: Optional[int],
                     training: bool = True) -> float:
    """The page budget (fraction of local experts on the device) ``auto`` picks.

    Args:
        expert_param_bytes: parameter bytes of all this rank's local experts.
        num_local_experts: ``L``.
        free_device_bytes: free memory of the device, or None on a CPU rank (never page).
    Returns:
        0.0 (no paging: they fit, or a CPU rank) or the fraction in ``[1/L, 1)`` that fits.
    """
    if free_device_bytes is None or num_local_experts == 0:
        return 0.0
    need = expert_param_bytes * (TRAINING_BYTES_PER_PARAM_BYTE if training else 1)
    room = free_device_bytes * MEMORY_FRACTION
    if need <= room:
        return 0.0
    return max(1.0 / num_local_experts, room / need)


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device`` (CUDA/NPU; imported lazily), None on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        import torch_npu  # noqa: F401

        return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]
    return None


def hide_threshold_tokens(peak_flops: float, h2d_bytes_per_s: float) -> float:
    """Tokens per expert from which paging's copies can hide behind compute: FLOPS / (bytes/s)."""
    return peak_flops / h2d_bytes_per_s


def copies_can_hide(tokens_per_expert: float, peak_flops: float, h2d_bytes_per_s: Optional[float]) -> Optional[bool]:
    """The step record's verdict, or None when the bandwidth is unknown (a CPU rank)."""
    if h2d_bytes_per_s is None or h2d_bytes_per_s <= 0:
        return None
    return tokens_per_expert >= hide_threshold_tokens(peak_flops, h2d_bytes_per_s)


def auto_page_budget_of(experts: Sequence[nn.Module]) -> float:
    """:func:`auto_page_budget` of a rank's local ``experts`` on the device they were built on
    (``MoEConfig(page_budget="auto")``; a rank without experts: 0)."""
    params = [p for m in experts for p in m.parameters()]
    dev = params[0].device if params else torch.device("cpu")
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return auto_page_budget(nbytes, len(experts), free_device_bytes(dev))


def measure_h2d_bytes_per_s(device: torch.device, num_bytes: int = 64 << 20, repeats: int = 3) -> Optional[float]:
    """Host-to-device bandwidth of a pinned copy on ``device`` (median of ``repeats``), None on CPU."""
    if device.type not in ("cuda", "npu"):
        return None
    mod = torch.cuda if device.type == "cuda" else torch.npu  # type: ignore[attr-defined]
    host = torch.empty(num_bytes, dtype=torch.uint8, device="cpu").pin_memory()  # host: the source of the copy
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        mod.synchronize(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        mod.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return num_bytes / times[len(times) // 2]
