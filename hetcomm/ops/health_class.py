"""Health judged per device class: a 910B is not slow for being a 910B.

The launch health check's :func:`hetcomm.ops.health.judge` compares each rank's best link with
the global median; a straggler test of Megatron's kind (outlier > 1 sigma and > 10 % from the
mean) would flag every 910B of a mixed cluster. Here each rank is compared with its own class:

* **compute** (the report's ``gemm_s``, :func:`hetcomm.ops.health.compute_probe`): the class is
  the device model. A rank's time is first normalised by its declared speed
  (:func:`hetcomm.topo.compute.rank_speeds`: ``device.tflops`` or the device table), so
  ``norm(r) = gemm_s(r) * tflops(r) / max tflops``; the baseline of a class with at least
  ``MIN_CLASS`` ranks is the median ``norm`` of its members, else the median ``norm`` of all
  ranks (every class's expected time, scaled by the device table). Slow: ``norm(r) >
  compute_threshold x baseline``. A healthy half-speed device takes twice as long and declares
  half the speed: ``norm`` = baseline. An H800 throttled to half speed is at 2x.
* **network** (the best-pair medians of the report, when a ``link_class`` function is given):
  the class is the link class of the rank's best pair; baseline = median best-pair time of the
  ranks whose best pair has that class (>= ``MIN_CLASS`` of them, else of all ranks).

Each finding names the rank, node, model, class, its measurement and the class baseline
(:class:`SlowRank`); :func:`records` gives them as JSON lines (``kind: health``) that
``hetcomm launch`` appends to the job's health record in the launch directory.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["SlowRank", "ClassVerdict", "judge_by_class", "records", "MIN_CLASS", "COMPUTE_THRESHOLD"]

#: A class needs this many ranks for its own median; smaller ones use the speed-scaled median.
MIN_CLASS = 3
#: Slow = normalised GEMM time above this x the class baseline (a half-speed throttle is 2x;
#: the emulated quotas measured 1.7-2.6x per round at load 15, healthy ranks within +-25 %).
COMPUTE_THRESHOLD = 1.4


@dataclass(frozen=True)
class SlowRank:
    """A rank slower than its class.

    Attributes:
        rank / node / model: where.
        probe: ``compute`` or ``network``.
        klass: the class it was judged in (device model, or link class).
        measured_s: its measurement (GEMM seconds, or best-pair median seconds).
        baseline_s: the class baseline in the same unit, for this rank's device.
        factor: ``measured / baseline``.
        baseline_of: how the baseline was formed (``class median of N``, ``speed-scaled median of N``).
    """

    rank: int
    node: str
    model: str
    probe: str
    klass: str
    measured_s: float
    baseline_s: float
    factor: float
    baseline_of: str

    def line(self) -> str:
        return (f"rank {self.rank} ({self.model} on {self.node}) slow in {self.probe}: {self.measured_s * 1e3:.2f} ms vs "
                f"{self.baseline_s * 1e3:.2f} ms for its class {self.klass} ({self.factor:.2f}x; {self.baseline_of})")


@dataclass(frozen=True)
class ClassVerdict:
    """What :func:`judge_by_class` found: ``slow`` ranks, and every rank's factor per probe."""

    slow: List[SlowRank]
    compute_factor: Dict[int, float]
    network_factor: Dict[int, float]


def _best_pairs(report: Dict[str, Any]) -> Dict[int, tuple]:
    """rank -> (best pair median, peer) towards other nodes (any peer on a one-node job)."""
    ranks = report["ranks"]
    nodes = [r["node"] for r in ranks]
    out = {}
    for r, row in enumerate(report["pair_p50"]):
        cand = [(v, p) for p, v in enumerate(row) if p != r and v is not None and nodes[p] != nodes[r]]
        cand = cand or [(v, p) for p, v in enumerate(row) if p != r and v is not None]
        if cand:
            out[r] = min(cand)
    return out


def judge_by_class(report: Dict[str, Any], speeds: Sequence[float], *, link_class=None,
                   compute_threshold: float = COMPUTE_THRESHOLD, network_threshold: float = 3.0) -> ClassVerdict:
    """The per-class verdict on a health report (see the module docstring).

    Args:
        report: :func:`hetcomm.ops.health.run_probes`' report (``gemm_s`` per rank when the
            compute probe ran).
        speeds: each rank's declared TFLOPS (:func:`hetcomm.topo.compute.rank_speeds`).
        link_class: ``(a, b) -> name`` of the link class between two of the report's ranks;
            None: no network judgement here (the launch's best-peer verdict,
            :func:`hetcomm.ops.health.judge`, covers the network then).
    """
    ranks = report["ranks"]
    slow: List[SlowRank] = []
    compute_factor: Dict[int, float] = {}
    top = max(speeds) if speeds else 1.0
    norm = {r["rank"]: r["gemm_s"] * speeds[r["rank"]] / top for r in ranks if r.get("gemm_s")}
    if len(norm) >= 2:
        by_model: Dict[str, List[int]] = {}
        for r in ranks:
            if r["rank"] in norm:
                by_model.setdefault(r.get("model", "unknown"), []).append(r["rank"])
        everyone = statistics.median(norm.values())
        for r in ranks:
            i = r["rank"]
            if i not in norm:
                continue
            members = by_model[r.get("model", "unknown")]
            if len(members) >= MIN_CLASS:
                base, how = statistics.median(norm[m] for m in members), f"class median of {len(members)}"
            else:
                base, how = everyone, f"speed-scaled median of {len(norm)} (class has {len(members)})"
            factor = norm[i] / base if base > 0 else float("nan")
            compute_factor[i] = factor
            if factor > compute_threshold:
                scale = top / speeds[i]  # this device's own expected time
                slow.append(SlowRank(i, r["node"], r.get("model", "unknown"), "compute", r.get("model", "unknown"),
                                     r["gemm_s"], base * scale, factor, how))
    network_factor: Dict[int, float] = {}
    best = _best_pairs(report) if link_class is not None else {}
    if len(best) >= 3:
        cls_of = {r: link_class(r, p) for r, (_, p) in best.items()}
        for r, (v, _) in best.items():
            peers = [q for q in best if cls_of[q] == cls_of[r]]
            pool = peers if len(peers) >= MIN_CLASS else list(best)
            base = statistics.median(best[q][0] for q in pool)
            factor = v / base if base > 0 else float("nan")
            network_factor[r] = factor
            if factor > network_threshold:
                entry = ranks[r]
                slow.append(SlowRank(r, entry["node"], entry.get("model", "unknown"), "network", cls_of[r], v, base,
                                     factor, f"{'class' if pool is peers else 'all-rank'} median of {len(pool)}"))
    return ClassVerdict(sorted(slow, key=lambda s: (s.rank, s.probe)), compute_factor, network_factor)


def records(verdict: ClassVerdict, *, step: Optional[int] = None) -> List[Dict[str, Any]]:
    """The findings as JSON-ready records (``kind: health``) for the job's health record."""
    return [{"kind": "health", "step": step, **asdict(s)} for s in verdict.slow]
