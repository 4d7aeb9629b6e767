"""torchrun (env://) with a script that never imports hetcomm: the torch.backends entry point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(150)
def test_torchrun_env_init_without_import():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(HERE, "torchrun_script.py")],
        env=env, capture_output=True, text=True, timeout=140,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # both ranks passed; hetcomm was loaded by torch's autoload, not by the script
    assert proc.stdout.count("OK True") == 2, proc.stdout + proc.stderr
