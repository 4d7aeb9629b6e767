"""``hetcomm launch`` as an operator meets it (issue 21, items 9, 10, 11, 14, 16): bad options and
bad jobs refused before torchrun starts, signals that stop the whole job, one cluster per job, a
failure that names the rank at fault, and a rendezvous host that is never ejected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hetcomm.cli.main import main as hetcomm_main
from hetcomm.ops.metrics import read_metrics
from hetcomm.ops.supervise import descendants, run_supervised

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SLOW = os.path.join(HERE, "slow-node.yaml")  # three one-rank nodes: a 3-rank job
TINY = os.path.join(HERE, "tiny.yaml")  # its own cluster is the 4-rank mixed-mini
EQUAL = os.path.join(REPO, "configs", "clusters", "mixed-mini-equal.yaml")


@pytest.mark.parametrize("argv, says", [
    (["--nproc-per-node", "0"], "--nproc-per-node 0"),
    (["--nproc-per-node", "-2"], "--nproc-per-node -2"),
    (["--nproc-per-node", "3"], "has 4 ranks"),
    (["--max-restarts", "-1"], "--max-restarts -1"),
    (["--probe-iters", "0"], "--probe-iters 0"),
    (["--probe-size", "64G"], "--probe-size"),
    (["--threshold", "-1"], "--threshold -1"),
    (["--threshold", "nan"], "--threshold nan"),
    (["--group-size", "-1"], "--group-size -1"),
    (["--group-delay", "-5"], "--group-delay -5"),
    (["--group-delay", "nan"], "--group-delay nan"),
    (["--node", "a100-0", "--rdzv-endpoint", "a100-0"], "expected HOST:PORT"),
    (["--node", "a100-0", "--rdzv-endpoint", "no-such-host.invalid:29400"], "does not resolve"),
    (["--nnodes", "2"], "without --node"),
    (["--", "train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--", "nosuch"], "invalid choice: 'nosuch'"),
    (["--", "train", "--steps", "0"], "steps"),
    (["--", "train", "--warmup-from", "/nonexistent/m.jsonl"], "--warmup-from /nonexistent/m.jsonl: cannot be read"),
    (["--warmup-from", "/nonexistent/m.jsonl"], "cannot be read"),
    (["--cluster", SLOW, "--", "train", "--cluster", EQUAL], "one cluster per job"),
])
def test_bad_options_and_jobs_exit_2_with_one_line_before_torchrun(tmp_path, capsys, argv, says):
    work = tmp_path / "work"
    code = hetcomm_main(["launch", "--work-dir", str(work)] + argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert says in err and len(err.splitlines()) == 1, err
    assert not work.exists()  # nothing was started: the launch directory is made just before torchrun


@pytest.mark.parametrize("name, value, says", [
    ("HETCOMM_GROUP_DELAY", "1e308", "above 3600"),  # used to overflow time.sleep in the workers
    ("HETCOMM_GROUP_SIZE", "two", "not a whole number"),
])
def test_bad_grouped_start_variables_exit_2_before_torchrun(tmp_path, capsys, monkeypatch, name, value, says):
    monkeypatch.setenv("HETCOMM_GROUP_SIZE", "1")
    monkeypatch.setenv(name, value)
    work = tmp_path / "work"
    code = hetcomm_main(["launch", "--work-dir", str(work)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert f"hetcomm launch: error: {name}={value!r} is not valid ({says})" in err and len(err.splitlines()) == 1, err
    assert not work.exists()


def _workers(work_dir: str):
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


def _rank_pid(work_dir: str, rank: int, module: str):
    want = {f"HETCOMM_LAUNCH_DIR={work_dir}".encode(), f"RANK={rank}".encode()}
    for pid in _workers(work_dir):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if want <= env and module.encode() in cmd:
            return pid
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _launch(argv, **kw):
    return subprocess.Popen([sys.executable, "-m", "hetcomm.cli.main", "launch"] + argv, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_torchrun_and_every_worker(tmp_path):
    # SIGTERM to the launcher's pid alone (what a scheduler, systemd or `kill PID` sends), while
    # torchrun's workers run (a long health check: the same supervision as the job's phase).
    work = str(tmp_path / "work")
    proc = _launch(["--health-only", "--cluster", SLOW, "--work-dir", work, "--probe-iters", "10000", "--probe-size", "4K"])
    try:
        _wait(lambda: all(os.path.exists(os.path.join(work, f"health-0-rank{r}.started")) for r in range(3)), 240,
              "every health worker")
        tree = set(descendants(proc.pid))
        workers = set(_workers(work))
        assert len(workers) >= 4  # torchrun's agent and its 3 workers
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM received during the health check; stopped torchrun and every worker" in out
    left = [p for p in tree | workers if _alive(p)]
    assert not left, f"left running after SIGTERM: {left}"


def test_sigint_is_forwarded_and_a_process_that_ignores_it_is_killed_after_the_grace(tmp_path):
    # A tree like torchrun's: the command starts a child in a session of its own that ignores
    # SIGINT, and the command itself exits at once on SIGINT (the child is orphaned).
    pidfile = tmp_path / "child.pid"
    script = (
        "import os, signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    import threading

    def send_sigint_when_started():
        _wait(lambda: pidfile.exists() and pidfile.read_text(), 60, "the child")
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=send_sigint_when_started, daemon=True)
    t.start()
    done = run_supervised([sys.executable, "-c", script], dict(os.environ), kill_grace_s=1.0)
    t.join(5)
    child = int(pidfile.read_text())
    assert done.signum == signal.SIGINT and done.exit_code == 130
    assert child in done.killed  # it ignored the signal: SIGKILLed after the grace
    assert not _alive(child)


def test_the_callers_own_children_are_not_the_jobs_to_stop():
    # `hetcomm launch` run in-process (a test runner, a notebook) has children of its own, e.g.
    # multiprocessing's fork server: when torchrun ends, the supervisor stops what torchrun left,
    # never those (it once SIGTERMed pytest's fork server: "No child processes" in later tests).
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        done = run_supervised([sys.executable, "-c", "pass"], dict(os.environ), kill_grace_s=1.0)
        assert done.exit_code == 0 and mine.pid not in done.killed
        assert mine.poll() is None, "the supervisor stopped a process the caller had started"
    finally:
        mine.kill()
        mine.wait()


@pytest.mark.slow
def test_a_failed_health_check_names_the_rank_that_died(tmp_path):
    work = str(tmp_path / "work")
    proc = _launch(["--health-only", "--cluster", SLOW, "--work-dir", work, "--probe-iters", "200", "--probe-size", "4K"])
    try:
        # Once every rank has its end mark set up (hetcomm.ops.rank_marks), rank 2 dies.
        _wait(lambda: all(os.path.exists(os.path.join(work, f"health-0-rank{r}.started")) for r in range(3)), 240,
              "every health worker")
        os.kill(_rank_pid(work, 2, "hetcomm.ops.health"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out[-3000:]
    line = next(ln for ln in out.splitlines() if "the health check failed" in ln)
    assert "rank 2 exited without a word" in line, line
    assert "rank 0 " not in line.split(":", 2)[-1].split(";")[0]  # the survivors are not blamed


@pytest.mark.slow
def test_the_job_runs_on_the_launch_cluster_and_a_job_that_fails_for_good_says_so(tmp_path):
    # Item 10: the train config names the 4-rank mixed-mini; launch --cluster a 3-rank cluster.
    # Item 16: a rank dies, --max-restarts is spent: one summary line naming it.
    work, metrics = str(tmp_path / "work"), str(tmp_path / "m.jsonl")
    proc = _launch(["--no-health", "--max-restarts", "0", "--cluster", SLOW, "--work-dir", work, "--", "train",
                    "--config", TINY, "--experts", "3", "--steps", "100000", "--metrics", metrics])
    try:
        _wait(lambda: os.path.exists(metrics) and read_metrics(metrics).steps, 240, "the first step")
        log = read_metrics(metrics)
        assert log.run.cluster == "slow-node" and log.run.world_size == 3
        assert [r["node"] for r in log.run.ranks] == ["fast-0", "fast-1", "slow-0"]
        assert all(os.path.exists(os.path.join(work, f"job-0-rank{r}.started")) for r in range(3))
        os.kill(_rank_pid(work, 1, "hetcomm.cli.launch_worker"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out[-3000:]
    line = next(ln for ln in out.splitlines() if "the job failed for good" in ln)
    assert "--max-restarts 0 spent" in line and "rank 1 exited without a word" in line, line


def test_the_give_up_line_counts_this_nodes_restarts_not_the_limit(tmp_path):
    # Real marks as each node's workers leave them; torchrun's agent numbers the attempts of its
    # own node, so a node that joined a later round gave up after fewer restarts than the limit.
    from hetcomm.ops.rank_marks import give_up_line, write_mark

    first, late = str(tmp_path / "first"), str(tmp_path / "late")
    os.mkdir(first)
    os.mkdir(late)
    for attempt in range(3):  # the node there from the start: attempts 0, 1, 2 (--max-restarts 2)
        write_mark(first, "job", attempt, 0, "started")
    write_mark(first, "job", 2, 0, "failed", error="CollectiveError: ... peer 1 ...", peer=1)
    line = give_up_line(first, 2, 1, 2, None)
    assert line.startswith("the job failed for good after 2 restart(s) (--max-restarts 2 spent; torchrun exit 1)"), line
    assert "rank 0 saw: CollectiveError" in line, line  # rank 1 ran on another node: no marks here
    write_mark(late, "job", 0, 1, "started")  # joined in the third round: its first attempt is 0
    line = give_up_line(late, 2, 1, 2, None)
    assert "after 0 restart(s) on this node, fewer than --max-restarts 2" in line, line
    assert "joined a later rendezvous round" in line and "spent" not in line, line
    assert "rank 1 exited without a word" in line, line


def test_the_node_hosting_the_rendezvous_is_never_ejected():
    from hetcomm.cli.launch import eject_plan
    from hetcomm.ops.health import judge

    m = [[None, 0.010, 0.100], [0.011, None, 0.105], [0.100, 0.105, None]]
    nodes = ["fast-0", "fast-1", "slow-0"]
    report = {"ranks": [{"rank": r, "node": n, "hosts_rendezvous": n == "slow-0"} for r, n in enumerate(nodes)],
              "pair_p50": m}
    verdict = judge(report)
    assert verdict.slow_nodes == ["slow-0"]
    assert eject_plan(report, verdict) == ([], ["slow-0"])  # slow, but it hosts the store: kept
    for r in report["ranks"]:
        r["hosts_rendezvous"] = r["node"] == "fast-0"
    assert eject_plan(report, verdict) == (["slow-0"], [])


def test_per_class_judge_scales_by_declared_speed_and_names_the_baseline():
    # Real numbers of an emulated run (tests/emulate/test_health_class.py) in miniature: the 910B
    # declares half the TFLOPS and takes twice as long (healthy); the H800 declares full speed and
    # takes twice as long too (throttled).
    from hetcomm.ops.health_class import judge_by_class

    models = ["A100-SXM4-80GB", "A100-SXM4-80GB", "H800", "910B"]
    gemm = [0.010, 0.011, 0.021, 0.020]
    report = {"ranks": [{"rank": r, "node": f"n{r}", "model": m, "gemm_s": g} for r, (m, g) in enumerate(zip(models, gemm))],
              "pair_p50": [[None, 1, 1, 1], [1, None, 1, 1], [1, 1, None, 1], [1, 1, 1, None]]}
    v = judge_by_class(report, [100.0, 100.0, 100.0, 50.0])
    assert [(s.rank, s.probe) for s in v.slow] == [(2, "compute")]
    s = v.slow[0]
    assert s.measured_s == 0.021 and abs(s.baseline_s - 0.0105) < 1e-9 and "speed-scaled median of 4" in s.baseline_of
    assert "rank 2 (H800 on n2) slow in compute" in s.line()
    assert v.compute_factor[3] < 1.4


def test_end_marks_name_the_rank_that_died_not_the_survivors(tmp_path):
    # Real files in a launch directory, as the workers leave them.
    from hetcomm.ops.rank_marks import clear_marks, culprits, describe, last_attempt, read_marks, write_mark

    work = str(tmp_path)
    for r in range(4):
        write_mark(work, "job", 1, r, "started")
    write_mark(work, "job", 1, 0, "failed", error="CollectiveError: ... peer 2 ...", peer=2)
    write_mark(work, "job", 1, 0, "stopped")  # the first mark wins: rank 0 stays failed
    write_mark(work, "job", 1, 1, "stopped")
    write_mark(work, "job", 1, 3, "failed", error="PeerTimeout: ... peer 2 ...", peer=2)
    marks = read_marks(work, "job", 1, 4)
    assert marks[0].status == "failed" and marks[2].status == "started"
    assert culprits(marks, 4) == [2] and last_attempt(work, "job") == 1
    assert "rank 2 exited without a word" in describe(marks, 4) and "rank 0 saw: CollectiveError" in describe(marks, 4)
    write_mark(work, "job", 1, 2, "failed", error="RuntimeError: boom")  # now it said something
    marks = read_marks(work, "job", 1, 4)
    assert culprits(marks, 4) == [2]  # still the one the others blamed
    os.symlink("/etc/passwd", os.path.join(work, "health-0-rank0.json"))
    assert read_marks(work, "health", 0, 1) == {}  # a planted link is not read
    clear_marks(work, "job")
    assert read_marks(work, "job", 1, 4) == {}
