"""In-memory snapshots (hetcomm.ops.snapshot): a killed rank costs at most one step, no manual action.

* the buddy choice (a rank on another node);
* 4 real ranks, each "node" with its own shared-memory root: snapshots with peer copies, the
  h800 node's memory lost, a fresh group restores every rank's state exactly, rank 2's over the
  wire from its buddy; the normal end leaves nothing behind;
* one 4-rank ``hetcomm launch -- train`` whose rank 2 is SIGKILLed mid-run and whose own
  snapshots are deleted with it: torchrun restarts the group, it restores from memory (rank 2
  from its peer copy), loses at most one step (counted in the summary), the losses after the
  restore equal an uninterrupted run's, and ``/dev/shm`` holds nothing of the job afterwards.
"""

from __future__ import annotations

import glob
import math
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from hetcomm.ops.metrics import read_metrics
from hetcomm.ops.snapshot import buddies
from tests.backends.ranks import run_ranks
from tests.ops.jobs import STEPS, TINY
from tests.ops.test_resume import REPO, _last_step, _worker_pid

HALFSPEED = os.path.join(REPO, "configs", "clusters", "mixed-mini-halfspeed.yaml")

NODES = ["a100", "a100", "h800", "ascend"]  # mixed-mini's ranks


def test_snapshot_knobs_are_checked():
    import pytest

    from hetcomm.cli.main import build_parser
    from hetcomm.cli.train import train_config
    from hetcomm.errors import ConfigError
    from hetcomm.train.loop import TrainConfig

    assert TrainConfig().snapshot_every == "auto" and TrainConfig().snapshot_peer
    for bad in (-1, "sometimes", True, 1.5):
        with pytest.raises(ConfigError, match="snapshot_every"):
            TrainConfig(snapshot_every=bad)
    cfg = train_config(build_parser().parse_args(["train", "--snapshot-every", "3", "--no-snapshot-peer",
                                                  "--checkpoint-async"]))
    assert (cfg.snapshot_every, cfg.snapshot_peer, cfg.checkpoint_async) == (3, False, True)
    with pytest.raises(ConfigError, match="snapshot-every"):
        train_config(build_parser().parse_args(["train", "--snapshot-every", "often"]))


def test_buddy_is_a_rank_on_another_node():
    assert buddies(NODES) == [2, 2, 3, 0]
    assert buddies(["n"] * 3) == [None, None, None]
    assert buddies(["a", "b"]) == [1, 0]


