"""The paged MoELayer on a CUDA device (marker ``gpu``; skipped without CUDA): pinned host pool,
side-stream copies ordered by events, waves whose backward pages experts in on autograd's
device thread. Trained side by side with the unpaged layer on the same device, as
``tests/moe/test_paging_layer.py`` does on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.moe.test_paging_layer import assert_trains_like_unpaged, train_twins

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_layer_on_cuda_trains_like_the_unpaged_one():
    torch.backends.cuda.matmul.allow_tf32 = False
    res = train_twins(0, 1, 0.5, 30, 0, 12, 1, "cuda")
    assert res["slots"] == 4 and res["local"] == 8  # as on CPU: half the experts' slots
    # The paged weights live in a pool at 64-byte alignment, the unpaged ones where the caching
    # allocator put them; cuBLAS may pick other kernels for either, so FP32 rounding may differ.
    assert_trains_like_unpaged(res, tol=1e-4)
