"""``hetcomm train`` (no flags: balancing by default) against ``hetcomm train --no-balance``,
side by side in one emulation.

Brings up one ``hetcomm emulate up --compute`` of the cluster (or joins ``--id``), then runs the
variants alternately, ``--pairs`` times each, and prints per variant: median tokens/s, the summary's
``per-rank MoE time max/mean``, the cold-move and balancer rows of the last run, the ratio of
medians against ``--no-balance``, and each rank's CPU seconds per wall second over the middle half
of the last run (``/proc/PID/stat``; a rank at its cgroup quota is the bottleneck, one far below
it waits). Speed-blind against the default and an oracle, with the full-speed twin as the
ceiling, is ``benchmarks/het_testbed.py``. Needs root (network namespaces, cgroups). The load average is printed before and after: the machine is
shared, compare only numbers of one run.

``--config FILE`` trains that config (e.g. ``configs/train/compute-bound.yaml``: expert compute
dominates the step) instead of the demo's; ``--only default|no-balance`` runs one variant;
``--threads`` prints each rank's CPU per step by thread (main, hetcomm's executor, gloo-wait and
heartbeat threads, gloo's and torch's native ones); ``--profile-rank R`` samples rank ``R`` of each run with py-spy (``pip install py-spy``; its
``record`` from ``--profile-after`` seconds into the run, for ``--profile-seconds``) and prints the functions holding
most samples, with the flame data under ``--profile-dir``.

    sudo .venv/bin/python benchmarks/het_train_emulated.py --pairs 3 --steps 60 --threads
    .venv/bin/python benchmarks/het_train_emulated.py --plain --cluster configs/clusters/mixed-mini.yaml --steps 200
    .venv/bin/python benchmarks/het_train_emulated.py --pairs 1 --only default --profile-rank 3
    .venv/bin/python benchmarks/het_train_emulated.py --pairs 1 --config configs/train/compute-bound.yaml
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLD = "placement by speed (measured busy time evened once per layer)"
HETCOMM = os.path.join(REPO, ".venv", "bin", "hetcomm")
ROWS = ("tokens/s (all ranks)", "per-rank MoE time max/mean", COLD,
        "balancer speeds", "balancer  ", "verdict")


def _load() -> str:
    return open("/proc/loadavg").read().split()[:3].__str__()


def _up(cluster: str, compute: bool, subnet: str, state: str) -> str:
    out = subprocess.run([HETCOMM, "emulate", "up", "--compute" if compute else "--no-compute", "--cluster", cluster,
                          "--subnet", subnet, "--state-dir", state], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1].strip()


def _rank_pids(tag: str, root: Optional[int] = None) -> dict:
    """``{RANK: pid}`` of the running train ranks: processes whose command line holds ``tag``
    (emulated ranks run ``hetcomm train ...`` each), or else -- the plain demo's ranks are fresh
    interpreters started by the launcher -- descendants of ``root`` with ``RANK`` in their
    environment (the topmost such process per rank)."""
    parent, env_rank, by_tag = {}, {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            parent[int(pid)] = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is None:
                continue
            env_rank[int(pid)] = rank
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            if tag in cmd and " train " in cmd and "emulate" not in cmd:
                by_tag[rank] = int(pid)
        except (OSError, ValueError, IndexError):
            continue
    if by_tag or root is None:
        return by_tag
    out = {}
    for pid, rank in env_rank.items():
        p, under = parent.get(pid), False
        while p:
            if p == root:
                under = True
                break
            p = parent.get(p)
        if under and env_rank.get(parent.get(pid)) != rank:
            out.setdefault(rank, pid)
    return out


def _rank_cpu(tag: str, root: Optional[int] = None) -> dict:
    """``{RANK: cpu seconds}`` (user + system, all threads) of the running train ranks."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for rank, pid in _rank_pids(tag, root).items():
        try:
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            out[rank] = (int(f[11]) + int(f[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return out


def _rank_threads(tag: str, root: Optional[int] = None) -> dict:
    """``{RANK: {thread name: cpu seconds}}`` (user + system per thread, ``/proc/PID/task/*/stat``)
    of the running train ranks. Names: ``main`` (the rank's main thread), hetcomm's own threads by
    their kernel names (``hc-exec-*``, ``hc-gloo-wait-*``, ``hc-heartbeat-*``:
    :func:`hetcomm.backends.thread_name.name_native_thread`; peer numbers folded into ``*``), and
    ``native`` for the threads hetcomm does not start (gloo's and torch's C++ threads, which keep
    the process's name)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    for rank, pid in _rank_pids(tag, root).items():
        per: dict = {}
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                raw = open(f"/proc/{pid}/task/{tid}/stat").read()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            f = raw.rsplit(")", 1)[1].split()
            if int(tid) == pid:
                name = "main"
            elif comm.startswith("hc-"):
                name = re.sub(r"-\d+$", "-*", comm)
            else:
                name = "native"
            per[name] = per.get(name, 0.0) + (int(f[11]) + int(f[12])) / tick
        out[rank] = per
    return out


def _profile_top(raw_path: str, top: int = 12) -> list:
    """``[(share of samples, function)]`` by self samples (the leaf frame) of a py-spy raw file."""
    counts: dict = {}
    total = 0
    for line in open(raw_path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        leaf = stack.split(";")[-1]
        counts[leaf] = counts.get(leaf, 0) + int(n)
        total += int(n)
    return [(c / total, f) for f, c in sorted(counts.items(), key=lambda kv: -kv[1])[:top]] if total else []


def _start_profile(tag: str, root: int, rank: int, out_dir: str, name: str, seconds: float) -> Optional[subprocess.Popen]:
    pid = _rank_pids(tag, root).get(rank)
    pyspy = os.path.join(REPO, ".venv", "bin", "py-spy")
    if pid is None or not os.path.exists(pyspy):
        print(f"  profile: {'no py-spy in .venv (pip install py-spy)' if pid else f'rank {rank} not found'}", flush=True)
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}-rank{rank}.txt")
    return subprocess.Popen([pyspy, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
                             "--rate", "50", "--format", "raw", "--nonblocking", "--output", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _run(run_id: Optional[str], state: str, cluster: str, steps: int, flags: list, config: Optional[str] = None,
         profile: Optional[tuple] = None, threads: bool = False) -> dict:
    cmd = [HETCOMM, "train", "--cluster", cluster, "--steps", str(steps), *flags]
    if config is not None:
        cmd += ["--config", config]
    if run_id is not None:  # inside the emulation; None: plain ranks on this machine (make demo)
        cmd = [HETCOMM, "emulate", "run", "--id", run_id, "--state-dir", state, "--timeout", "900", "--", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    # CPU seconds per wall second of each rank over the middle of the run (after imports and the
    # group's setup, before the end): a rank near its cgroup quota is the bottleneck.
    samples = []
    spy = None
    tag = f"--cluster {cluster} --steps {steps}"
    while proc.poll() is None:
        cpu = _rank_cpu(tag, proc.pid)
        if len(cpu) >= 1:
            samples.append((time.monotonic(), cpu, _rank_threads(tag, proc.pid) if threads else None))
        full_so_far = sum(1 for _, c, _ in samples if len(c) == 4)
        if profile is not None and spy is None and full_so_far == profile[4]:  # past imports and setup
            rank, out_dir, name, seconds, _ = profile
            spy = _start_profile(tag, proc.pid, rank, out_dir, name, seconds) or False
        time.sleep(1.0)
    text = proc.stdout.read()
    out = subprocess.CompletedProcess(cmd, proc.returncode, text, "")
    rows = {}
    for line in text.splitlines():
        for key in ROWS:
            if line.startswith(key):
                rows[key.strip()] = line[len(key):].strip()
    m = re.match(r"([\d,]+)", rows.get("tokens/s (all ranks)", ""))
    rows["tok_s"] = float(m.group(1).replace(",", "")) if m else float("nan")
    m = re.match(r"([\d.]+)", rows.get("per-rank MoE time max/mean", ""))
    rows["moe_mm"] = float(m.group(1)) if m else float("nan")
    rows["rc"] = out.returncode
    full = [(t, c, th) for t, c, th in samples if len(c) == 4]
    if len(full) >= 8:
        a, b = full[len(full) // 4], full[(3 * len(full)) // 4]
        rows["cpu_rate"] = [round((b[1][r] - a[1][r]) / (b[0] - a[0]), 3) for r in range(4)]
        if threads:  # per thread name: CPU s per wall s over the same window
            rows["thread_rate"] = {r: {n: (b[2].get(r, {}).get(n, 0.0) - a[2].get(r, {}).get(n, 0.0)) / (b[0] - a[0])
                                       for n in b[2].get(r, {})} for r in range(4)}
    if spy:
        spy.wait(timeout=60)
        rank, out_dir, name, _, _ = profile
        path = os.path.join(out_dir, f"{name}-rank{rank}.txt")
        rows["profile"] = _profile_top(path) if os.path.exists(path) else []
        rows["profile_path"] = path
    if out.returncode not in (0, 1):
        print(text[-3000:], file=sys.stderr)
    return rows


def _print_threads(r: dict, config: Optional[str]) -> None:
    """The run's per-thread CPU as a table: ms of CPU per step (CPU s per wall s x the run's wall
    step, from its tokens/s) by thread name and rank."""
    sys.path.insert(0, REPO)
    from hetcomm.train.loop import load_train_config

    cfg = load_train_config(config or os.path.join(REPO, "configs", "train", "demo.yaml"))
    step_s = cfg.batch_size * cfg.seq_len * 4 / r["tok_s"]  # 4 ranks
    rates = r["thread_rate"]
    names = sorted({n for per in rates.values() for n in per}, key=lambda n: (n != "main", n))
    print(f"    per-thread CPU, ms per step (wall step {step_s * 1e3:.0f} ms), ranks 0 / 1 / 2 / 3:", flush=True)
    for n in names + ["all"]:
        vals = [sum(rates[k].values()) if n == "all" else rates[k].get(n, 0.0) for k in range(4)]
        print(f"      {n:18s} " + " / ".join(f"{v * step_s * 1e3:6.1f}" for v in vals), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="configs/clusters/mixed-mini-halfspeed.yaml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--subnet", default="10.219.0.0/16")
    ap.add_argument("--state-dir", default="/run/hetcomm/emulate-het-train")
    ap.add_argument("--plain", action="store_true",
                    help="no emulation: the plain demo (make demo's job) with and without --no-balance")
    ap.add_argument("--config", default=None, help="train config YAML (default: the demo's, configs/train/demo.yaml)")
    ap.add_argument("--only", choices=("default", "no-balance"), default=None, help="run one variant only")
    ap.add_argument("--profile-rank", type=int, default=None, metavar="R",
                    help="py-spy record rank R of every run (needs py-spy in .venv); top functions printed")
    ap.add_argument("--profile-seconds", type=float, default=20.0, help="py-spy record duration")
    ap.add_argument("--profile-after", type=int, default=20,
                    help="seconds after all four ranks exist before py-spy starts (past imports and setup)")
    ap.add_argument("--threads", action="store_true",
                    help="per-thread CPU (/proc/PID/task/*/stat) of every rank over the middle half of each run")
    ap.add_argument("--profile-dir", default="/tmp/hetcomm-het-train-profile", help="py-spy raw flame files")
    args = ap.parse_args()
    variants = {"default (no flags)": [], "--no-balance": ["--no-balance"]}
    if args.only == "default":
        del variants["--no-balance"]
    elif args.only == "no-balance":
        del variants["default (no flags)"]
    t0 = time.time()
    print(f"start {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {_load()}", flush=True)
    ids = {"compute": None if args.plain else _up(args.cluster, True, args.subnet, args.state_dir)}
    results = {k: [] for k in variants}
    try:
        for i in range(args.pairs):
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for name in order:
                rid = ids["compute"]
                prof = None
                if args.profile_rank is not None:
                    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
                    prof = (args.profile_rank, args.profile_dir, f"pair{i + 1}-{slug}", args.profile_seconds,
                            args.profile_after)
                r = _run(rid, args.state_dir, args.cluster, args.steps, variants[name], args.config, prof, args.threads)
                results[name].append(r)
                print(f"  pair {i + 1} {name}: {r['tok_s']:,.0f} tok/s, MoE max/mean {r['moe_mm']:.2f}, "
                      f"CPU s per s by rank {r.get('cpu_rate')}, {r.get('verdict', 'no verdict')[:5]}, load {_load()}",
                      flush=True)
                print(f"    cold move: {r.get(COLD, '-')}", flush=True)
                if r.get("thread_rate"):
                    _print_threads(r, args.config)
                if r.get("profile"):
                    print(f"    py-spy rank {args.profile_rank} ({r['profile_path']}), self samples:", flush=True)
                    for share, fn in r["profile"]:
                        print(f"      {share * 100:5.1f}%  {fn}", flush=True)
    finally:
        for rid in (r for r in ids.values() if r is not None):
            subprocess.run([HETCOMM, "emulate", "down", "--id", rid, "--state-dir", args.state_dir], capture_output=True)
    base_runs = results.get("--no-balance") or next(iter(results.values()))
    base = statistics.median(x["tok_s"] for x in base_runs)
    where = "plain, no emulation" if args.plain else "under hetcomm emulate --compute"
    print(f"\n{args.cluster} {where}, config {args.config or 'demo'}, {args.steps} steps, {args.pairs} runs each "
          f"(alternating); end load {_load()}, {time.time() - t0:.0f} s")
    print("| variant | tokens/s (median; runs) | x --no-balance | per-rank MoE time max/mean (median) | "
          "CPU s per wall s by rank (last run) | cold move (last run) | balancer (last run) |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        med = statistics.median(x["tok_s"] for x in rs)
        runs = " / ".join(f"{x['tok_s']:,.0f}" for x in rs)
        mm = statistics.median(x["moe_mm"] for x in rs)
        print(f"| {name} | {med:,.0f} ({runs}) | {med / base:.2f} | {mm:.2f} | {rs[-1].get('cpu_rate', '-')} | "
              f"{rs[-1].get(COLD, '-')} "
              f"| {rs[-1].get('balancer', '-')}; {rs[-1].get('balancer speeds', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
