"""``hetcomm train`` (no flags: balancing by default) against ``hetcomm train --no-balance``,
side by side in one emulation (issue 19, "Done when" 2).

Brings up one ``hetcomm emulate up --compute`` of the cluster (or joins ``--id``), then runs the
variants alternately, ``--pairs`` times each, and prints per variant: median tokens/s, the summary's
``per-rank MoE time max/mean``, the batch split and balancer rows of the last run, the ratio of
medians against ``--no-balance``, and each rank's CPU seconds per wall second over the middle half
of the last run (``/proc/PID/stat``; a rank at its cgroup quota is the bottleneck, one far below
it waits). ``--no-compute`` also runs ``--no-balance`` on a second emulation of the same links
without cpu cgroups (every rank at full speed), interleaved with the others: no balancing of
compute can beat that. Needs root (network namespaces, cgroups). The load average is printed before and
after: the machine is shared, compare only numbers of one run.

    sudo .venv/bin/python benchmarks/het_train_emulated.py --pairs 3 --steps 60 --no-compute
    .venv/bin/python benchmarks/het_train_emulated.py --plain --cluster configs/clusters/mixed-mini.yaml --steps 200
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
HETCOMM = os.path.join(REPO, ".venv", "bin", "hetcomm")
ROWS = ("tokens/s (all ranks)", "per-rank MoE time max/mean", "batch split (by measured dense speed)",
        "balancer speeds", "balancer  ", "verdict")


def _load() -> str:
    return open("/proc/loadavg").read().split()[:3].__str__()


def _up(cluster: str, compute: bool, subnet: str, state: str) -> str:
    out = subprocess.run([HETCOMM, "emulate", "up", "--compute" if compute else "--no-compute", "--cluster", cluster,
                          "--subnet", subnet, "--state-dir", state], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1].strip()


def _rank_cpu(tag: str) -> dict:
    """``{RANK: cpu seconds}`` of the running train ranks whose command line holds ``tag``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            if tag not in cmd or " train " not in cmd or "emulate" in cmd:
                continue
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            if rank is not None:
                out[rank] = (int(f[11]) + int(f[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return out


def _run(run_id: Optional[str], state: str, cluster: str, steps: int, flags: list) -> dict:
    cmd = [HETCOMM, "train", "--cluster", cluster, "--steps", str(steps), *flags]
    if run_id is not None:  # inside the emulation; None: plain ranks on this machine (make demo)
        cmd = [HETCOMM, "emulate", "run", "--id", run_id, "--state-dir", state, "--timeout", "900", "--", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    # CPU seconds per wall second of each rank over the middle of the run (after imports and the
    # group's setup, before the end): a rank near its cgroup quota is the bottleneck.
    samples = []
    while proc.poll() is None:
        cpu = _rank_cpu(f"--cluster {cluster} --steps {steps}")
        if len(cpu) >= 1:
            samples.append((time.monotonic(), cpu))
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
    full = [(t, c) for t, c in samples if len(c) == 4]
    if len(full) >= 8:
        a, b = full[len(full) // 4], full[(3 * len(full)) // 4]
        rows["cpu_rate"] = [round((b[1][r] - a[1][r]) / (b[0] - a[0]), 3) for r in range(4)]
    if out.returncode not in (0, 1):
        print(text[-3000:], file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="configs/clusters/mixed-mini-halfspeed.yaml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--no-compute", action="store_true", help="also run --no-balance on an emulation without cgroups")
    ap.add_argument("--subnet", default="10.219.0.0/16")
    ap.add_argument("--subnet-full", default="10.220.0.0/16", help="subnet of the --no-compute emulation")
    ap.add_argument("--state-dir", default="/run/hetcomm/emulate-het-train")
    ap.add_argument("--plain", action="store_true",
                    help="no emulation: the plain demo (make demo's job) with and without --no-balance")
    args = ap.parse_args()
    variants = {"default (no flags)": [], "--no-balance": ["--no-balance"]}
    t0 = time.time()
    print(f"start {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {_load()}", flush=True)
    ids = {"compute": None if args.plain else _up(args.cluster, True, args.subnet, args.state_dir)}
    if args.no_compute:  # a second emulation, same links, no cgroups; its runs interleave with the others
        ids["full speed"] = _up(args.cluster, False, args.subnet_full, args.state_dir)
        variants["--no-balance, no cpu cgroups"] = ["--no-balance"]
    results = {k: [] for k in variants}
    try:
        for i in range(args.pairs):
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for name in order:
                rid = ids["full speed"] if "no cpu cgroups" in name else ids["compute"]
                r = _run(rid, args.state_dir, args.cluster, args.steps, variants[name])
                results[name].append(r)
                print(f"  pair {i + 1} {name}: {r['tok_s']:,.0f} tok/s, MoE max/mean {r['moe_mm']:.2f}, "
                      f"CPU s per s by rank {r.get('cpu_rate')}, {r.get('verdict', 'no verdict')[:5]}, load {_load()}",
                      flush=True)
    finally:
        for rid in (r for r in ids.values() if r is not None):
            subprocess.run([HETCOMM, "emulate", "down", "--id", rid, "--state-dir", args.state_dir], capture_output=True)
    base = statistics.median(x["tok_s"] for x in results["--no-balance"])
    where = "plain, no emulation" if args.plain else "under hetcomm emulate --compute"
    print(f"\n{args.cluster} {where}, {args.steps} steps, {args.pairs} runs each "
          f"(alternating); end load {_load()}, {time.time() - t0:.0f} s")
    print("| variant | tokens/s (median; runs) | x --no-balance | per-rank MoE time max/mean (median) | "
          "CPU s per wall s by rank (last run) | batch split (last run) | balancer (last run) |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        med = statistics.median(x["tok_s"] for x in rs)
        runs = " / ".join(f"{x['tok_s']:,.0f}" for x in rs)
        mm = statistics.median(x["moe_mm"] for x in rs)
        print(f"| {name} | {med:,.0f} ({runs}) | {med / base:.2f} | {mm:.2f} | {rs[-1].get('cpu_rate', '-')} | "
              f"{rs[-1].get('batch split (by measured dense speed)', '-')} "
              f"| {rs[-1].get('balancer', '-')}; {rs[-1].get('balancer speeds', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
