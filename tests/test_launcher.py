"""hetcomm.launcher: the one rank launcher (bench, train, emulate and the tests start ranks with it).

Real processes throughout; the only time bounds are generous timeouts that a correct launcher
meets on a loaded machine by a wide margin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hetcomm.errors import PeerTimeout, UsageError
from hetcomm.launcher import is_timeout, launch

from tests.conftest import REPO_ROOT


def report_env(tag):
    """Target: what this rank was given."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE", "LAUNCH_TEST")
    return {"tag": tag, "pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}


def one_raises(bad_rank):
    """Target: ``bad_rank`` raises at once; the others would sleep for ten minutes."""
    if int(os.environ["RANK"]) == bad_rank:
        raise PeerTimeout("deliberate: peer never answered", op="test", rank=bad_rank, rail=None)
    time.sleep(600)


def one_silent(silent_rank):
    """Target: ``silent_rank`` never returns; the others finish."""
    if int(os.environ["RANK"]) == silent_rank:
        time.sleep(600)
    return int(os.environ["RANK"])


def leaves_segment(_):
    """Target: make a /dev/shm entry named the way the shm rail names its segments, then die
    without unlinking it (as a SIGKILLed rank would)."""
    path = f"/dev/shm/hetcomm-{os.getpid()}-launchertest"
    with open(path, "wb") as f:
        f.write(b"x")
    os._exit(9)


@pytest.mark.timeout(120)
def test_results_env_and_store_come_back_per_rank():
    out = launch(report_env, 3, args=("t",), start="forkserver", env={"LAUNCH_TEST": "yes"}, store=True, timeout_s=90)
    assert out.ok, out.message()
    assert [r["RANK"] for r in out.results] == ["0", "1", "2"]
    assert {(r["WORLD_SIZE"], r["LOCAL_RANK"] == r["RANK"], r["LAUNCH_TEST"], r["TORCHELASTIC_USE_AGENT_STORE"])
            for r in out.results} == {("3", True, "yes", "True")}
    assert [r.pid for r in out.ranks] == [r["pid"] for r in out.results]
    assert all(r.exitcode == 0 and r.stopped is None for r in out.ranks)


SCRIPT = """
import os, sys, time
from hetcomm.launcher import launch

def store_sum(_):
    import datetime
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          timeout=datetime.timedelta(seconds=60))
    store.add("sum", rank)
    store.add("arrived", 1)
    while int(store.add("arrived", 0)) < world:
        time.sleep(0.01)
    return int(store.add("sum", 0))

if __name__ == "__main__":
    out = launch(store_sum, 2, args=(None,), start="exec", store=True, timeout_s=90)
    print("RESULTS", out.ok, out.results, out.message())
"""


@pytest.mark.timeout(120)
def test_exec_ranks_of_a_script_target_meet_at_the_launchers_store(tmp_path):
    # A fresh interpreter per rank (exec) unpickles a target defined in the script's __main__
    # (as multiprocessing's spawn would) and rendezvouses through the launcher's store.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=REPO_ROOT),
                          capture_output=True, text=True, timeout=110)
    assert "RESULTS True [1, 1] all 2 ranks finished" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_a_failing_rank_stops_the_others_and_its_error_comes_back():
    t0 = time.monotonic()
    out = launch(one_raises, 3, args=(1,), start="forkserver", timeout_s=90, grace_s=0, kill_grace_s=2)
    assert time.monotonic() - t0 < 60  # not the sleepers' ten minutes
    assert not out.ok and out.first_failure == 1
    bad = out.ranks[1]
    assert (bad.error_type, bad.timeout_error, bad.exitcode, bad.stopped) == ("PeerTimeout", True, 1, None)
    assert "deliberate: peer never answered" in bad.error
    assert "one_raises" in bad.traceback and "raise PeerTimeout" in bad.traceback
    for r in (0, 2):
        assert out.ranks[r].stopped == "failure" and out.ranks[r].exitcode == -signal.SIGTERM, out.ranks[r]
    assert [f.rank for f in out.failures][0] == 1  # the root cause first
    assert "rank 1 raised PeerTimeout" in out.message().splitlines()[0]


@pytest.mark.timeout(120)
def test_the_timeout_names_the_silent_rank():
    out = launch(one_silent, 3, args=(2,), start="forkserver", timeout_s=8, kill_grace_s=1)
    assert out.timed_out == (2,)
    assert [r.ok for r in out.ranks] == [True, True, False]
    assert out.results[:2] == [0, 1]
    assert out.ranks[2].stopped == "timeout"
    assert "ranks [2] did not finish within 8 s" in out.message()


@pytest.mark.timeout(60)
def test_commands_take_a_per_rank_prefix_env_and_log(tmp_path):
    logs = {r: str(tmp_path / f"rank{r}.log") for r in range(3)}
    out = launch(
        ["sh", "-c", 'echo "$PREFIXED $RANK/$WORLD_SIZE $NODE"; exit "$RANK"'],
        3,
        prefix=lambda r: ["env", f"PREFIXED=p{r}"],
        rank_env=lambda r: {"NODE": f"n{r}"},
        logs=logs,
        timeout_s=30,
        grace_s=None,
    )
    assert [open(logs[r]).read().strip() for r in range(3)] == ["p0 0/3 n0", "p1 1/3 n1", "p2 2/3 n2"]
    assert [(r.ok, r.exitcode, r.log) for r in out.ranks] == [(True, 0, logs[0]), (False, 1, logs[1]), (False, 2, logs[2])]
    assert out.first_failure in (1, 2)
    assert out.ranks[2].describe() == "rank 2 exited with status 2"
    with pytest.raises(UsageError):
        launch([], 2)
    with pytest.raises(UsageError):
        launch(["true"], 0)


