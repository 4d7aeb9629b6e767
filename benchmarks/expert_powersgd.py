"""``hetcomm train --powersgd-experts RANK`` against exact replica-gradient sums: bytes on the
compressed (cross-node) pairs and final loss.

The demo job (``configs/train/demo.yaml``: 2-layer MoE LM, 8 experts, 4 ranks of mixed-mini:
ranks 0, 1 share a node, 2 and 3 are alone on theirs) trains twice per seed, interleaved: exact
replica-gradient sums, then PowerSGD on their cross-node pairs (exact inside the node). Each
rank's ``train_worker`` runs in-process and hands back its summary
(:func:`hetcomm.train.loop.last_summary`), so the numbers are the run's own counters:

- **bytes per reduction on the compressed pairs**: what ranks 2 and 3 (each alone on its node,
  so every byte they send crosses a node) sent on hetcomm's rails during the replica-gradient
  reductions, from ``hetcomm.stats()`` around each reduction: all reductions of the exact run,
  the compressed ones of the PowerSGD run (its first ``max(10, steps // 10)`` are exact); ranks
  0 and 1 apart (their bytes mix the exact intra-node stages with rank 0's cross-node ones);
- **PowerSGD's count** on rank 0's leader links (elements before / after compression);
- **loss**: mean of the last 20 steps (the mean over ranks), as the dense-PowerSGD table.

Usage::

    .venv/bin/python benchmarks/expert_powersgd.py --seeds 0 1 [--steps 200] [--rank 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "train", "demo.yaml")


def rank_body(rank: int, world_size: int, cfg, port: int) -> Dict[str, Any]:
    from hetcomm.train.loop import last_summary
    from tests.ops.jobs import _train_rank

    code = _train_rank(rank, world_size, cfg, port)
    s = last_summary()
    return {"code": code, "losses": s["losses"], "experts": s["replica_grad_ranks"][rank],
            "groups": s["process_groups"]}


def _replica_bytes(rank_out: Dict[str, Any], compressed: bool) -> float:
    """Rail bytes per replica-gradient reduction this rank sent (compressed ones only when on)."""
    e = rank_out["experts"]
    if compressed:
        return e["compressed_rail_bytes"] / e["compressed_calls"] if e.get("compressed_calls") else 0.0
    return e["rail_bytes"] / e["calls"] if e.get("calls") else 0.0


def run(seed: int, steps: int, rank: int) -> Dict[str, Any]:
    from hetcomm.train.loop import load_train_config
    from tests.backends.ranks import MIXED_MINI, run_ranks
    from tests.ops.jobs import _free_port

    out: Dict[str, Any] = {"seed": seed}
    for name, pr in (("exact", 0), ("powersgd", rank)):
        cfg = load_train_config(DEMO, steps=steps, seed=seed, powersgd_experts=pr, log_every=10**6)
        t0 = time.perf_counter()
        res = run_ranks(rank_body, 4, cluster=MIXED_MINI, args=(cfg, _free_port()), timeout=3600)
        wall = time.perf_counter() - t0
        losses = res[0]["losses"]
        out[name] = {
            "wall_s": wall,
            "load": os.getloadavg()[0],
            "last20": sum(losses[-20:]) / len(losses[-20:]),
            "final": losses[-1],
            "bytes_per_reduction": {r: _replica_bytes(res[r], pr > 0) for r in range(4)},
            "reductions": {r: res[r]["experts"].get("calls", 0) for r in range(4)},
            "compressed_reductions": {r: res[r]["experts"].get("compressed_calls", 0) for r in range(4)},
            "leader_count": {k: res[0]["experts"].get(k, 0) for k in ("uncompressed_bytes", "compressed_bytes")},
            "groups": sorted(set(res[0]["groups"])),
        }
    return out


def _fmt(n: float) -> str:
    from hetcomm.units import format_bytes

    return format_bytes(n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank of the compressed run")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows: List[Dict[str, Any]] = []
    for seed in a.seeds:
        rows.append(run(seed, a.steps, a.rank))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# expert_powersgd: demo, {a.steps} steps, PowerSGD rank {a.rank} on the replica-gradient sums' "
          f"cross-node pairs; started {started}; {uptime}")
    print("| seed | exact last-20 loss | PowerSGD last-20 loss | difference | rank 2 bytes/reduction exact -> PowerSGD "
          "| rank 3 bytes/reduction | PowerSGD count, rank 0's leader links | compressed / all reductions (rank 0) "
          "| wall exact / PowerSGD (load) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ex, ps = r["exact"], r["powersgd"]
        diff = (ps["last20"] - ex["last20"]) / ex["last20"]
        b2e, b2p = ex["bytes_per_reduction"][2], ps["bytes_per_reduction"][2]
        b3e, b3p = ex["bytes_per_reduction"][3], ps["bytes_per_reduction"][3]
        lc = ps["leader_count"]
        ratio = lambda x, y: f"{x / y:.1f}x" if y else "-"  # noqa: E731
        print(f"| {r['seed']} | {ex['last20']:.3f} | {ps['last20']:.3f} | {diff:+.1%} | {_fmt(b2e)} -> {_fmt(b2p)} "
              f"(**{ratio(b2e, b2p)} fewer**) | {_fmt(b3e)} -> {_fmt(b3p)} ({ratio(b3e, b3p)}) | "
              f"{_fmt(lc['compressed_bytes'])} instead of {_fmt(lc['uncompressed_bytes'])} "
              f"({ratio(lc['uncompressed_bytes'], lc['compressed_bytes'])}) | "
              f"{ps['compressed_reductions'][0]} / {ps['reductions'][0]} | "
              f"{ex['wall_s']:.0f} s / {ps['wall_s']:.0f} s ({ex['load']:.0f} / {ps['load']:.0f}) |")
    print()
    print("Ranks 0 and 1 share a node: their bytes mix the exact intra-node stages with rank 0's cross-node ones.")
    print("| seed | rank 0 bytes/reduction exact -> PowerSGD | rank 1 bytes/reduction exact -> PowerSGD |")
    print("|---|---|---|")
    for r in rows:
        ex, ps = r["exact"]["bytes_per_reduction"], r["powersgd"]["bytes_per_reduction"]
        print(f"| {r['seed']} | {_fmt(ex[0])} -> {_fmt(ps[0])} | {_fmt(ex[1])} -> {_fmt(ps[1])} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"started": started, "uptime": uptime, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
