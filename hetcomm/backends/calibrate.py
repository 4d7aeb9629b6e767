"""Which way CPU tensors travel between same-host peers, chosen by measurement per size class.

Shared memory is not always the faster way between two processes on one host: on a small,
oversubscribed machine the shm rings ran at 0.68-0.99x plain gloo at 16 MiB (``benchmarks/README.md``):
gloo's TCP loopback copies in the kernel and on gloo's own threads, the rings on the executor
threads of the same cores. Which one wins also depends on the size (a latency-bound 1 MiB step and
a bandwidth-bound 64 MiB step are different races; the first calibration measured at 8 MiB only
and picked gloo, which lost at 16 and 64 MiB). So with the default rails (``rails=None``) the
communicator measures the candidates at a few sizes, once per host, and routes each call by its
size class:

* the *unit* of the choice is a set of ranks that may share memory (same YAML node on the same
  host); its lowest rank is the leader;
* candidates: ``shm`` (the rings, :mod:`.rails.shm`) and ``gloo``; when the unit is the whole
  group (it then has the shared-memory board) also ``cma``, the single-copy all-to-all
  (:mod:`.rails.cma`), if every rank may read every other rank's memory (:func:`.rails.cma.probe`,
  run whenever ``cma`` is a candidate or was chosen);
* size classes: :data:`CAL_SIZES` bytes per rank (1, 4, 16 MiB). A call of ``B`` bytes per rank
  (the exchanged split matrix's total / ranks, the same on every rank) takes the class of the
  nearest measured size on a log scale (boundaries 2 and 8 MiB). A unit that is not the whole group
  routes its pairs one way for every call (ranks outside it could not tell the class): the
  choice of the largest class;
* the leader looks the answer up in a cache file (``$HETCOMM_CACHE_DIR``, default
  ``~/.cache/hetcomm/calibration.json``) under a key of everything that changes the answer:
  cache version, hostname, ranks in the unit, group size, ring size, CPU count, torch and hetcomm
  versions (not ``chunk_bytes``: the measurement sends each peer's share as one chunk, so that a
  test forcing 64-byte chunks does not calibrate with 100,000 of them). ``HETCOMM_RECALIBRATE=1``
  (read by the leader) ignores the cache and measures again; ``HETCOMM_SAME_HOST_RAIL=shm|gloo|cma``
  (read by the leader) skips the measurement and the cache and takes that way for every size
  (``cma`` outside a whole-group unit, or where the probe fails, means ``shm``): for a deployment
  that knows its hosts, and for the test suite, whose expectations must not depend on what an
  earlier run measured on this host;
* otherwise the unit's ranks measure together: the same all-to-all (``CAL_SIZES`` per rank) over
  each candidate, interleaved, :data:`CAL_REPS` times each, best time kept. In a whole-group unit
  each variant is what the group then runs, the cross-rank check's board exchange included:
  gloo's own all-to-all, the rings, the single-copy reads; otherwise point-to-point among the
  unit. The leader scores each way by the slowest rank's best wall time (the step ends when the
  last rank is done) or, when the host was already busy before the unit started measuring (1-min
  load average >= CPUs), by the CPU time the unit's ranks spent on it (median per rank, summed):
  on an oversubscribed host a few-millisecond wall time measures the scheduler, and the CPU each
  way costs decides the throughput. Per size, ``gloo`` only if it beats the best shared-memory
  variant by more than :data:`MARGIN`; the leader writes the cache and publishes the classes;
* every rank of the group reads every unit's classes from the store, so all ranks route every
  call and pair the same way (a pair whose ends chose differently would deadlock).

Cost: 1.4-2.9 s on 4 ranks of a 2-core machine at load 15-18, once per host and group shape
(then one file read). Explicit rails (``HetcommOptions.rails`` / ``HETCOMM_RAILS``) are never overridden.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hetcomm import settings
from hetcomm.backends.agreement import _wait_all
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.placement import Placement
from hetcomm.backends.rails.base import Rail
from hetcomm.backends.stats import paused
from hetcomm.errors import CollectiveError, ConfigError

__all__ = [
    "SameHostRails", "same_host_rails", "unit_key", "cache_path", "CAL_SIZES", "CAL_REPS", "MARGIN", "CACHE_VERSION",
]

#: Bytes each rank sends per measured all-to-all, one size per class: latency-bound (1 MiB),
#: between (4 MiB), bandwidth-bound (16 MiB, the sizes MoE steps move).
CAL_SIZES = (1 << 20, 4 << 20, 16 << 20)
#: Timed repetitions per variant and size (best of them counts: the machine may be busy).
CAL_REPS = 3
#: gloo must beat the shared-memory ways by this fraction to be chosen (they keep their lower
#: latency otherwise).
MARGIN = 0.03
#: Part of the cache key: entries of another layout are not read (v1: one rail, measured at 8 MiB).
CACHE_VERSION = 2
#: The ways same-host CPU tensors may travel (``cma``: whole-group units only).
WAYS = settings.SAME_HOST_WAYS


@dataclass(frozen=True)
class SameHostRails:
    """A unit's calibrated way per size class.

    Attributes:
        classes: ``((bytes per rank measured, way), ...)``, ascending; ``way`` is ``shm``,
            ``gloo`` or ``cma``. One entry with size 0 = the same way for every size.
    """

    classes: Tuple[Tuple[int, str], ...]

    def rail_for(self, bytes_per_rank: int) -> str:
        """The way of a call moving ``bytes_per_rank`` (the nearest measured size, log scale)."""
        if len(self.classes) == 1:
            return self.classes[0][1]
        b = math.log2(max(1, bytes_per_rank))
        best = min(self.classes, key=lambda c: (abs(math.log2(max(1, c[0])) - b), -c[0]))
        return best[1]

    @property
    def ways(self) -> Tuple[str, ...]:
        return tuple(w for _, w in self.classes)

    @property
    def pair_rail(self) -> str:
        """The rail the unit's pairs are routed over: ``shm`` when any class uses shared memory
        (the rings and the single-copy path are both "shm" in rail names and statistics)."""
        return "gloo" if all(w == "gloo" for w in self.ways) else "shm"

    @property
    def per_call(self) -> bool:
        """Whether the way depends on the call (several ways, or the single-copy path, which
        needs the exchanged input addresses)."""
        return len(set(self.ways)) > 1 or "cma" in self.ways

    def without_cma(self) -> "SameHostRails":
        """The classes with the rings instead of the single-copy path."""
        return SameHostRails(tuple((b, "shm" if w == "cma" else w) for b, w in self.classes))

    def to_json(self) -> str:
        return json.dumps([[b, w] for b, w in self.classes])

    @classmethod
    def from_json(cls, text: str) -> "SameHostRails":
        return cls(tuple((int(b), str(w)) for b, w in json.loads(text)))

    @classmethod
    def single(cls, way: str) -> "SameHostRails":
        return cls(((0, way),))

    def __str__(self) -> str:
        if len(set(self.ways)) == 1:
            return self.ways[0]
        return ", ".join(f"{w} at {b >> 20} MiB" for b, w in self.classes)


def cache_path() -> str:
    """The calibration cache file of this user."""
    root = settings.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "hetcomm")
    return os.path.join(root, "calibration.json")


def unit_key(members: int, size: int, options: HetcommOptions) -> str:
    """The cache key of a unit's choice: everything that changes which way is faster."""
    from hetcomm._version import __version__

    return (
        f"v={CACHE_VERSION}|host={socket.gethostname()}|unit={members}|group={size}|ring={options.ring_bytes}|"
        f"cpus={os.cpu_count()}|torch={torch.__version__}|hetcomm={__version__}"
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


def _cached_classes(entry: Optional[dict]) -> Optional[SameHostRails]:
    try:
        classes = SameHostRails(tuple((int(b), str(w)) for b, w in entry["classes"]))  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None
    return classes if classes.classes and all(w in WAYS for w in classes.ways) else None


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


def same_host_rails(
    store, rails, options: HetcommOptions, placement: Placement, rank: int, size: int, timeout: timedelta
) -> Dict[str, SameHostRails]:
    """``unit name -> SameHostRails`` for every unit of the group (the same dict on every rank).

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
        _calibrate_unit(store, rails, options, placement, mine, rank, size, timeout)
    keys = [f"hetcomm/calib/{u[0]}/final" for u in units]
    _wait_all(store, keys, rank, timeout, "hetcomm rail calibration")
    return {unit_name(placement, u[0]): SameHostRails.from_json(store.get(k).decode()) for u, k in zip(units, keys)}


def _calibrate_unit(
    store, rails, options: HetcommOptions, placement: Placement, members: List[int], rank: int, size: int, timeout: timedelta
) -> None:
    leader = members[0]
    base = f"hetcomm/calib/{leader}"
    key = unit_key(len(members), size, options)
    # The single-copy path needs the board (the whole group shares memory) for its exchanges.
    whole = len(members) == size and rails.board is not None
    if rank == leader:
        decided: Optional[SameHostRails] = None
        try:
            pinned = settings.SAME_HOST_RAIL.get()
        except ConfigError:
            # Published before raising, so the unit's other ranks fail on the same setting
            # instead of waiting for a measurement that never starts.
            _publish(store, base, SameHostRails.single("gloo"))
            raise
        if rails.shm is None:
            decided = SameHostRails.single("gloo")  # no shared memory here after all
        elif pinned:
            decided = SameHostRails.single(pinned)
        elif not settings.RECALIBRATE.get():
            decided = _cached_classes(_read_cache().get(key))
        if decided is not None and not whole:
            decided = decided.without_cma()
        store.set(f"{base}/plan", decided.to_json() if decided is not None else "measure")
    _wait_all(store, [f"{base}/plan"], rank, timeout, "hetcomm rail calibration")
    plan = store.get(f"{base}/plan").decode()
    pids = [p.pid for p in placement.ranks]
    if plan != "measure":
        decided = SameHostRails.from_json(plan)
        if "cma" in decided.ways and not _probe(store, rank, members, pids, timeout):
            decided = decided.without_cma()
        if rank == leader:
            store.set(f"{base}/final", decided.to_json())
        return
    # Read before the unit's ranks add their own load: is the host oversubscribed by others?
    busy = os.getloadavg()[0] >= (os.cpu_count() or 1)
    cma_ok = whole and _probe(store, rank, members, pids, timeout)
    variants = ("shm", "gloo") + (("cma",) if cma_ok else ())
    with paused():
        best = _measure(rails, variants, members, rank, size, pids, whole, timeout)
    store.set(f"{base}/times/{rank}", json.dumps(best))
    if rank != leader:
        return
    _wait_all(store, [f"{base}/times/{r}" for r in members], rank, timeout, "hetcomm rail calibration")
    times = [json.loads(store.get(f"{base}/times/{r}").decode()) for r in members]
    classes, table = [], []
    for nbytes in CAL_SIZES:
        slowest = {v: max(t[str(nbytes)][v]["wall"] for t in times) for v in variants}
        cpu = {v: sum(t[str(nbytes)][v]["cpu"] for t in times) for v in variants}
        # On a busy host a few-millisecond wall time measures the scheduler more than the way
        # (the same 16 MiB step measured 1.6x apart in two calibrations at load 15-18); the CPU
        # time each way spends on the unit's ranks is what decides the throughput there.
        score = cpu if busy else slowest
        shared = min((v for v in variants if v != "gloo"), key=lambda v: score[v])
        way = "gloo" if score["gloo"] < score[shared] * (1.0 - MARGIN) else shared
        classes.append((nbytes, way))
        table.append({"bytes_per_rank": nbytes, "rail": way, "by": "cpu" if busy else "wall",
                      **{f"{v}_s": slowest[v] for v in variants}, **{f"{v}_cpu_s": cpu[v] for v in variants}})
    chosen = SameHostRails(tuple(classes)) if whole else SameHostRails.single(classes[-1][1])
    _write_cache(key, {
        "classes": [list(c) for c in chosen.classes], "measured": table, "cma_possible": cma_ok,
        "whole_group": whole, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load": os.getloadavg()[0],
    })
    store.set(f"{base}/final", chosen.to_json())


def _publish(store, base: str, choice: SameHostRails) -> None:
    store.set(f"{base}/plan", choice.to_json())
    store.set(f"{base}/final", choice.to_json())


def _probe(store, rank: int, members: List[int], pids: Sequence[int], timeout: timedelta) -> bool:
    from hetcomm.backends.rails.cma import probe

    return probe(store, rank, members, pids, timeout)


def _measure(
    rails, variants: Sequence[str], members: List[int], rank: int, size: int, pids: Sequence[int], whole: bool,
    timeout: timedelta,
) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Per size (key: bytes per rank, as text) and variant of one all-to-all among ``members``
    (variants interleaved): ``{"wall": best seconds, "cpu": median CPU seconds of this process}``."""
    import torch.distributed as dist

    from hetcomm.backends import checks
    from hetcomm.backends.executor import direct_all_to_all
    from hetcomm.backends.rails import cma

    m = len(members)
    deadline_s = timeout.total_seconds() * 0.75
    out: Dict[str, Dict[str, float]] = {}
    for nbytes in CAL_SIZES:
        rows = nbytes // 4 // m
        splits = [rows if p in members and p != rank else 0 for p in range(size)]
        splits[rank] = rows
        x = torch.ones(sum(splits), dtype=torch.float32, device="cpu")  # host: calibration of host rails
        y = torch.empty_like(x)

        def exchange(addr: int = 0) -> checks.Meta:
            # What a whole-group call does first: the cross-rank check on the board.
            meta = checks.encode_meta("all_to_all_single", 0, torch.float32, 4, (), splits, splits, addr)
            return checks.Meta([t.tolist() for t in rails.board.exchange(meta, time.monotonic() + deadline_s, "calibration")])

        def over(rail: Rail) -> Callable[[int], Rail]:
            return lambda peer: rail

        def shm_step() -> None:
            if whole:
                exchange()
            direct_all_to_all(y, x, splits, splits, rank, over(rails.shm), nbytes, "calibration (shm)", 0,
                              time.monotonic() + deadline_s, wakeup=rails.wakeup)

        def gloo_step() -> None:
            if whole:
                exchange()
                rails.gloo_x.alltoall_base(y, x, [], [], dist.AllToAllOptions()).wait()
            else:
                direct_all_to_all(y, x, splits, splits, rank, over(rails.gloo_rail), nbytes, "calibration (gloo)", 0,
                                  time.monotonic() + deadline_s, wakeup=rails.wakeup)

        def cma_step() -> None:
            meta = exchange(x.data_ptr())
            row = 4 * rows
            err, _ = cma.gather_rows(pids, rank, y, x, [meta.addr(j) for j in range(size)], [row] * size,
                                     [rank * row] * size)
            failed = cma.finish(rails.board, rank, size, "calibration", 0, err, time.monotonic() + deadline_s)
            if failed:
                r, peer, code = failed[0]
                raise CollectiveError(f"calibration: rank {r} could not read rank {peer}'s memory ({os.strerror(code)})",
                                      op="init", rank=rank, peer=peer, rail="shm")

        steps = {"shm": shm_step, "gloo": gloo_step, "cma": cma_step}
        best = {v: float("inf") for v in variants}
        cpu: Dict[str, List[float]] = {v: [] for v in variants}
        for v in variants:  # warm-up: first touch of the buffers, rings and sockets
            steps[v]()
        for i in range(CAL_REPS):
            order = list(variants[i % len(variants):]) + list(variants[: i % len(variants)])
            for v in order:
                c0, t0 = time.process_time(), time.perf_counter()
                steps[v]()
                best[v] = min(best[v], time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)  # every thread of this rank (gloo's too)
        out[str(nbytes)] = {v: {"wall": best[v], "cpu": sorted(cpu[v])[len(cpu[v]) // 2]} for v in variants}
    return out
