"""Shared pytest configuration: device markers skip cleanly where the device is missing."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Same-host pairs ride shm in every test, whatever an earlier calibration on this host measured
# (hetcomm/backends/calibrate.py): expectations about rails must not depend on the machine's
# state. Set before any rank, forkserver or CLI subprocess starts, so all of them inherit it;
# tests/backends/test_calibrate.py unsets it where it measures.
os.environ.setdefault("HETCOMM_SAME_HOST_RAIL", "shm")
FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures")

# pytest-xdist's workers start with SIGINT ignored, and an ignored signal stays ignored across
# fork and exec: every launcher, torchrun and rank a test starts would then ignore the SIGINT the
# signal tests send. Python's own handler (KeyboardInterrupt) is put back, so those children
# start with the default disposition, as they do under a plain `pytest`.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401
        import torch

        return torch.npu.is_available()
    except Exception:
        return False


def _emulation_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return ""


def pytest_collection_modifyitems(config, items):
    no_cuda = None if _has_cuda() else pytest.mark.skip(reason="no CUDA device on this machine")
    no_npu = None if _has_npu() else pytest.mark.skip(reason="no Ascend NPU on this machine")
    why = _emulation_unavailable()
    no_emulate = pytest.mark.skip(reason=f"emulation {why}") if why else None
    for item in items:
        if no_cuda and "gpu" in item.keywords:
            item.add_marker(no_cuda)
        if no_npu and "npu" in item.keywords:
            item.add_marker(no_npu)
        if no_emulate and "emulate" in item.keywords:
            item.add_marker(no_emulate)


@pytest.fixture
def fixture_path():
    """Path of a file in tests/fixtures."""

    def _path(name: str) -> str:
        return os.path.join(FIXTURES, name)

    return _path
