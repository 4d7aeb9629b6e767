"""GPU check of planned all-to-all paths on device tensors (marker ``gpu``; skipped without CUDA).

Rank 0 on the CUDA device, rank 1 a CPU process standing for an Ascend rank (``nvidia-ascend-2.yaml``,
the pair over the bridge): ``all_to_all_single`` with a pinned plan (``hier``, ``multirail``) and
with the default (``adaptive``) runs with real device memory on rank 0 (the plan's transfers take
the bridge for the CUDA tensor, ordered after the caller's stream) and equals the expected rows,
bit for bit; the CUDA output stays on the device.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.backends.ranks import run_ranks
from tests.gpu import DEVICE_START

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvidia-ascend-2.yaml")
pytestmark = pytest.mark.gpu


def _rows(src: int, dst: int, count: int) -> torch.Tensor:
    return (src * 100 + dst) * 1000.0 + torch.arange(count * 6, dtype=torch.float32).view(count, 6)  # host: test data


def _body(rank, world_size):
    import torch.distributed as dist

    import hetcomm
    from hetcomm.backends import HetcommOptions

    dev = "cuda" if rank == 0 else "cpu"
    in_s = [[3, 5], [4, 4]][rank]
    out_s = [in_s_j[rank] for in_s_j in ([3, 5], [4, 4])]
    res = {}
    for plan in ("hier", "multirail", "adaptive"):
        g = dist.new_group(backend="hetcomm", pg_options=HetcommOptions(plan=plan))
        x = torch.cat([_rows(rank, j, c) for j, c in enumerate(in_s)]).to(dev)
        y = torch.empty(sum(out_s), 6, device=dev)
        dist.all_to_all_single(y, x, out_s, in_s, group=g)
        want = torch.cat([_rows(j, rank, c) for j, c in enumerate(out_s)])
        res[plan] = {"equal": torch.equal(y.cpu(), want), "device": str(y.device),
                     "taken": hetcomm.communicator(g).plan_paths["taken"]}
    return res


@pytest.mark.timeout(300)
def test_plans_on_a_cuda_rank_equal_the_expected_rows():
    res = run_ranks(_body, world_size=2, cluster=CLUSTER, timeout=280, start_method=DEVICE_START)
    for rank, r in enumerate(res):
        for plan in ("hier", "multirail"):
            assert r[plan]["equal"] and r[plan]["taken"] == {plan: 1}, (rank, plan, r)
            assert r[plan]["device"].startswith("cuda" if rank == 0 else "cpu"), (rank, plan, r)
        assert r["adaptive"]["equal"] and r["adaptive"]["taken"] == {"direct": 1}, (rank, r)
