"""Phase 1 of ``hetcomm launch``: collective probes per rank and link class, and the verdict.

Run in every worker of a torchrun job (``python -m hetcomm.ops.health --out FILE``), over the
``hetcomm`` backend, so the probes take the rails the job will take:

* ``allreduce``: ``iters`` all-reduces of ``size`` bytes, timed on each rank;
* ``alltoall``: ``iters`` all-to-alls of ``size`` bytes per rank;
* ``pairs``: every pair of ranks exchanges ``size`` bytes (send/recv both ways) ``iters`` times,
  one round-robin round at a time with a barrier between rounds, so that a rank's time is its
  own pair's; each sample is filed under the pair's link class (from the cluster YAML).

Every rank all-gathers the pair medians, and the local rank 0 of every node writes the same
report (JSON) to ``--out``: per rank P50/P99 of each probe and class, and the ``W x W`` matrix of
pair medians. :func:`judge` turns a report into the verdict.

The verdict. A slow link slows every pair that crosses it, so a rank is not judged by its worst
pair (everyone has one pair with the slow node) but by its **best**: ``score(r)`` = the lowest
pair median of ``r`` towards ranks on other nodes (all ranks on a one-node job). A rank is slow
when ``score(r) > threshold * median(scores)``, a node when the median score of its ranks is
(default threshold 3). With two nodes a slow link between them cannot be blamed on either side,
and nothing is reported.

Each pair's median is first divided by what its **declared link class** makes it take
(:func:`expected_pair_seconds`, the report's ``pair_expected``): a node the cluster YAML reaches
only over a slower class (a 910B behind the cross-vendor bridge at 100 Gb/s + 30 us, beside
200 Gb/s RoCE) takes longer by design and is not slow for it; compared class-blind it was judged
slow and ``--eject`` left a healthy node out. The expectation is the class's rate, not each
port's: a node whose own port is slower than the rest of its class still stands out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["Verdict", "judge", "render_report", "run_probes", "main", "is_local_address", "expected_pair_seconds"]


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this machine (or network namespace): it can be bound."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))]


def _rounds(world: int) -> List[List[Tuple[int, int]]]:
    """Round-robin (circle method) pairings: every pair meets once; ``-1`` sits out."""
    n = world + (world % 2)
    ids = list(range(n))
    out = []
    for _ in range(n - 1):
        pairs = [(ids[i], ids[n - 1 - i]) for i in range(n // 2)]
        out.append([(a, b) for a, b in pairs if a < world and b < world])
        ids = [ids[0], ids[-1]] + ids[1:-1]
    return out


#: Side of the square float32 GEMM the compute probe times (~14 MFLOP: milliseconds on a core).
COMPUTE_GEMM = 192


def compute_probe(seconds: float) -> float:
    """Seconds per ``COMPUTE_GEMM``-sized float32 matmul on this rank, averaged over ``seconds``
    of back-to-back GEMMs (long enough to span many CFS periods of a cgroup quota: what a
    throttled or emulated-slow device shows)."""
    import torch

    a = torch.randn(COMPUTE_GEMM, COMPUTE_GEMM, dtype=torch.float32)
    b = torch.randn(COMPUTE_GEMM, COMPUTE_GEMM, dtype=torch.float32)
    torch.mm(a, b)  # warm-up
    n, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n


def expected_pair_seconds(cluster, world: int, size_bytes: int,
                          rate_scale: Optional[float] = None) -> List[List[Optional[float]]]:
    """Seconds each pair's exchange of ``size_bytes`` is expected to take by its declared link
    class: ``size / rate + latency``, the rate being the cross-vendor bridge's (and its latency)
    for a bridged pair, else the best rate the cluster declares for pairs of that class.

    ``rate_scale``: the emulation's (``hetcomm emulate``: every rate times it on the wire, and no
    bridge latency added), so that rates and latency keep their real proportion."""
    bridged: Dict[Tuple[int, int], bool] = {}
    classes: Dict[Tuple[int, int], Any] = {}
    rates: Dict[Tuple[int, int], float] = {}
    best: Dict[Any, float] = {}
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            va, vb = cluster.rank(a).vendor, cluster.rank(b).vendor
            bridged[a, b] = va != vb and "cpu" not in (va, vb)  # cluster.link_class's own rule
            classes[a, b] = cluster.link_class(a, b)
            rates[a, b] = cluster.link_gbps(a, b)
            if not bridged[a, b]:
                best[classes[a, b]] = max(best.get(classes[a, b], 0.0), rates[a, b])
    out: List[List[Optional[float]]] = [[None] * world for _ in range(world)]
    for (a, b), cls in classes.items():
        if bridged[a, b]:
            rate, latency = rates[a, b], cluster.interconnect.cross_vendor_latency_us * 1e-6
        else:
            rate, latency = best[cls], 0.0
        if rate_scale:
            rate, latency = rate * rate_scale, 0.0
        out[a][b] = size_bytes * 8 / (rate * 1e9) + latency
    return out


def run_probes(size_bytes: int, iters: int, cluster, node_of_rank: Sequence[str],
               compute_s: float = 0.0) -> Dict[str, Any]:
    """Run the probes on this rank (collective); returns the report (same on every rank).

    ``compute_s`` > 0 adds the compute probe (:func:`compute_probe`, every rank at once)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gemm_s = float("nan")
    if compute_s > 0:
        dist.barrier()
        gemm_s = compute_probe(compute_s)
    n = max(1, size_bytes // 4)
    x = torch.ones(n, dtype=torch.float32)

    def timed(fn) -> List[float]:
        fn()  # warm-up: first use sets up rails and buffers
        out = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    ar = timed(lambda: dist.all_reduce(x.clone()))
    per = max(1, n // world)
    a2a_in = torch.ones(per * world, dtype=torch.float32)
    a2a_out = torch.empty_like(a2a_in)
    a2a = timed(lambda: dist.all_to_all_single(a2a_out, a2a_in))

    send = torch.ones(n, dtype=torch.float32)
    recv = torch.empty_like(send)
    pair_samples: Dict[int, List[float]] = {}
    for pairs in _rounds(world):
        partner = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
        samples: List[float] = []
        for it in range(iters + 1):
            dist.barrier()
            if partner is None:
                continue
            t0 = time.perf_counter()
            reqs = [dist.isend(send, partner), dist.irecv(recv, partner)]
            for r in reqs:
                r.wait()
            if it:  # the first exchange of a pair sets up its connection
                samples.append(time.perf_counter() - t0)
        if partner is not None:
            pair_samples[partner] = samples

    med = torch.full((world,), float("nan"), dtype=torch.float64)
    for p, s in pair_samples.items():
        med[p] = statistics.median(s)
    mine = torch.tensor([_pct(ar, 50), _pct(ar, 99), _pct(a2a, 50), _pct(a2a, 99), gemm_s], dtype=torch.float64)
    gathered = [torch.empty(world + 5, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.cat([mine, med]))

    classes: Dict[str, List[float]] = {}
    for p, s in pair_samples.items():
        cls = cluster.link_class(rank, p).name if cluster is not None else "UNKNOWN"
        classes.setdefault(cls, []).extend(s)
    per_class = {c: {"p50": _pct(s, 50), "p99": _pct(s, 99)} for c, s in classes.items()}
    cls_list = [None] * world
    cls_list[rank] = per_class
    dist.all_gather_object(cls_list, per_class)

    ranks = []
    for r in range(world):
        v = gathered[r].tolist()
        ranks.append({
            "rank": r,
            "node": node_of_rank[r],
            "model": cluster.rank(r).model if cluster is not None else "unknown",
            "allreduce": {"p50": v[0], "p99": v[1]},
            "alltoall": {"p50": v[2], "p99": v[3]},
            "gemm_s": None if v[4] != v[4] else v[4],
            "classes": cls_list[r],
        })
    matrix = [[None if x != x else x for x in gathered[r].tolist()[5:]] for r in range(world)]
    report = {"world_size": world, "size_bytes": size_bytes, "iters": iters, "ranks": ranks, "pair_p50": matrix}
    if cluster is not None:
        from hetcomm import settings

        report["pair_expected"] = expected_pair_seconds(cluster, world, size_bytes, settings.EMULATE_SCALE.get())
    return report


@dataclass(frozen=True)
class Verdict:
    """What :func:`judge` found.

    Attributes:
        scores: per rank, its best pair median towards other nodes, divided by that pair's
            expected time when the report has one (``by_class``), else in seconds.
        median: the median score.
        slow_ranks: ranks whose score exceeds ``threshold * median``.
        slow_nodes: nodes whose ranks' median score does (only with >= 3 nodes).
        threshold: the factor used.
        by_class: scores are times over each pair's link-class expectation (unitless).
        best_s: per rank, the measured median (seconds) of the pair its score comes from.
    """

    scores: List[float]
    median: float
    slow_ranks: List[int]
    slow_nodes: List[str]
    threshold: float
    by_class: bool = False
    best_s: List[float] = field(default_factory=list)


def judge(report: Dict[str, Any], threshold: float = 3.0) -> Verdict:
    """The verdict on a probe report (see the module docstring)."""
    ranks = report["ranks"]
    nodes = [r["node"] for r in ranks]
    m = report["pair_p50"]
    expected = report.get("pair_expected")  # absent: a report of an older hetcomm, judged class-blind
    scores, best_s = [], []
    for r, row in enumerate(m):
        # (time over its class's expectation, measured time) of every pair with a measurement
        pairs = {p: (row[p] / expected[r][p] if expected and expected[r][p] else row[p], row[p])
                 for p in range(len(row)) if p != r and row[p] is not None}
        other = [v for p, v in pairs.items() if nodes[p] != nodes[r]] or list(pairs.values())
        score, raw = min(other) if other else (float("nan"), float("nan"))
        scores.append(score)
        best_s.append(raw)
    valid = [s for s in scores if s == s]
    med = statistics.median(valid) if valid else float("nan")
    slow_ranks = [r for r, s in enumerate(scores) if len(valid) >= 3 and s == s and s > threshold * med]
    node_names = list(dict.fromkeys(nodes))
    node_scores = {n: statistics.median([scores[r] for r in range(len(scores)) if nodes[r] == n]) for n in node_names}
    nmed = statistics.median(node_scores.values()) if node_scores else float("nan")
    slow_nodes = [n for n in node_names if len(node_names) >= 3 and node_scores[n] > threshold * nmed]
    return Verdict(scores, med, slow_ranks, slow_nodes, threshold, bool(expected), best_s)


def render_report(report: Dict[str, Any], verdict: Verdict) -> str:
    """The table ``hetcomm launch`` prints after phase 1."""
    classes = sorted({c for r in report["ranks"] for c in r["classes"]})
    head = ["rank", "node", "allreduce p50/p99 ms", "alltoall p50/p99 ms"] + [f"{c} p50/p99 ms" for c in classes] + ["best peer ms"]
    rows = []
    for r, s in zip(report["ranks"], verdict.scores):
        def pp(d):
            return f"{d['p50'] * 1e3:.2f}/{d['p99'] * 1e3:.2f}" if d else "-"

        flag = "  SLOW" if r["rank"] in verdict.slow_ranks else ""
        best = (f"{verdict.best_s[r['rank']] * 1e3:.2f} ({s:.2f}x its class)" if verdict.by_class
                else f"{s * 1e3:.2f}")
        rows.append([str(r["rank"]), r["node"], pp(r["allreduce"]), pp(r["alltoall"])]
                    + [pp(r["classes"].get(c)) for c in classes] + [best + flag])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [
        f"health check: {report['world_size']} ranks, {report['size_bytes']} B probes x {report['iters']}",
        "  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)),
    ]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    median = (f"{verdict.median:.2f}x its link class's expected time" if verdict.by_class
              else f"{verdict.median * 1e3:.2f} ms")
    if verdict.slow_nodes or verdict.slow_ranks:
        lines.append(
            f"slow (best-peer time > {verdict.threshold:g}x the median {median}): "
            + (f"nodes {', '.join(verdict.slow_nodes)}; " if verdict.slow_nodes else "")
            + f"ranks {', '.join(map(str, verdict.slow_ranks))}"
        )
    else:
        lines.append(f"no rank or node above {verdict.threshold:g}x the median best-peer time ({median})")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Worker entry point under torchrun (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m hetcomm.ops.health")
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=65536)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--marks", default=None, help="launch directory: leave this rank's end mark there (hetcomm.ops.rank_marks)")
    p.add_argument("--compute-s", type=float, default=0.0, help="seconds of the compute probe per rank (0: none)")
    p.add_argument("--rdzv-host", default=None, help="host of the rendezvous endpoint: each rank reports whether it is local")
    args = p.parse_args(argv)
    from hetcomm.ops.supervise import die_with_parent

    die_with_parent()  # a SIGKILLed agent must not leave this worker probing on
    from hetcomm.ops.rank_marks import marked

    rank = int(os.environ.get("RANK", "0"))
    with marked(args.marks, "health", int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), rank):
        return _probe_main(args)


def _probe_main(args: argparse.Namespace) -> int:

    import torch
    import torch.distributed as dist

    import hetcomm  # noqa: F401  (registers the backend)
    from hetcomm.ops.worker import fresh_store, place, round_store
    from hetcomm.topo.cluster import cluster_from_env

    round_store()  # rank 0 hosts the round's store (hetcomm launch turns torch's sharing off)
    place([])  # the job's cluster YAML in torchrun's node order (HETCOMM_CLUSTER)
    fresh_store()
    torch.set_num_threads(1)
    dist.init_process_group("hetcomm", timeout=timedelta(seconds=args.timeout))
    try:
        cluster = cluster_from_env()
        world = dist.get_world_size()
        nodes = [cluster.node_of(r).name if cluster is not None else "local" for r in range(world)]
        report = run_probes(args.size, args.iters, cluster, nodes, compute_s=args.compute_s)
        # Whether each rank's device kind is only a label (the process lacks that device, e.g.
        # the demo's A100/H800/910B on one CPU machine): its GEMM probe then measures this CPU,
        # not the device, and the launch judges compute against the measured CPU.
        from hetcomm.backends import hetcomm_group

        for place, entry in zip(hetcomm_group().placement.ranks, report["ranks"]):
            entry["label_only"] = bool(place.label_only)
        if args.rdzv_host is not None:
            hosts = [None] * world
            dist.all_gather_object(hosts, is_local_address(args.rdzv_host))
            for r, entry in enumerate(report["ranks"]):
                entry["hosts_rendezvous"] = bool(hosts[r])
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            from hetcomm.ops.safe_fs import write_private

            write_private(args.out, json.dumps(report, indent=1))  # 0600, never through a link
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
