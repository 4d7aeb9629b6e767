"""Device paths (nccl, bridge with CUDA tensors, hccl): run only where the devices exist.

On the CPU-only development machine these are skipped (markers ``gpu`` / ``npu``); the CPU
tests exercise the same executor, checks and bridge staging with CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import run_ranks


def cuda_all_to_all(rank: int, n: int) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import hetcomm_group

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    in_s = [(rank + j) % 3 + 1 for j in range(n)]
    out_s = [(j + rank) % 3 + 1 for j in range(n)]
    x = torch.cat([torch.full((in_s[j], 4), float(100 * rank + j), device=dev) for j in range(n)])
    y = torch.empty(sum(out_s), 4, device=dev)
    dist.all_to_all_single(y, x, out_s, in_s)
    expect = torch.cat([torch.full((out_s[j], 4), float(100 * j + rank), device=dev) for j in range(n)])
    return {"ok": bool(torch.equal(y, expect)), "rails": hetcomm_group().rail_names("cuda"), "stats": __import__("hetcomm").stats()}


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU; needs 2 GPUs")
def test_cuda_all_to_all_over_nccl():
    # Without a cluster YAML, CUDA ranks are real NVIDIA ranks: peers go over nccl.
    n = max(2, min(4, torch.cuda.device_count()))
    outs = run_ranks(cuda_all_to_all, world_size=n, timeout=150)
    for o in outs:
        assert o["ok"]
        assert set(o["rails"]) - {"self"} == {"nccl"}
        assert o["stats"]["nccl"]["bytes_sent"] > 0


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_cuda_all_to_all_over_bridge_when_nccl_is_not_allowed():
    outs = run_ranks(cuda_all_to_all, world_size=2, timeout=150, env={"HETCOMM_RAILS": "bridge,gloo"})
    for o in outs:
        assert o["ok"]
        assert set(o["rails"]) - {"self"} == {"bridge"}
        assert o["stats"]["bridge"]["bytes_sent"] > 0


def npu_all_to_all(rank: int, n: int) -> bool:
    import torch.distributed as dist
    import torch_npu  # noqa: F401

    dev = torch.device("npu", rank % torch.npu.device_count())
    torch.npu.set_device(dev)
    x = torch.arange(2 * n, dtype=torch.float32, device=dev) + 10 * rank
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 10 * j for j in range(n)])
    return bool(torch.equal(y.cpu(), expect))


@pytest.mark.npu
@pytest.mark.timeout(180)
def test_npu_all_to_all_over_hccl():
    assert all(run_ranks(npu_all_to_all, world_size=2, timeout=150))