@pytest.mark.timeout(60)
def test_shm_left_by_a_dead_rank_is_removed_and_listed():
    out = launch(leaves_segment, 2, args=(None,), start="forkserver", timeout_s=30, grace_s=None, clean_shm=True)
    assert [r.exitcode for r in out.ranks] == [9, 9]
    want = sorted(f"/dev/shm/hetcomm-{r.pid}-launchertest" for r in out.ranks)
    assert list(out.shm_removed) == want
    assert not any(os.path.exists(p) for p in want)


SIGNALLED = """
import sys
from hetcomm.launcher import launch

def job(attempt):
    pidfile = f"{sys.argv[1]}.{attempt}"
    cmd = f"echo $$ > {pidfile}.$RANK.tmp && mv {pidfile}.$RANK.tmp {pidfile}.$RANK; exec sleep 300"
    launch(["sh", "-c", cmd], 2, timeout_s=120)

try:
    job("int")
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
job("term")
"""


@pytest.mark.timeout(90)
def test_sigint_and_sigterm_to_the_launcher_stop_the_ranks(tmp_path):
    # One launcher process, two launches: SIGINT to the first (KeyboardInterrupt, caught by the
    # script), SIGTERM to the second (exit 143). The ranks are gone before the launcher moves on.
    pidfile = str(tmp_path / "rank")
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED, pidfile], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    try:
        for attempt, sig in (("int", signal.SIGINT), ("term", signal.SIGTERM)):
            deadline = time.monotonic() + 60
            while not all(os.path.exists(f"{pidfile}.{attempt}.{r}") for r in range(2)):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            pids = [int(open(f"{pidfile}.{attempt}.{r}").read()) for r in range(2)]
            assert all(_alive(pid) for pid in pids)
            proc.send_signal(sig)
            if sig == signal.SIGINT:
                assert proc.stdout.readline().strip() == "KeyboardInterrupt"
            else:
                assert proc.wait(timeout=30) == 128 + signal.SIGTERM
            assert [pid for pid in pids if _alive(pid)] == [], attempt  # stopped before launch returned
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_is_timeout_goes_by_type():
    assert is_timeout(PeerTimeout("x", op="o", rank=0, rail=None))
    assert is_timeout(TimeoutError())
    assert not is_timeout(RuntimeError("connection closed by peer"))


@pytest.mark.timeout(120)
def test_launch_options_are_one_record_and_keywords_still_work():
    from hetcomm.launcher import LaunchOptions

    opts = LaunchOptions(args=("opt",), start="forkserver", env={"LAUNCH_TEST": "record"}, store=True, timeout_s=90)
    out = launch(report_env, 2, opts)
    assert out.ok and [r["tag"] for r in out.results] == ["opt", "opt"]
    assert [r["LAUNCH_TEST"] for r in out.results] == ["record", "record"]
    # A keyword changes one field of the record for this call (the record itself is frozen).
    out = launch(report_env, 2, opts, args=("kw",))
    assert out.ok and [r["tag"] for r in out.results] == ["kw", "kw"] and opts.args == ("opt",)
    # Bad values are refused before any rank starts; an unknown keyword is a TypeError, as before.
    with pytest.raises(UsageError, match="start must be"):
        launch(report_env, 2, start="spawn")
    with pytest.raises(UsageError, match="kill_grace_s must be >= 0"):
        LaunchOptions(kill_grace_s=-1)
    with pytest.raises(TypeError):
        launch(report_env, 2, timeout=5)


def killed_once():
    """Target: rank 1's first process SIGKILLs itself; a process started again in its slot
    (``LAUNCH_REJOIN`` set by ``rejoin``) reports what it was given."""
    if os.environ["RANK"] == "1" and not os.environ.get("LAUNCH_REJOIN"):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"rank": os.environ["RANK"], "rejoin": os.environ.get("LAUNCH_REJOIN"), "pid": os.getpid()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["forkserver", "exec"])
def test_rejoin_starts_a_killed_rank_once_more_in_its_slot(start):
    out = launch(killed_once, 3, start=start, grace_s=None, timeout_s=90, rejoin={"LAUNCH_REJOIN": "yes"})
    assert out.ok, out.message()
    assert [r["rejoin"] for r in out.results] == [None, "yes", None]
    assert [r["rank"] for r in out.results] == ["0", "1", "2"]
    pid, code = out.ranks[1].replaced
    assert code == -signal.SIGKILL and pid != out.ranks[1].pid == out.results[1]["pid"]
    assert out.ranks[0].replaced is None and out.ranks[2].replaced is None
    # without rejoin the killed rank is a failure, as before
    out = launch(killed_once, 3, start=start, grace_s=None, timeout_s=90)
    assert not out.ok and out.ranks[1].exitcode == -signal.SIGKILL and out.ranks[1].replaced is None
