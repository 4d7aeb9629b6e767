"""Collectives per training step, by call site, of a default ``hetcomm train`` run (issue 19).

Every rank wraps the group-wide operations of the hetcomm backend — the delegated collectives
(all_reduce, broadcast, all_gather, barrier, ...: :class:`~hetcomm.backends.delegated.DelegatedCollectives`)
and the routed ones (all_to_all_single, all_to_all, run_plan: :class:`~hetcomm.backends.routed.RoutedCollectives`)
— and books each call to the first frame outside ``hetcomm/backends`` and torch (the hetcomm code
that asked for it) and to the training step it ran in. The step is counted by wrapping
``hetcomm.train.loop._step`` (once per step); calls before the first
step are "startup", calls after the loop "end". The training itself is the unmodified
``train_worker`` with the demo config (``configs/train/demo.yaml``, mixed-mini, 4 ranks).

    .venv/bin/python benchmarks/count_collectives.py --steps 30

Prints one markdown row per call site: calls per step (mean over the steps, and the min/max
over steps), per rank, and the total per step.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_DELEGATED = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "allgather_coalesced",
              "all_gather_single", "reduce_scatter", "reduce_scatter_single", "reduce", "gather",
              "scatter", "barrier")
_ROUTED = ("all_to_all_single", "all_to_all", "run_plan")


def _site() -> str:
    """The hetcomm caller outside the backend: ``module.py:line:function``."""
    pkg = os.path.join(REPO, "hetcomm") + os.sep
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename
        if f.startswith(pkg) and not f.startswith(os.path.join(pkg, "backends")):
            return f"{os.path.relpath(f, pkg)}:{frame.lineno}:{frame.name}"
    return "other"


def _rank_main(cfg: Any) -> Dict[str, Any]:
    from hetcomm.backends.delegated import DelegatedCollectives
    from hetcomm.backends.routed import RoutedCollectives
    from hetcomm.train import loop
    from hetcomm.ops import hooks

    state = {"step": "startup"}
    calls: Dict[Any, collections.Counter] = collections.defaultdict(collections.Counter)

    def wrap(cls, name: str) -> None:
        orig = getattr(cls, name)

        def counted(self, *args, **kwargs):
            calls[state["step"]][f"{_site()} ({name})"] += 1
            return orig(self, *args, **kwargs)

        setattr(cls, name, counted)

    for name in _DELEGATED:
        wrap(DelegatedCollectives, name)
    for name in _ROUTED:
        wrap(RoutedCollectives, name)
    orig_step = loop._step

    def one_step(job, step) -> None:
        state["step"] = 1 if state["step"] == "startup" else state["step"] + 1
        orig_step(job, step)

    loop._step = one_step
    orig_finish = hooks.finish_checkpoints

    def finish(mc) -> None:
        state["step"] = "end"
        orig_finish(mc)

    hooks.finish_checkpoints = finish
    rc = loop.train_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg)
    return {"rc": rc, "calls": {str(k): dict(v) for k, v in calls.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "train", "demo.yaml"))
    args = ap.parse_args()
    from hetcomm.launcher import launch
    from hetcomm.topo.cluster import CLUSTER_ENV
    from hetcomm.train.loop import load_train_config

    cfg = load_train_config(args.config, steps=args.steps)
    t0 = time.time()
    out = launch(_rank_main, 4, args=(cfg,), env={CLUSTER_ENV: None}, store=True, store_timeout_s=cfg.timeout_s,
                 timeout_s=cfg.timeout_s + 10.0 * cfg.steps, grace_s=0.0, clean_shm=True, name="count")
    if not out.ok:
        print(out.ranks[out.failures[0].rank].describe(), file=sys.stderr)
        return 1
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.steps} steps, "
          f"wall {time.time() - t0:.0f} s, rc {[r['rc'] for r in out.results]}")
    steps = [str(s) for s in range(1, args.steps + 1)]
    sites = sorted({s for r in out.results for k in steps for s in r["calls"].get(k, {})})
    print("| call site (backend op) | per step, mean (min-max) rank 0 | rank 1 | rank 2 | rank 3 |")
    print("|---|---|---|---|---|")
    totals: List[List[int]] = [[0] * len(steps) for _ in out.results]
    for site in sites:
        cells = []
        for ri, r in enumerate(out.results):
            per = [r["calls"].get(k, {}).get(site, 0) for k in steps]
            for i, n in enumerate(per):
                totals[ri][i] += n
            cells.append(f"{sum(per) / len(per):.2f} ({min(per)}-{max(per)})")
        print(f"| {site} | " + " | ".join(cells) + " |")
    print("| **total** | " + " | ".join(f"{sum(t) / len(t):.2f} ({min(t)}-{max(t)})" for t in totals) + " |")
    for ri, t in enumerate(totals):
        print(f"rank {ri} per step: {t}")
    for phase in ("startup", "end"):
        n = [sum(r["calls"].get(phase, {}).values()) for r in out.results]
        print(f"{phase}: {n} calls per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
