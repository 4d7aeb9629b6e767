"""Which rail carries CPU tensors between same-host peers: ``shm`` or ``gloo``, chosen by measurement.

Shared memory is not always the faster way between two processes on one host: on a small,
oversubscribed machine the shm rail ran at 0.68-0.99x plain gloo at 16 MiB (``benchmarks/README.md``):
gloo's TCP loopback copies in the kernel and on gloo's own threads, the ring copies on the
executor threads of the same two cores. So with the default rails (``rails=None``)
the communicator measures both, once per host, and takes the faster:

* the *unit* of the choice is a set of ranks that may share memory (same YAML node on the same
  host); its lowest rank is the leader;
* the leader looks the answer up in a cache file (``$HETCOMM_CACHE_DIR``, default
  ``~/.cache/hetcomm/calibration.json``) under a key of everything that changes the answer:
  hostname, ranks in the unit, group size, ring size, CPU count, torch and hetcomm versions (not
  ``chunk_bytes``: the measurement sends each peer's share as one chunk, so that a test forcing
  64-byte chunks does not calibrate with 100,000 of them). ``HETCOMM_RECALIBRATE=1`` (read by
  the leader) ignores the cache and measures again; ``HETCOMM_SAME_HOST_RAIL=shm|gloo`` (read by
  the leader) skips the measurement and the cache and takes that rail: for a deployment that
  knows its hosts, and for the test suite, whose expectations must not depend on what an
  earlier run measured on this host;
* otherwise the unit's ranks measure together: the same all-to-all (:data:`CAL_BYTES` per rank)
  over the shm rings and over gloo, interleaved, :data:`CAL_REPS` times each. When the unit is
  the whole group the gloo variant is gloo's own all-to-all, which is what the group then runs
  (:meth:`RoutedCollectives.all_to_all_single`); otherwise gloo point-to-point among the unit.
  Each rank keeps its best time per variant; the leader takes the slowest rank's (the step ends
  when the last rank is done), picks ``gloo`` only if it is faster by more than
  :data:`MARGIN`, writes the cache and publishes the choice in the store;
* every rank of the group reads every unit's choice from the store, so all ranks route every
  pair the same way (a pair whose ends chose differently would deadlock).

Explicit rails (``HetcommOptions.rails`` / ``HETCOMM_RAILS``) are never overridden.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch

from hetcomm.backends.agreement import _wait_all
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.placement import Placement
from hetcomm.backends.rails.base import Rail
from hetcomm.backends.stats import paused
from hetcomm.errors import ConfigError

__all__ = ["same_host_rails", "unit_key", "cache_path", "CAL_BYTES", "CAL_REPS", "MARGIN"]

#: Bytes each rank sends per measured all-to-all: large enough to be bandwidth-bound (the sizes
#: MoE steps move), small enough that calibrating a 4-rank host takes well under a second.
CAL_BYTES = 8 << 20
#: Timed repetitions per variant (best of them counts: the machine may be busy).
CAL_REPS = 3
#: gloo must beat shm by this fraction to be chosen (shm keeps its lower latency otherwise).
MARGIN = 0.03


def cache_path() -> str:
    """The calibration cache file of this user."""
    root = os.environ.get("HETCOMM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hetcomm")
    return os.path.join(root, "calibration.json")


def unit_key(members: int, size: int, options: HetcommOptions) -> str:
    """The cache key of a unit's choice: everything that changes which rail is faster."""
    import hetcomm

    return (
        f"host={socket.gethostname()}|unit={members}|group={size}|ring={options.ring_bytes}|"
        f"cpus={os.cpu_count()}|torch={torch.__version__}|hetcomm={hetcomm.__version__}"
    )


def _read_cache() -> Dict[str, dict]:
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # absent or unreadable: measure
        return {}