def _model(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _snapshot_rank(rank: int, world_size: int, root: str):
    import shutil

    import torch
    import torch.distributed as dist

    from hetcomm.ops.snapshot import Snapshotter, job_dir

    os.environ["HETCOMM_SNAPSHOT_ROOT"] = os.path.join(root, NODES[rank])  # one "node" per name
    os.environ["HETCOMM_JOB_ID"] = "unit"
    os.makedirs(os.environ["HETCOMM_SNAPSHOT_ROOT"], mode=0o700, exist_ok=True)
    model = _model(100 + rank)  # every rank's state differs: a copy of the wrong rank would show
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    snap = Snapshotter(rank, world_size, NODES, every=1, peer=True, timeout_s=30)
    for step in (1, 2, 3):
        loss = model(torch.randn(5, 4, generator=gen)).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        snap.take(step, model, opt, gen)
    snap.close(remove=False)
    want = [p.detach().clone() for p in model.parameters()]
    want_moment = opt.state[next(model.parameters())]["exp_avg"].clone()
    want_draw = torch.randn(3, generator=torch.Generator().set_state(gen.get_state()))
    dist.barrier()
    if rank == 2:  # the h800 node's memory is gone (a lost node): rank 2 only has its buddy's copy
        shutil.rmtree(job_dir("unit"))
    dist.barrier()
    # The restarted job: fresh objects, a fresh group.
    model2 = _model(7)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    gen2 = torch.Generator().manual_seed(99)
    snap2 = Snapshotter(rank, world_size, NODES, every=1, peer=True, timeout_s=30)
    got = snap2.restore(model2, opt2, gen2, below=3)  # a job of 3 steps: restore step 2, train 3 again
    early = (got.step, got.lost)
    got = snap2.restore(model2, opt2, gen2)
    same = all(torch.equal(a, b) for a, b in zip(want, model2.parameters()))
    same_moment = torch.equal(opt2.state[next(model2.parameters())]["exp_avg"], want_moment)
    same_draw = torch.equal(torch.randn(3, generator=gen2), want_draw)
    snap2.close(remove=True)
    left = os.path.exists(job_dir("unit"))
    return early, got.step, got.source, got.from_peer, got.lost, snap2.lost, same, same_moment, same_draw, left


def test_restore_from_memory_and_from_a_peer_copy_exactly(tmp_path):
    out = run_ranks(_snapshot_rank, 4, backend="gloo", args=(str(tmp_path),), timeout=120)
    for rank, (early, step, source, from_peer, lost, total, same, moment, draw, left) in enumerate(out):
        assert early == (2, 1), (rank, early)  # below=3: step 2 (the generation kept), one step lost
        assert (step, source, from_peer, lost) == (3, "memory+peer", (2,), 0), (rank, out[rank])
        assert total == 0  # the job's count comes with the snapshot restored (none lost before it)
        assert same and moment and draw, (rank, out[rank])  # weights, Adam moments, data position
        assert not left, f"rank {rank}'s node kept its snapshot directory"
    assert not glob.glob(str(tmp_path / "*" / "hetcomm-*")), os.listdir(tmp_path)


def _launch_and_kill(tmp_path, job_prefix: str, train_args, kill_after: int, rank: int, *, on_poll=None,
                     after_kill=None, limit_s: float = 240):
    """``hetcomm launch -- train TRAIN_ARGS --metrics M`` (no health check, 2 restarts) whose
    ``rank`` is SIGKILLed once rank 0 recorded step ``kill_after``. ``on_poll(done, work)`` runs at
    every poll before the kill, ``after_kill(shm)`` right after it. Returns ``(returncode, output,
    metrics path, the job's /dev/shm directory, killed pid or None)``."""
    work, metrics = str(tmp_path / "work"), str(tmp_path / "m.jsonl")
    job = f"{job_prefix}{uuid.uuid4().hex[:8]}"
    shm = f"/dev/shm/hetcomm-{os.getuid()}-{job}"
    cmd = [sys.executable, "-m", "hetcomm.cli.main", "launch", "--no-health", "--max-restarts", "2", "--work-dir", work,
           "--rdzv-id", job, "--", "train", *train_args, "--metrics", metrics]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    try:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and proc.poll() is None:
            done = _last_step(metrics)
            if on_poll is not None:
                on_poll(done, work)
            if done >= kill_after:
                pid = _worker_pid(work, rank)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
                    if after_kill is not None:
                        after_kill(shm)
                    break
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=max(10, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, metrics, shm, killed


def test_kill_one_rank_restores_from_memory_loses_at_most_one_step(tmp_path, demo_run):
    ref_loss = {s.step: s.loss for s in read_metrics(demo_run[1]).steps}  # uninterrupted, same job

    def own_memory_gone(shm: str) -> None:  # only the peer copy on rank 3 is left
        for f in glob.glob(os.path.join(shm, "r2-*.snap")):
            os.unlink(f)

    # mid-run: snapshots of several steps exist
    code, out, metrics, shm, killed = _launch_and_kill(tmp_path, "snaptest", ["--config", TINY, "--steps", str(STEPS)],
                                                       9, 2, after_kill=own_memory_gone)
    assert killed is not None, "the job ended before rank 2 could be killed"
    # Exit code = the tiny job's loss verdict (24 steps do not reach the demo's target), not a crash.
    verdict_pass = "verdict" in out and "PASS:" in out
    assert code == (0 if verdict_pass else 1), out[-4000:]
    assert "failed for good" not in out, out[-4000:]
    assert "peer 2" in out or "local_rank: 2" in out, out[-4000:]
    log = read_metrics(metrics)
    resumes = [e for e in log.events if e.event == "resume"]
    assert len(resumes) == 1 and resumes[0].detail.startswith("from memory"), ([e.detail for e in resumes], out[-3000:])
    assert "ranks 2 from peer copies" in resumes[0].detail, resumes[0].detail
    # The same membership came back: the snapshots' headers say so, and no change is recorded.
    assert not [e.detail for e in log.events if e.event == "membership"], out[-3000:]
    # Rank 0's startup marks of the restarted process, in order (benchmarks/snapshot_kill.py's parts).
    from hetcomm.ops.rank_marks import STARTUP_PHASES

    marks = resumes[0].marks
    assert list(marks) == list(STARTUP_PHASES), marks
    assert all(marks[a] <= marks[b] for a, b in zip(STARTUP_PHASES, STARTUP_PHASES[1:])), marks
    at = resumes[0].step
    seq = [s.step for s in log.all_steps]  # the first attempt's steps, then the restored one's
    cut = next((i for i in range(1, len(seq)) if seq[i] <= seq[i - 1]), None)
    lost = seq[cut - 1] - at if cut is not None else 0  # steps rank 0 finished, then did again
    assert 0 <= lost <= 1, (lost, at, seq)
    summary = next(line for line in out.splitlines() if line.startswith("restores / steps lost"))
    assert summary.split()[4:7] == ["1", "/", str(lost)], summary  # the summary counts what was lost
    assert [s.step for s in log.steps] == list(range(1, STEPS + 1))
    for s in log.steps:  # the final record of every step: the restored run's equal the reference
        assert math.isclose(s.loss, ref_loss[s.step], rel_tol=1e-5, abs_tol=1e-6), (s.step, s.loss, ref_loss[s.step])
    assert not os.path.exists(shm), os.listdir(shm)


def test_async_checkpoint_holds_the_state_at_the_save_and_commits(tmp_path):
    # --checkpoint-async: DCP's async_save copies the state before returning, so the step that
    # follows cannot leak into the checkpoint; finish_save commits it (latest moves only then).
    import torch

    from hetcomm.ops.checkpoint import finish_save, latest_checkpoint, load_checkpoint, save_checkpoint_async

    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    want = [p.detach().clone() for p in model.parameters()]
    root = str(tmp_path / "ck")
    pending = save_checkpoint_async(root, 5, model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next step, while the files are written
    assert latest_checkpoint(root) is None  # nothing committed yet
    path = finish_save(pending)
    assert path is not None and latest_checkpoint(root) == path
    fresh = _model(2)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert load_checkpoint(path, fresh, opt2) == 5
    assert all(torch.equal(a, b) for a, b in zip(want, fresh.parameters()))


def test_pack_round_trip_keeps_dtype_shape_and_bytes():
    import torch

    from hetcomm.ops.snapshot import pack, unpack

    t = {"w": torch.randn(3, 5), "step": torch.tensor(7.0), "ids": torch.arange(7), "mask": torch.tensor([True, False]),
         "none": torch.empty(0, 4), "tr": torch.randn(4, 3).t(), "bf": torch.randn(5).to(torch.bfloat16),
         "rng": torch.Generator().manual_seed(3).get_state()}
    out = unpack(bytes(pack(t, {"meta": {"step": 3}, "extras": {"x": {"y": torch.ones(2)}}})))
    assert out["meta"] == {"step": 3} and torch.equal(out["extras"]["x"]["y"], torch.ones(2))
    for k, v in t.items():
        got = out["tensors"][k]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k


def _snapshot_kill_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("snapshot_kill", os.path.join(REPO, "benchmarks", "snapshot_kill.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_recovery_parts_add_up_from_the_end_marks_and_the_startup_marks(tmp_path):
    # benchmarks/snapshot_kill.py's split of a recovery: the end marks' times (rank_marks.mark_times)
    # and the resume event's startup marks; the parts add up to the recovery, None where unknown.
    from hetcomm.ops.rank_marks import mark_times, write_mark

    bench = _snapshot_kill_module()
    for r, (status, t) in enumerate([("failed", 101.0), ("failed", 101.5), ("stopped", 102.0)]):
        write_mark(str(tmp_path), "job", 0, r, status)
        os.utime(tmp_path / f"job-0-rank{r}.json", (t, t))
    ended = mark_times(str(tmp_path), "job", 0, 4)
    assert ended == {0: 101.0, 1: 101.5, 2: 102.0}  # rank 3 (killed) left none
    marks = {"process": 105.0, "imports": 110.0, "group": 111.0, "model": 113.0, "restore": 113.5}
    parts = bench.recovery_parts(100.0, 114.0, marks, ended)
    assert parts == {"notice": 1.0, "stop": 1.0, "rendezvous_spawn": 3.0, "imports": 5.0, "group_init": 1.0,
                     "model_build": 2.0, "restore": 0.5, "first_step": 0.5}
    assert sum(parts.values()) == 14.0
    partial = bench.recovery_parts(100.0, 114.0, {}, ended)
    assert partial["rendezvous_spawn"] is None and partial["first_step"] is None and partial["stop"] == 1.0


def test_placement_check_reads_the_move_before_the_kill_and_the_counts_resumed_with():
    # benchmarks/snapshot_kill.py --emulate: the placement by speed's `migration` events (cold.py's
    # detail) at or before the kill step against the `resume` event's counts (hooks.experts_per_rank).
    from types import SimpleNamespace

    from hetcomm.ops.hooks import experts_per_rank
    from hetcomm.ops.metrics import Event

    bench = _snapshot_kill_module()
    layers = [SimpleNamespace(placement=SimpleNamespace(owner=o)) for o in ([0, 0, 1, 1, 1, 2, 2, 3], [0, 1, 1, 2, 2, 2, 3, 3])]
    resumed = "from memory after step 14 (memory); lost 1 step(s)" + experts_per_rank(layers, 4)
    assert resumed.endswith("; experts per rank: layer 0 [2, 3, 2, 1], layer 1 [1, 2, 3, 2]")
    moves = [Event(10, "migration", "layer 0: experts re-placed by measured busy time, moved [4], experts per rank [2, 3, 2, 1]"),
             Event(10, "migration", "layer 1: experts re-placed by measured busy time, moved [2, 5], experts per rank [1, 2, 3, 2]")]
    got = bench.placement_check(moves + [Event(14, "resume", resumed)], 15, resumed)
    assert got["move_before_kill"] and got["counts_restored"], got
    assert got["counts_after_restore"] == {0: [2, 3, 2, 1], 1: [1, 2, 3, 2]}
    other = resumed.replace("layer 1 [1, 2, 3, 2]", "layer 1 [2, 2, 2, 2]")  # a restore that lost the move
    assert bench.placement_check(moves, 15, other)["counts_restored"] is False
    late = bench.placement_check(moves, 9, resumed)  # killed before the move: nothing to restore
    assert not late["move_before_kill"] and late["counts_restored"] is None


def test_job_recovers_a_rank_killed_after_its_experts_moved(tmp_path):
    # A `hetcomm launch -- train` whose experts are re-placed by speed at step 5 (the slow rank
    # keeps fewer: expert counts change): the half-speed cluster's speeds are given (--speed
    # oracle), so the move happens in every run,
    # whatever the machine's load (measured speeds decide it only beyond their noise; the
    # default job's recovery under kill -9 is benchmarks/snapshot_kill.py). Before the placement
    # travelled in the snapshots, every restart after that move refused them ("taken by another
    # model") and the job failed for good.
    steps, kill_at = 30, 14
    # Wide experts (16 of 64 x 2048) make the slow rank's experts worth moving; with the demo's
    # it already holds the one expert every rank keeps.
    wide = tmp_path / "wide.yaml"
    with open(os.path.join(REPO, "configs", "train", "demo.yaml"), encoding="utf-8") as f:
        wide.write_text(f.read().replace("hidden_dim: 128", "hidden_dim: 2048"))
    args = ["--config", str(wide), "--experts", "16", "--steps", str(steps), "--cluster", HALFSPEED, "--speed", "oracle"]
    code, out, metrics, shm, killed = _launch_and_kill(tmp_path, "coldkill", args, kill_at, 1, limit_s=300)
    assert killed is not None, "the job ended before rank 1 could be killed"
    log = read_metrics(metrics)
    moves = [e for e in log.events if e.event == "migration" and e.step <= kill_at]
    assert moves, "no expert moved before the kill: this test covers a restore after a run-time placement change"
    assert "failed for good" not in out and "taken by another model" not in out, out[-4000:]
    verdict_pass = "verdict" in out and "PASS:" in out
    assert code == (0 if verdict_pass else 1), out[-4000:]
    resumes = [e for e in log.events if e.event == "resume"]
    assert len(resumes) == 1 and resumes[0].detail.startswith("from memory"), [e.detail for e in resumes]
    assert resumes[0].step >= kill_at - 1, resumes[0].step  # after the move: at most one step lost
    cold = next(line for line in out.splitlines() if line.startswith("placement by speed"))
    assert f"at step {moves[0].step}" in cold and "moved" in cold, cold  # the restarted ranks remember the move
    check = _snapshot_kill_module().placement_check(log.events, kill_at, resumes[0].detail)
    assert check["counts_restored"], check  # the restarted job trains on the moved placement
    assert [s.step for s in log.steps] == list(range(1, steps + 1))
    assert not os.path.exists(shm), os.listdir(shm)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_full_shared_memory_skips_snapshots_with_one_warning(tmp_path):
    # A real tmpfs, filled up: the job runs on (its disk checkpoints still stand), says so once,
    # and counts the skipped files in the summary and the metrics.
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=1777", "tmpfs", str(mnt)], check=True)
    try:
        with open(mnt / "filler", "wb", buffering=0) as f:  # every page taken
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        metrics = str(tmp_path / "m.jsonl")
        env = dict(os.environ, HETCOMM_SNAPSHOT_ROOT=str(mnt))
        proc = subprocess.run([sys.executable, "-m", "hetcomm.cli.main", "train", "--config", TINY, "--steps", "6",
                               "--snapshot-every", "1", "--metrics", metrics],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        out = proc.stdout + proc.stderr
        assert proc.returncode in (0, 1) and "verdict" in out, out[-4000:]  # 1: the tiny job's loss verdict
        assert "Traceback" not in out and "No space left" in out, out[-4000:]
        assert out.count("no space left for in-memory snapshots") == 1, out[-4000:]
        row = next(line for line in out.splitlines() if line.startswith("snapshots "))
        assert "0 taken" in row and "skipped, no space" in row, row
        log = read_metrics(metrics)
        assert [e.event for e in log.events].count("snapshot-skipped") == 1, [e.event for e in log.events]
        assert sorted(os.listdir(mnt)) == ["filler"], os.listdir(mnt)  # nothing of the job left behind
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_rank_whose_own_and_buddy_snapshots_are_lost_restarts_from_zero_and_says_what_was_lost(tmp_path):
    # Rank 2's own snapshots and its buddy's copies both gone: no step is complete in memory, no
    # disk checkpoint. The job starts again from step 0 and reports the steps it redoes (it said
    # "steps lost 0").
    def all_copies_gone(shm: str) -> None:
        for f in glob.glob(os.path.join(shm, "[rp]2-*.snap")):
            os.unlink(f)

    _, out, metrics, shm, killed = _launch_and_kill(tmp_path, "lostall", ["--config", TINY, "--steps", str(STEPS)],
                                                    9, 2, after_kill=all_copies_gone)
    assert killed is not None, "the job ended before rank 2 could be killed"
    assert "failed for good" not in out, out[-4000:]
    log = read_metrics(metrics)
    first = [s.step for s in log.all_steps]
    done = max(first[: next(i for i in range(1, len(first)) if first[i] <= first[i - 1])])  # before the restart
    resumes = [e for e in log.events if e.event == "resume"]
    assert len(resumes) == 1 and resumes[0].step == 0, [(e.step, e.detail) for e in resumes]
    assert resumes[0].detail.startswith("from nothing"), resumes[0].detail
    lost = int(resumes[0].detail.rsplit("lost ", 1)[1].split()[0])
    assert done - 1 <= lost <= done + 1, (lost, done)  # rank 0's last record vs the newest any rank finished
    row = next(line for line in out.splitlines() if line.startswith("restores / steps lost"))
    assert row.split()[4:7] == ["1", "/", str(lost)] and "started again from step 0" in row, row
    from hetcomm.ops.doctor import diagnose, load_record

    found = [f for f in diagnose(load_record([metrics])) if f.code == "work-lost"]
    assert len(found) == 1 and f"{lost} finished step(s)" in found[0].message, found
    assert not os.path.exists(shm), os.listdir(shm)
