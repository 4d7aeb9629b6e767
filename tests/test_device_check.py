"""scripts/device-check on a machine without CUDA: it must say clearly that it skipped, install
nothing, write a "skipped" summary (with the torch it looked at) to $OUT, and exit 0 (issue 10,
item 7). On a GPU machine run it directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: run scripts/device-check itself")
def test_device_check_reports_its_skip(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    p = subprocess.run([os.path.join(REPO, "scripts", "device-check")], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "device-check: SKIPPED: no CUDA device" in p.stdout
    assert "nothing was installed" in p.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "skipped"
    # which torch it looked at, and that none was installed (no GPU: no multi-GB download)
    assert summary["torch"] == torch.__version__ and summary["torch_source"] == "none", summary
    bad = subprocess.run([os.path.join(REPO, "scripts", "device-check"), "--bogus"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
