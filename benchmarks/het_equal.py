"""Equal ranks: does the default ``hetcomm train`` leave them alone, and what does its
heterogeneity machinery cost per step where there is nothing to balance?

Three setups whose ranks compute alike (``SETUPS``): ``mixed-mini-equal`` (the demo job on the
mixed-mini links with every device at one rate) and the full-speed twin (the testbed job on
``mislabelled-fullspeed.yaml``), both under ``hetcomm emulate up --compute`` as
:mod:`het_testbed` brings them up (its helpers, imported); and the plain demo
(``configs/train/demo.yaml`` on its default cluster, no emulation: four CPU processes that only
the labels tell apart).

**Actions.** Each setup runs the default ``hetcomm train`` (no balancing flags) ``--runs`` times
with ``--metrics FILE.jsonl``; a run took a balancing action when its metrics say so
(:func:`actions_of`): a ``migration`` event or a step record with experts landed (``move``), the
token split turned on or off by a ``policy`` event, or its speed vector changed while the split
was on (``split``), any event of a kind that is neither a migration nor bookkeeping (a deal or
another lever yet to come: named by its kind); the summary's cold-move row saying experts moved
counts as ``move`` too.

**Added work per step**, three ways:

- *CPU, from outside*: the first ``--pairs`` default runs are each paired with a run of the same
  job with ``--speed datasheet`` (the layers keep the datasheet's speeds: no agreement, no noise
  estimate, no verdict, no cold move; the compute timer stays on in both, it also feeds the
  MoE-time row), in an order that alternates from pair to pair. Each run's per-step process CPU
  is the summary's ``busy`` figure (``time.process_time`` per step, every thread, summed over
  the ranks, first tenth of the steps left out); per pair, default minus datasheet over
  datasheet. Median and spread (min-max) over the pairs.
- *CPU, inside the real job*: one more launch of the default job (no emulation) with thread-CPU
  timers wrapped around the speed meter's calls (``SpeedMeter.begin`` / ``end``: the clock;
  ``finish_step``: the EMAs and the agreement) and the measured loop's decisions
  (``speed_verdict``, ``Policy.with_verdict``, ``ColdMoves.after_step``), against the process CPU
  of each whole step (``hetcomm.train.loop._step``). The wrappers are installed by this script
  in the rank processes; the library is unchanged.
- *Collectives*: the default job and the datasheet job, each launched once with every hetcomm
  collective counted by call site (:func:`count_collectives._rank_main`); per step, the default's
  total, the datasheet's, the difference and the call sites that differ.

Emulated setups need root (network namespaces, cgroups). A run starts only when the 1-minute
load is below ``--max-load`` (default 2).

    sudo PYTHONPATH=. .venv/bin/python benchmarks/het_equal.py                       # 10 runs, 5 pairs per setup
    sudo PYTHONPATH=. .venv/bin/python benchmarks/het_equal.py --runs 1 --pairs 1 --steps 20 --max-load 100  # smoke
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

import het_testbed as tb  # noqa: E402  (the emulation helpers: up, load, quiet wait, spread)


@dataclass(frozen=True)
class Setup:
    """One equal-rank setup: the cluster (None: the config's own), the train config, and
    whether it runs under ``hetcomm emulate up --compute`` (with its own subnet)."""

    cluster: Optional[str]
    config: str
    emulated: bool
    subnet: str = ""


SETUPS: Dict[str, Setup] = {
    "mixed-mini-equal": Setup("configs/clusters/mixed-mini-equal.yaml", "configs/train/demo.yaml", True, "10.223.0.0/16"),
    "fullspeed-twin": Setup("configs/clusters/mislabelled-fullspeed.yaml", "configs/train/testbed.yaml", True,
                            "10.224.0.0/16"),
    "demo": Setup(None, "configs/train/demo.yaml", False),
}
#: Event kinds that record what happened without changing where work runs.
BOOKKEEPING = ("policy", "checkpoint", "snapshots", "snapshot-skipped", "resume", "membership")
#: ``hetcomm train`` flags of the variant with measurement off (the CPU pairs' baseline).
DATASHEET = ["--speed", "datasheet"]
_BUSY = re.compile(r"busy ([\d.]+(?:/[\d.]+)*) ms CPU per step")
_SPLIT = re.compile(r"token_split (on|off)")


# -- what a run did ------------------------------------------------------------------------------
def read_log(path: str) -> Any:
    """The run's metrics file read back (:func:`hetcomm.ops.metrics.read_metrics`), or None when
    the run wrote none."""
    from hetcomm.ops.metrics import read_metrics

    return read_metrics(path) if os.path.exists(path) else None


def actions_of(log: Any, cold_row: str = "") -> List[str]:
    """The balancing actions a run took, sorted, each once: ``move`` (a ``migration`` event, a
    step record with ``migrations`` > 0, or a cold-move summary row naming experts moved),
    ``split`` (a ``policy`` event turning the token split on or off, or the agreed speed vector's
    shares changing between steps while the split is on), and the kind of any other event that is
    not bookkeeping (:data:`BOOKKEEPING`).

    Args:
        log: the run's :class:`hetcomm.ops.metrics.MetricsLog` (:func:`read_log`), or None.
        cold_row: the summary's cold-move row (``layer 0 at step 20: experts [3] moved; ...``).
    """
    found = set()
    split_from: List[tuple] = []  # (step, on): the split's state from that step on, by policy events
    for ev in log.events if log is not None else []:
        if ev.event == "migration":
            found.add("move")
        elif ev.event == "policy":
            m = _SPLIT.search(ev.detail)
            on = m is not None and m.group(1) == "on"
            if split_from and on != split_from[-1][1]:
                found.add("split")
            split_from.append((ev.step, on))
        elif ev.event not in BOOKKEEPING:
            found.add(ev.event)
    shares: Optional[List[float]] = None
    for st in log.steps if log is not None else []:
        if (st.migrations or 0) > 0:
            found.add("move")
        on = False
        for since, state in split_from:  # the last policy event at or before this step
            if since <= st.step:
                on = state
        speeds = st.speed_rows_per_s
        if on and speeds and sum(speeds) > 0:
            now = [v / sum(speeds) for v in speeds]
            if shares is not None and max(abs(x - y) for x, y in zip(now, shares)) > 1e-6:
                found.add("split")
            shares = now
    if re.search(r"experts \[[\d, ]+\] moved", cold_row):
        found.add("move")
    return sorted(found)


def verdict_of(log: Any) -> str:
    """The agreed speed verdict at the run's last step (layer 0's ``speed_differ`` in its step
    record): ``ranks differ``, ``ranks equal`` or ``not agreed``; ``-`` without steps."""
    steps = log.steps if log is not None else []
    if not steps:
        return "-"
    return {None: "not agreed", True: "ranks differ", False: "ranks equal"}[steps[-1].speed_differ]


def busy_ms(row: str) -> Optional[float]:
    """Process CPU per step summed over ranks (ms) from the summary's ``expert FFN share`` row
    (``... busy 71.6/66.2/65.8/57.3 ms CPU per step ...``), or None without it."""
    m = _BUSY.search(row)
    return sum(float(x) for x in m.group(1).split("/")) if m else None


def summary_rows(stdout: str) -> Dict[str, str]:
    """The ``hetcomm train`` summary rows :data:`het_testbed.ROWS` names, by name."""
    rows: Dict[str, str] = {}
    for line in stdout.splitlines():
        for key in tb.ROWS:
            if line.startswith(key):
                rows[key] = line[len(key):].strip()
    return rows


# -- one run -------------------------------------------------------------------------------------
def run_once(setup: Setup, flags: List[str], steps: Optional[int], run_id: Optional[str], state: str,
             workdir: str) -> Dict[str, Any]:
    """One ``hetcomm train`` of ``setup`` with ``flags`` (under the emulation ``run_id`` when
    emulated); returns rc, the summary rows, the actions and verdict its metrics show, and its busy CPU."""
    metrics = os.path.join(workdir, f"run-{len(os.listdir(workdir))}-{time.monotonic_ns()}.jsonl")
    cmd = ["train", "--config", setup.config, "--metrics", metrics, *flags]
    if setup.cluster is not None:
        cmd += ["--cluster", setup.cluster]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if setup.emulated:
        cmd = tb._hetcomm("emulate", "run", "--id", run_id, "--state-dir", state, "--timeout", "900", "--",
                          *tb._hetcomm(*cmd))
    else:
        cmd = tb._hetcomm(*cmd)
    out = subprocess.run(cmd, capture_output=True, text=True, env=tb._env(), cwd=REPO)
    rows = summary_rows(out.stdout)
    log = read_log(metrics)
    if log is not None:
        os.unlink(metrics)
    busy = busy_ms(rows.get("expert FFN share (fwd + bwd)", ""))
    if out.returncode not in (0, 1) or busy is None:
        print((out.stdout + out.stderr)[-3000:], file=sys.stderr)
    return {"rc": out.returncode, "rows": rows, "actions": actions_of(log, rows.get(tb.COLD, "")),
            "verdict": verdict_of(log), "busy_ms": busy}


# -- inside the job: collectives and timers ------------------------------------------------------
def _job_config(setup: Setup, steps: Optional[int], speed: str) -> Any:
    from hetcomm.train.loop import load_train_config

    over: Dict[str, Any] = {"steps": steps, "speed": speed}
    if setup.cluster is not None:
        over["cluster"] = os.path.join(REPO, setup.cluster)
    return load_train_config(os.path.join(REPO, setup.config), **over)


def _launch(target: Any, cfg: Any, workdir: str) -> List[Dict[str, Any]]:
    """``target(cfg)`` on every rank of ``cfg.cluster`` (no emulation); each rank's output goes to a
    log in ``workdir``, printed when a rank fails."""
    from hetcomm.launcher import launch
    from hetcomm.topo.cluster import CLUSTER_ENV, load_cluster

    world = load_cluster(cfg.cluster).num_ranks
    logs = {r: os.path.join(workdir, f"rank{r}-{time.monotonic_ns()}.log") for r in range(world)}
    out = launch(target, world, args=(cfg,), env={CLUSTER_ENV: None}, store=True, store_timeout_s=cfg.timeout_s,
                 timeout_s=cfg.timeout_s + 10.0 * cfg.steps, grace_s=0.0, clean_shm=True, name="het-equal", logs=logs)
    if not out.ok:
        bad = out.failures[0].rank
        with open(logs[bad], encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        sys.exit(f"het_equal: a rank failed:\n{out.ranks[bad].describe()}\n{tail}")
    return list(out.results)


def per_step_collectives(results: Sequence[Dict[str, Any]], steps: int) -> Dict[str, float]:
    """Mean collectives per step and rank by call site (``count_collectives._rank_main``'s
    ``calls``), steps 1..``steps``."""
    per: Dict[str, float] = collections.defaultdict(float)
    for r in results:
        for k in range(1, steps + 1):
            for site, n in r["calls"].get(str(k), {}).items():
                per[site] += n / (steps * len(results))
    return dict(per)


def _timed_rank(cfg: Any) -> Dict[str, Any]:
    """A rank of the default job with thread-CPU timers around the speed meter's and the measured
    loop's calls and process-CPU timers around each step (installed here, in the rank process)."""
    import time as _t

    from hetcomm.moe import measured_loop
    from hetcomm.moe.cold import ColdMoves
    from hetcomm.moe.policy import Policy
    from hetcomm.moe.speed import SpeedMeter
    from hetcomm.train import loop

    spent: Dict[str, float] = collections.defaultdict(float)
    calls: Dict[str, int] = collections.defaultdict(int)
    steps: List[float] = []

    def timed(owner: Any, name: str, part: str) -> None:
        orig = getattr(owner, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = _t.thread_time()
            try:
                return orig(*a, **kw)
            finally:
                spent[part] += _t.thread_time() - t0
                calls[part] += 1

        setattr(owner, name, wrapper)

    timed(SpeedMeter, "begin", "clock")
    timed(SpeedMeter, "end", "clock")
    timed(SpeedMeter, "finish_step", "ema+agreement")
    timed(measured_loop, "speed_verdict", "verdict+cold")
    timed(Policy, "with_verdict", "verdict+cold")
    timed(ColdMoves, "after_step", "verdict+cold")
    timed_cold = ColdMoves.after_step
    moved: List[str] = []

    def cold_step(self: Any, *a: Any, **kw: Any) -> List[str]:
        lines = timed_cold(self, *a, **kw)
        moved.extend(lines)  # a move's own CPU is in verdict+cold: the table says whether one came
        return lines

    ColdMoves.after_step = cold_step
    orig_step = loop._step

    def one_step(job: Any, step: int) -> None:
        t0 = _t.process_time()
        orig_step(job, step)
        steps.append(_t.process_time() - t0)

    loop._step = one_step
    rc = loop.train_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg)
    return {"rc": rc, "spent": dict(spent), "calls": dict(calls), "steps": steps, "moved": moved}


