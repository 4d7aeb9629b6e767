"""The per-step metrics record of ``hetcomm train --metrics FILE.jsonl``: schema, I/O, collector.

A metrics file is JSON lines. Every line is one object with a ``kind``:

``run``   (first line, and again after every resume) — what the job is::

    {"kind": "run", "schema": "hetcomm.metrics/1", "world_size": 4, "cluster": "mixed-mini",
     "ranks": [{"rank": 0, "model": "A100-SXM4-80GB", "node": "a100-0"}, ...],
     "config": {...TrainConfig fields...}, "start_step": 0, "env": {"NCCL_IB_HCA": "mlx5_0", ...}}

``step``  one per optimizer step, written by rank 0 from every rank's numbers
          (:class:`StepRecord`; units in the field names: ``_s`` seconds, ``bytes``)

``event`` something that happened between steps: ``{"kind": "event", "step": 40, "event":
          "checkpoint", "detail": "..."}`` (``checkpoint``, ``resume``, ``migration``, ``policy``)

Fields no layer reports (``page_hits``, ``page_faults``, ``page_stall_s`` without paging,
``migrations`` before the first placement change) are ``null``, never a fake 0; they are filled
from :meth:`hetcomm.moe.MoELayer.step_stats` (keys :data:`LAYER_COUNTERS` and
:data:`LAYER_SECONDS`, summed over layers and ranks) as soon as a layer reports them.
``docs/OPERATIONS.md`` documents every field.

Why by hand: nothing in torch records per-phase step time, per-rail bytes and per-expert load of
an expert-parallel job; the file itself is plain JSON lines so that jq, pandas or the doctor read
it without hetcomm.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from hetcomm.errors import ConfigError

__all__ = [
    "SCHEMA",
    "ENV_PREFIXES",
    "comm_env",
    "PHASES",
    "RAILS",
    "LAYER_COUNTERS",
    "LAYER_SECONDS",
    "OTHER",
    "RunHeader",
    "StepRecord",
    "Event",
    "MetricsLog",
    "read_metrics",
    "MetricsCollector",
]

SCHEMA = "hetcomm.metrics/1"

#: Environment variables the ``run`` line records (prefixes).
ENV_PREFIXES: Tuple[str, ...] = ("NCCL_", "HCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "HETCOMM_")


def comm_env(environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The communication settings of ``environ`` (default ``os.environ``): :data:`ENV_PREFIXES`."""
    import os

    src = os.environ if environ is None else environ
    return {k: v for k, v in sorted(src.items()) if k.startswith(ENV_PREFIXES)}

#: Phases of one training step, in order; ``phase_s`` has exactly these keys.
PHASES: Tuple[str, ...] = ("data", "forward", "backward", "grad_sync", "optimizer", "replica_sync", "loss_sync")

#: Rails the backend counts (``hetcomm.stats()``); ``bytes_by_rail`` has these keys.
RAILS: Tuple[str, ...] = ("shm", "gloo", "bridge", "nccl", "hccl")

#: ``bytes_by_link_class`` key of bytes sent on a rail that none of the sender's pairs use.
OTHER = "OTHER"

#: Counters summed from ``MoELayer.step_stats()`` (a ``StepStats``) when a layer reports them (else ``null``).
LAYER_COUNTERS: Tuple[str, ...] = ("page_hits", "page_faults", "migrations")

#: Seconds summed from ``MoELayer.step_stats()`` when a layer reports them (else ``null``).
LAYER_SECONDS: Tuple[str, ...] = ("page_stall_s",)


