"""Rails benchmark: plain gloo vs hetcomm through its gloo rail vs hetcomm through its shm rail.

One invocation measures, side by side, ``all_to_all_single`` of 1/4/16/64 MiB per rank on 4 local
ranks (float32, equal splits) over three process groups that live in the same 4 processes:

* ``gloo``        the default group, plain torch gloo;
* ``hetcomm/gloo`` ``new_group(backend="hetcomm", pg_options=HetcommOptions(rails=("gloo",)))``;
* ``hetcomm/shm``  the same with ``rails=("shm",)``;

plus the machine's copy bandwidth measured in the same processes: all ranks run
``dst.copy_(src)`` of the same size at once. Variants take turns inside every iteration (the
order rotates each iteration, so no variant always runs first); each iteration's time is the
maximum over the ranks; a run's value is the median over its iterations; the table gives the
median of the run values with the range [min-max] over runs. Every run is a fresh set of
processes.

Copy bound of the shm rail: every byte is copied twice (into the shared segment, out of it), so
with ``t_copy`` the time for every rank to copy ``S`` bytes at once (aggregate copy bandwidth
``n*S/t_copy``), the all-to-all cannot take less than ``2*t_copy``.

Usage::

    .venv/bin/python benchmarks/bench_rails.py                  # 3 runs x 10 iterations
    .venv/bin/python benchmarks/bench_rails.py --runs 5 --iters 20 --out table.md --json raw.json

Performance is never asserted in tests; this script prints a markdown table (and the targets of
issue 3, item 9, met or missed) for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from hetcomm.cli import _benchlib as lib  # noqa: E402

VARIANTS = ("gloo", "hetcomm/gloo", "hetcomm/shm", "hetcomm/default", "copy")
# HetcommOptions of each hetcomm variant; the "-nocheck" ones (--unchecked) turn off the
# cross-rank split check (one small gloo all_gather per call) to show what it costs.
HETCOMM_VARIANTS = {
    # The default rails: same-host ways as calibrated per size class (calibrate.py), e.g. the
    # single-copy path; HETCOMM_SAME_HOST_RAIL in the environment pins it instead.
    "hetcomm/default": {},
    "hetcomm/gloo": {"rails": ["gloo"]},
    "hetcomm/shm": {"rails": ["shm"]},
    "hetcomm/gloo-nocheck": {"rails": ["gloo"], "check_splits": False},
    "hetcomm/shm-nocheck": {"rails": ["shm"], "check_splits": False},
}
LABELS = {
    "gloo": "plain gloo",
    "hetcomm/gloo": "hetcomm, gloo rail forced",
    "hetcomm/shm": "hetcomm, shm rail forced",
    "hetcomm/default": "hetcomm, default rails (calibrated)",
    "hetcomm/gloo-nocheck": "hetcomm, gloo rail, split check off",
    "hetcomm/shm-nocheck": "hetcomm, shm rail, split check off",
}
_MiB = 1 << 20


def rank_main(payload: str, rank: int, world_size: int, store) -> Dict[str, Any]:
    """One rank of one run (a :func:`hetcomm.cli._benchlib.launch_ranks` target).

    Returns:
        On every rank: ``{"times": {variant: {size: [seconds per iteration]}}, "verify": ...}``
        after an ``all_gather_object``, rank 0 returns the list over ranks.
    """
    import torch
    import torch.distributed as dist

    import hetcomm
    from hetcomm.backends.options import HetcommOptions

    cfg = json.loads(payload)
    timeout = datetime.timedelta(seconds=cfg["timeout_s"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    variants = tuple(cfg["variants"])
    groups = {"gloo": dist.group.WORLD}
    # Barriers between timed calls run on a gloo group of their own: on the plain-gloo group
    # they would leave that group's sockets and threads freshly woken for its next call only.
    sync = dist.new_group(backend="gloo", timeout=timeout)
    for name in variants:  # same order on every rank: new_group is collective
        if name in HETCOMM_VARIANTS:
            spec = dict(HETCOMM_VARIANTS[name])
            if "rails" in spec:
                spec["rails"] = tuple(spec["rails"])
            groups[name] = dist.new_group(
                backend="hetcomm", timeout=timeout, pg_options=HetcommOptions(**spec)
            )
    sizes = [int(s) for s in cfg["sizes"]]
    max_count = max(sizes) // 4
    src_all = torch.empty(max_count, dtype=torch.float32)
    dst_all = torch.empty(max_count, dtype=torch.float32)

    # 1. Before timing anything: each variant gives gloo's exact result, and the forced rail is
    #    the one that carried the bytes (hetcomm.stats() counters, per group in isolation).
    verify: Dict[str, Any] = {}
    count = sizes[0] // 4
    src = lib.alltoall_input(rank, world_size, count, torch.float32)
    expected = lib.alltoall_expected(rank, world_size, count, torch.float32)
    for name in groups:
        hetcomm.reset_stats()
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src, group=groups[name])
        verify[name] = {
            "wrong": int((out != expected).sum().item()),
            "rail_bytes_sent": {k: v.get("bytes_sent", 0) for k, v in hetcomm.stats().items()},
        }
    hetcomm.reset_stats()

    # 2. Timed iterations, variants interleaved.
    times: Dict[str, Dict[int, List[float]]] = {v: {s: [] for s in sizes} for v in variants}
    for size in sizes:
        count = size // 4
        src, dst = src_all[:count], dst_all[:count]
        src.copy_(lib.alltoall_input(rank, world_size, count, torch.float32))
        for it in range(cfg["warmup"] + cfg["iters"]):
            shift = it % len(variants)
            for name in variants[shift:] + variants[:shift]:
                dist.barrier(group=sync)  # every variant starts from the same point
                t0 = time.perf_counter()
                if name == "copy":
                    dst.copy_(src)
                else:
                    dist.all_to_all_single(dst, src, group=groups[name])
                seconds = time.perf_counter() - t0
                if it >= cfg["warmup"]:
                    times[name][size].append(seconds)
        if rank == 0:
            print(
                f"bench_rails: run {cfg['run']}: {lib.format_bytes(size)} done",
                file=sys.stderr,
                flush=True,
            )
    mine = {
        "times": {v: {str(s): t for s, t in d.items()} for v, d in times.items()},
        "verify": verify,
    }
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    for name, group in groups.items():
        if name != "gloo":
            dist.destroy_process_group(group)
    dist.destroy_process_group()
    return gathered


def _run_value(per_rank: List[Dict[str, Any]], variant: str, size: int) -> float:
    """Median over iterations of the per-iteration maximum over ranks, in seconds."""
    series = [r["times"][variant][str(size)] for r in per_rank]
    return statistics.median(max(values) for values in zip(*series))


def summarize(
    runs: List[List[Dict[str, Any]]], sizes: List[int], num_ranks: int, variants: List[str]
) -> Dict[str, Any]:
    """Cells: per variant and size, median and range over runs of the run values (seconds)."""
    cells: Dict[str, Dict[int, Dict[str, float]]] = {}
    for variant in variants:
        cells[variant] = {}
        for size in sizes:
            values = [_run_value(run, variant, size) for run in runs]
            cells[variant][size] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "runs": values,
            }
    verify = [{name: r["verify"][name] for name in r["verify"]} for run in runs for r in run]
    return {
        "cells": cells,
        "verify": verify,
        "sizes": sizes,
        "num_ranks": num_ranks,
        "variants": variants,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def render(summary: Dict[str, Any], args: argparse.Namespace, machine: Dict[str, Any]) -> str:
    """The markdown section for benchmarks/README.md."""
    cells, sizes, n = summary["cells"], summary["sizes"], summary["num_ranks"]
    head = "| variant | " + " | ".join(lib.format_bytes(s) for s in sizes) + " |"
    lines = [
        f"Machine: `{machine['host']}`, {machine['num_cpus']} CPUs (`nproc`), "
        f"{machine['cpu_model']}; "
        f"{machine['date']}; torch {machine['torch']}. {n} ranks (processes) on this one host, "
        f"float32 `all_to_all_single`, equal splits. {args.runs} runs (fresh processes) x "
        f"{args.iters} iterations after {args.warmup} warm-up; variants interleaved per iteration. "
        f"Cell: time in ms, median over runs of (median over iterations of the max over ranks), "
        f"[range over runs], (speed relative to plain gloo = t_gloo / t).",
        "",
        head,
        "|" + "---|" * (len(sizes) + 1),
    ]
    gloo = cells["gloo"]
    for variant in [v for v in summary["variants"] if v != "copy"]:
        row = [LABELS[variant]]
        for s in sizes:
            c = cells[variant][s]
            row.append(
                f"{_ms(c['median'])} [{_ms(c['min'])}-{_ms(c['max'])}] "
                f"({gloo[s]['median'] / c['median']:.2f}x)"
            )
        lines.append("| " + " | ".join(row) + " |")
    copy = cells["copy"]
    lines.append(
        "| copy, all ranks at once: aggregate GB/s | "
        + " | ".join(
            f"{n * s / copy[s]['median'] / 1e9:.2f} [{n * s / copy[s]['max'] / 1e9:.2f}-"
            f"{n * s / copy[s]['min'] / 1e9:.2f}]"
            for s in sizes
        )
        + " |"
    )
    lines.append(
        "| shm copy bound (2 copies per byte) | "
        + " | ".join(f"{_ms(2 * copy[s]['median'])}" for s in sizes)
        + " |"
    )
    lines.append(
        "| single-copy bound (1 copy per byte) | "
        + " | ".join(f"{_ms(copy[s]['median'])}" for s in sizes)
        + " |"
    )
    lines.append(
        "| shm time / copy bound | "
        + " | ".join(
            f"{cells['hetcomm/shm'][s]['median'] / (2 * copy[s]['median']):.2f}x" for s in sizes
        )
        + " |"
    )
    lines += ["", "Targets (issue 3, item 9):", ""]
    for s in sizes:
        r = gloo[s]["median"] / cells["hetcomm/gloo"][s]["median"]
        lines.append(
            f"- gloo rail >= 0.95x plain gloo at {lib.format_bytes(s)}: {r:.2f}x "
            f"{'met' if r >= 0.95 else f'MISSED by {(0.95 - r) / 0.95 * 100:.0f}%'}"
        )
    if 16 * _MiB in sizes:
        s = 16 * _MiB
        r = gloo[s]["median"] / cells["hetcomm/shm"][s]["median"]
        lines.append(
            f"- shm rail >= 3x plain gloo at 16 MiB: {r:.2f}x "
            f"{'met' if r >= 3 else f'MISSED (needs {3 / r:.2f}x more speed)'}"
        )
    for s in sizes:
        q = cells["hetcomm/shm"][s]["median"] / (2 * copy[s]["median"])
        lines.append(
            f"- shm rail within 2x of the copy bound at {lib.format_bytes(s)}: {q:.2f}x "
            f"{'met' if q <= 2 else 'MISSED'}"
        )
    bad = {name for v in summary["verify"] for name, d in v.items() if d["wrong"]}
    rails_seen = {
        name: sorted(
            {
                rail
                for v in summary["verify"]
                for rail, b in v[name]["rail_bytes_sent"].items()
                if b > 0
            }
        )
        for name in ("hetcomm/gloo", "hetcomm/shm")
    }
    lines += [
        "",
        f"Checks in the same run: every variant's result equal to the expected pattern on every "
        f"rank: {'yes' if not bad else 'NO for ' + ', '.join(sorted(bad))}; rails that carried "
        f"bytes (hetcomm.stats()): gloo-forced group {rails_seen['hetcomm/gloo'] or ['none']}, "
        f"shm-forced group {rails_seen['hetcomm/shm'] or ['none']}.",
        f"Load: 1-min load average at the start {machine['load_start']}, at the end "
        f"{machine['load_end']} (other work on the machine inflates and spreads the times).",
        f"Reproduce: `{args.command_line}`",
    ]
    if machine.get("exit_crashes"):
        lines.append(
            f"Teardown crashes after the timings were complete (backend bug, reported): "
            f"{'; '.join(machine['exit_crashes'])}."
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="fresh process sets (default 3)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    p.add_argument(
        "--sizes", default="1M,4M,16M,64M", help="bytes per rank (default 1M,4M,16M,64M)"
    )
    p.add_argument("--nprocs", type=int, default=4, help="ranks (default 4)")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="collective timeout, s (default 120)"
    )
    p.add_argument("--out", default=None, help="also write the markdown to this file")
    p.add_argument("--json", default=None, help="write every raw timing to this JSON file")
    p.add_argument(
        "--unchecked",
        action="store_true",
        help="also time both hetcomm rails with the cross-rank split check off",
    )
    args = p.parse_args(argv)
    args.command_line = (
        f".venv/bin/python benchmarks/bench_rails.py --runs {args.runs} --iters {args.iters} "
        f"--warmup {args.warmup} --sizes {args.sizes} --nprocs {args.nprocs}"
        + (" --unchecked" if args.unchecked else "")
    )
    sizes = [lib.parse_bytes(s, "--sizes") for s in args.sizes.split(",")]
    if any(s % (4 * args.nprocs) for s in sizes) or args.runs < 1 or args.iters < 1:
        p.error("sizes must be multiples of 4*nprocs bytes; runs and iters >= 1")
    # The benchmark forces rails through pg_options; inherited HETCOMM_* settings would change
    # placement (a cluster YAML) or the default group's rails.
    for var in ("HETCOMM_CLUSTER", "HETCOMM_RAILS", "HETCOMM_PLAN"):
        os.environ.pop(var, None)
    import torch

    machine = lib.machine_description()
    machine["torch"] = torch.__version__
    machine["load_start"] = f"{os.getloadavg()[0]:.2f}"
    variants = list(VARIANTS)
    if args.unchecked:
        variants[3:3] = ["hetcomm/gloo-nocheck", "hetcomm/shm-nocheck"]
    runs = []
    exit_crashes: List[str] = []
    for run in range(args.runs):
        payload = json.dumps(
            {
                "sizes": sizes,
                "iters": args.iters,
                "warmup": args.warmup,
                "timeout_s": args.timeout,
                "run": run + 1,
                "variants": variants,
            }
        )
        outcome = lib.launch_ranks(
            "bench_rails:rank_main",
            payload,
            args.nprocs,
            timeout_s=args.timeout,
            env={"PYTHONPATH": HERE + os.pathsep + REPO_ROOT},
        )
        if not outcome.ok:
            for f in outcome.failures:
                print(
                    f"bench_rails: run {run + 1}: rank {f.rank} failed: "
                    f"{f.error_type}: {f.message}",
                    file=sys.stderr,
                )
            return 1
        for w in outcome.exit_warnings:
            print(
                f"bench_rails: run {run + 1}: warning: rank {w.rank} finished, then died while "
                f"exiting ({w.message}): a backend teardown bug; its timings are complete",
                file=sys.stderr,
            )
            exit_crashes.append(f"run {run + 1} rank {w.rank}: {w.message}")
        runs.append(outcome.result)
    machine["load_end"] = f"{os.getloadavg()[0]:.2f}"
    summary = summarize(runs, sizes, args.nprocs, variants)
    machine["exit_crashes"] = exit_crashes
    text = render(summary, args, machine)
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine, "summary": summary, "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
