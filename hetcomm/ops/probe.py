"""The periodic in-training health probe: every N steps, each rank judged against its own class.

The launch health check (:mod:`hetcomm.ops.health`, :mod:`hetcomm.ops.health_class`) runs once,
before the job; a GPU that throttles or a link that degrades an hour in is only seen by a probe
that keeps running. This one measures what training already does, so it adds no work to a step:

* **compute** — each rank's busy expert seconds per expert row of each step, summed over the MoE
  layers: the one rank-speed source's clock and the rows that teach the speed
  (``MoELayer.speed.last_speed_step``, :mod:`hetcomm.moe.speed`: compute, never the waits for the
  all-to-all; a holder's replica rows, which read slow per row, left out); the window's
  measurement is the median over its steps (a step the scheduler stalled does not make a rank
  slow). Judged per device model by
  :func:`hetcomm.ops.health_class.judge_by_class` (time normalised by the rank's declared speed;
  class median with >= 3 ranks, else the speed-scaled median of all ranks; over the threshold above
  ``COMPUTE_THRESHOLD`` = 1.6x: a half-speed throttle is 2x; the launch check's GEMM probe uses
  1.4x, but expert time on an overloaded CPU host is noisier: a healthy emulated A100 reached
  1.51x in one window at load 37, the throttled H800 1.62-7.7x).
  Declared speeds are the cluster's (``device.tflops`` or the device table) on real devices and
  under ``hetcomm emulate --compute``; on plain CPU ranks, whose devices are labels and all
  compute alike, they are taken equal (else every label would look "slow" for its datasheet).
* **links** — each rank's busy seconds per MiB sent on each rail over the window
  (``hetcomm.stats()``: ``seconds_busy`` / ``bytes_sent``), the class being the rail and the link
  classes of its peers (``bridge:HOST_BRIDGE``, ``gloo:NET_ROCE_GDR``, ``shm:NVLINK``); a rank is
  slow on a link above ``LINK_THRESHOLD`` x the median of the ranks of that class (classes of
  >= 3 ranks only: a link class with fewer has no peers to judge by). Busy time includes waiting
  for a slow receiver, so a link finding next to a compute finding on the peer is the peer's.

**Off the critical path.** At the window's last step the main thread only copies a few numbers
into a queue. A thread per rank puts them in the group's store (its own clone of it, as the
heartbeat does; key ``hetcomm/probe/<step>/<rank>``); rank 0's thread waits for every rank's (up
to ``timeout_s``: a rank that never reports is left out of that window, never waited for by the
step), judges, and appends the records (:mod:`hetcomm.ops.ops_records`): one ``probe`` line per
window with every rank's factors and the ranks over the threshold, and one ``health`` line per
slow rank with its measurement and its class baseline (``source: probe``), read by ``hetcomm
doctor``. A rank is *slow* once it is over the threshold in ``CONFIRM`` consecutive windows (on
an overloaded host, one window of a healthy CPU rank can be 1.5-2x off; a throttle persists). ``hetcomm train --probe-every N``
(``TrainConfig.probe_every``; 0 = off; it also needs a place for the records: ``--metrics`` or
``hetcomm launch``).

Why by hand: Megatron's straggler detector compares every rank with the global mean and sigma,
which on a mixed cluster flags each slower device class for being slower; torch has no probe.
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence

from hetcomm import settings
from hetcomm.ops.health_class import MIN_CLASS, SlowRank, judge_by_class

__all__ = ["TrainingProbe", "NullProbe", "probe_for", "judge_window", "declared_speeds", "COMPUTE_THRESHOLD",
           "LINK_THRESHOLD", "ROWS_UNIT", "CONFIRM"]

#: Over the threshold in compute: normalised expert time per row above this x the class baseline.
COMPUTE_THRESHOLD = 1.6
#: Slow on a link: busy seconds per MiB above this x its link class's median.
LINK_THRESHOLD = 3.0
#: The compute measurement's unit: seconds per this many expert rows.
ROWS_UNIT = 1000
#: Consecutive windows over a threshold before a rank is named slow.
CONFIRM = 2
_MIB = float(1 << 20)


class NullProbe:
    """The probe's interface doing nothing (``probe_every`` 0, or nowhere to write records)."""

    def after_step(self, step: int, layers: Sequence[Any]) -> None:
        pass

    def close(self) -> None:
        pass


def declared_speeds(cluster, world_size: int, real_devices: bool) -> List[float]:
    """The speeds the compute judgement normalises by (see the module docstring)."""
    if cluster is not None and (real_devices or settings.EMULATE_COMPUTE.get()):
        from hetcomm.topo.compute import rank_speeds

        return rank_speeds(cluster, range(world_size))
    return [1.0] * world_size


def rail_link_classes(rank: int, world_size: int, cluster, backend: str) -> Dict[str, str]:
    """``rail -> class name`` of this rank's rails (``bridge:HOST_BRIDGE``; several link classes
    on one rail are joined with ``+``)."""
    from hetcomm.ops.metrics import _rail_peer_classes

    return {rail: f"{rail}:{'+'.join(sorted(classes))}"
            for rail, classes in _rail_peer_classes(rank, world_size, cluster, backend).items()}