@dataclass(frozen=True)
class RunHeader:
    """The ``run`` line: who ran, on what, with which settings.

    Attributes:
        world_size: ranks.
        cluster: cluster name.
        ranks: per rank ``{"rank", "model", "node"}``.
        config: the job's settings (``TrainConfig`` fields).
        start_step: 0 for a fresh run, the checkpoint's step after a resume.
        env: rank 0's communication settings from the environment (``NCCL_*``, ``HCCL_*``,
            ``TORCH_NCCL_*``, ``TORCH_DISTRIBUTED_*``, ``HETCOMM_*``), for ``hetcomm doctor``.
    """

    world_size: int
    cluster: str
    ranks: List[Dict[str, Any]]
    config: Dict[str, Any]
    start_step: int = 0
    env: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step (written by rank 0, from every rank's numbers).

    Attributes:
        step: 1-based step number.
        time_s: seconds since the run (or the resume) started, at the end of the step.
        loss: training loss averaged over ranks.
        tokens: tokens trained on in this step, all ranks.
        step_s: wall time of the step on rank 0.
        step_s_by_rank: ``[world_size]`` wall time of the step on each rank.
        phase_s: rank 0's time per phase (keys :data:`PHASES`); sums to ``step_s`` up to timer
            overhead.
        moe_s: rank 0's MoE-layer time summed over layers: ``comm_exposed`` (blocked on the
            all-to-all) and ``expert`` (in expert modules); both inside ``forward``.
        bytes_by_rail: bytes sent over each rail in this step, summed over ranks (routed
            collectives: the MoE all-to-alls; delegated all-reduces are not counted by rails).
        bytes_by_link_class: the same bytes by the link class of the pair (``LinkClass``
            names; :data:`OTHER` for bytes on a rail none of the sender's pairs use).
        expert_load: ``[layers][E]`` token copies routed to each expert, all ranks.
        dropped: token copies dropped by capacity, all layers and ranks.
        page_hits / page_faults / migrations: summed :data:`LAYER_COUNTERS`, or None when no
            layer reports them: expert computations that started without waiting for their
            pages / that waited (or took a degraded answer); experts that landed on a rank
            through a placement change.
        page_stall_s: seconds expert computations waited for page loads, summed over layers
            and ranks (:data:`LAYER_SECONDS`), or None without paging.
        max_rss_bytes: largest resident set size among the ranks so far.
        expert_s_by_rank: ``[world_size]`` each rank's MoE expert seconds (forward, all layers):
            ``hetcomm report``'s per-rank MoE time max/mean.
        speed_rows_per_s: layer 0's agreed per-rank expert speed (:mod:`hetcomm.moe.speed`;
            rows/s once measured, the datasheet prior before).
    """

    step: int
    time_s: float
    loss: float
    tokens: int
    step_s: float
    step_s_by_rank: List[float]
    phase_s: Dict[str, float]
    moe_s: Dict[str, float]
    bytes_by_rail: Dict[str, int]
    bytes_by_link_class: Dict[str, int]
    expert_load: List[List[float]]
    dropped: int = 0
    page_hits: Optional[int] = None
    page_faults: Optional[int] = None
    migrations: Optional[int] = None
    max_rss_bytes: Optional[int] = None
    page_stall_s: Optional[float] = None
    expert_s_by_rank: Optional[List[float]] = None
    speed_rows_per_s: Optional[List[float]] = None


@dataclass(frozen=True)
class Event:
    """An ``event`` line: ``checkpoint`` (saved after ``step``), ``resume`` (restarted at it),
    ``membership`` (that resume found other ranks: :meth:`hetcomm.ops.membership.MembershipChange.line`,
    with or without a checkpoint directory), ``snapshots`` (the in-memory snapshots' rows at the end),
    ``migration`` (experts moved) or ``policy`` (which heterogeneity levers are on and why,
    :meth:`hetcomm.moe.policy.Policy.line`: at the start, and again when the agreed speed verdict
    changes a lever).

    ``marks``: for ``resume``, rank 0's startup marks (:func:`hetcomm.ops.rank_marks.startup_marks`:
    phase -> unix time), from which a recovery's parts are told apart."""

    step: int
    event: str
    detail: str = ""
    marks: Dict[str, float] = field(default_factory=dict)


Entry = Union[RunHeader, StepRecord, Event]
_KINDS = {"run": RunHeader, "step": StepRecord, "event": Event}


def _to_line(entry: Entry) -> str:
    kind = {RunHeader: "run", StepRecord: "step", Event: "event"}[type(entry)]
    obj = {"kind": kind, "schema": SCHEMA} if kind == "run" else {"kind": kind}
    obj.update(asdict(entry))
    return json.dumps(obj, separators=(",", ":"), allow_nan=True)