def inside(setup: Setup, steps: Optional[int], workdir: str) -> Dict[str, Any]:
    """Collectives per step (default vs datasheet) and the timers' CPU per step, for ``setup``."""
    from count_collectives import _rank_main

    cfg = _job_config(setup, steps, "measured")
    n = cfg.steps
    default = per_step_collectives(_launch(_rank_main, cfg, workdir), n)
    sheet = per_step_collectives(_launch(_rank_main, _job_config(setup, steps, "datasheet"), workdir), n)
    timed = _launch(_timed_rank, cfg, workdir)
    skip = max(1, n // 10)  # first tenth left out, as the summary's busy figure
    step_s = statistics.mean(s for r in timed for s in r["steps"][skip:])
    parts = {p: sum(r["spent"].get(p, 0.0) for r in timed) / (len(timed) * n) for p in ("clock", "ema+agreement", "verdict+cold")}
    return {"default": default, "datasheet": sheet, "step_cpu_s": step_s, "parts_s": parts, "steps": n,
            "moved": len(timed[0]["moved"]) > 0}


# -- the tables ----------------------------------------------------------------------------------
def print_tables(results: Dict[str, Dict[str, Any]], header: str) -> None:
    print(f"\n{header}")
    print("| setup | cluster | config | runs | runs with an action | actions (runs) | speed verdict at the end (runs) |")
    print("|---|---|---|---|---|---|---|")
    for name, res in results.items():
        s, runs = SETUPS[name], res["runs"]
        acted = [r for r in runs if r["actions"]]
        kinds = collections.Counter(a for r in runs for a in r["actions"])
        verdicts = collections.Counter(r["verdict"] for r in runs)
        print(f"| {name} | {s.cluster or 'config default'} | {s.config} | {len(runs)} | {len(acted)} | "
              f"{', '.join(f'{k} ({v})' for k, v in sorted(kinds.items())) or 'none'} | "
              f"{', '.join(f'{k} ({v})' for k, v in sorted(verdicts.items()))} |")
    print("\nAdded CPU per step, default vs --speed datasheet, interleaved pairs (process CPU per step summed over ranks, "
          "summary's busy figure)")
    print("| setup | pairs | default ms/step median (min-max) | datasheet ms/step | added, % per pair median (min-max) |")
    print("|---|---|---|---|---|")
    for name, res in results.items():
        pairs = [(a, b) for a, b in res["pairs"] if a is not None and b is not None]
        if not pairs:
            print(f"| {name} | 0 | - | - | - |")
            continue
        added = [(a - b) / b * 100 for a, b in pairs]
        print(f"| {name} | {len(pairs)} | {tb._spread([a for a, _ in pairs], '{:.1f}')} | "
              f"{tb._spread([b for _, b in pairs], '{:.1f}')} | {tb._spread(added, '{:+.2f}')} |")
    if not any("inside" in res for res in results.values()):
        return
    print("\nInside the default job (no emulation): collectives per step and rank, and thread CPU of the speed meter "
          "and the measured loop's decisions against the step's process CPU")
    print("| setup | steps | collectives/step default | datasheet | added (% of the step's) | clock us/step | "
          "EMA + agreement us/step | verdict + cold us/step | cold move in this run | step CPU ms | machinery % of step CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        if "inside" not in res:
            continue
        x = res["inside"]
        d, s = sum(x["default"].values()), sum(x["datasheet"].values())
        p = x["parts_s"]
        total = sum(p.values())
        print(f"| {name} | {x['steps']} | {d:.2f} | {s:.2f} | {d - s:+.2f} ({(d - s) / d * 100:+.1f} %) | "
              f"{p['clock'] * 1e6:.0f} | {p['ema+agreement'] * 1e6:.0f} | {p['verdict+cold'] * 1e6:.0f} | "
              f"{'yes' if x['moved'] else 'no'} | "
              f"{x['step_cpu_s'] * 1e3:.1f} | {total / x['step_cpu_s'] * 100:.2f} |")
    for name, res in results.items():
        if "inside" not in res:
            continue
        d, s = res["inside"]["default"], res["inside"]["datasheet"]
        diff = {k: d.get(k, 0.0) - s.get(k, 0.0) for k in set(d) | set(s)}
        diff = {k: v for k, v in diff.items() if abs(v) > 1e-9}
        print(f"{name}: call sites that differ (default - datasheet, per step and rank): "
              + ("; ".join(f"{k} {v:+.2f}" for k, v in sorted(diff.items())) or "none"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    ap.add_argument("--runs", type=int, default=10, help="default runs per setup (actions counted on each)")
    ap.add_argument("--pairs", type=int, default=5, help="of those, how many are paired with a --speed datasheet run")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the config's)")
    ap.add_argument("--no-inside", dest="inside", action="store_false",
                    help="skip the in-process collective count and timers")
    ap.add_argument("--max-load", type=float, default=2.0, help="start a run only below this 1-minute load")
    ap.add_argument("--max-wait", type=float, default=1800.0, help="seconds to wait for the load before giving up")
    ap.add_argument("--state-dir", default="/run/hetcomm/emulate-het-equal")
    args = ap.parse_args()
    if args.pairs > args.runs:
        ap.error(f"--pairs {args.pairs} exceeds --runs {args.runs}: each pair's default run is one of the runs")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the emulations still come down (finally)
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    print(f"start {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {rev}, load {tb._load():.2f}; "
          f"setups {args.setups}, {args.runs} runs, {args.pairs} pairs each", flush=True)
    results: Dict[str, Dict[str, Any]] = {}
    start_loads: List[float] = []
    ids: Dict[str, str] = {}
    workdir = tempfile.mkdtemp(prefix="het-equal-")
    try:
        for name in args.setups:
            s = SETUPS[name]
            if s.emulated:
                ids[name] = tb._up(s.cluster, s.subnet, args.state_dir)
            res: Dict[str, Any] = {"runs": [], "pairs": []}
            results[name] = res
            for i in range(args.runs):
                if not tb._wait_for_quiet(args.max_load, args.max_wait):
                    print(f"het_equal: the load stayed >= {args.max_load:g}; {name} stops after {i} run(s)", flush=True)
                    break
                start_loads.append(tb._load())
                order = ["default", "datasheet"] if i % 2 == 0 else ["datasheet", "default"]
                if i >= args.pairs:
                    order = ["default"]
                got: Dict[str, Dict[str, Any]] = {}
                for variant in order:
                    r = run_once(s, [] if variant == "default" else DATASHEET, args.steps, ids.get(name),
                                 args.state_dir, workdir)
                    got[variant] = r
                    print(f"  {name} run {i + 1} {variant}: rc {r['rc']}, actions {r['actions'] or 'none'}, "
                          f"verdict {r['verdict']}, busy "
                          f"{'-' if r['busy_ms'] is None else format(r['busy_ms'], '.1f')} ms CPU/step, load {tb._load():.2f}", flush=True)
                    print(f"    cold move: {r['rows'].get(tb.COLD, '-')}", flush=True)
                res["runs"].append(got["default"])
                if "datasheet" in got:
                    res["pairs"].append((got["default"]["busy_ms"], got["datasheet"]["busy_ms"]))
            if s.emulated:
                subprocess.run(tb._hetcomm("emulate", "down", "--id", ids.pop(name), "--state-dir", args.state_dir),
                               capture_output=True, env=tb._env(), cwd=REPO)
            if args.inside:
                res["inside"] = inside(s, args.steps, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        for rid in ids.values():
            subprocess.run(tb._hetcomm("emulate", "down", "--id", rid, "--state-dir", args.state_dir),
                           capture_output=True, env=tb._env(), cwd=REPO)
    print_tables(results, f"het_equal: {args.runs} default runs per setup ({args.pairs} paired with --speed datasheet), "
                 f"steps {args.steps or 'the config`s'}, start loads {min(start_loads, default=0):.2f}-"
                 f"{max(start_loads, default=0):.2f}, end load {tb._load():.2f}, {time.time() - t0:.0f} s, commit {rev}")
    quiet = {n: sum(1 for r in res["runs"] if not r["actions"]) for n, res in results.items()}
    ok = all(len(res["runs"]) >= 10 and quiet[n] >= 0.9 * len(res["runs"]) for n, res in results.items())
    print("\nT2 actions (no balancing action in >= 9 of 10 runs, every setup): "
          + ", ".join(f"{n} {quiet[n]}/{len(res['runs'])} quiet" for n, res in results.items())
          + f" -> {'met' if ok else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
