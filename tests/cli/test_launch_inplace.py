"""``hetcomm launch --shrink-in-place`` (hetcomm/cli/_launch_inplace.py): a one-machine train job
whose job phase runs on hetcomm's own launcher, so a rank killed with -9 leaves the survivors to
shrink the group in place and finish.

The real command (``tests/cli/inplace_launch.py`` is ``hetcomm launch`` with the kill hook of
``tests/train/test_inplace_shrink.py`` in the job's ranks): the health check under torchrun, then
the tiny 4-rank job; rank 2 (or rank 0) SIGKILLs itself after step 4 (its own snapshots deleted
first). The launch exits with the job's own verdict (not a failure), its last line names the victim
as dead and the other three as finished in place with the pids the launcher started them as, and those are the
pids that finished training as ranks 0-2 of 3; at most one step redone; the membership record
says 4 -> 3 naming the victim; no snapshot is left. Then the refusals, before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from hetcomm.backends.reconfigure import supported
from hetcomm.cli.main import main as hetcomm_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "tests", "ops", "tiny.yaml")
STEPS = 8

needs_214 = pytest.mark.skipif(not supported(), reason="an in-place shrink needs torch >= 2.14 (dist.shrink_group)")


def _tiny_launch_dirs(tmp_path):
    """``(work, out, shm, metrics path, config)`` of a launch of the tiny job, with a 120 s group
    timeout: the launch's time limit (timeout_s + 10 s a step) then leaves room for four ranks
    importing torch on a loaded 2-core machine (~55 s seen)."""
    work, out_dir, shm = tmp_path / "work", tmp_path / "out", tmp_path / "shm"
    out_dir.mkdir()
    shm.mkdir()
    config = tmp_path / "tiny.yaml"
    with open(TINY, encoding="utf-8") as f:
        text = f.read()
    assert "timeout_s: 60" in text
    config.write_text(text.replace("timeout_s: 60", "timeout_s: 120").replace(
        "cluster: configs/clusters/mixed-mini.yaml", f"cluster: {REPO}/configs/clusters/mixed-mini.yaml"))
    return work, out_dir, shm, str(tmp_path / "m.jsonl"), config


@needs_214
@pytest.mark.slow
@pytest.mark.timeout(600)
# 0: the rank a torchrun attempt's store would live in (hetcomm.ops.worker.fresh_store); here the
# launcher hosts it, so the survivors shrink over it
@pytest.mark.parametrize("victim", [2, 0])
def test_launch_shrink_in_place_survivors_finish_in_their_processes(tmp_path, victim):
    from hetcomm.ops.metrics import read_metrics
    from tests.train.test_inplace_shrink import check_membership_change

    work, out_dir, shm, metrics, config = _tiny_launch_dirs(tmp_path)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               INPLACE_TEST_VICTIM=str(victim), INPLACE_TEST_OUT=str(out_dir), HETCOMM_SNAPSHOT_ROOT=str(shm))
    for name in ("HETCOMM_CLUSTER", "HETCOMM_JOB_ID", "HETCOMM_LAUNCH_NONCE", "HETCOMM_LAUNCH_OWNER"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.cli.inplace_launch", "--shrink-in-place", "--work-dir", str(work),
         # the health verdict is not under test: a loaded machine's probes can take 3x the median
         "--probe-size", "4K", "--probe-iters", "2", "--threshold", "1e6",
         "--", "train", "--config", str(config), "--steps", str(STEPS), "--metrics", metrics],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    out = proc.stdout + proc.stderr
    assert "phase 1, health check" in out, out[-4000:]  # the phases before the job are unchanged
    # Exit code = the tiny job's loss verdict (8 steps do not reach the demo's target), not a failure.
    verdict_pass = "verdict" in out and "PASS:" in out
    assert proc.returncode == (0 if verdict_pass else 1), out[-4000:]

    line = next((ln for ln in out.splitlines() if ln.startswith("hetcomm launch: rank(s)")), None)
    assert line is not None, out[-4000:]
    survivors = [r for r in range(4) if r != victim]
    pids = ", ".join(f"{r}:" + r"(\d+)" for r in survivors)
    m = re.fullmatch(rf"hetcomm launch: rank\(s\) \[{victim}\] died \(rank {victim} \(pid (\d+)\): signal 9\); ranks "
                     rf"\[{', '.join(map(str, survivors))}\] shrank the group in place and finished \(pids {pids}\)", line)
    assert m, line
    started = dict(zip(survivors, map(int, m.groups()[1:])))
    for new, r in enumerate(survivors):
        with open(out_dir / f"rank{r}.json", encoding="utf-8") as f:
            got = json.load(f)
        # in place: the process the launcher started as rank r finished training as new rank `new` of 3
        assert got["pid_end"] == started[r], (r, got, started)
        assert (got["world"], got["rank"], got["shrinks"], got["slots"]) == (3, new, 1, survivors), got
        assert got["finite"], f"rank {r}: a weight is not finite"
    assert not (out_dir / f"rank{victim}.json").exists()

    row = next(ln for ln in out.splitlines() if ln.startswith("restores / steps lost"))
    assert row.split()[4:7] in (["1", "/", "0"], ["1", "/", "1"]), row  # at most one step redone
    check_membership_change(metrics, victim)
    assert [s.step for s in read_metrics(metrics).steps][-1] == STEPS
    assert os.listdir(shm) == [], os.listdir(shm)  # the job's snapshots are gone


@needs_214
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_grow_back_takes_the_killed_rank_back_in_place(tmp_path):
    """``hetcomm launch --shrink-in-place --grow-back``: rank 2 killed after step 4, the survivors
    shrink, the launcher starts a replacement in slot 2 (through the worker's own entry, as the
    others), the survivors take it back in (at the latest after step 7: the wait hook) and all
    four finish as ranks 0-3 of 4; the launch's last lines name both pids of rank 2."""
    from hetcomm.ops.metrics import read_metrics

    work, out_dir, shm, metrics, config = _tiny_launch_dirs(tmp_path)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               INPLACE_TEST_VICTIM="2", INPLACE_TEST_OUT=str(out_dir), INPLACE_TEST_GROW="1",
               HETCOMM_SNAPSHOT_ROOT=str(shm))
    for name in ("HETCOMM_CLUSTER", "HETCOMM_JOB_ID", "HETCOMM_LAUNCH_NONCE", "HETCOMM_LAUNCH_OWNER", "HETCOMM_JOIN"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.cli.inplace_launch", "--shrink-in-place", "--grow-back", "--work-dir", str(work),
         "--probe-size", "4K", "--probe-iters", "2", "--threshold", "1e6",
         "--", "train", "--config", str(config), "--steps", "10", "--metrics", metrics],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    out = proc.stdout + proc.stderr
    verdict_pass = "verdict" in out and "PASS:" in out
    assert proc.returncode == (0 if verdict_pass else 1), out[-4000:]
    m = re.search(r"hetcomm launch: rank 2 \(pid (\d+)\) was killed by signal 9; pid (\d+) was started in its slot "
                  r"\(--grow-back\) and finished", out)
    assert m, out[-4000:]
    assert "died" not in out.splitlines()[-1], out[-2000:]  # every process in the outcome finished
    for r in range(4):
        with open(out_dir / f"rank{r}.json", encoding="utf-8") as f:
            got = json.load(f)
        assert (got["world"], got["rank"], got["slots"], got["shrinks"]) == (4, r, [0, 1, 2, 3], 1), (r, got)
        assert got["finite"], f"rank {r}: a weight is not finite"
    with open(out_dir / "rank2.json", encoding="utf-8") as f:
        assert json.load(f)["pid_end"] == int(m.group(2)) != int(m.group(1))
    events = [e.detail for e in read_metrics(metrics).events if e.event == "membership"]
    assert [e.split(" ranks")[0] for e in events] == ["4 -> 3", "3 -> 4"], events
    assert "cause: cluster rank 2 (H800 on h800-0) rejoined" in events[1], events[1]
    assert [s.step for s in read_metrics(metrics).steps][-1] == 10
    assert os.listdir(shm) == [], os.listdir(shm)


