"""A snapshot belongs to one launch of one job: a later job given the same id never resumes a
crashed one's state (it removes it, saying so, and starts from step 1 with its own seed), and a
job whose namesake still runs is refused by name without touching the running one's state.
Real ``hetcomm launch`` jobs (torchrun, 4 ranks), killed with SIGKILL."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
import uuid

from hetcomm.ops.metrics import read_metrics
from tests.ops.jobs import TINY
from tests.ops.test_resume import REPO, _last_step


def _launch(job: str, work: str, metrics: str, steps: int, seed: int, shm_root: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hetcomm.cli.main", "launch", "--no-health", "--max-restarts", "0", "--work-dir", work,
           "--rdzv-id", job, "--", "train", "--config", TINY, "--steps", str(steps), "--seed", str(seed),
           "--metrics", metrics]
    env = dict(os.environ, HETCOMM_SNAPSHOT_ROOT=shm_root, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _pids_of(work: str):
    want = f"HETCOMM_LAUNCH_DIR={work}".encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        yield int(pid)
            except OSError:
                continue


def _wait_step(proc: subprocess.Popen, metrics: str, step: int, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None and _last_step(metrics) < step:
        time.sleep(0.05)
    assert _last_step(metrics) >= step, proc.communicate(timeout=30)[0][-3000:] if proc.poll() is not None else "slow"


def _kill_all(proc: subprocess.Popen, work: str) -> None:
    """SIGKILL the launch and every process of its job (a crashed node: nothing cleans up)."""
    proc.kill()
    proc.wait()
    for pid in list(_pids_of(work)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while list(_pids_of(work)) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_new_job_with_a_crashed_jobs_id_starts_on_its_own(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    job = f"ident{uuid.uuid4().hex[:8]}"
    state = shm / f"hetcomm-{os.getuid()}-{job}"
    m1, m2 = str(tmp_path / "m1.jsonl"), str(tmp_path / "m2.jsonl")
    first = _launch(job, str(tmp_path / "w1"), m1, 24, 1, str(shm))
    try:
        _wait_step(first, m1, 6)
    finally:
        _kill_all(first, str(tmp_path / "w1"))
    assert glob.glob(str(state / "r*.snap")), "the crashed job left no snapshot to resume"
    second = _launch(job, str(tmp_path / "w2"), m2, 8, 2, str(shm))
    out, _ = second.communicate(timeout=300)
    assert second.returncode in (0, 1), out[-4000:]  # the tiny job's loss verdict, not a crash
    log = read_metrics(m2)
    assert not [e.detail for e in log.events if e.event == "resume"], out[-4000:]  # nothing resumed
    assert [s.step for s in log.all_steps] == list(range(1, 9)), out[-4000:]  # its own run from step 1
    notice = [line for line in out.splitlines() if "ignored and removed the snapshots" in line]
    assert len(notice) == 1 and job in notice[0] and str(state) in notice[0], out[-4000:]
    assert "not running" in notice[0], notice
    assert not state.exists()  # its own normal end removed the directory


def test_a_job_whose_namesake_runs_is_refused_and_leaves_its_state_alone(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    job = f"ident{uuid.uuid4().hex[:8]}"
    state = shm / f"hetcomm-{os.getuid()}-{job}"
    m1, m2 = str(tmp_path / "m1.jsonl"), str(tmp_path / "m2.jsonl")
    first = _launch(job, str(tmp_path / "w1"), m1, 400, 1, str(shm))
    try:
        _wait_step(first, m1, 2)
        second = _launch(job, str(tmp_path / "w2"), m2, 8, 2, str(shm))
        out, _ = second.communicate(timeout=300)
        assert second.returncode == 2, out[-4000:]
        assert f"job {job!r} is already running here" in out and str(state) in out, out[-4000:]
        assert "--rdzv-id" in out, out[-4000:]
        # The running job's state is still there and it keeps training.
        assert glob.glob(str(state / "r*.snap")), out[-4000:]
        at = _last_step(m1)
        _wait_step(first, m1, at + 2)
        assert first.poll() is None
    finally:
        _kill_all(first, str(tmp_path / "w1"))


_PROBE = """
import os, sys
from hetcomm.ops.job_identity import mark_alive, this_launch
launch = this_launch(os.environ["TORCHELASTIC_RUN_ID"])
with open(os.path.join(sys.argv[1], os.environ["TORCHELASTIC_RESTART_COUNT"] + "-" + os.environ["RANK"]), "w") as f:
    f.write(" ".join([os.environ["TORCHELASTIC_RESTART_COUNT"], launch.nonce, str(all(map(mark_alive, launch.owners)))]))
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    sys.exit(3)  # torchrun restarts both workers
"""


def test_plain_torchrun_has_one_launch_identity_across_its_restarts_and_another_per_launch(tmp_path):
    from tests.ops.jobs import _free_port

    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    for name in ("HETCOMM_LAUNCH_NONCE", "HETCOMM_LAUNCH_OWNER"):
        env.pop(name, None)
    nonces = []
    for n in range(2):  # two launches, each with a restart; plain torchrun's run id is "none" both times
        out = tmp_path / str(n)
        out.mkdir()
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
             "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
             str(probe), str(out)], env=env, capture_output=True, text=True, timeout=120)
        lines = [(out / name).read_text().split() for name in sorted(os.listdir(out))]
        assert sorted(w[0] for w in lines) == ["0", "0", "1", "1"], proc.stdout + proc.stderr[-3000:]
        assert len({w[1] for w in lines}) == 1 and all(w[2] == "True" for w in lines), lines
        nonces.append(lines[0][1])
    assert nonces[0] != nonces[1]
