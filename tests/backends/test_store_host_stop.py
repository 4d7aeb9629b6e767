"""A stopped store host under ``hetcomm launch``: rank 0's process hosts each attempt's store, and
a call to a stopped ``TCPStore`` host never returns (the client has no read timeout). The
survivors must still raise naming rank 0 and exit, so that torchrun stops the attempt (SIGKILL
ends the stopped rank too) and restarts it, instead of every survivor hanging in a store call of
its failure path (the heartbeat's goodbye, the fault diagnosis' marks) for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hetcomm.ops.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TINY = os.path.join(REPO, "tests", "ops", "tiny.yaml")  # the 4-rank mixed-mini, steps of tens of ms


def _workers(work_dir: str) -> list:
    """pids of every process started with this launch directory in its environment."""
    want = f"HETCOMM_LAUNCH_DIR={work_dir}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:
            continue
    return out


def _rank_pid(work_dir: str, rank: int) -> int:
    want = {f"HETCOMM_LAUNCH_DIR={work_dir}".encode(), f"RANK={rank}".encode(), f"LOCAL_RANK={rank}".encode()}
    for pid in _workers(work_dir):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if want <= env and b"hetcomm.cli.launch_worker" in cmd:
            return pid
    raise AssertionError(f"no worker of rank {rank} under {work_dir}")


def _state(pid: int) -> str:
    """``/proc`` state letter of ``pid``, or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_stopped_store_host_is_named_and_the_job_restarts_instead_of_hanging(tmp_path):
    work, metrics = str(tmp_path / "work"), str(tmp_path / "m.jsonl")
    shm = tmp_path / "shm"  # the job's snapshots: the test SIGKILLs everyone, so nothing cleans /dev/shm
    shm.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), HETCOMM_SNAPSHOT_ROOT=str(shm))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetcomm.cli.main", "launch", "--no-health", "--max-restarts", "1", "--work-dir", work,
         "--", "train", "--config", TINY, "--steps", "100000", "--metrics", metrics],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped = None
    try:
        _wait(lambda: os.path.exists(metrics) and len(read_metrics(metrics).steps) >= 5, 240, "five steps")
        stopped = _rank_pid(work, 0)
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # Bound: the survivors raise within the heartbeat's interval; the launcher SIGKILLs the
        # stopped rank they name (a stopped process ignores torchrun's SIGTERM until its 30 s
        # grace ends) and torchrun starts attempt 1 (its ranks are stopped by the test).
        _wait(lambda: os.path.exists(os.path.join(work, "job-1-rank0.started")), 240, "the restarted attempt")
        assert _state(stopped) in ("gone", "Z"), f"the stopped rank 0 (pid {stopped}) was not killed"
        restarted_after = time.monotonic() - stopped_at
    finally:
        for pid in _workers(work):  # the processes this test started (their environment names its directory)
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        out, _ = proc.communicate(timeout=60)
    # The launcher SIGKILLed the stopped culprit, so the restart did not wait for torchrun's 30 s
    # SIGTERM grace (the bound is generous: a loaded machine starts workers slowly).
    assert f"rank 0 (pid {stopped}) is stopped (state T) and attempt 0's other ranks failed naming it: SIGKILLed" in out, \
        out[-4000:]
    print(f"stop -> attempt 1 started: {restarted_after:.1f} s")
    # The survivors raise naming rank 0 (the heartbeat's verdict, not a reset store connection).
    # Not every survivor need get to say it: once the first one fails, torchrun SIGTERMs the
    # others, and a loaded machine can end one before it prints.
    named = {r for r in (1, 2, 3) for line in out.splitlines()
             if line.startswith(f"[rank{r}]:") and "rank 0 is stopped" in line}
    assert named, out[-4000:]


_SURVIVOR = r"""
import datetime, sys
import torch.distributed as dist
from hetcomm.backends import heartbeat
port, host_pid = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600))
heartbeat.start(store, 1, 2, local_pids={0: host_pid}, store_host=0, give_up_s=2.0,
                describe_peer=lambda r: f"rank {r} (pid {host_pid}, host here)")
print("ready", flush=True)
store.get("never-set")  # a store call: to a stopped host it never returns
"""

_STORE_HOST = r"""
import datetime, socket, sys, time
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print(port, flush=True)
time.sleep(300)
"""


def test_a_survivor_blocked_in_a_store_call_gives_up_naming_the_stopped_host():
    # The backstop, on its own: a process whose main thread sits in a store call to a stopped host
    # (and whose heartbeat thread is stuck in one too) exits 1 within give_up_s of the verdict,
    # naming the host; the store watch found it stopped through /proc.
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdout=subprocess.PIPE, text=True, env=env)
    survivor = None
    try:
        port = int(host.stdout.readline())
        survivor = subprocess.Popen([sys.executable, "-c", _SURVIVOR, str(port), str(host.pid)], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert survivor.stdout.readline().strip() == "ready"
        os.kill(host.pid, signal.SIGSTOP)
        _, err = survivor.communicate(timeout=60)
    finally:
        for p in (survivor, host):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert survivor.returncode == 1, err[-3000:]
    assert f"lost peer rank 0: its process (pid {host.pid}) is stopped" in err, err[-3000:]
    named = f"gives up: rank 0 (pid {host.pid}, host here), which hosts the group's store, is stopped"
    assert named in err, err[-3000:]
