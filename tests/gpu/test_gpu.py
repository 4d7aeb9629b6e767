"""GPU checks (marker ``gpu``; skipped without CUDA). Run them with ``pytest -m gpu`` or
``scripts/device-check``.

- The MoE layer on one CUDA device equals the same layer on CPU (outputs and gradients).
- Two ranks on one host, rank 0 on the CUDA device and rank 1 a CPU process standing for an
  Ascend rank (cluster ``nvidia-ascend-2.yaml``: the pair is cross-vendor, so it goes over the
  bridge; NCCL, which refuses two ranks on one GPU, is not involved): ``all_to_all_single``,
  dispatch/combine and the layer run with real device memory on rank 0 and equal the CPU
  reference (the same two ranks with both on CPU).

TF32 is switched off so that CUDA matmuls are FP32 like the CPU's; remaining differences are
float reassociation (bounds 1e-4 on outputs of magnitude ~1-10, 1e-3 relative on gradients).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.backends.ranks import run_ranks
from tests.gpu import DEVICE_START

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvidia-ascend-2.yaml")
pytestmark = pytest.mark.gpu


def _fp32_matmuls() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _layer_run(device: str, world_size: int = 1, rank: int = 0, wire: str = "fp32"):
    from hetcomm.moe import MoELayer

    _fp32_matmuls()
    torch.manual_seed(0)
    layer = MoELayer(32, 8, k=2, capacity_factor=1.25, calibrate=True, wire_dtype=wire, num_chunks=2).to(device)
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(64, 32, generator=g).to(device).requires_grad_(True)
    gy = torch.randn(64, 32, generator=g).to(device)
    out = {}
    for step in range(2):  # the second step uses the calibration history of the first
        y = layer(x)
        ((y * gy).sum() + 0.01 * layer.l_aux).backward()
        out[f"y{step}"] = y.detach().cpu()
    out["x_grad"] = x.grad.cpu()
    out["gate_grad"] = layer.gate.wg.weight.grad.cpu()
    out["expert_grads"] = [p.grad.cpu() if p.grad is not None else None for p in layer.experts.parameters()]
    out["devices"] = sorted({str(t.device.type) for t in list(layer.parameters()) + list(layer.buffers())})
    return out


def _close(a, b, tol):
    if a is None or b is None:
        return a is None and b is None
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max())) if a.numel() else True


def test_layer_on_cuda_equals_cpu():
    cpu = _layer_run("cpu")
    gpu = _layer_run("cuda")
    assert gpu["devices"] == ["cuda"], gpu["devices"]  # layer.to(device) moved every buffer
    for key in ("y0", "y1", "x_grad", "gate_grad"):
        assert _close(gpu[key], cpu[key], 1e-4), key
    for a, b in zip(gpu["expert_grads"], cpu["expert_grads"]):
        assert _close(a, b, 1e-3)


def _pair_body(rank, world_size, use_cuda: bool):
    """Rank 0 on CUDA when ``use_cuda``; rank 1 always CPU. Returns host copies of everything."""
    import torch.distributed as dist

    import hetcomm
    from tests.backends import token_cases

    _fp32_matmuls()
    dev = "cuda" if (use_cuda and rank == 0) else "cpu"
    res = {}
    # 1. all_to_all_single through the bridge, uneven splits, an FP32 payload (exact wire:
    #    the process group's own wire_dtype stays "exact").
    hetcomm.reset_stats()
    in_s = [[3, 5], [4, 4]][rank]
    out_s = [[3, 4], [5, 4]][rank]
    x = (torch.arange(sum(in_s) * 6, dtype=torch.float32).view(-1, 6) + 1000 * rank).to(dev)
    y = torch.empty(sum(out_s), 6, device=dev)
    dist.all_to_all_single(y, x, out_s, in_s)
    res["a2a"] = y.cpu()
    res["bridge_bytes"] = hetcomm.stats().get("bridge", {}).get("bytes_sent", 0)
    # 2. dispatch/combine (FP32 and FP16 wires) against the dense reference on this device.
    cases = [c for c in token_cases.all_cases(world_size) if c["name"] in ("k2", "uneven_k4_chunks2_async", "zero_tokens_on_rank1")]
    res["dispatch"] = token_cases.run_all(rank, world_size, cases, device=dev)
    res["dispatch_fp16"] = token_cases.run_all(rank, world_size, cases[:1], device=dev, wire=torch.float16)
    # 3. the layer (the cluster's wire: FP16 over the bridge).
    res["layer"] = _layer_run(dev, world_size, rank, wire="auto")
    return res


@pytest.mark.timeout(300)
def test_cuda_rank_and_cpu_rank_over_the_bridge_equal_the_cpu_reference():
    mixed = run_ranks(_pair_body, world_size=2, cluster=CLUSTER, timeout=280, args=(True,), start_method=DEVICE_START)
    ref = run_ranks(_pair_body, world_size=2, cluster=CLUSTER, timeout=280, args=(False,))
    for rank in range(2):
        m, r = mixed[rank], ref[rank]
        assert torch.equal(m["a2a"], r["a2a"]), rank
        for name, d in m["dispatch"].items():
            assert d["device"].startswith("cuda" if rank == 0 else "cpu"), (rank, name, d)
            for key in ("out", "x_grad", "w_grad", "no_grad_out"):
                assert d[key] <= 1e-4, (rank, name, key, d)
        d16 = m["dispatch_fp16"]["k2"]
        assert d16["out"] <= 2e-2 * max(1.0, d16["out_scale"]), d16
        # The layer crosses an FP16 wire: CUDA's and the CPU's float32 results differ by ~1e-7,
        # which can flip one FP16 rounding (an ulp is 1e-3 at |y| ~ 1): a few ulps of slack.
        for key in ("y0", "y1", "x_grad", "gate_grad"):
            assert _close(m["layer"][key], r["layer"][key], 5e-3), (rank, key)
    assert mixed[0]["bridge_bytes"] > 0 and mixed[1]["bridge_bytes"] > 0
