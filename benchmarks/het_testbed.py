"""The heterogeneity testbed: speed-blind, the default and the oracle on one emulation of a
cluster whose labels hide its slow node, and the full-speed twin as the ceiling.

Brings up ``hetcomm emulate up --compute`` of ``--cluster`` (default
``configs/clusters/mislabelled-halfspeed.yaml``: every device labelled alike, the third node's
ranks at half the CPU quota) and of ``--twin`` (``mislabelled-fullspeed.yaml``: the same file with
that node at full speed), then trains ``--config`` (default ``configs/train/testbed.yaml``, a job
whose expert FFNs are most of a rank's work) in four variants, interleaved: each pair runs every
variant once, in an order that alternates from pair to pair.

- ``speed-blind``: ``hetcomm train --no-balance``: no decision reads a speed (equal contiguous
  placement, nothing measured, no cold move, no token split);
- ``default``: ``hetcomm train`` with no balancing flags: what measurement finds;
- ``oracle``: ``hetcomm train --speed oracle --token-split on``: placement weights, replica
  holders and the token split from the emulation's known compute factors;
- ``ceiling``: ``--no-balance`` on the full-speed twin: the same work with no rank slower;
- ``split-on`` / ``split-off``: the default with ``--token-split on`` / ``off`` (what the split
  costs or saves with replication on; only with ``--only``: the four above are the default set).

A pair starts only when the 1-minute load average is below ``--max-load`` (default 2: the
machine is shared; a waiting message is printed every 30 s, and after ``--max-wait`` seconds the
benchmark gives up with exit 3). Per variant it prints the median tokens/s with the spread (min-max)
and each run, the ratio of medians to speed-blind, and the slow ranks' expert FFN share of their
busy CPU -- forward and backward, measured by the run itself (the summary's ``expert FFN share``
row, :mod:`hetcomm.train.expert_time`) -- median and spread. The slow ranks are those the
emulation runs below full speed. Needs root (network namespaces, cgroups).

    sudo PYTHONPATH=. .venv/bin/python benchmarks/het_testbed.py --pairs 5 --first 60
    sudo PYTHONPATH=. .venv/bin/python benchmarks/het_testbed.py --pairs 1 --max-load 100   # a smoke run
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

#: variant -> (which emulation, hetcomm train flags)
VARIANTS: Dict[str, tuple] = {
    "speed-blind": ("half", ["--no-balance"]),
    "default": ("half", []),
    "oracle": ("half", ["--speed", "oracle", "--token-split", "on"]),
    "ceiling": ("twin", ["--no-balance"]),  # speed-blind on the full-speed twin
    "split-on": ("half", ["--token-split", "on"]),  # the default with its per-step split forced on
    "split-off": ("half", ["--token-split", "off"]),  # ... and forced off
}
ROWS = ("tokens/s (all ranks)", "expert FFN share (fwd + bwd)", "placement by speed (measured busy time evened once per layer)", "verdict")


COLD = "placement by speed (measured busy time evened once per layer)"


def _hetcomm(*args: str) -> List[str]:
    return [sys.executable, "-m", "hetcomm", *args]


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _load() -> float:
    with open("/proc/loadavg", encoding="utf-8") as f:
        return float(f.read().split()[0])


def _wait_for_quiet(max_load: float, max_wait_s: float, until: Optional[float] = None) -> bool:
    """Wait until the 1-minute load is below ``max_load``; False after ``max_wait_s`` or past
    ``until`` (epoch seconds)."""
    t0 = time.monotonic()
    last = -1e9
    while _load() >= max_load or (until is not None and time.time() > until):
        if time.monotonic() - t0 > max_wait_s or (until is not None and time.time() > until):
            return False
        if time.monotonic() - last >= 30:
            print(f"  waiting: load {_load():.2f} >= {max_load:g} (waited {time.monotonic() - t0:.0f} s of "
                  f"{max_wait_s:g})", flush=True)
            last = time.monotonic()
        time.sleep(5)
    return True


def _up(cluster: str, subnet: str, state: str) -> str:
    out = subprocess.run(_hetcomm("emulate", "up", "--compute", "--cluster", cluster, "--subnet", subnet,
                                  "--state-dir", state), capture_output=True, text=True, env=_env(), cwd=REPO)
    if out.returncode != 0:
        sys.exit(f"het_testbed: emulate up {cluster} failed:\n{out.stdout}{out.stderr}")
    return out.stdout.strip().splitlines()[-1].strip()


def steady_pace(metrics_path: str, from_step: int, first: int = 0) -> Tuple[float, float, float]:
    """From a run's metrics file, over the steps after ``from_step`` (every variant's one-time
    placement is done by then): tokens/s of all ranks, and the median over those steps of the
    ranks' expert busy seconds max/mean (``expert_s_by_rank``, forward); and the tokens/s of the
    first ``first`` steps (what a run of that many steps times). NaN where the run ended first."""
    steps = []
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "step":
                steps.append((int(rec["step"]), float(rec["time_s"]), float(rec["tokens"]),
                              rec.get("expert_s_by_rank") or []))
    head = [(t, n) for s, t, n, _ in steps if s <= first]
    head_pace = sum(n for _, n in head) / head[-1][0] if first and len(head) == first else float("nan")
    start = [t for s, t, _, _ in steps if s == from_step]
    after = [(t, n, e) for s, t, n, e in steps if s > from_step]
    if not start or not after:
        return float("nan"), float("nan"), head_pace
    spread = [max(e) / (sum(e) / len(e)) for _, _, e in after if e and sum(e) > 0]
    return (sum(n for _, n, _ in after) / (after[-1][0] - start[0]),
            statistics.median(spread) if spread else float("nan"), head_pace)


def _run(run_id: str, state: str, cluster: str, config: str, steps: Optional[int], flags: List[str],
         steady_from: int, first: int) -> dict:
    metrics = tempfile.NamedTemporaryFile(prefix="het-testbed-", suffix=".jsonl", delete=False).name
    cmd = _hetcomm("train", "--cluster", cluster, "--config", config, "--metrics", metrics, *flags)
    if steps is not None:
        cmd += ["--steps", str(steps)]
    cmd = _hetcomm("emulate", "run", "--id", run_id, "--state-dir", state, "--timeout", "900", "--", *cmd)
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
    rows: dict = {"rc": out.returncode}
    try:
        rows["steady"], rows["expert_spread"], rows["first"] = steady_pace(metrics, steady_from, first)
    except (OSError, ValueError, KeyError):
        rows["steady"] = rows["expert_spread"] = rows["first"] = float("nan")
    finally:
        os.unlink(metrics)
    for line in out.stdout.splitlines():
        for key in ROWS:
            if line.startswith(key):
                rows[key] = line[len(key):].strip()
    m = re.match(r"([\d,]+)", rows.get("tokens/s (all ranks)", ""))
    rows["tok_s"] = float(m.group(1).replace(",", "")) if m else float("nan")
    from hetcomm.train.expert_time import parse_shares

    rows["shares"] = parse_shares(rows.get("expert FFN share (fwd + bwd)", ""))
    if out.returncode not in (0, 1) or not m:
        print((out.stdout + out.stderr)[-3000:], file=sys.stderr)
    return rows


def _slow_ranks(cluster: str) -> List[int]:
    """Ranks the emulation runs below full speed (the oracle's speeds)."""
    from hetcomm.topo.cluster import load_cluster
    from hetcomm.train.speed_modes import oracle_speeds

    c = load_cluster(os.path.join(REPO, cluster))
    speeds = oracle_speeds(c, c.num_ranks)
    return [r for r, s in enumerate(speeds) if s < max(speeds)]


def _spread(xs: List[float], fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="configs/clusters/mislabelled-halfspeed.yaml")
    ap.add_argument("--twin", default="configs/clusters/mislabelled-fullspeed.yaml",
                    help="the full-speed twin: the ceiling's cluster")
    ap.add_argument("--config", default="configs/train/testbed.yaml")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the config's)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steady-from", type=int, default=20,
                    help="the steady pace is timed over the steps after this one (default 20: every "
                    "variant's one-time placement is done by then)")
    ap.add_argument("--first", type=int, default=0, metavar="N",
                    help="also time the first N steps of every run (what an N-step run measures): a "
                    "column and a T1 line of their own")
    ap.add_argument("--max-load", type=float, default=2.0, help="start a pair only below this 1-minute load")
    ap.add_argument("--max-wait", type=float, default=1800.0, help="seconds to wait for the load before giving up")
    ap.add_argument("--until", default=None, metavar="HH:MM",
                    help="start no pair after this UTC time today (a shared machine's deadline)")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=None, help="run these variants only")
    ap.add_argument("--subnet", default="10.221.0.0/16")
    ap.add_argument("--subnet-twin", default="10.222.0.0/16")
    ap.add_argument("--state-dir", default="/run/hetcomm/emulate-het-testbed")
    args = ap.parse_args()
    if args.first:  # refused before any emulation starts: a window the runs cannot fill times nothing
        from hetcomm.train.loop import load_train_config

        steps = args.steps or load_train_config(os.path.join(REPO, args.config)).steps
        if not 0 < args.first <= steps:
            ap.error(f"--first {args.first}: give a number from 1 to the run's {steps} steps ({args.config}"
                     f"{'' if args.steps is None else ', --steps'})")
    # A SIGTERM (a kill, a session ending) still takes the emulations down (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    until = None
    if args.until:
        hh, mm = (int(x) for x in args.until.split(":"))
        now = time.gmtime()
        until = calendar.timegm((now.tm_year, now.tm_mon, now.tm_mday, hh, mm, 0, 0, 0, 0))
    variants = {k: v for k, v in VARIANTS.items() if (k in args.only if args.only else not k.startswith("split-"))}
    slow = _slow_ranks(args.cluster)
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    print(f"start {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {rev}, load {_load():.2f}; "
          f"slow ranks {slow}; {args.pairs} pairs of {list(variants)}", flush=True)
    ids: Dict[str, str] = {}
    results: Dict[str, List[dict]] = {k: [] for k in variants}
    start_loads: List[float] = []
    try:
        ids["half"] = _up(args.cluster, args.subnet, args.state_dir)
        if any(where == "twin" for where, _ in variants.values()):
            ids["twin"] = _up(args.twin, args.subnet_twin, args.state_dir)
        for i in range(args.pairs):
            if not _wait_for_quiet(args.max_load, args.max_wait, until):
                print(f"het_testbed: the load stayed >= {args.max_load:g} (waited up to {args.max_wait:g} s"
                      f"{', until ' + args.until + ' UTC' if args.until else ''}); stopping after {i} pair(s)", flush=True)
                break
            start_loads.append(_load())
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for name in order:
                where, flags = variants[name]
                cluster = args.cluster if where == "half" else args.twin
                r = _run(ids[where], args.state_dir, cluster, args.config, args.steps, flags, args.steady_from,
                         args.first)
                results[name].append(r)
                shares = r["shares"]
                head = f", {r['first']:,.0f} in the first {args.first}" if args.first else ""
                print(f"  pair {i + 1} {name}: {r['tok_s']:,.0f} tok/s ({r['steady']:,.0f} after step "
                      f"{args.steady_from}{head}), expert share by rank {shares} %, "
                      f"expert time max/mean {r['expert_spread']:.2f}, "
                      f"{r.get('verdict', 'no verdict')[:4]}, rc {r['rc']}, load {_load():.2f}", flush=True)
                print(f"    cold move: {r.get(COLD, '-')}", flush=True)
    finally:
        for rid in ids.values():
            subprocess.run(_hetcomm("emulate", "down", "--id", rid, "--state-dir", args.state_dir),
                           capture_output=True, env=_env(), cwd=REPO)
    done = {k: [r for r in v if r["tok_s"] == r["tok_s"]] for k, v in results.items()}
    if not all(done.values()):
        print("het_testbed: a variant has no finished run; no table")
        return 1
    ref = "speed-blind" if "speed-blind" in done else next(iter(done))  # the ratios' baseline
    base = statistics.median(r["tok_s"] for r in done[ref])
    n = min(len(v) for v in done.values())
    print(f"\n{args.cluster} (twin {args.twin}) under emulate --compute, config {args.config}, "
          f"{n} pair(s), start loads {[round(x, 2) for x in start_loads]}, end load {_load():.2f}, "
          f"{time.time() - t0:.0f} s, commit {rev}")
    print(f"| variant | tokens/s median (min-max) | runs | x {ref} per pair: median (min-max) | "
          f"after step {args.steady_from}: x {ref} per pair | "
          f"{f'first {args.first} steps: x {ref} per pair | ' if args.first else ''}slow rank expert share of busy CPU, "
          f"median (min-max) | expert busy time max/mean over ranks, median of steps (min-max of runs) | placement (last run) |")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.first else ""))
    blind = done.get("speed-blind")
    reference = done[ref]
    for name, rs in done.items():
        tok = [r["tok_s"] for r in rs]
        sl = [r["shares"][s] for r in rs for s in slow if len(r["shares"]) > s and r["shares"][s] is not None]
        share = _spread(sl, "{:.0f} %") if sl else "-"
        split = rs[-1].get(COLD, "-")
        pairs = [a["tok_s"] / b["tok_s"] for a, b in zip(rs, reference)]
        steady = [a["steady"] / b["steady"] for a, b in zip(rs, reference)]
        head = [a["first"] / b["first"] for a, b in zip(rs, reference)]
        spread = [r["expert_spread"] for r in rs if r["expert_spread"] == r["expert_spread"]]
        print(f"| {name} | {_spread(tok)} | {' / '.join(f'{x:,.0f}' for x in tok)} | "
              f"{_spread(pairs, '{:.2f}')} | {_spread(steady, '{:.2f}')} | "
              f"{_spread(head, '{:.2f}') + ' | ' if args.first else ''}{share} | "
              f"{_spread(spread, '{:.2f}') if spread else '-'} | {split} |")
    if "oracle" in done and "default" in done and blind:
        windows = [("whole run", "tok_s"), (f"after step {args.steady_from}", "steady")]
        for label, key in windows + ([(f"first {args.first} steps", "first")] if args.first else []):
            gap = [(d[key] - b[key]) / (o[key] - b[key]) * 100
                   for d, o, b in zip(done["default"], done["oracle"], blind) if o[key] != b[key]]
            if gap:
                print(f"T1 ({label}): the default recovers {statistics.median(gap):.0f} % of the gap to the oracle "
                      f"(per pair {' / '.join(f'{g:.0f}' for g in gap)} %; target >= 70 %)")
    if "oracle" in done and "speed-blind" in done:
        # The median of the per-pair ratios: each pair's runs share the machine's state, which
        # drifts from pair to pair on a shared host (the ratio of the medians mixes pairs).
        ratio = statistics.median(o["tok_s"] / b["tok_s"] for o, b in zip(done["oracle"], done["speed-blind"]))
        of_medians = statistics.median(r["tok_s"] for r in done["oracle"]) / base
        blind_share = [r["shares"][s] for r in done["speed-blind"] for s in slow if len(r["shares"]) > s]
        share = statistics.median(blind_share) if blind_share else float("nan")
        ok = ratio >= 1.35 and share >= 60 and n >= 5 and all(x < 2 for x in start_loads)
        print(f"\nT0 (oracle >= 1.35x speed-blind, slow rank's expert share >= 60 %, >= 5 pairs started at "
              f"load < 2): oracle {ratio:.2f}x (median of the pairs; ratio of the medians {of_medians:.2f}x), "
              f"share {share:.0f} % -> {'met' if ok else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
