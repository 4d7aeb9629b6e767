"""Recovery of the default job, full size: kill -9 (or SIGSTOP) one rank of a `hetcomm launch -- train`.

    python benchmarks/snapshot_kill.py [--steps 200] [--seed S | --at STEP] [--rank 2] [--signal KILL|STOP]
                                       [--out DIR] [--reference M.jsonl]
    sudo python benchmarks/snapshot_kill.py --emulate configs/clusters/mislabelled-halfspeed.yaml
                                       --config configs/train/testbed.yaml --at 15 --rank slow --require-move

4 ranks of mixed-mini (the demo's defaults; in-memory snapshots every step, their default under
`hetcomm launch`), one rank signalled once rank 0 recorded step ``--at`` (default: a random step
in [30, 170], seeded), and an uninterrupted run of the same job for reference (or `--reference` a
metrics file of one). Prints one JSON line:
exit code, kill step, the step restored, steps lost (the summary's count and the metrics'),
recovery time (the kill to the first step completed after the restore), the largest relative loss
difference to the reference at the same step after the restore, and what is left in /dev/shm.

``--emulate CLUSTER`` (root) runs the job on the heterogeneity testbed instead, where the default
moves experts: ``hetcomm emulate up --compute`` of the cluster (default job config
``configs/train/testbed.yaml``; ``--steps`` defaults to the config's), one ``hetcomm launch --node``
per emulated node (their torchrun rendezvous on rank 0's node, as ``elastic_shrink_run.sh``), the
reference the same launches with no signal. A node's launch starts all its ranks' workers in the
node's first rank's cpu cgroup, so each worker is moved into its own rank's cgroup and core as soon
as it appears (the emulation's per-rank quota, ``hetcomm.emulate.cgroup``; after a restart too).
``--rank slow`` signals the worker on the slowest node (lowest ``compute_scale``). The JSON line
then also says whether the placement by speed had changed the expert counts before the signal
(``move_before_kill``: the ``migration`` events' ``experts per rank`` at or before the kill step),
the counts before the kill and those the restarted job resumed with (the ``resume`` event's
``experts per rank``), and whether they are equal (``counts_restored``); ``--require-move``: exit 1
when no count-changing move came before the signal (the default's verdict was "equal" or came
late), and exit 1 whenever the counts were not restored.

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
import re
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


def _environ(pid: str):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.decode(errors="replace").split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None


def _workers(works: set) -> dict:
    """``pid -> environ`` of the job's workers: processes whose ``HETCOMM_LAUNCH_DIR`` is one of
    ``works`` and that torchrun started (``TORCHELASTIC_RESTART_COUNT``; under ``hetcomm emulate``
    the launch and torchrun's agent carry the emulation's ``RANK`` too, which is not the job's)."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            env = _environ(pid)
            if env and env.get("HETCOMM_LAUNCH_DIR") in works and "TORCHELASTIC_RESTART_COUNT" in env:
                out[int(pid)] = env
    return out


def _steps(path: str):
    try:
        return read_metrics(path).all_steps
    except Exception:  # being written
        return []


class Emulation:
    """``hetcomm emulate up --compute`` of ``cluster`` (module docstring): one ``hetcomm launch
    --node`` per node, each worker moved into its own rank's cpu cgroup and core."""

    def __init__(self, cluster: str, subnet: str, state_dir: str) -> None:
        from hetcomm.emulate.state import load_state, state_path

        self.state_dir = state_dir
        out = subprocess.run(_hetcomm("emulate", "up", "--compute", "--cluster", cluster, "--subnet", subnet,
                                      "--state-dir", state_dir), capture_output=True, text=True, cwd=REPO, env=_env())
        if out.returncode != 0:
            sys.exit(f"snapshot_kill: emulate up {cluster} failed:\n{out.stdout}{out.stderr}")
        self.run_id = out.stdout.strip().splitlines()[-1].strip()
        self.cluster = os.path.join(REPO, cluster)
        self.state = load_state(state_path(state_dir, self.run_id[2:]))
        self.nodes = {n["node"]: n for n in self.state.nodes}
        self.slow_node = min(self.state.nodes, key=lambda n: n.get("compute_scale", 1.0))["node"]
        self.cgroups = {os.path.basename(c)[len(self.state.prefix):]: c for c in self.state.cgroups}
        self.placed: set = set()

    def down(self) -> None:
        subprocess.run(_hetcomm("emulate", "down", "--id", self.run_id, "--state-dir", self.state_dir),
                       capture_output=True, cwd=REPO, env=_env())

    def command(self, job: str, work: str, train: list) -> list:
        """``hetcomm emulate run`` of one launch per node (the other ranks' shells exit at once);
        each node's launch output goes to ``work/launch-<node>.log``, its exit code to
        ``work/exit-<node>``."""
        import shlex

        port = 29400 + int(job[-4:], 16) % 500
        launch = [sys.executable, "-m", "hetcomm.cli.main", "launch", "--cluster", self.cluster, "--node",
                  "$HETCOMM_EMULATE_NODE", "--rdzv-endpoint", f"$MASTER_ADDR:{port}", "--rdzv-id", job,
                  "--local-addr", "${HETCOMM_EMULATE_ADDRS%%,*}", "--no-health", "--max-restarts", "2",
                  "--work-dir", f"{work}/$HETCOMM_EMULATE_NODE", "--", *train]
        line = " ".join(a if "$" in a else shlex.quote(a) for a in launch)
        line = line.replace("$HETCOMM_EMULATE_NODE", '"$HETCOMM_EMULATE_NODE"')
        node_cmd = (f'if [ "$LOCAL_RANK" != 0 ]; then exit 0; fi; {line} > {work}/launch-"$HETCOMM_EMULATE_NODE".log 2>&1; '
                    f'echo $? > {work}/exit-"$HETCOMM_EMULATE_NODE"')
        return _hetcomm("emulate", "run", "--id", self.run_id, "--state-dir", self.state_dir, "--timeout", "900",
                        "--", "sh", "-c", node_cmd)

    def place(self, workers: dict) -> None:
        """Move each new worker into its rank's cgroup and pin its threads to its rank's core."""
        from hetcomm.emulate.ranks import rank_core

        for pid, env in workers.items():
            if pid in self.placed:
                continue
            node = self.nodes.get(env.get("HETCOMM_EMULATE_NODE", ""))
            if node is None:
                continue
            er = node["ranks"][int(env.get("LOCAL_RANK", "0"))]
            cg = self.cgroups.get(f"{node['node']}-r{er}")
            try:
                if cg is not None:
                    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                        f.write(str(pid))
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), {rank_core(er)})
            except OSError:
                continue  # gone (a restart): its successor is placed on the next look
            self.placed.add(pid)


