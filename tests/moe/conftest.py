"""MoE tests: one intra-op thread in the test process (restored afterwards).

On a shared 2-core machine, two torch threads per process contending with spawned ranks and
other jobs made single-process tests several times slower, not faster.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
