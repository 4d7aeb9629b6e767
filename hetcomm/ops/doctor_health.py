"""``hetcomm doctor``'s rules over the job's health records.

The records (:mod:`hetcomm.ops.ops_records`) come from the launch health check, the in-training
probe (:mod:`hetcomm.ops.probe`) and the membership changes at a resume
(:mod:`hetcomm.ops.membership`, also an ``event`` line ``membership`` in the metrics file):

=====================  =========  ===================================================================
code                   severity   fires when
=====================  =========  ===================================================================
``slow-rank``          warning    a ``health`` record of the compute probe: a rank slower than its
                                  device class (launch check or in-training probe); one finding per
                                  rank, with its last measurement, its class baseline and how many
                                  windows named it
``slow-link``          warning    the same for the network probe (a rank's links slower than its
                                  link class)
``membership-change``  info       the job resumed on other ranks: who left or joined, the cause,
                                  the cost and the experts present (``error`` when an expert was
                                  missing after the restore)
=====================  =========  ===================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from hetcomm.topo.findings import FindingSpec
from hetcomm.topo.model import Finding

__all__ = ["HealthFile", "HEALTH_CODES", "rule_slow_rank", "rule_membership_change"]

HEALTH_CODES: Dict[str, FindingSpec] = {
    s.code: s
    for s in (
        FindingSpec(
            "slow-rank", "warning", "a rank computes slower than its device class",
            "Every rank waits for the slowest at each all-to-all and all-reduce; a throttled or "
            "degraded device costs the whole job its slowdown. Judged against ranks of the same "
            "device model (or the speed-scaled median), so a slower device class is not slow.",
        ),
        FindingSpec(
            "slow-link", "warning", "a rank's links are slower than its link class",
            "A degraded NIC, cable or switch port slows every transfer crossing it; judged against "
            "ranks whose links are of the same class.",
        ),
        FindingSpec(
            "membership-change", "info", "the job continued on other ranks",
            "A rank or node was lost (or joined) and the job resumed on the ranks present from "
            "its in-memory snapshots or its checkpoint, experts re-placed for the new world size; "
            "the steps since the restored one were redone.",
        ),
    )
}


@dataclass(frozen=True)
class HealthFile:
    """One health-records file as ``hetcomm doctor`` read it."""

    path: str
    records: List[Dict[str, Any]] = field(default_factory=list)


def _where(r: Dict[str, Any]) -> str:
    return f"rank {r.get('rank')} ({r.get('model', '?')} on {r.get('node', '?')})"


def rule_slow_rank(files: List[HealthFile]) -> List[Finding]:
    """``slow-rank`` / ``slow-link``: one finding per rank and probe (the last record of it)."""
    last: Dict[Tuple[str, Any, str], Tuple[str, Dict[str, Any], int]] = {}
    for f in files:
        for r in f.records:
            if r.get("kind") != "health":
                continue
            key = (f.path, r.get("rank"), str(r.get("probe", "compute")))
            n = last[key][2] + 1 if key in last else 1
            last[key] = (f.path, r, n)
    out = []
    for (path, _, probe), (_, r, n) in sorted(last.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2])):
        code = "slow-link" if probe == "network" else "slow-rank"
        source = "in-training probe" if r.get("source") == "probe" else "launch health check"
        when = f" at step {r['step']}" if isinstance(r.get("step"), int) else ""
        line = r.get("line") or (
            f"{_where(r)} slow in {probe}: {float(r.get('measured_s', 0)) * 1e3:.2f} ms vs "
            f"{float(r.get('baseline_s', 0)) * 1e3:.2f} ms for its class {r.get('klass')} "
            f"({float(r.get('factor', 0)):.2f}x; {r.get('baseline_of', '')})")
        fix = ("Check the device's clocks, temperature and power cap (nvidia-smi -q -d PERFORMANCE,CLOCK; "
               "npu-smi info), then eject the node (hetcomm launch --eject at the next start) or replace it"
               if code == "slow-rank" else
               "Check the NIC's link speed and errors (ethtool, ibstat, hetcomm audit) and the switch port; "
               "hetcomm launch --eject at the next start leaves a slow node out")
        out.append(Finding(code, HEALTH_CODES[code].severity, f"{path}: {_where(r)}",
                           f"{source}{when}, named in {n} record(s); last: {line}", fix))
    return out


def rule_membership_change(files: List[HealthFile], events: List[Tuple[str, int, str]]) -> List[Finding]:
    """``membership-change``: every change in the health records, and every metrics ``membership``
    event (``(path, step, detail)``) not already among them."""
    out = []
    seen = set()
    for f in files:
        for r in f.records:
            if r.get("kind") != "membership":
                continue
            seen.add((r.get("step"), r.get("line")))
            bad = r.get("experts_present") != r.get("experts_total")
            out.append(Finding(
                "membership-change", "error" if bad else "info", f"{f.path}: after step {r.get('step')}",
                f"{r.get('line')}",
                "Experts are missing: the checkpoint lacks them or the placement names a rank that is not "
                "there; resume from an earlier checkpoint" if bad else
                "Nothing, if the job finished; to grow back, start the node's `hetcomm launch` again (it joins at "
                "the next rendezvous, up to --nnodes MAX) or restart every node with --resume",
            ))
    for path, step, detail in events:
        if (step, detail) in seen:
            continue
        out.append(Finding("membership-change", "info", f"{path}: after step {step}", detail,
                           "Nothing, if the job finished; the health records beside the metrics file hold the details"))
    return out
