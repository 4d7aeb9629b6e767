"""GPU tests: torch.cuda.is_available() answers from NVML here (``PYTORCH_NVML_BASED_CUDA_CHECK``).

The CUDA runtime's own check initialises the driver in the calling process, and the rank
launcher's forkserver (tests/backends/ranks.py) forks every rank from a process that imported
torch and hetcomm: a driver initialised there leaves the forked ranks a CUDA they cannot use.
Set before the forkserver starts, so it and every rank inherit it; scripts/device-check sets it
too.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