def _hetcomm(*args: str) -> list:
    return [sys.executable, "-m", "hetcomm.cli.main", *args]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


_MOVE = re.compile(r"layer (\d+): experts re-placed.*experts per rank (\[[\d, ]+\])")
_RESUMED = re.compile(r"layer (\d+) (\[[\d, ]+\])")


def placement_check(events: list, killed_step, resume_detail) -> dict:
    """From the metrics' events: the placement changes at or before the kill step (``migration``
    events' ``experts per rank``, the last per layer), the counts the restarted job resumed with
    (the ``resume`` event's ``experts per rank``), and whether every moved layer's counts came back."""
    before = {}
    for e in events:
        if e.event == "migration" and killed_step is not None and e.step <= killed_step:
            m = _MOVE.search(e.detail)
            if m:
                before[int(m.group(1))] = (e.step, json.loads(m.group(2)))
    after = {}
    if resume_detail and "experts per rank:" in resume_detail:
        tail = resume_detail.split("experts per rank:", 1)[1]
        after = {int(m.group(1)): json.loads(m.group(2)) for m in _RESUMED.finditer(tail)}
    restored = bool(before) and all(after.get(layer) == counts for layer, (_, counts) in before.items())
    return {"move_before_kill": bool(before),
            "moves": {layer: f"step {st}: {counts}" for layer, (st, counts) in sorted(before.items())},
            "counts_after_restore": after, "counts_restored": restored if before else None}