def judge_window(window: Dict[int, Dict[str, Any]], ranks: Sequence[Dict[str, Any]], speeds: Sequence[float],
                 *, step: int, first_step: int, speeds_kind: str, streak: Optional[Dict[str, int]] = None,
                 confirm: int = CONFIRM) -> List[Dict[str, Any]]:
    """The records of one probe window.

    Args:
        window: ``{rank: {"per_row_s": [s per expert row, per step], "rails": {class: [bytes_sent,
            seconds_busy]}}}`` of the ranks that reported.
        ranks: every rank's ``{"rank", "model", "node"}``.
        speeds: :func:`declared_speeds`.
        step / first_step: the window's last and first steps.
        speeds_kind: how ``speeds`` were chosen (recorded).
        streak: windows in a row each ``rank/probe/class`` was over its threshold, carried from
            window to window by the caller (updated here); None: a fresh one (``confirm`` 1 then
            names a rank at its first window over).
        confirm: windows over the threshold in a row before a rank is named slow.

    Returns:
        one ``probe`` record, then one ``health`` record per slow rank (JSON-ready dicts).
    """
    report_ranks = []
    for r in ranks:
        w = window.get(r["rank"])
        per_row = None
        vals = [v for v in (w or {}).get("per_row_s", []) if v > 0]
        if vals:
            per_row = statistics.median(vals) * ROWS_UNIT
        report_ranks.append({**r, "gemm_s": per_row})
    verdict = judge_by_class({"ranks": report_ranks}, list(speeds), compute_threshold=COMPUTE_THRESHOLD)
    over: List[SlowRank] = list(verdict.slow)
    # Links: busy s/MiB per rank and rail class, judged within classes of >= MIN_CLASS ranks.
    by_class: Dict[str, Dict[int, float]] = {}
    for r, w in window.items():
        for klass, (nbytes, busy) in (w.get("rails") or {}).items():
            if nbytes >= _MIB and busy > 0:
                by_class.setdefault(klass, {})[r] = busy / (nbytes / _MIB)
    link_factor: Dict[str, Dict[int, float]] = {}
    for klass, vals in sorted(by_class.items()):
        if len(vals) < MIN_CLASS:
            continue
        base = statistics.median(vals.values())
        if base <= 0:
            continue
        link_factor[klass] = {r: v / base for r, v in vals.items()}
        for r, v in vals.items():
            if v / base > LINK_THRESHOLD:
                entry = ranks[r]
                over.append(SlowRank(r, entry["node"], entry["model"], "network", klass, v, base, v / base,
                                     f"class median of {len(vals)}"))
    streak = {} if streak is None else streak
    names = {f"{s.rank}/{s.probe}/{s.klass}": s for s in over}
    for key in list(streak):
        if key not in names:
            del streak[key]
    slow: List[SlowRank] = []
    for key, s in names.items():
        streak[key] = streak.get(key, 0) + 1
        if streak[key] >= confirm:
            slow.append(s)
    probe = {
        "kind": "probe", "step": step, "first_step": first_step, "ranks_reported": sorted(window),
        "compute_s": {str(r["rank"]): r["gemm_s"] for r in report_ranks if r["gemm_s"] is not None},
        "compute_factor": {str(r): round(f, 4) for r, f in verdict.compute_factor.items()},
        "link_factor": {k: {str(r): round(f, 4) for r, f in v.items()} for k, v in link_factor.items()},
        "compute_unit": f"s per {ROWS_UNIT} expert rows", "link_unit": "busy s per MiB sent",
        "speeds": speeds_kind, "over_threshold": sorted({s.rank for s in over}), "slow": sorted({s.rank for s in slow}),
        "confirm": confirm,
    }
    out = [probe]
    for s in sorted(slow, key=lambda s: (s.rank, s.probe)):
        unit = f"per {ROWS_UNIT} expert rows" if s.probe == "compute" else "busy per MiB sent"
        from dataclasses import asdict

        n = streak[f"{s.rank}/{s.probe}/{s.klass}"]
        out.append({"kind": "health", "source": "probe", "step": step, "first_step": first_step, **asdict(s),
                    "unit": unit, "windows": n,
                    "line": f"steps {first_step}-{step}: {s.line()} ({unit}; {n} windows in a row)"})
    return out


