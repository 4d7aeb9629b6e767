"""``hetcomm bench`` output: the nccl-tests table (header, rows, footer) and its per-rank and rail summary lines."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from hetcomm.units import format_bytes


# -- the table --------------------------------------------------------------------------------

# nccl-tests' header, verbatim (tests/fixtures/nccltests_alltoall_perf_b300_1node_2node.txt);
# every value of a row is right-aligned to the end of its header word.
_HEADER_1 = (
    "#                                                              out-of-place"
    "                       in-place"
)
_HEADER_2 = (
    "#       size         count      type   redop    root     time   algbw   busbw #wrong"
    "     time   algbw   busbw #wrong"
)
_HEADER_3 = (
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
    "            (us)  (GB/s)  (GB/s)"
)
_COLUMN_ENDS = [m.end() for m in re.finditer(r"\S+", _HEADER_2)][1:]  # skip the leading '#'


def _time_str(time_us: float) -> str:
    # nccl-tests' precision rule: fewer decimals as the number grows.
    if time_us >= 10000.0:
        return f"{time_us:.0f}"
    if time_us >= 100.0:
        return f"{time_us:.1f}"
    return f"{time_us:.2f}"


def _row_line(values: Sequence[str]) -> str:
    line = ""
    for value, end in zip(values, _COLUMN_ENDS):
        start = max(end - len(value), len(line) + 1)
        line += " " * (start - len(line)) + value
    return line


def _rank_line(info: Dict[str, Any], cpu_model: str) -> str:
    """nccl-tests' ``#  Rank`` line. The bracket (a PCI bus id in nccl-tests) says where the
    tensors really are and, with a cluster YAML, that the device kind is a label; the model
    follows the bracket, as in nccl-tests."""
    where = info["torch_device"] + (", label" if info.get("label_only") else "")
    model = info.get("model") or cpu_model
    return (
        f"#  Rank {info['rank']:2d} Group  0 Pid {info['pid']:6d} on {info['host']:>10s} "
        f"device {info['device']:2d} [{where}] {model}"
    )


def _label_lines(result: Dict[str, Any]) -> List[str]:
    """Where each rank stands, and the statement that GPU/NPU kinds are labels."""
    ranks = [i for i in result["ranks"] if i.get("model")]
    if not ranks:
        return []
    stands = ", ".join(
        f"rank {i['rank']} = {i.get('device_name', '')} {i['model']} on {i['node']}".replace(
            "  ", " "
        )
        for i in ranks
    )
    lines = [f"# Cluster placement: {stands}"]
    if result.get("labels_only"):
        cfg = result["config"]
        cluster = os.path.basename(cfg.get("cluster") or "") or "the cluster YAML"
        lines.append(
            f"# Device kinds are labels: each rank is a CPU process standing for the GPU/NPU "
            f"named in {cluster}; tensors stay in host memory, and the transports between the "
            f"processes (shared memory, TCP) are real."
        )
    return lines


def format_table(result: Dict[str, Any]) -> str:
    """Render a result document (from :func:`run_rank`) as nccl-tests prints its table.

    Lines: ``#`` metadata (version, parameters, one ``#  Rank`` line per rank), the three header
    lines, one row per size with out-of-place and in-place ``time algbw busbw #wrong``, then
    ``# Out of bounds values`` and ``# Avg bus bandwidth``.
    """
    cfg = result["config"]
    machine = result["machine"]
    rails = ",".join(cfg["rails"]) if cfg.get("rails") else "chosen per peer"
    step = f"{cfg['stepfactor']}(factor)" if cfg["stepfactor"] > 1 else f"{cfg['stepbytes']}(bytes)"
    lines = [
        f"# hetcomm bench version {result['version']} torch {result['torch']}",
        f"# Collective test starting: {result['test']}",
        f"# nThread 1 nGpus 1 minBytes {cfg['minbytes']} maxBytes {cfg['maxbytes']} step: {step} "
        f"warmup iters: {cfg['warmup_iters']} iters: {cfg['iters']} agg iters: 1 "
        f"validation: {int(cfg['check'])} graph: 0",
        f"# backend: {cfg['backend']}"
        + (f"  rails: {rails}" if cfg["backend"] == "hetcomm" else "")
        + (f"  plan: {cfg['plan']}" if cfg.get("plan") else "")
        + f"  ranks: {result['num_ranks']}  datatype: {cfg['datatype']}  redop: {cfg['redop']}",
        f"# machine: {machine['host']}, {machine['num_cpus']} CPUs, {machine['cpu_model']}; "
        f"date: {machine['date']}",
        "# time: max over ranks of each rank's mean time per iteration",
        "#",
        "# Using devices",
    ]
    lines += [_rank_line(info, machine["cpu_model"]) for info in result["ranks"]]
    lines += _label_lines(result)
    rail_line = _rail_summary(result.get("rails"))
    if rail_line:
        lines.append(rail_line)
    lines += ["#", _HEADER_1, _HEADER_2, _HEADER_3]
    for row in result["rows"]:
        values = [str(row["size"]), str(row["count"]), row["type"], row["redop"], str(row["root"])]
        for name in ("out_of_place", "in_place"):
            block = row[name]
            values += [
                _time_str(block["time_us"]),
                f"{block['algbw_gbps']:.2f}",
                f"{block['busbw_gbps']:.2f}",
                "N/A" if block["wrong"] is None else str(block["wrong"]),
            ]
        lines.append(_row_line(values))
    status = "OK" if result["out_of_bounds"] == 0 else "FAILED"
    lines += [
        f"# Out of bounds values : {result['out_of_bounds']} {status}",
        f"# Avg bus bandwidth    : {_avg_str(result['avg_busbw_gbps'])}",
        "#",
        f"# Collective test concluded: {result['test']}",
    ]
    return "\n".join(lines) + "\n"


def _avg_str(value: float) -> str:
    # nccl-tests prints %g-like output ("359.21", "102.495"); keep 6 significant digits.
    return f"{value:.6g}"


def _rail_summary(rails: Optional[List[Any]]) -> str:
    """``# Rail bytes sent (all ranks): shm 3.0 MiB, gloo 0 B`` from hetcomm.stats() counters."""
    if not rails:
        return ""
    totals: Dict[str, float] = {}
    for per_rank in rails:
        if not isinstance(per_rank, dict):
            return ""
        for rail, counters in per_rank.items():
            sent = _sent_bytes(counters)
            if sent is None:
                continue
            totals[rail] = totals.get(rail, 0.0) + sent
    if not totals:
        return ""
    parts = ", ".join(f"{rail} {format_bytes(v)}" for rail, v in sorted(totals.items()))
    return f"# Rail bytes sent (all ranks, whole run incl. warmup and checks): {parts}"


def _sent_bytes(counters: Any) -> Optional[float]:
    if isinstance(counters, dict):
        for key in ("bytes_sent", "sent_bytes", "tx_bytes"):
            if isinstance(counters.get(key), (int, float)) and not isinstance(
                counters.get(key), bool
            ):
                return float(counters[key])
    return None