@dataclass
class MetricsLog:
    """A metrics file read back: the run headers, steps and events in file order.

    When a job resumed, steps after the resume replace the earlier records of the same step
    numbers in :attr:`steps` (the job redid them); :attr:`all_steps` keeps every line.
    """

    path: str
    runs: List[RunHeader] = field(default_factory=list)
    all_steps: List[StepRecord] = field(default_factory=list)
    events: List[Event] = field(default_factory=list)

    @property
    def steps(self) -> List[StepRecord]:
        by_step: Dict[int, StepRecord] = {}
        for s in self.all_steps:
            by_step[s.step] = s
        return [by_step[k] for k in sorted(by_step)]

    @property
    def run(self) -> Optional[RunHeader]:
        return self.runs[-1] if self.runs else None


def read_metrics(path: str) -> MetricsLog:
    """Read a metrics file written by :class:`MetricsCollector`.

    Raises:
        ConfigError: unreadable file, a line that is not JSON, an unknown ``kind`` or schema, a
            missing or unknown field — naming the file, the line and the key.
    """
    from hetcomm.ops.record_input import check_fields, parse_json_line, read_record_text

    # Bounded, regular files only (a FIFO or /dev/zero is refused at once), UTF-8 or UTF-16.
    lines = read_record_text(path, "metrics file").splitlines()
    log = MetricsLog(path)
    for no, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = parse_json_line(text, path, no)
        except json.JSONDecodeError as e:
            if no == len(lines):
                continue  # a job killed mid-write leaves a torn last line; the rest is good
            raise ConfigError(f"not a JSON object: {e.msg}", path=path, line=no) from None
        if not isinstance(obj, dict) or obj.get("kind") not in _KINDS:
            raise ConfigError(
                f"expected an object with kind run, step or event; got {str(obj)[:60]!r}", path=path, line=no, key="kind"
            )
        kind = obj.pop("kind")
        schema = obj.pop("schema", SCHEMA)
        if schema != SCHEMA:
            raise ConfigError(
                f"schema {schema!r} is not {SCHEMA!r}; read it with the hetcomm version that wrote it",
                path=path, line=no, key="schema",
            )
        cls = _KINDS[kind]
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise ConfigError(f"unknown field(s) {unknown} in a {kind} line", path=path, line=no, key=unknown[0])
        check_fields(cls, obj, path, no)  # types and ranges: "file:line, key 'k': what is wrong"
        try:
            entry = cls(**obj)
        except TypeError as e:
            raise ConfigError(f"bad {kind} line: {e}", path=path, line=no) from None
        if isinstance(entry, RunHeader):
            log.runs.append(entry)
        elif isinstance(entry, StepRecord):
            _check_per_rank(entry, log.run, path, no)
            log.all_steps.append(entry)
        else:
            log.events.append(entry)
    return log


def _check_per_rank(step: StepRecord, run: Optional[RunHeader], path: str, line: int) -> None:
    """A step's per-rank lists hold one number per rank of the run above it (the report takes
    their max and mean: an empty list was a ValueError traceback in ``hetcomm report``)."""
    for key in ("step_s_by_rank", "expert_s_by_rank"):
        values = getattr(step, key)
        if values is None:
            continue
        want = run.world_size if run is not None else None
        if not values or (want is not None and len(values) != want):
            ranks = f"the run's {want} ranks" if want is not None else "every rank"
            raise ConfigError(
                f"holds {len(values)} number(s), expected one per rank ({ranks}); the line is damaged: "
                f"use the metrics file the job wrote", path=path, line=line, key=key,
            )


# -- collecting in the job -------------------------------------------------------------------


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def _rail_peer_classes(rank: int, world_size: int, cluster, backend: str) -> Dict[str, Dict[str, int]]:
    """``rail -> {link class name: peers}`` for this rank's CPU traffic.

    The rail of a pair follows the backend's rule for CPU tensors (``hetcomm.backends.select``):
    ``HOST_BRIDGE`` pairs on ``bridge``, pairs the cluster puts on one node on ``shm``, the rest
    on ``gloo``; with ``--backend gloo`` everything is on ``gloo``.
    """
    from hetcomm.topo.model import LinkClass

    out: Dict[str, Dict[str, int]] = {}
    for peer in range(world_size):
        if peer == rank:
            continue
        if cluster is None:
            cls, rail = "UNKNOWN", "gloo"
        else:
            link = cluster.link_class(rank, peer)
            cls = link.name
            if backend != "hetcomm":
                rail = "gloo"
            elif link == LinkClass.HOST_BRIDGE:
                rail = "bridge"
            elif cluster.node_of(rank).name == cluster.node_of(peer).name:
                rail = "shm"
            else:
                rail = "gloo"
        per = out.setdefault(rail, {})
        per[cls] = per.get(cls, 0) + 1
    return out