class TrainingProbe:
    """The probe of one rank (see the module docstring). Every rank calls :meth:`after_step`
    after each step and :meth:`close` at the end."""

    def __init__(self, every: int, rank: int, world_size: int, ranks: Sequence[Dict[str, Any]],
                 speeds: Sequence[float], speeds_kind: str, rail_classes: Dict[str, str], paths: Sequence[str],
                 *, store=None, timeout_s: float = 60.0, confirm: int = CONFIRM) -> None:
        self.every, self.rank, self.world_size = every, rank, world_size
        self.ranks, self.speeds, self.speeds_kind = list(ranks), list(speeds), speeds_kind
        self.rail_classes = dict(rail_classes)
        self.paths = list(paths)
        self.timeout_s = timeout_s
        self.confirm = confirm
        self._streak: Dict[str, int] = {}
        self._per_row: List[float] = []
        self._first = None
        self._rails0: Optional[Dict[str, Dict[str, float]]] = None
        self._queue: "queue.Queue[Optional[Dict[str, Any]]]" = queue.Queue()
        if store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        self._store = store.clone() if hasattr(store, "clone") else store
        self.windows = 0  # windows judged (rank 0)
        self._thread = threading.Thread(target=self._run, name=f"hetcomm-probe-{rank}", daemon=True)
        self._thread.start()

    def _rail_counters(self) -> Dict[str, Dict[str, float]]:
        import hetcomm

        return hetcomm.stats()

    def after_step(self, step: int, layers: Sequence[Any]) -> None:
        """Fold this step's expert time in; at a window's end hand the window to the thread."""
        if self._first is None:
            # The first step of a run (allocation, the first agreements) is not a measurement.
            self._first = step + 1
            self._rails0 = self._rail_counters()
            return
        rows = secs = 0.0
        for m in layers:  # the speed meter's step: the rows and seconds that teach the speed (hetcomm.moe.speed)
            r, sec = m.speed.last_speed_step
            rows += float(r)
            secs += float(sec)
        if rows > 0 and secs > 0:
            self._per_row.append(secs / rows)
        if step % self.every:
            return
        now = self._rail_counters()
        rails: Dict[str, List[float]] = {}
        for rail, c in now.items():
            was = (self._rails0 or {}).get(rail, {})
            klass = self.rail_classes.get(rail)
            if klass is None:
                continue
            rails[klass] = [float(c.get("bytes_sent", 0)) - float(was.get("bytes_sent", 0)),
                            float(c.get("seconds_busy", 0.0)) - float(was.get("seconds_busy", 0.0))]
        self._queue.put({"step": step, "first_step": self._first, "per_row_s": self._per_row, "rails": rails})
        self._per_row = []
        self._first, self._rails0 = step + 1, now

    def _run(self) -> None:
        from datetime import timedelta

        from hetcomm.ops.ops_records import append_records

        while True:
            item = self._queue.get()
            if item is None:
                return
            step = item["step"]
            try:
                self._store.set(f"hetcomm/probe/{step}/{self.rank}", json.dumps(item))
                if self.rank != 0:
                    continue
                keys = [f"hetcomm/probe/{step}/{r}" for r in range(self.world_size)]
                try:
                    self._store.wait(keys, timedelta(seconds=self.timeout_s))
                except Exception:  # noqa: BLE001 - a rank that never reported: judge the others
                    pass
                window = {}
                for r, k in enumerate(keys):
                    if self._store.check([k]):
                        window[r] = json.loads(self._store.get(k).decode())
                        self._store.delete_key(k)
                recs = judge_window(window, self.ranks, self.speeds, step=step, first_step=item["first_step"],
                                    speeds_kind=self.speeds_kind, streak=self._streak, confirm=self.confirm)
                append_records(self.paths, recs)
                for rec in recs[1:]:
                    print(f"hetcomm probe: {rec['line']}", file=sys.stderr, flush=True)
                self.windows += 1
            except Exception as e:  # noqa: BLE001 - the probe must never fail the job
                print(f"hetcomm probe: rank {self.rank}: window ending at step {step} skipped ({type(e).__name__}: "
                      f"{e})", file=sys.stderr, flush=True)

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the thread finish the windows handed to it (rank 0 judges the last one), then stop it."""
        self._queue.put(None)
        self._thread.join(timeout_s)


def probe_for(cfg, rank: int, world_size: int, cluster, model) -> Any:
    """The job's probe: a :class:`TrainingProbe` when ``cfg.probe_every`` > 0, the job has more
    than one rank and its records have somewhere to go; else a :class:`NullProbe`."""
    import torch.distributed as dist

    from hetcomm.ops.ops_records import record_paths

    every = cfg.probe_every
    paths = record_paths(cfg.metrics)
    if every <= 0 or world_size < 2 or not dist.is_initialized() or not paths or cluster is None:
        return NullProbe()
    params = list(model.parameters())
    real = bool(params) and params[0].device.type != "cpu"
    speeds = declared_speeds(cluster, world_size, real)
    kind = ("declared (device.tflops or the device table)" if real or settings.EMULATE_COMPUTE.get()
            else "equal (CPU ranks: the device kinds are labels)")
    ranks = [{"rank": r, "model": cluster.rank(r).model, "node": cluster.rank(r).node.name} for r in range(world_size)]
    return TrainingProbe(every, rank, world_size, ranks, speeds, kind,
                         rail_link_classes(rank, world_size, cluster, cfg.backend), paths,
                         timeout_s=max(30.0, float(cfg.timeout_s)))
