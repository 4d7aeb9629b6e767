"""MoELayer(rank_weights="throughput"): experts in proportion to device TFLOPS, replicas on the
fastest ranks (issue 11 item 3), on real ranks."""

from __future__ import annotations

import os

from tests.backends.ranks import REPO_ROOT, run_ranks

CLUSTERS = {
    "half": os.path.join(REPO_ROOT, "configs", "clusters", "mixed-mini-halfspeed.yaml"),
    "mini": os.path.join(REPO_ROOT, "configs", "clusters", "mixed-mini.yaml"),
}


def _layout(rank: int, world: int):
    import torch

    from hetcomm.moe import MoELayer

    out = {}
    for name, path in CLUSTERS.items():
        for weights in ("strong", "throughput"):
            layer = MoELayer(16, 16, k=2, cluster=path, rank_weights=weights, replicate=True, calibrate=False)
            layer(torch.randn(8, 16)).sum().backward()
            out[name, weights] = (
                list(layer.placement.num_local_experts_per_rank), list(layer.strong_ranks), list(layer.rank_tflops)
            )
    return out


def test_throughput_weights_follow_the_device_speeds():
    (res, *_) = run_ranks(_layout, world_size=4, backend="gloo", timeout=180)
    # half-speed cluster (100/100/100/50 TFLOPS): the 910B gets half a rank's experts, no replicas
    assert res["half", "throughput"] == ([5, 5, 4, 2], [0, 1, 2], [100.0, 100.0, 100.0, 50.0])
    # the table's speeds on mixed-mini (A100 312, H800 989.5, 910B 320): the H800 holds half the
    # experts and is the only replica holder; the default ("strong") is unchanged
    sizes, strong, tflops = res["mini", "throughput"]
    assert tflops == [312.0, 312.0, 989.5, 320.0]
    assert sizes == [3, 2, 8, 3] and strong == [2]
    assert res["mini", "strong"][:2] == ([5, 5, 4, 2], [0, 1, 2])  # strong flags: 2:2:2:1