def _write_cache(key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` atomically (rename), keeping the others' entries."""
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        data = _read_cache()
        data[key] = entry
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".calibration-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only home: the choice still holds for this run
        pass


def units_of(placement: Placement) -> List[List[int]]:
    """Sets of ranks that may share memory (same node and host), 2 or more ranks each."""
    by: Dict[Tuple[str, str], List[int]] = {}
    for p in placement.ranks:
        by.setdefault((p.host, p.node), []).append(p.group_rank)
    return [sorted(m) for m in by.values() if len(m) >= 2]


def unit_name(placement: Placement, leader: int) -> str:
    """``host|node`` of a unit (the key of :attr:`RailSet.same_host`)."""
    p = placement.ranks[leader]
    return f"{p.host}|{p.node}"


def same_host_rails(store, rails, options: HetcommOptions, placement: Placement, rank: int, size: int, timeout: timedelta) -> Dict[str, str]:
    """``unit name -> "shm" | "gloo"`` for every unit of the group (the same dict on every rank).

    Collective over the group. Empty when the rails are explicit (``HetcommOptions.rails``) or
    no two ranks may share memory.
    """
    if options.rails is not None:
        return {}
    units = units_of(placement)
    if not units:
        return {}
    mine = next((u for u in units if rank in u), None)
    if mine is not None:
        _calibrate_unit(store, rails, options, mine, rank, size, timeout)
    keys = [f"hetcomm/calib/{u[0]}/rail" for u in units]
    _wait_all(store, keys, rank, timeout, "hetcomm rail calibration")
    return {unit_name(placement, u[0]): store.get(k).decode() for u, k in zip(units, keys)}


def _calibrate_unit(store, rails, options: HetcommOptions, members: List[int], rank: int, size: int, timeout: timedelta) -> None:
    leader = members[0]
    base = f"hetcomm/calib/{leader}"
    key = unit_key(len(members), size, options)
    if rank == leader:
        cached = None if os.environ.get("HETCOMM_RECALIBRATE", "").strip() in ("1", "true", "yes") else _read_cache().get(key)
        if rails.shm is None:
            store.set(f"{base}/plan", "decided")
            store.set(f"{base}/rail", "gloo")  # no shared memory here after all
            return
        pinned = os.environ.get("HETCOMM_SAME_HOST_RAIL", "").strip()
        if pinned:
            if pinned not in ("shm", "gloo"):
                # Published before raising, so the unit's other ranks fail on the same setting
                # instead of waiting for a measurement that never starts.
                store.set(f"{base}/plan", "decided")
                store.set(f"{base}/rail", "gloo")
                raise ConfigError(
                    f"HETCOMM_SAME_HOST_RAIL={pinned!r} (rank {rank}) is not a rail for same-host "
                    "pairs; use 'shm' or 'gloo', or unset it to let hetcomm measure",
                    key="HETCOMM_SAME_HOST_RAIL",
                )
            store.set(f"{base}/plan", "decided")
            store.set(f"{base}/rail", pinned)
            return
        if cached is not None and cached.get("rail") in ("shm", "gloo"):
            store.set(f"{base}/plan", "decided")
            store.set(f"{base}/rail", cached["rail"])
            return
        store.set(f"{base}/plan", "measure")
    _wait_all(store, [f"{base}/plan"], rank, timeout, "hetcomm rail calibration")
    if store.get(f"{base}/plan").decode() != "measure":
        return
    with paused():
        best = _measure(rails, members, rank, size, timeout)
    store.set(f"{base}/times/{rank}", json.dumps(best))
    if rank != leader:
        return
    _wait_all(store, [f"{base}/times/{r}" for r in members], rank, timeout, "hetcomm rail calibration")
    times = [json.loads(store.get(f"{base}/times/{r}").decode()) for r in members]
    shm_s = max(t["shm"] for t in times)
    gloo_s = max(t["gloo"] for t in times)
    choice = "gloo" if gloo_s < shm_s * (1.0 - MARGIN) else "shm"
    _write_cache(key, {
        "rail": choice, "shm_s": shm_s, "gloo_s": gloo_s, "bytes_per_rank": CAL_BYTES,
        "whole_group": len(members) == size, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load": os.getloadavg()[0],
    })
    store.set(f"{base}/rail", choice)


def _measure(rails, members: List[int], rank: int, size: int, timeout: timedelta) -> Dict[str, float]:
    """Best seconds of one all-to-all among ``members`` over shm and over gloo (interleaved)."""
    import torch.distributed as dist

    from hetcomm.backends.executor import direct_all_to_all

    m = len(members)
    rows = CAL_BYTES // 4 // m
    splits = [rows if p in members and p != rank else 0 for p in range(size)]
    splits[rank] = rows
    x = torch.ones(sum(splits), dtype=torch.float32, device="cpu")  # host: calibration of host rails
    y = torch.empty_like(x)
    whole = m == size
    deadline_s = timeout.total_seconds() * 0.75

    def over(rail: Rail):
        return lambda peer: rail

    def shm_step() -> None:
        direct_all_to_all(y, x, splits, splits, rank, over(rails.shm), CAL_BYTES, "calibration (shm)", 0,
                          time.monotonic() + deadline_s, wakeup=rails.wakeup)

    def gloo_step() -> None:
        if whole:
            rails.gloo_x.alltoall_base(y, x, [], [], dist.AllToAllOptions()).wait()
        else:
            direct_all_to_all(y, x, splits, splits, rank, over(rails.gloo_rail), CAL_BYTES, "calibration (gloo)", 0,
                              time.monotonic() + deadline_s, wakeup=rails.wakeup)

    best = {"shm": float("inf"), "gloo": float("inf")}
    shm_step()  # warm-up: first touch of the rings and the sockets
    gloo_step()
    for _ in range(CAL_REPS):
        for name, step in (("shm", shm_step), ("gloo", gloo_step)):
            t0 = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best
