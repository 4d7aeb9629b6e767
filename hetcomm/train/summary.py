"""What ``hetcomm train`` prints: the progress line while it runs and the summary at the end.

The summary's rows come from every part of the run (the balancer's rows, the heterogeneity rows,
PowerSGD's counters gathered over ranks, the pager's totals, the rails' bytes); this module only
formats them, so the loop (:mod:`hetcomm.train.loop`) keeps to the step.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

__all__ = ["Progress", "summarise", "compression_per_rank", "group_backends"]


def compression_per_rank(psgd, model, cfg, rank: int, world_size: int) -> Dict[str, Any]:
    """Every rank's PowerSGD counters, gathered (collective with ``--powersgd`` or replication):
    for the dense averager, compressed calls, PowerSGD's uncompressed/compressed bytes on the
    rank's leader links and the rail bytes it sent in those calls; for the replica-gradient sums
    (exact or compressed) every reduction's count and rail bytes, and the same PowerSGD
    counters summed over layers."""
    from hetcomm.train.balance import ReplicaPowerSGD

    parts: Dict[str, List[float]] = {}
    if psgd is not None:
        st = psgd.stats()
        parts["powersgd_ranks"] = [st["compressed_calls"], st["uncompressed_bytes"], st["compressed_bytes"],
                                   float(sum(psgd.rail_bytes.values()))]
    if cfg.replicate:  # the exact sums count their reductions and rail bytes too
        t = ReplicaPowerSGD(model).totals()
        parts["replica_grad_ranks"] = [t[k] for k in _REPLICA_KEYS]
    if not parts:
        return {}
    n = sum(len(v) for v in parts.values())
    table = torch.zeros(world_size, n, dtype=torch.float64)  # host: a few counters, once per run
    table[rank] = torch.tensor([x for v in parts.values() for x in v], dtype=torch.float64)
    dist.all_reduce(table)
    out, off = {}, 0
    for name, v in parts.items():
        keys = _DENSE_KEYS if name == "powersgd_ranks" else _REPLICA_KEYS
        out[name] = [dict(zip(keys, row[off : off + len(v)].tolist())) for row in table]
        off += len(v)
    return out


_DENSE_KEYS = ("compressed_calls", "uncompressed_bytes", "compressed_bytes", "rail_bytes")
_REPLICA_KEYS = ("calls", "compressed_calls", "uncompressed_bytes", "compressed_bytes", "rail_bytes",
                 "compressed_rail_bytes")


def group_backends() -> List[str]:
    """The backend of each process group this rank belongs to (torch's group registry)."""
    return [str(dist.get_backend(pg)) for pg in list(dist.distributed_c10d._world.pg_map)]


def _rail_bytes() -> Dict[str, int]:
    import hetcomm

    return {rail: int(c.get("bytes_sent", 0)) for rail, c in hetcomm.stats().items()}


def _fmt_bytes(n: float) -> str:
    # The one byte formatter of every command (hetcomm.units).
    from hetcomm.units import format_bytes

    return format_bytes(n)


class Progress:
    """A one-line progress bar on a terminal; a line every ``log_every`` steps otherwise."""

    def __init__(self, enabled: bool, cfg, world_size: int, cluster, balancer=None, *, detected: bool = False) -> None:
        self.enabled = enabled
        self.cfg = cfg
        self.balancer = balancer
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last_t = self.t0
        self.last_step = 0
        self.last_bytes: Dict[str, int] = {}
        if enabled:
            labels = ", ".join(
                f"rank{r}={cluster.rank(r).model}@{cluster.rank(r).node.name}" for r in range(world_size)
            )
            if detected:
                origin = (
                    f"; detected by probing every host (no cluster file): {len({n.name for n in cluster.nodes})} "
                    f"node(s), device kinds as the probe saw them"
                )
            else:
                origin = "; device kinds are labels on this CPU-only machine, the rails between the processes are real"
            print(f"hetcomm train: {world_size} ranks on cluster '{cluster.name}' ({labels}){origin}.", file=sys.stderr)

    def update(self, step: int, loss: float, tokens_per_step: int, model) -> None:
        if not self.enabled:
            return
        if not (self.tty or step % self.cfg.log_every == 0 or step == self.cfg.steps or step == 1):
            return
        now = time.perf_counter()
        steps = step - self.last_step
        tok_s = tokens_per_step * steps / max(now - self.last_t, 1e-9)
        rail_now = _rail_bytes()
        per_rail = {r: (b - self.last_bytes.get(r, 0)) / max(steps, 1) for r, b in rail_now.items()}
        self.last_t, self.last_step, self.last_bytes = now, step, rail_now
        st = model.moe_layers[0].step_stats()  # a StepStats
        top5 = st.global_top5_share if st.global_top5_share is not None else st.top5_share
        replicas = list(st.replicas)
        frac = step / self.cfg.steps
        bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
        rails = " ".join(f"{r}:{_fmt_bytes(b)}" for r, b in sorted(per_rail.items())) or "-"
        line = (
            f"[{bar}] step {step}/{self.cfg.steps} loss {loss:.3f} {tok_s:,.0f} tok/s "
            f"a2a/step(rank0) {rails}"
            + (f" top5 {top5:.0%}" if isinstance(top5, float) else "")
            + (f" replicas {replicas}" if replicas is not None else "")
            + (f" migrations {self.balancer.migrations}" if self.balancer is not None else "")
            + (f" pages {_page_line(model)}" if self.cfg.page_budget else "")
        )
        if self.tty:
            print("\r" + line[:200].ljust(120), end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def _page_totals(model) -> Dict[str, float]:
    """This rank's pager counters summed over layers (cumulative; ``MoELayer.page_stats``)."""
    keys = ("hits", "waits", "stall_s", "loads", "evictions", "prefetches", "reacquires", "reacquire_stall_s",
            "slots", "experts")
    tot = {k: 0.0 for k in keys}
    for m in model.moe_layers:
        st = m.page_stats()
        for k in keys:
            tot[k] += st.get(k, 0)
    return tot


def _page_line(model) -> str:
    t = _page_totals(model)
    n = t["hits"] + t["waits"]
    rate = f"{t['hits'] / n:.1%}" if n else "-"
    return f"{rate} hit, stall {(t['stall_s'] + t['reacquire_stall_s']) * 1e3:.0f} ms"


def _page_row(cfg, model) -> str:
    t = _page_totals(model)
    n = t["hits"] + t["waits"]
    rate = f"{t['hits'] / n:.2%}" if n else "-"
    return (f"budget {cfg.page_budget:g} of each rank's experts ({int(t['slots'])} of {int(t['experts'])} expert slots "
            f"on rank0's device); {int(t['hits']):,} computations started without waiting, {int(t['waits']):,} "
            f"faulted ({rate} hits); stall {(t['stall_s'] + t['reacquire_stall_s']):.2f} s; {int(t['loads']):,} loads, "
            f"{int(t['evictions']):,} evictions, {int(t['prefetches']):,} prefetches, {int(t['reacquires']):,} "
            f"backward reloads (steps over budget)")


def _psgd_row(psgd) -> str:
    st = psgd.stats()
    if not st["compressed_bytes"]:
        return f"rank {psgd.state.matrix_approximation_rank if psgd.state else '-'}; no compressed step on rank 0"
    n = max(1, st["compressed_calls"])
    rails = ", ".join(f"{r} {_fmt_bytes(b / n)}" for r, b in sorted(psgd.rail_bytes.items()) if b) or "none"
    return (f"rank {psgd.state.matrix_approximation_rank}: {_fmt_bytes(st['compressed_bytes'] / n)} per step "
            f"instead of {_fmt_bytes(st['uncompressed_bytes'] / n)} on rank 0's leader links "
            f"({st['reduction']:.1f}x fewer); hetcomm rails sent per step: {rails}")


def _replica_row(model) -> str:
    from hetcomm.train.balance import ReplicaPowerSGD

    return ReplicaPowerSGD(model).summary()


def _groups_row() -> str:
    """This rank's process groups by backend: with ``--backend hetcomm`` all hetcomm unless a
    side group was made (``--balance``'s migrations and checkpointing's DCP coordination use gloo)."""
    backends = group_backends()
    counts = {b: backends.count(b) for b in sorted(set(backends))}
    if len(counts) == 1:
        return f"{len(backends)}, all {next(iter(counts))}"
    return f"{len(backends)}: " + ", ".join(f"{n} {b}" for b, n in counts.items())


def summarise(rank, world_size, cfg, cluster, task, model, losses, elapsed, tokens_per_step,
              balancer=None, psgd=None, het_rows=(), *, detected: bool = False, policy=None) -> Dict[str, Any]:
    """The end-of-run summary: ``ok`` (the verdict), ``text`` (the table, the policy's levers
    first: :class:`hetcomm.moe.policy.Policy`), ``first``/``last`` loss (means of a window),
    the task's ``unigram`` baseline and ``optimum``, ``verdict``."""
    unigram = task.unigram_entropy()
    optimum = task.conditional_entropy()
    window = max(1, min(20, len(losses) // 5))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    # "Well below the unigram baseline": at least half-way from the baseline to the optimum.
    target = unigram - 0.5 * (unigram - optimum)
    ok = last <= target
    verdict = ("PASS: " if ok else "FAIL: ") + f"last loss {'<=' if ok else '>'} {target:.3f} (half-way to optimum)"
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:  # NaN compares false with everything: say what happened, not "last loss > x"
        ok = False
        verdict = (f"FAIL: the loss is {losses[bad]} from step {cfg.steps - len(losses) + 1 + bad} on (diverged): "
                   f"lower --lr, or check the checkpoint it resumed from")
    rails = _rail_bytes()
    layer = model.moe_layers[0]
    st = layer.step_stats()
    rows = [
        *(policy.rows() if policy is not None else []),
        ("ranks", f"{world_size} ({', '.join(sorted({cluster.rank(r).model for r in range(world_size)}))}; "
                  f"{'detected, no cluster file' if detected else 'labels on CPU'})"),
        ("steps", f"{cfg.steps} in {elapsed:.1f} s"),
        ("tokens/s (all ranks)", f"{tokens_per_step * world_size * cfg.steps / elapsed:,.0f}"),
        ("loss first -> last", f"{first:.3f} -> {last:.3f} (mean of {window} steps)"),
        ("unigram baseline", f"{unigram:.3f}  (best context-free predictor)"),
        ("achievable optimum", f"{optimum:.3f}  (the chain's conditional entropy)"),
        ("verdict", verdict),
        ("replication / calibration", f"{'on' if cfg.replicate else 'off'} / {'on' if cfg.calibrate else 'off'}"),
        ("wire dtype", cfg.wire_dtype),
        *(balancer.summary_rows() if balancer is not None else []),
        *het_rows,
        *([("PowerSGD (cross-node pairs)", _psgd_row(psgd))] if psgd is not None else []),
        *([("PowerSGD replica grads (rank0)", _replica_row(model))] if cfg.powersgd_experts else []),
        ("process groups", _groups_row()),
        *([("paging (rank0)", _page_row(cfg, model))] if cfg.page_budget else []),
    ]
    for rail, c in sorted(rails.items()):
        rows.append((f"rank0 sent over {rail}", f"{_fmt_bytes(c)} ({_fmt_bytes(c / cfg.steps)}/step)"))
    labels = {
        "global_top5_share": "layer0 top-5 expert share",
        "global_min_expert_rate": "layer0 least-used expert share",
        "overflow_rate": "layer0 capacity overflow (rank0)",
        "local_fraction": "layer0 tokens computed locally (rank0)",
    }
    for key, label in labels.items():
        if isinstance(st.get(key), (int, float)):
            rows.append((label, f"{st[key]:.1%}"))
    if st.get("replicas") is not None:
        rows.append(("layer0 replicas on rank0", f"{list(st['replicas'])} (hot: {list(st.get('hot_experts', []))})"))
    if isinstance(st.get("a2a_bytes_sent"), (int, float)) and isinstance(st.get("a2a_bytes_sent_without_replication"), (int, float)):
        rows.append((
            "layer0 a2a bytes/step (rank0)",
            f"{_fmt_bytes(st['a2a_bytes_sent'])} sent; {_fmt_bytes(st['a2a_bytes_sent_without_replication'])} without replication",
        ))
    width = max(len(k) for k, _ in rows)
    text = "\n".join(["", "hetcomm train summary", "-" * (width + 40)] + [f"{k.ljust(width)}  {v}" for k, v in rows])
    return {"ok": ok, "text": text, "first": first, "last": last, "unigram": unigram, "optimum": optimum,
            "verdict": verdict}


