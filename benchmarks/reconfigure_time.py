"""Time of a membership change through torch 2.14's API: hetcomm next to gloo.

    PYTHONPATH=. .venv/bin/python benchmarks/reconfigure_time.py --reps 5

Each repetition launches, for each backend in turn (interleaved: gloo, hetcomm, gloo, ...), the
five processes of tests/backends/membership_ranks.py over one store: four members, rank 3
SIGKILLed after its last collective, the survivors shrink to three, a new process joins and the
four reconfigure (``uuid`` and handles exchanged through the store). Measured in each member
around its call:

* ``shrink 4->3``: ``dist.shrink_group([3])`` on hetcomm (agreement, the survivors' new
  communicator: placement, option agreement, rails, inner gloo, heartbeat; c10d's new group; the
  old group destroyed); on gloo, which cannot shrink on torch 2.14 (``supports_shrinking`` is
  False), ``dist._reconfigure`` over the survivors' handles: the way gloo changes membership;
* ``grow 3->4``: ``dist._reconfigure`` over the four handles, the joiner's included (on hetcomm
  also the new default ProcessGroup, see docs/BACKEND.md).

A change is done when its slowest member is: per repetition the maximum over the members; the
table gives the median and the range over repetitions. Detection of the dead rank is not in
these numbers (the survivors are told which rank left; the heartbeat's detection time is
``heartbeat_detect.py``'s), nor is the store exchange of the handles.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_run(backend: str) -> dict:
    """One launch; ``{"shrink": s, "grow": s}`` (slowest member), or raises naming the rank."""
    from hetcomm.launcher import launch
    from tests.backends.membership_ranks import member

    out = launch(member, 5, args=(backend,), start="forkserver", store=True, timeout_s=180, grace_s=None,
                 kill_grace_s=1.0, name="reconfigure-bench")
    bad = [o.describe() for o in out.ranks if o.rank != 3 and not o.ok]
    if bad or out.ranks[3].exitcode != -9:
        raise RuntimeError(f"{backend}: " + "; ".join(bad or [out.ranks[3].describe()]))
    res = [o.result for o in out.ranks]
    ref = res[0]["grown"]
    if any(res[r]["grown"]["all_reduce"] != ref["all_reduce"] for r in (1, 2, 4)):
        raise RuntimeError(f"{backend}: the members' all_reduce after the grow differ")
    return {"shrink": max(res[r]["seconds"]["shrink"] for r in (0, 1, 2)),
            "grow": max(res[r]["seconds"]["grow"] for r in (0, 1, 2, 4))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions per backend (interleaved)")
    args = ap.parse_args()
    import torch

    from hetcomm.backends.reconfigure import supported

    if not supported():
        print(f"torch {torch.__version__} has no membership-change API (needs >= 2.14)", file=sys.stderr)
        return 2
    backends = ("gloo", "hetcomm")
    times = {b: {"shrink": [], "grow": []} for b in backends}
    t0 = time.time()
    for rep in range(args.reps):
        for b in backends:
            got = one_run(b)
            for k, v in got.items():
                times[b][k].append(v)
            print(f"rep {rep + 1}/{args.reps} {b:8s} shrink {got['shrink'] * 1e3:7.1f} ms  grow {got['grow'] * 1e3:7.1f} ms",
                  file=sys.stderr, flush=True)
    print(f"\ntorch {torch.__version__}, {args.reps} interleaved repetitions per backend, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {time.time() - t0:.0f} s\n")
    print("| change | backend | median ms | min - max ms |")
    print("|---|---|---|---|")
    for change, label in (("shrink", "shrink 4->3 after kill -9"), ("grow", "grow 3->4 (a new process joins)")):
        for b in backends:
            v = sorted(x * 1e3 for x in times[b][change])
            how = {("shrink", "hetcomm"): "`shrink_group`", ("shrink", "gloo"): "`_reconfigure`: gloo cannot shrink"}
            print(f"| {label} | {b} ({how.get((change, b), '`_reconfigure`')}) | {statistics.median(v):.1f} | "
                  f"{v[0]:.1f} - {v[-1]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