def run_job(args, emu, kill_at, metrics: str) -> dict:
    """One launch of the job; ``kill_at`` None: no signal (a reference). Returns what was seen."""
    work = os.path.join(args.out, f"work-{uuid.uuid4().hex[:6]}")
    os.makedirs(work, mode=0o700)
    if os.path.exists(metrics):
        os.unlink(metrics)
    job = f"snapkill{uuid.uuid4().hex[:8]}"
    train = ["train", "--steps", str(args.steps), "--metrics", metrics] + (["--config", args.config] if args.config else [])
    if emu is None:
        cmd = _hetcomm("launch", "--no-health", "--max-restarts", "2", "--work-dir", work, "--rdzv-id", job, "--", *train)
        works = {work}
    else:
        cmd = emu.command(job, work, train)
        works = {os.path.join(work, n) for n in emu.nodes}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    t_kill = killed_step = killed_rank = n_at_resume = t_recovered = None
    t_look = 0.0
    while proc.poll() is None:
        steps = _steps(metrics)
        last = steps[-1].step if steps else 0
        if emu is not None and time.time() - t_look > 1.0:
            emu.place(_workers(works))
            t_look = time.time()
        if kill_at is not None and t_kill is None and last >= kill_at:
            for pid, env in _workers(works).items():
                if (args.rank == "slow" and env.get("HETCOMM_EMULATE_NODE") == emu.slow_node) or env["RANK"] == args.rank:
                    os.kill(pid, getattr(signal, f"SIG{args.signal}"))
                    t_kill, killed_step, killed_rank = time.time(), last, int(env["RANK"])
                    break
        elif t_kill is not None and t_recovered is None:
            try:
                log = read_metrics(metrics)
            except Exception:
                log = None
            if log is not None and n_at_resume is None and any(e.event == "resume" for e in log.events):
                n_at_resume = len(log.all_steps)  # the new group's header and resume line are in
            elif log is not None and n_at_resume is not None and len(log.all_steps) > n_at_resume:
                t_recovered = time.time()  # the first step the restored group completed
        time.sleep(0.1)
    out = proc.stdout.read()
    # before an emulation's tear-down removes its nodes' /dev/shm directories
    shm_root = "/dev/shm" if emu is None else f"/dev/shm/{emu.run_id}-*"
    shm_left = sorted(glob.glob(f"{shm_root}/hetcomm-{os.getuid()}-{job}*"))
    exits = {}
    if emu is not None:
        for n in emu.nodes:
            with open(os.path.join(work, f"launch-{n}.log"), errors="replace") as f:
                out += f.read()
            try:
                with open(os.path.join(work, f"exit-{n}")) as f:
                    exits[n] = int(f.read().strip())
            except (OSError, ValueError):
                exits[n] = None
    return {"work": work, "works": sorted(works), "rc": proc.returncode, "exits": exits, "out": out, "t0": t0,
            "t_kill": t_kill, "killed_step": killed_step, "killed_rank": killed_rank, "t_recovered": t_recovered,
            "shm_left": shm_left}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="the job's steps (default 200; --emulate: the config's)")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--rank", default="2", help="the global rank to signal, or `slow` (--emulate: the slowest node's)")
    ap.add_argument("--at", type=int, default=None, help="signal the rank once rank 0 recorded this step")
    ap.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    ap.add_argument("--out", default="/tmp/hetcomm-snapshot-kill")
    ap.add_argument("--reference", default=None, help="metrics of an uninterrupted run of the same job")
    ap.add_argument("--emulate", default=None, metavar="CLUSTER", help="run on `hetcomm emulate up --compute` of it (root)")
    ap.add_argument("--config", default=None, help="the job's train config (--emulate: default configs/train/testbed.yaml)")
    ap.add_argument("--require-move", action="store_true", help="exit 1 unless experts moved before the signal")
    ap.add_argument("--subnet", default="10.241.0.0/16")
    ap.add_argument("--state-dir", default="/run/hetcomm/emulate-snapshot-kill")
    args = ap.parse_args()
    if args.rank == "slow" and not args.emulate:
        ap.error("--rank slow needs --emulate (the slow node is the emulation's)")
    if args.emulate and args.config is None:
        args.config = "configs/train/testbed.yaml"
    if args.steps is None:
        if args.config:
            from hetcomm._yaml import load_yaml

            args.steps = int(load_yaml(os.path.join(REPO, args.config)).data.get("steps", 200))
        else:
            args.steps = 200
    os.makedirs(args.out, exist_ok=True)
    kill_at = args.at if args.at is not None else random.Random(args.seed).randint(30, min(170, args.steps - 10))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below takes the emulation down
    emu = Emulation(args.emulate, args.subnet, args.state_dir) if args.emulate else None
    try:
        ref = args.reference
        if ref is None:
            ref = os.path.join(args.out, "ref.jsonl")
            t = time.time()
            if emu is None:
                subprocess.run(_hetcomm("train", "--steps", str(args.steps), "--metrics", ref), cwd=REPO, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                r = run_job(args, emu, None, ref)
                print(f"reference: exit {r['exits']}; "
                      + next((x for x in r["out"].splitlines() if x.startswith("placement by speed")), "no placement row"),
                      file=sys.stderr, flush=True)
            print(f"reference run: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
        ref_loss = {s.step: s.loss for s in read_metrics(ref).steps}
        metrics = os.path.join(args.out, "m.jsonl")
        r = run_job(args, emu, kill_at, metrics)
    finally:
        if emu is not None:
            emu.down()
    out, work = r["out"], r["work"]
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
    if r["t_kill"] is not None and r["t_recovered"] is not None and resumes:
        attempt = max(last_attempt(w, "job") for w in r["works"])
        ended = {}
        for w in r["works"]:
            ended.update(mark_times(w, "job", max(0, attempt - 1), log.run.world_size if log.run else 4))
        parts = recovery_parts(r["t_kill"], r["t_recovered"], resumes[-1].marks, ended)
    exit_code = r["rc"] if emu is None else max((c for c in r["exits"].values() if c is not None), default=r["rc"])
    if emu is not None and None in r["exits"].values():
        exit_code = max(exit_code, 1)  # a node's launch left no exit code
    rec = {
        "exit": exit_code, "steps": args.steps, "seed": args.seed, "signal": args.signal, "rank": r["killed_rank"],
        "kill_at_step": r["killed_step"],
        "restored_after_step": at, "resume": resumes[-1].detail if resumes else None, "lost_metrics": lost,
        "summary_row": summary.strip(),
        "recovery_s": None if r["t_recovered"] is None else round(r["t_recovered"] - r["t_kill"], 1),
        "recovery_parts": parts,
        "max_rel_loss_diff_after_restore": worst, "final_loss": log.steps[-1].loss if log.steps else None,
        "ref_final_loss": ref_loss.get(args.steps), "wall_s": round(time.time() - r["t0"], 1),
        "shm_left": r["shm_left"],
        "load": os.getloadavg()[0],
    }
    if emu is not None:
        check = placement_check(log.events, r["killed_step"], rec["resume"])
        rec.update(check, slow_node=emu.slow_node, node_exits=r["exits"],
                   placement_row=next((x for x in out.splitlines() if x.startswith("placement by speed")), ""))
    print(json.dumps(rec))
    if exit_code != 0:
        print(out[-3000:], file=sys.stderr)
    if emu is not None and (rec["counts_restored"] is False or (args.require_move and not rec["move_before_kill"])):
        print("snapshot_kill: " + ("no placement change came before the signal (--require-move)"
                                   if not rec["move_before_kill"] else
                                   f"the expert counts were not restored: before the kill {rec['moves']}, "
                                   f"resumed with {rec['counts_after_restore']}"), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
