"""A second, real local user for the tests of what another user can plant (a directory in
``/dev/shm``, a link where a job writes): made with ``useradd`` once, used through a child
process that switches to it (``subprocess`` with ``user=``/``group=``: setgid, setuid), so what
it plants is owned by it exactly as an attacker's files would be. Needs root; the tests that use
it skip otherwise."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from typing import Tuple

import pytest

NAME = "hetcomm-other"

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


def other_user() -> Tuple[int, int]:
    """``(uid, gid)`` of the second user, made with ``useradd`` if missing."""
    try:
        pw = pwd.getpwnam(NAME)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
                       check=False, capture_output=True)
        pw = pwd.getpwnam(NAME)
    return pw.pw_uid, pw.pw_gid


def as_other(code: str) -> None:
    """Run ``code`` (Python) in a child process running as the second user."""
    uid, gid = other_user()
    # The system interpreter: the test venv may live where the second user cannot reach.
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    proc = subprocess.run([python, "-I", "-c", code], user=uid, group=gid, extra_groups=[],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.geteuid() != uid
