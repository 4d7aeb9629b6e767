"""``hetcomm simulate``: predict all-to-all plans on a cluster file, next to the lower bound.

Nothing runs on devices: the cluster YAML describes the machines (their kinds are labels) and
the cost model (``hetcomm.sched.cost``) times each plan (``hetcomm.sched.simulate``).

Examples::

    hetcomm simulate --cluster configs/clusters/mixed-a100-h800-910b.yaml --size 64M
    hetcomm simulate --cluster C.yaml --size 1M --skew zipf:1.2 --plans flat,auto --json
    hetcomm simulate --cluster C.yaml --size 256M --calibrate NET_ROCE_GDR=alltoall_perf.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

from hetcomm.errors import UsageError

__all__ = ["add_parser", "run", "SCHEMA", "predict_alltoall_us"]

SCHEMA = "hetcomm.simulate/1"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="predict all-to-all plans on a cluster file (time, lower bound, busiest resource)",
        description="Plan an all-to-all on a cluster YAML with each strategy and predict its time "
        "with the cost model, next to a lower bound no plan can beat. Nothing runs on devices.",
    )
    p.add_argument("--cluster", required=True, metavar="YAML", help="cluster description (configs/clusters/*.yaml)")
    p.add_argument("--size", default=None, help="bytes each rank sends in total, e.g. 1M, 64M, 256MiB (binary units); required without --placement")
    p.add_argument("--skew", default="uniform", help="uniform (default) or zipf:S, e.g. zipf:1.2 (destination popularity)")
    p.add_argument("--plans", default="flat,hier,multirail,auto", help="comma-separated: flat,hier,multirail,auto")
    p.add_argument("--seed", type=int, default=0, help="seed of the Zipf popularity order (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON (schema hetcomm.simulate/1) instead of a table")
    p.add_argument("--plot", metavar="PNG", help="also draw predicted times against the bound (needs hetcomm[plot])")
    p.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="FILE",
        help="cost parameters: a JSON parameter file, or measured rows that name their link class (repeatable)",
    )
    p.add_argument(
        "--calibrate",
        action="append",
        default=[],
        metavar="CLASS=FILE",
        help="calibrate one link class from `hetcomm bench --json` rows or nccl-tests alltoall_perf output",
    )
    g = p.add_argument_group("MoE step (--placement): placements judged on all-to-alls + expert compute")
    g.add_argument("--placement", default=None, metavar="LIST", help="compare expert placements: comma-separated equal,strong,throughput")
    g.add_argument("--experts", type=int, default=None, help="experts per layer (default: 4 per rank)")
    g.add_argument("--tokens", type=int, default=4096, help="tokens each rank routes per step (default %(default)s)")
    g.add_argument("--k", type=int, default=8, help="experts per token (default %(default)s)")
    g.add_argument("--model-dim", type=int, default=4096, help="D (default %(default)s)")
    g.add_argument("--hidden-dim", type=int, default=14336, help="F of each expert FFN (default %(default)s)")
    g.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak TFLOPS a GEMM reaches (default %(default)s)")
    return p


class _Progress:
    """A progress line on stderr, shown only once a run has taken more than a second."""

    def __init__(self, total: int, stream=None) -> None:
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        self.stream = stream or sys.stderr
        self.shown = False

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        if elapsed < 1.0 and not self.shown:
            return
        self.shown = True
        width = 24
        fill = int(width * self.done / max(self.total, 1))
        line = f"simulate [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {what} ({elapsed:.1f} s)"
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.stream.write(("\r" + line) if tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.shown and getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\n")
            self.stream.flush()


def _parse_plans(text: str) -> List[str]:
    from hetcomm.sched.planner import PLAN_CHOICES

    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError(f"--plans is empty; choose from {','.join(PLAN_CHOICES)}")
    for name in names:
        if name not in PLAN_CHOICES:
            raise UsageError(f"unknown plan {name!r} in --plans; choose from {','.join(PLAN_CHOICES)}")
    return list(dict.fromkeys(names))


def _cost_params(args: argparse.Namespace):
    from hetcomm.sched.cost import CostParams, load_cost_params

    params = CostParams()
    for path in args.cost:
        params = params.merged(load_cost_params(path))
    for spec in args.calibrate:
        cls_name, sep, path = spec.partition("=")
        if not sep or not cls_name or not path:
            raise UsageError(f"bad --calibrate {spec!r}; expected CLASS=FILE, e.g. NET_ROCE_GDR=alltoall_perf.txt")
        params = params.merged(load_cost_params(path, link_class=cls_name))
    return params


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def simulate_report(
    cluster_path: str,
    size_bytes: int,
    skew: str = "uniform",
    plans: Sequence[str] = ("flat", "hier", "multirail", "auto"),
    seed: int = 0,
    params: Any = None,
    progress: Optional[_Progress] = None,
) -> Dict[str, Any]:
    """The JSON document ``hetcomm simulate --json`` prints (see docs/SCHED.md)."""
    from hetcomm.sched.bound import lower_bound
    from hetcomm.sched.planner import plan_all_to_all
    from hetcomm.sched.simulate import simulate
    from hetcomm.sched.traffic import make_traffic, parse_skew
    from hetcomm.topo.cluster import load_cluster

    parse_skew(skew)
    cluster = load_cluster(cluster_path)
    T = make_traffic(cluster.num_ranks, size_bytes, skew, seed=seed)
    bound = lower_bound(cluster, T, params)
    if progress:
        progress.step("lower bound")
    offdiag = T.copy()
    for i in range(len(T)):
        offdiag[i, i] = 0
    devices = Counter(cluster.rank(r).model for r in range(cluster.num_ranks))
    doc: Dict[str, Any] = {
        "schema": SCHEMA,
        "cluster": {
            "name": cluster.name,
            "path": cluster_path,
            "num_ranks": cluster.num_ranks,
            "num_nodes": cluster.num_nodes,
            "devices": dict(devices),
            "devices_are_labels": True,
        },
        "traffic": {
            "size_bytes": int(size_bytes),
            "skew": skew,
            "seed": seed,
            "total_bytes": int(T.sum()),
            "moved_bytes": int(offdiag.sum()),
            "max_receive_bytes": int(offdiag.sum(axis=0).max()) if len(T) else 0,
        },
        "cost_model": {"source": getattr(params, "source", "nominal") if params is not None else "nominal"},
        "lower_bound": {
            "time_s": bound.time_s,
            "binding": _term(bound.binding),
            "terms": [_term(t) for t in bound.terms],
        },
        "plans": [],
    }
    for name in plans:
        t0 = time.perf_counter()
        plan = plan_all_to_all(cluster, T, name, params=params)
        t1 = time.perf_counter()
        sim = simulate(plan, cluster, params)
        t2 = time.perf_counter()
        doc["plans"].append(
            {
                "name": name,
                "strategy": plan.strategy,
                "time_s": sim.time_s,
                "ratio_to_bound": sim.time_s / bound.time_s if bound.time_s > 0 else None,
                "num_stages": sim.num_stages,
                "num_messages": sim.num_messages,
                "num_transfers": plan.num_transfers,
                "bytes_by_class": sim.bytes_by_class,
                "busiest_resource": {
                    "name": sim.busiest[0],
                    "busy_s": sim.busiest[1],
                    "utilization": sim.busiest[2],
                },
                "stage_end_s": list(sim.stage_end_s),
                "plan_s": t1 - t0,
                "simulate_s": t2 - t1,
                "notes": list(plan.notes),
            }
        )
        if progress:
            progress.step(name)
    return doc


def predict_alltoall_us(cluster_path: str, size_bytes: int, params: Any = None) -> float:
    """The flat plan's predicted time in microseconds for a uniform all-to-all of ``size_bytes``
    per rank: what ``hetcomm simulate --plans flat`` prints, and ``hetcomm audit --cluster``'s
    expected time (one model for both)."""
    doc = simulate_report(cluster_path, size_bytes, plans=("flat",), params=params)
    return float(doc["plans"][0]["time_s"]) * 1e6


def _term(t) -> Optional[Dict[str, Any]]:
    if t is None:
        return None
    return {"name": t.name, "num_bytes": t.num_bytes, "gbps": t.gbps, "alpha_s": t.alpha_s, "time_s": t.time_s}


def _text(doc: Dict[str, Any]) -> str:
    from hetcomm.sched.traffic import format_bytes

    c, tr, lb = doc["cluster"], doc["traffic"], doc["lower_bound"]
    kinds = ", ".join(f"{n}x {m}" for m, n in c["devices"].items())
    lines = [
        f"cluster {c['name']}: {c['num_ranks']} ranks on {c['num_nodes']} nodes ({kinds}; device kinds are "
        f"labels, nothing ran)",
        f"traffic: {tr['skew']}, {format_bytes(tr['size_bytes'])} sent per rank, "
        f"{format_bytes(tr['moved_bytes'])} between ranks, busiest receiver {format_bytes(tr['max_receive_bytes'])}"
        f"; cost model: {doc['cost_model']['source']}",
    ]
    b = lb["binding"]
    if b:
        lines.append(
            f"lower bound: {_ms(lb['time_s'])}  ({b['name']}: {format_bytes(b['num_bytes'])} over "
            f"{b['gbps']:g} Gb/s + {b['alpha_s'] * 1e6:g} us)"
        )
    else:
        lines.append("lower bound: 0 (no bytes move between ranks)")
    lines.append("")
    head = f"{'plan':<18} {'time':>12} {'ratio':>6} {'stages':>6} {'messages':>9}  busiest resource (busy share of the time)"
    lines.append(head)
    for p in doc["plans"]:
        name = p["name"] if p["name"] == p["strategy"] else f"{p['name']} ({p['strategy']})"
        ratio = f"{p['ratio_to_bound']:.2f}" if p["ratio_to_bound"] is not None else "-"
        br = p["busiest_resource"]
        lines.append(
            f"{name:<18} {_ms(p['time_s']):>12} {ratio:>6} {p['num_stages']:>6} {p['num_messages']:>9}  "
            f"{br['name']} ({br['utilization'] * 100:.0f}%)"
        )
    classes = sorted({k for p in doc["plans"] for k in p["bytes_by_class"]}, key=_class_order)
    if classes:
        lines.append("")
        lines.append(f"{'bytes per link class':<18} " + " ".join(f"{k:>13}" for k in classes))
        for p in doc["plans"]:
            lines.append(
                f"{p['name']:<18} " + " ".join(f"{format_bytes(p['bytes_by_class'].get(k, 0)):>13}" for k in classes)
            )
    for p in doc["plans"]:
        if p["name"] == "auto" and p["notes"]:
            lines.append("")
            lines.append(p["notes"][0])
    return "\n".join(lines)


def _class_order(name: str) -> int:
    from hetcomm.topo.model import LinkClass

    return int(LinkClass[name])


def _plot(doc: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed; install it with: pip install 'hetcomm[plot]'"
        ) from None
    names = [p["name"] if p["name"] == p["strategy"] else f"{p['name']}\n({p['strategy']})" for p in doc["plans"]]
    times = [p["time_s"] * 1e3 for p in doc["plans"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, times, color="#4c72b0")
    ax.axhline(doc["lower_bound"]["time_s"] * 1e3, color="#c44e52", linestyle="--", label="lower bound")
    ax.set_ylabel("predicted time (ms)")
    tr = doc["traffic"]
    ax.set_title(f"{doc['cluster']['name']}: {tr['size_bytes'] / 2**20:g} MiB per rank, {tr['skew']}")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise UsageError(f"cannot write plot {path}: {e.strerror}") from None
    finally:
        plt.close(fig)


def _run_placement(args: argparse.Namespace) -> int:
    from hetcomm.cli._placement_report import PLACEMENTS, placement_report, placement_text
    from hetcomm.sched.step import MoEWorkload
    from hetcomm.topo.cluster import load_cluster

    names = [n.strip() for n in args.placement.split(",") if n.strip()]
    bad = [n for n in names if n not in PLACEMENTS]
    if not names or bad:
        raise UsageError(f"--placement: unknown {bad or args.placement!r}; choose from {', '.join(PLACEMENTS)}")
    plans = _parse_plans(args.plans)
    experts = args.experts or 4 * load_cluster(args.cluster).num_ranks
    workload = MoEWorkload(
        tokens_per_rank=args.tokens, k=args.k, model_dim=args.model_dim, hidden_dim=args.hidden_dim, efficiency=args.efficiency
    )
    doc = placement_report(
        args.cluster, names, num_experts=experts, workload=workload, skew=args.skew,
        plan=plans[-1], seed=args.seed, params=_cost_params(args),
    )
    print(json.dumps(doc, indent=2) if args.json else placement_text(doc))
    return 0


def run(args: argparse.Namespace) -> int:
    from hetcomm.sched.traffic import parse_size, parse_skew

    if args.placement:
        return _run_placement(args)
    if args.size is None:
        raise UsageError("--size is required (or compare placements with --placement)")

    size = parse_size(args.size, what="--size")
    parse_skew(args.skew)
    plans = _parse_plans(args.plans)
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib, which is not installed; install it with: pip install 'hetcomm[plot]'"
            ) from None
    params = _cost_params(args)
    progress = _Progress(total=len(plans) + 1)
    try:
        doc = simulate_report(args.cluster, size, args.skew, plans, args.seed, params, progress)
    finally:
        progress.close()
    if args.plot:
        _plot(doc, args.plot)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(_text(doc))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0
