"""Recovery of the default job, full size: kill -9 (or SIGSTOP) one rank of a 200-step `hetcomm launch -- train`.

    python benchmarks/snapshot_kill.py [--steps 200] [--seed S | --at STEP] [--rank 2] [--signal KILL|STOP]
                                       [--out DIR] [--reference M.jsonl]

4 ranks of mixed-mini (the demo's defaults; in-memory snapshots every step, their default under
`hetcomm launch`), one rank signalled once rank 0 recorded step ``--at`` (default: a random step
in [30, 170], seeded), and an uninterrupted run of the same job for reference (or `--reference` a
metrics file of one). Prints one JSON line:
exit code, kill step, the step restored, steps lost (the summary's count and the metrics'),
recovery time (the kill to the first step completed after the restore), the largest relative loss
difference to the reference at the same step after the restore, and what is left in /dev/shm.

``recovery_parts`` splits the recovery (seconds, they add up to ``recovery_s``):

* ``notice``: the kill to the first survivor's failure mark (``hetcomm.ops.rank_marks``: a mark
  file's modification time is when its rank ended);
* ``stop``: from there to the last mark of the killed attempt (torchrun stopping the rest);
* ``rendezvous_spawn``: from there to the start of rank 0's new process (``/proc``);
* ``imports``, ``group_init``, ``model_build``, ``restore``: rank 0's startup marks, carried by
  the ``resume`` metrics event (``Event.marks``: process, imports, group, model, restore);
* ``first_step``: the restore to the first step the restored group completed (seen here).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hetcomm.ops.metrics import read_metrics  # noqa: E402
from hetcomm.ops.rank_marks import last_attempt, mark_times  # noqa: E402


def recovery_parts(t_kill: float, t_recovered: float, marks: dict, ended: dict) -> dict:
    """The parts of one recovery (module docstring): ``marks``, the resume event's startup
    marks; ``ended``, when each rank of the killed attempt left its mark. None where unknown."""
    points = [("notice", min(ended.values(), default=None)), ("stop", max(ended.values(), default=None)),
              ("rendezvous_spawn", marks.get("process")), ("imports", marks.get("imports")),
              ("group_init", marks.get("group")), ("model_build", marks.get("model")),
              ("restore", marks.get("restore")), ("first_step", t_recovered)]
    out, prev = {}, t_kill
    for name, t in points:
        out[name] = None if t is None or prev is None else round(t - prev, 2)
        prev = t
    return out


def _worker_pid(work: str, rank: int):
    want = {f"HETCOMM_LAUNCH_DIR={work}".encode(), f"RANK={rank}".encode()}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if want <= set(f.read().split(b"\0")):
                        return int(pid)
            except OSError:
                continue
    return None


def _steps(path: str):
    try:
        return read_metrics(path).all_steps
    except Exception:  # being written
        return []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--at", type=int, default=None, help="signal the rank once rank 0 recorded this step")
    ap.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    ap.add_argument("--out", default="/tmp/hetcomm-snapshot-kill")
    ap.add_argument("--reference", default=None, help="metrics of an uninterrupted run of the same job")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    kill_at = args.at if args.at is not None else random.Random(args.seed).randint(30, min(170, args.steps - 10))
    hetcomm = [sys.executable, "-m", "hetcomm.cli.main"]
    ref = args.reference
    if ref is None:
        ref = os.path.join(args.out, "ref.jsonl")
        t = time.time()
        subprocess.run(hetcomm + ["train", "--steps", str(args.steps), "--metrics", ref], cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"reference run: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    ref_loss = {s.step: s.loss for s in read_metrics(ref).steps}
    work, metrics = os.path.join(args.out, f"work-{uuid.uuid4().hex[:6]}"), os.path.join(args.out, "m.jsonl")
    if os.path.exists(metrics):
        os.unlink(metrics)
    job = f"snapkill{uuid.uuid4().hex[:8]}"
    shm = f"/dev/shm/hetcomm-{os.getuid()}-{job}"
    cmd = hetcomm + ["launch", "--no-health", "--max-restarts", "2", "--work-dir", work, "--rdzv-id", job, "--",
                     "train", "--steps", str(args.steps), "--metrics", metrics]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t_kill = killed_step = n_at_resume = t_recovered = None
    recovered_s = None
    while proc.poll() is None:
        steps = _steps(metrics)
        last = steps[-1].step if steps else 0
        if t_kill is None and last >= kill_at:
            pid = _worker_pid(work, args.rank)
            if pid is not None:
                os.kill(pid, getattr(signal, f"SIG{args.signal}"))
                t_kill, killed_step = time.time(), last
        elif t_kill is not None and recovered_s is None:
            try:
                log = read_metrics(metrics)
            except Exception:
                log = None
            if log is not None and n_at_resume is None and any(e.event == "resume" for e in log.events):
                n_at_resume = len(log.all_steps)  # the new group's header and resume line are in
            elif log is not None and n_at_resume is not None and len(log.all_steps) > n_at_resume:
                t_recovered = time.time()
                recovered_s = t_recovered - t_kill  # the first step the restored group completed
        time.sleep(0.05)
    out = proc.stdout.read()
    log = read_metrics(metrics)
    resumes = [e for e in log.events if e.event == "resume"]
    at = resumes[-1].step if resumes else None
    seq = [s.step for s in log.all_steps]
    cut = next((i for i in range(1, len(seq)) if seq[i] <= seq[i - 1]), None)
    lost = (seq[cut - 1] - at if cut is not None else 0) if at is not None else None
    summary = next((line for line in out.splitlines() if line.startswith("restores / steps lost")), "")
    after = [s for s in log.steps if at is not None and s.step > at]
    worst = max((abs(s.loss - ref_loss[s.step]) / abs(ref_loss[s.step]) for s in after), default=None)
    parts = None
    if t_kill is not None and t_recovered is not None and resumes:
        attempt = last_attempt(work, "job")
        parts = recovery_parts(t_kill, t_recovered, resumes[-1].marks, mark_times(work, "job", max(0, attempt - 1), 4))
    rec = {
        "exit": proc.returncode, "steps": args.steps, "seed": args.seed, "signal": args.signal, "rank": args.rank,
        "kill_at_step": killed_step,
        "restored_after_step": at, "resume": resumes[-1].detail if resumes else None, "lost_metrics": lost,
        "summary_row": summary.strip(), "recovery_s": None if recovered_s is None else round(recovered_s, 1),
        "recovery_parts": parts,
        "max_rel_loss_diff_after_restore": worst, "final_loss": log.steps[-1].loss if log.steps else None,
        "ref_final_loss": ref_loss.get(args.steps), "wall_s": round(time.time() - t0, 1),
        "shm_left": sorted(glob.glob(f"/dev/shm/hetcomm-{os.getuid()}-*")) if os.path.exists(shm) else [],
        "load": os.getloadavg()[0],
    }
    print(json.dumps(rec))
    if proc.returncode != 0:
        print(out[-3000:], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
