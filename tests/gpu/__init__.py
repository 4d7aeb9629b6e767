"""GPU tests (marker ``gpu``), run by ``pytest -m gpu`` and ``scripts/device-check``."""

#: How rank processes that use CUDA start: as fresh interpreters. A forked rank inherits the
#: CUDA driver state of its parent, and a driver initialised there (by anything the forkserver
#: imports, on some torch build) leaves the rank a CUDA it cannot use; a fresh interpreter costs
#: one torch import per rank and cannot inherit that.
DEVICE_START = "spawn"