def _bytes_by_class(delta: Dict[str, int], classes: Dict[str, Dict[str, int]]) -> Dict[str, float]:
    """Rail byte deltas -> link-class bytes (see :func:`_rail_peer_classes`)."""
    out: Dict[str, float] = {}
    for rail, nbytes in delta.items():
        if nbytes <= 0:
            continue
        # A rail none of this rank's pairs use by the rule (control messages, a host transport
        # staging bridge bytes, a replica sync over a sub-group): counted, but not as a pair's.
        peers = classes.get(rail, {OTHER: 1})
        total = sum(peers.values())
        # A rail carrying peers of several classes: bytes shared out by peer count (the
        # backend counts per rail, not per pair).
        for cls, n in peers.items():
            out[cls] = out.get(cls, 0.0) + nbytes * n / total
    return out


class MetricsCollector:
    """Times the phases of each step and writes one :class:`StepRecord` per step (rank 0).

    Every rank calls the same methods in the same order; :meth:`end_step` is collective (one
    ``all_gather`` of a small float64 vector per step), so it must be called on every rank.

    Usage in a training loop::

        mc = MetricsCollector(path, rank, world_size, cluster, layers, header)
        for step in ...:
            mc.start_step()
            batch = ...;            mc.mark("data")
            loss = model(batch);    mc.mark("forward")
            ...
            mc.end_step(step, loss_value, tokens)

    Args:
        path: the JSON-lines file (appended to: a resumed job continues its file).
        rank / world_size: this process in the default group.
        cluster: the job's :class:`~hetcomm.topo.cluster.Cluster` (link classes, rank labels).
        layers: the job's MoE layers (their ``step_stats()`` after each forward).
        header: the ``run`` line to write first (rank 0).
        backend: the process group's backend (``hetcomm`` or ``gloo``: which rail carries a pair).
    """

    def __init__(
        self, path: str, rank: int, world_size: int, cluster, layers: Sequence[Any], header: RunHeader, backend: str = "hetcomm"
    ) -> None:
        self.path = path
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.cluster = cluster
        self.layers = list(layers)
        self.num_experts = [int(m.config.num_experts) for m in self.layers]
        self._file = None
        if rank == 0:
            from hetcomm.ops.safe_fs import open_append_private

            # Never through a link: a (root) job appending to a link someone planted at this
            # name would write wherever it points (UnsafePathError names path, owner, fix).
            self._file = open_append_private(path, what="metrics file (--metrics)")
            self._write(header)
        self._t_run = time.perf_counter()
        self._t_step = self._t_mark = self._t_run
        self._phase: Dict[str, float] = {}
        self._rail_classes: Optional[Dict[str, Dict[str, int]]] = None
        self._last_rail_bytes: Dict[str, int] = {}
        self._class_names: List[str] = []
        self._last_picks: Dict[int, torch.Tensor] = {}
        self._speed: Optional[List[float]] = None  # layer 0's agreed speed vector (rank 0's view)

    def _write(self, entry: Entry) -> None:
        assert self._file is not None
        self._file.write(_to_line(entry) + "\n")
        self._file.flush()

    def event(self, step: int, event: str, detail: str = "", marks: Optional[Dict[str, float]] = None) -> None:
        """Write an ``event`` line (rank 0; a no-op elsewhere)."""
        if self._file is not None:
            self._write(Event(step, event, detail, dict(marks or {})))

    def start_step(self) -> None:
        self._t_step = self._t_mark = time.perf_counter()
        self._phase = {p: 0.0 for p in PHASES}

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or the step's start) to ``phase``."""
        assert phase in PHASES, f"unknown phase {phase!r}"
        now = time.perf_counter()
        self._phase[phase] += now - self._t_mark
        self._t_mark = now

    def _rail_bytes(self) -> Dict[str, int]:
        import hetcomm

        return {rail: int(c.get("bytes_sent", 0)) for rail, c in hetcomm.stats().items()}

    def end_step(self, step: int, loss: float, tokens: int) -> Optional[StepRecord]:
        """Gather this step's numbers from every rank; rank 0 writes and returns the record."""
        import torch.distributed as dist

        from hetcomm.topo.model import LinkClass

        now = time.perf_counter()
        step_s = now - self._t_step
        if self._rail_classes is None:
            self._rail_classes = _rail_peer_classes(self.rank, self.world_size, self.cluster, self.backend)
            self._class_names = [c.name for c in LinkClass] + [OTHER]
        rails_now = self._rail_bytes()
        delta = {r: b - self._last_rail_bytes.get(r, 0) for r, b in rails_now.items()}
        self._last_rail_bytes = rails_now
        class_bytes = _bytes_by_class(delta, self._rail_classes)
        by_class = [class_bytes.get(c, 0.0) for c in self._class_names]
        stats = [m.step_stats() for m in self.layers]
        speed = stats[0].speed_rows_per_s if stats else None
        self._speed = [float(v) for v in speed] if speed is not None else None
        loads: List[float] = []
        for li, (m, E) in enumerate(zip(self.layers, self.num_experts)):
            # The layer's accumulator sums picks over forwards; this step's are the difference.
            picks = m.metrics.picks
            now_picks = picks.double().cpu() if picks is not None else torch.zeros(E, dtype=torch.float64)
            prev = self._last_picks.get(li)
            loads.extend((now_picks - prev if prev is not None else now_picks).tolist())
            self._last_picks[li] = now_picks.clone()
        counters = []
        for key in LAYER_COUNTERS + LAYER_SECONDS:  # StepStats fields, None where a layer has none
            vals = [float(st.as_dict()[key]) for st in stats if key in st]
            counters.append(sum(vals) if vals else math.nan)
        vec = torch.tensor(
            [step_s]
            + [self._phase.get(p, 0.0) for p in PHASES]
            + [sum(st.comm_exposed_s for st in stats), sum(st.expert_s for st in stats)]
            + [float(delta.get(r, 0)) for r in RAILS]
            + by_class
            + loads
            + [float(sum(int(st.get("dropped", 0)) for st in stats))]
            + counters
            + [float(_max_rss_bytes())],
            dtype=torch.float64,
        )
        if self.world_size > 1:
            parts = [torch.empty_like(vec) for _ in range(self.world_size)]
            dist.all_gather(parts, vec)
            allv = torch.stack(parts)
        else:
            allv = vec.unsqueeze(0)
        if self.rank != 0:
            return None
        return self._emit(step, loss, tokens, allv, now)

    def _emit(self, step: int, loss: float, tokens: int, allv: torch.Tensor, now: float) -> StepRecord:
        P, R, C = len(PHASES), len(RAILS), len(self._class_names)
        mine = allv[0].tolist()
        total = allv.sum(0).tolist()
        i = 0
        step_s = mine[i]
        step_by_rank = allv[:, 0].tolist()
        i += 1
        phase = dict(zip(PHASES, mine[i : i + P]))
        i += P
        moe = {"comm_exposed": mine[i], "expert": mine[i + 1]}
        i += 2
        rails = {r: int(round(v)) for r, v in zip(RAILS, total[i : i + R]) if v}
        i += R
        classes = {c: int(round(v)) for c, v in zip(self._class_names, total[i : i + C]) if v}
        i += C
        load: List[List[float]] = []
        for E in self.num_experts:
            load.append([float(v) for v in total[i : i + E]])
            i += E
        dropped = int(total[i])
        i += 1
        counters = {}
        for key in LAYER_COUNTERS:
            counters[key] = None if math.isnan(total[i]) else int(total[i])
            i += 1
        for key in LAYER_SECONDS:
            counters[key] = None if math.isnan(total[i]) else float(total[i])
            i += 1
        rss = int(allv[:, i].max())
        rec = StepRecord(
            step=step,
            time_s=now - self._t_run,
            loss=float(loss),
            tokens=int(tokens),
            step_s=step_s,
            step_s_by_rank=step_by_rank,
            phase_s=phase,
            moe_s=moe,
            bytes_by_rail=rails,
            bytes_by_link_class=classes,
            expert_load=load,
            dropped=dropped,
            max_rss_bytes=rss,
            expert_s_by_rank=allv[:, 1 + P + 1].tolist(),
            speed_rows_per_s=self._speed,
            **counters,
        )
        self._write(rec)
        return rec

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