@pytest.mark.parametrize("argv, says", [
    (["--node", "a100-0", "--rdzv-endpoint", "127.0.0.1:29400", "--shrink-in-place"],
     "--shrink-in-place with --node a100-0"),
    (["--shrink-in-place", "--", "bench"], "--shrink-in-place applies to `train` jobs, not `bench`"),
    (["--grow-back"], "--grow-back takes a dead rank's slot back after an in-place shrink; add --shrink-in-place"),
    (["--", "train", "--grow-back"], "--grow-back takes a killed rank's slot back after an in-place shrink; add "),
] + ([
    (["--shrink-in-place", "--", "train", "--backend", "gloo"], "--shrink-in-place needs the hetcomm backend"),
    (["--shrink-in-place", "--", "train", "--snapshot-every", "0"], "restores the survivors from the in-memory snapshots"),
] if supported() else [
    (["--shrink-in-place"], "--shrink-in-place needs torch >= 2.14 (dist.shrink_group)"),
]))
def test_shrink_in_place_refused_before_anything_starts(tmp_path, capsys, argv, says):
    work = tmp_path / "work"
    code = hetcomm_main(["launch", "--work-dir", str(work)] + argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert says in err and len(err.splitlines()) == 1, err
    if "restores the survivors" not in says and "--grow-back" not in says:
        assert "drop --shrink-in-place" in err or "drop it" in err, err  # the fix: the restart path
    assert not work.exists()  # nothing was started


@needs_214
def test_grow_back_is_passed_on_to_the_train_job():
    """``hetcomm launch --shrink-in-place --grow-back``: the job gets both flags (once), and its
    ranks' launch options start a replacement in a dead rank's slot (HETCOMM_JOIN)."""
    from hetcomm.cli import _launch_inplace
    from hetcomm.cli.main import build_parser
    from hetcomm.train.local_ranks import launch_options

    for extra in ([], ["--grow-back"]):
        args = build_parser().parse_args(["launch", "--shrink-in-place", "--grow-back", "--", "train", *extra])
        job = _launch_inplace.check(args, ["train", *extra])
        assert job[0] == "train" and sorted(job[1:]) == ["--grow-back", "--shrink-in-place"], job
    cfg = _launch_inplace.check_config(job + ["--config", TINY])
    assert cfg.grow_back and launch_options(cfg, in_place=True).rejoin == {"HETCOMM_JOIN": "1"}


@needs_214
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_during_the_in_place_job_stops_every_rank(tmp_path):
    """SIGTERM to the launch while the job runs on hetcomm's launcher: every rank stopped, exit
    128 + 15 with one line saying so, no process of the launch left (as on the torchrun path)."""
    import signal
    import time

    from tests.ops.test_launch_edges import _wait, _workers

    work = str(tmp_path / "work")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HETCOMM_SNAPSHOT_ROOT=str(tmp_path / "shm"))
    os.makedirs(tmp_path / "shm")
    proc = subprocess.Popen([sys.executable, "-m", "hetcomm.cli.main", "launch", "--no-health", "--shrink-in-place",
                             "--work-dir", work, "--", "train", "--config", TINY, "--steps", "100000"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: all(os.path.exists(os.path.join(work, f"job-0-rank{r}.started")) for r in range(4)), 240,
              "every rank's start mark")
        assert len(_workers(work)) >= 4  # the ranks carry the launch directory in their environment
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "hetcomm launch: SIGTERM received during the job; stopped every rank" in out, out[-3000:]
    deadline = time.monotonic() + 10
    while _workers(work) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _workers(work) == [], _workers(work)
    assert os.listdir(tmp_path / "shm") == [], os.listdir(tmp_path / "shm")  # the job's snapshots removed
