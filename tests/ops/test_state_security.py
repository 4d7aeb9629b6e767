"""What another local user plants where a job keeps its state: a directory at the job's
``/dev/shm`` name is refused by name and never deleted; a link (or a second hard link) at the
``--metrics`` file is refused, never written through. A real second user (``useradd``) plants
them from a child process that ran ``setuid``; the job runs as root, as clusters run them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from hetcomm.errors import UnsafePathError
from tests.ops.jobs import TINY
from tests.ops.other_user import NAME, as_other, other_user, root_only

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra)
    env.pop("PYTHONSAFEPATH", None)
    return env


@root_only
def test_a_snapshot_directory_planted_by_another_user_is_refused_and_kept():
    job = f"planted{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/hetcomm-{os.getuid()}-{job}"
    as_other(f"import os; os.mkdir({path!r}, 0o700); open({path + '/theirs'!r}, 'w').write('x')")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hetcomm.cli.main", "launch", "--no-health", "--max-restarts", "0",
             "--rdzv-id", job, "--", "train", "--config", TINY, "--steps", "2"],
            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
        )
        err = proc.stdout + proc.stderr
        # Another user's directory and file are still there, untouched (the launch's cleanup
        # used to rmtree the job's directory whoever owned it).
        assert os.path.isdir(path) and os.stat(path).st_uid == other_user()[0], err[-3000:]
        assert open(os.path.join(path, "theirs")).read() == "x"
        # Refused before torchrun starts: exit 2, one line naming the path, the owner, the fix.
        assert proc.returncode == 2, err[-3000:]
        assert "starting the job" not in err, err[-3000:]
        assert path in err and f"owned by uid {other_user()[0]} ({NAME})" in err, err[-3000:]
        assert "--rdzv-id" in err and "HETCOMM_SNAPSHOT_ROOT" in err, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    finally:
        shutil.rmtree(path, ignore_errors=True)


@root_only
def test_metrics_through_another_users_link_is_refused_and_the_target_untouched():
    uid, _ = other_user()
    shared = tempfile.mkdtemp(prefix="hetcomm-shared-", dir="/tmp")
    try:
        os.chmod(shared, 0o777)  # a shared directory (not sticky: the kernel's link protection is off)
        victim = os.path.join(shared, "victim")
        with open(victim, "w") as f:
            f.write("precious\n")
        os.chmod(victim, 0o644)
        link = os.path.join(shared, "m.jsonl")
        as_other(f"import os; os.symlink({victim!r}, {link!r})")
        assert os.lstat(link).st_uid == uid
        proc = subprocess.run(
            [sys.executable, "-m", "hetcomm.cli.main", "train", "--config", TINY, "--steps", "1", "--metrics", link],
            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
        )
        err = proc.stdout + proc.stderr
        assert proc.returncode == 2, err[-3000:]
        assert link in err and "symbolic link" in err and f"uid {uid} ({NAME})" in err, err[-3000:]
        assert open(victim).read() == "precious\n"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_metrics_file_with_a_second_hard_link_or_not_a_file_is_refused(tmp_path):
    from hetcomm.ops.safe_fs import open_append_private

    theirs = tmp_path / "theirs"
    theirs.write_text("precious\n")
    os.link(theirs, tmp_path / "m.jsonl")
    with pytest.raises(UnsafePathError) as e:
        open_append_private(str(tmp_path / "m.jsonl"), what="metrics file")
    assert e.value.reason == "owner" and "2 hard links" in str(e.value)
    assert theirs.read_text() == "precious\n"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafePathError) as e:
        open_append_private(str(tmp_path / "fifo"), what="metrics file")
    assert e.value.reason == "not-a-file"
    with open_append_private(str(tmp_path / "new.jsonl")) as f:  # a fresh file: 0600, appended to
        f.write("a\n")
    assert oct(os.stat(tmp_path / "new.jsonl").st_mode & 0o777) == "0o600"
