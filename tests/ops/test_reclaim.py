"""What killed jobs leave (their ``/dev/shm`` snapshot directories, ``hetcomm launch``'s default
work directories) is reclaimed by the next job of the same user that starts, and only that:
never a live job's, never one without an owner record, never another user's (a real second
user plants one). The owners are real processes, one that has exited and one that runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from hetcomm.ops import job_identity
from tests.ops.other_user import as_other, other_user, root_only

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _state_dir(path: str, owner_mark: str) -> str:
    """A job directory as a job leaves it: 0700, a snapshot file, the owner record."""
    os.mkdir(path, 0o700)
    with open(os.path.join(path, "r0-w4-s7.snap"), "wb") as f:
        f.write(b"x" * 64)
    job_identity.write_record(path, job_identity.Launch(os.path.basename(path), "n0", [owner_mark]))
    return path


@root_only
def test_a_starting_launch_reclaims_dead_jobs_state_and_nothing_else(tmp_path):
    uid = os.getuid()
    shm = tempfile.mkdtemp(prefix="hetcomm-shm-", dir="/tmp")  # like /dev/shm: everyone may create
    os.chmod(shm, 0o1777)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        dead_mark, live_mark = job_identity.process_mark(gone.pid), job_identity.process_mark(live.pid)
        assert not job_identity.mark_alive(dead_mark) and job_identity.mark_alive(live_mark)
        dead = _state_dir(os.path.join(shm, f"hetcomm-{uid}-dead"), dead_mark)
        running = _state_dir(os.path.join(shm, f"hetcomm-{uid}-running"), live_mark)
        unknown = os.path.join(shm, f"hetcomm-{uid}-norecord")  # an older hetcomm's, or in the making
        os.mkdir(unknown, 0o700)
        other = os.path.join(shm, f"hetcomm-{uid}-planted")  # another user's, with a dead owner record
        record = {"launch": "x", "owners": [dead_mark]}
        as_other(f"import os, json; os.mkdir({other!r}, 0o700); "
                 f"open({other + '/owner.json'!r}, 'w').write(json.dumps({record!r}))")
        base = tmp_path / f"hetcomm-launch-{uid}"
        base.mkdir(mode=0o700)
        dead_work = _state_dir(str(base / "old-1a2b3c4d"), dead_mark)
        live_work = _state_dir(str(base / "busy-1a2b3c4d"), live_mark)
        env = dict(os.environ, TMPDIR=str(tmp_path), HETCOMM_SNAPSHOT_ROOT=shm, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        env.pop("PYTHONSAFEPATH", None)
        proc = subprocess.run(
            [sys.executable, "-m", "hetcomm.cli.main", "launch", "--health-only", "--probe-size", "4K",
             "--probe-iters", "2", "--threshold", "1000"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        err = proc.stdout + proc.stderr
        assert proc.returncode in (0, 1), err[-3000:]
        assert not os.path.exists(dead) and not os.path.exists(dead_work), err[-3000:]
        for kept in (running, unknown, other, live_work):
            assert os.path.isdir(kept), (kept, err[-3000:])
        assert os.stat(other).st_uid == other_user()[0]
        line = [x for x in err.splitlines() if "left by jobs of yours that no longer run" in x]
        assert len(line) == 1 and dead in line[0] and dead_work in line[0], err[-3000:]
        assert os.listdir(base) == ["busy-1a2b3c4d"]  # the launch's own default directory went at its end
    finally:
        live.kill()
        live.wait()
        shutil.rmtree(shm, ignore_errors=True)
