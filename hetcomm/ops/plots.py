"""``hetcomm report``: a text summary and four PNGs of a metrics file (:mod:`hetcomm.ops.metrics`).

PNGs (matplotlib, the ``Agg`` backend: no display needed):

``step_time.png``          rank 0's step time per phase, stacked, over steps
``bytes_by_link_class.png`` bytes sent per step by link class (all ranks), stacked
``expert_load.png``        heat map of each expert's share of the step's token copies, one panel
                           per MoE layer (steps across, experts down)
``loss.png``               training loss, with checkpoints and resumes marked
"""

from __future__ import annotations

import os
import statistics
from typing import Dict, List, Sequence

from hetcomm.errors import UsageError
from hetcomm.ops.metrics import PHASES, MetricsLog

__all__ = ["PLOT_FILES", "summarize", "plot_metrics"]

PLOT_FILES = ("step_time.png", "bytes_by_link_class.png", "expert_load.png", "loss.png")


def _fmt_bytes(n: float) -> str:
    from hetcomm.units import format_bytes

    return format_bytes(n)


def _percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[i]


def summarize(log: MetricsLog) -> str:
    """The summary ``hetcomm report`` prints: the policy's levers, steps, step time and its
    phases, bytes per link class, expert load, loss, paging counters, checkpoints and resumes."""
    steps = log.steps
    if not steps:
        return f"{log.path}: no step records"
    run = log.run
    rows: List[tuple] = []
    if run is not None:
        rows.append(("job", f"{run.world_size} ranks on cluster '{run.cluster}'"))
    policies = [e for e in log.events if e.event == "policy"]
    if policies:  # the last record in force: the levers and why (hetcomm.moe.policy)
        rows.append(("policy" + (f" (from step {policies[-1].step})" if policies[-1].step else ""), policies[-1].detail))
    rows.append(("steps", f"{steps[0].step}..{steps[-1].step} ({len(steps)} records)"))
    times = [s.step_s for s in steps]
    med = statistics.median(times)
    rows.append(("step time (rank 0)", f"median {med * 1e3:.1f} ms, p99 {_percentile(times, 99) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms"))
    total = sum(times) or 1.0
    shares = {p: sum(s.phase_s.get(p, 0.0) for s in steps) / total for p in PHASES}
    rows.append(("time by phase", ", ".join(f"{p} {v:.0%}" for p, v in shares.items() if v >= 0.005)))
    comm = sum(s.moe_s.get("comm_exposed", 0.0) for s in steps) / total
    rows.append(("MoE all-to-all exposed", f"{comm:.0%} of step time (inside forward)"))
    slow = [max(range(len(s.step_s_by_rank)), key=lambda r: s.step_s_by_rank[r]) for s in steps]
    by_rank = {r: slow.count(r) for r in set(slow)}
    rows.append(("slowest rank", ", ".join(f"rank {r}: {n} steps" for r, n in sorted(by_rank.items(), key=lambda kv: -kv[1]))))
    classes: Dict[str, float] = {}
    for s in steps:
        for c, b in s.bytes_by_link_class.items():
            classes[c] = classes.get(c, 0.0) + b
    for c, b in sorted(classes.items(), key=lambda kv: -kv[1]):
        rows.append((f"bytes over {c}", f"{_fmt_bytes(b / len(steps))}/step (all ranks)"))
    for li in range(len(steps[-1].expert_load)):
        loads = [sum(s.expert_load[li][e] for s in steps) for e in range(len(steps[-1].expert_load[li]))]
        tot = sum(loads) or 1.0
        share = sorted((v / tot, e) for e, v in enumerate(loads))
        rows.append((f"layer{li} expert load", f"least used expert {share[0][1]} {share[0][0]:.1%}, most used {share[-1][1]} {share[-1][0]:.1%}"))
    window = max(1, min(10, len(steps) // 5))
    first = sum(s.loss for s in steps[:window]) / window
    last = sum(s.loss for s in steps[-window:]) / window
    rows.append(("loss first -> last", f"{first:.3f} -> {last:.3f} (mean of {window} steps)"))
    by_rank = [s.expert_s_by_rank for s in steps if s.expert_s_by_rank and sum(s.expert_s_by_rank) > 0]
    if by_rank:
        mm = [max(v) / (sum(v) / len(v)) for v in by_rank]
        rows.append(("per-rank MoE time max/mean", f"median {statistics.median(mm):.2f} over {len(mm)} steps (forward expert seconds)"))
    if steps[-1].speed_rows_per_s:
        rows.append(("rank speeds (agreed)", ", ".join(f"{v:,.0f}" for v in steps[-1].speed_rows_per_s) + " rows/s"))
    for key in ("page_hits", "page_faults", "migrations"):
        vals = [getattr(s, key) for s in steps if getattr(s, key) is not None]
        text = f"{sum(vals):,}" if vals else "not reported by the layer"
        if key == "migrations":
            events = [e.step for e in log.events if e.event == "migration"]
            if events:
                text = (text + "; " if vals else "") + f"balancer events at steps {', '.join(map(str, events[:8]))}" + (" ..." if len(events) > 8 else "")
        if key == "page_faults" and vals:
            hits = sum(s.page_hits for s in steps if s.page_hits is not None)
            stall = [s.page_stall_s for s in steps if s.page_stall_s is not None]
            n = hits + sum(vals)
            ws = log.run.world_size if log.run is not None else 1
            text += (f" ({hits / n:.2%} of expert computations started without waiting" if n else " (") + (
                f"; {sum(stall):.3f} s stalled on page loads, all ranks: {sum(stall) / ws / max(1e-12, sum(s.step_s for s in steps)):.2%} "
                f"of a rank's step time on average)" if stall else ")")
        rows.append((key.replace("_", " "), text))
    ck = [e.step for e in log.events if e.event == "checkpoint"]
    rs = [e.step for e in log.events if e.event == "resume"]
    rows.append(("checkpoints", ", ".join(map(str, ck)) if ck else "none"))
    if rs:
        rows.append(("resumed at step", ", ".join(map(str, rs))))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"hetcomm report: {log.path}", "-" * (width + 50)] + [f"{k.ljust(width)}  {v}" for k, v in rows])


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'hetcomm[plot]'") from None
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def plot_metrics(log: MetricsLog, out_dir: str) -> List[str]:
    """Draw :data:`PLOT_FILES` into ``out_dir`` (created); returns their paths.

    Raises:
        UsageError: matplotlib is missing, or the file has no step records.
    """
    steps = log.steps
    if not steps:
        raise UsageError(f"{log.path} has no step records to plot; run hetcomm train --metrics FILE first")
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    x = [s.step for s in steps]
    paths = []
    title = f"{log.run.world_size} ranks, cluster '{log.run.cluster}'" if log.run else log.path

    fig, ax = plt.subplots(figsize=(9, 4))
    ys = [[s.phase_s.get(p, 0.0) * 1e3 for s in steps] for p in PHASES]
    ax.stackplot(x, ys, labels=PHASES)
    ax.plot(x, [s.moe_s.get("comm_exposed", 0.0) * 1e3 for s in steps], color="k", lw=1, ls="--", label="MoE a2a exposed (in forward)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms (rank 0)")
    ax.set_title(f"Step time by phase — {title}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    paths.append(_save(fig, plt, out_dir, PLOT_FILES[0]))

    fig, ax = plt.subplots(figsize=(9, 4))
    classes = sorted({c for s in steps for c in s.bytes_by_link_class})
    ys = [[s.bytes_by_link_class.get(c, 0) / 2**20 for s in steps] for c in classes]
    if classes:
        ax.stackplot(x, ys, labels=classes)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("MiB sent per step (all ranks)")
    ax.set_title(f"Bytes by link class — {title}")
    paths.append(_save(fig, plt, out_dir, PLOT_FILES[1]))

    L = len(steps[-1].expert_load)
    fig, axes = plt.subplots(L, 1, figsize=(8, 2.2 * max(L, 1) + 0.6), squeeze=False)
    for li in range(L):
        ax = axes[li][0]
        E = len(steps[-1].expert_load[li])
        grid = []
        for e in range(E):
            grid.append([s.expert_load[li][e] / max(sum(s.expert_load[li]), 1.0) for s in steps])
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", extent=(x[0] - 0.5, x[-1] + 0.5, -0.5, E - 0.5))
        ax.set_ylabel(f"layer {li}\nexpert")
        fig.colorbar(im, ax=ax, label="share of copies")
    axes[-1][0].set_xlabel("step")
    axes[0][0].set_title(f"Expert load — {title}")
    paths.append(_save(fig, plt, out_dir, PLOT_FILES[2]))

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(x, [s.loss for s in steps], lw=1.2, label="loss")
    for e in log.events:
        style = {"checkpoint": ("tab:green", ":"), "resume": ("tab:red", "--")}.get(e.event)
        if style:
            ax.axvline(e.step, color=style[0], ls=style[1], lw=0.8)
    if any(e.event == "checkpoint" for e in log.events):
        ax.plot([], [], color="tab:green", ls=":", label="checkpoint")
    if any(e.event == "resume" for e in log.events):
        ax.plot([], [], color="tab:red", ls="--", label="resume")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(f"Loss — {title}")
    ax.legend(loc="upper right", fontsize=8)
    paths.append(_save(fig, plt, out_dir, PLOT_FILES[3]))
    return paths


def _save(fig, plt, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
