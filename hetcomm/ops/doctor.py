"""``hetcomm doctor``: the troubleshooting table of an MoE job as rules over the job's record.

A *record* is whatever a job left behind, read by content (:func:`load_record`):

* the metrics file of ``hetcomm train --metrics`` (:mod:`hetcomm.ops.metrics`), whose ``run``
  line also carries the job's ``NCCL_*``/``HCCL_*``/``TORCH_NCCL_*`` environment;
* logs: NCCL (``NCCL_DEBUG=INFO``) and HCCL output, the job's stderr (OOMs, timeouts), ``env``
  dumps;
* clock reports: ``chronyc tracking``, ``ntpq -p``, ``timedatectl``;
* ``hetcomm audit --json`` output (its findings are carried over as they are);
* health records (:mod:`hetcomm.ops.ops_records`: the launch health check's and the in-training
  probe's slow ranks, membership changes), given or found beside the metrics file
  (``m.jsonl`` -> ``m.health.jsonl``); their rules are :mod:`hetcomm.ops.doctor_health`'s.

Each rule returns :class:`~hetcomm.topo.model.Finding` objects (the audit's type: code,
severity, subject = where, message = what was seen, fix = how to fix it). :data:`DOCTOR_CODES`
holds each code's meaning (the audit's :class:`~hetcomm.topo.audit.FindingSpec`).

=============================  ==============================================================
code                           fires when
=============================  ==============================================================
``step-time-jitter``           after warm-up, >= 10% of the steps take > 2x the median
``expert-starved``             an expert gets < 0.5% of a layer's token copies (second half)
``oom-prefetch``               a log shows an out-of-memory error and expert prefetch is on
``oom``                        the same without prefetch
``loss-oscillation-migration`` >= 2 loss spikes, most within 3 steps after expert migrations
``init-hang``                  a communicator init that started but never completed, or a
                               rendezvous/socket timeout during setup
``clock-offset``               a node's clock is unsynchronised or > 100 ms off its reference,
                               or nodes disagree by > 100 ms
``env-nccl-algo``              ``NCCL_ALGO``/``NCCL_PROTO`` forced
``env-roce-gid``               NCCL on RoCE NICs without ``NCCL_IB_GID_INDEX`` set
``env-hccl-buffsize``          Ascend ranks whose per-step all-to-all exceeds ``HCCL_BUFFSIZE``
``env-async-error-handling``   ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (a dead peer hangs)
``slow-rank`` / ``slow-link``  a health record names a rank slower than its device / link class
``membership-change``          the job resumed on other ranks (who, cause, cost, experts)
``work-lost``                  a restart redid finished steps (from which step, how many, why)
``store-reverse-dns``          torch's TCPStore logged a failed reverse lookup of a connection
                               (:mod:`hetcomm.ops.doctor_store`)
=============================  ==============================================================

Why by hand: these are the symptoms of the MegaScale-MoE troubleshooting table turned into
checks over hetcomm's own record; no library knows this record.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hetcomm.errors import ConfigError
from hetcomm.ops.doctor_health import HEALTH_CODES, HealthFile, rule_membership_change, rule_slow_rank
from hetcomm.ops.doctor_store import STORE_CODES, rule_store_reverse_dns
from hetcomm.ops.metrics import MetricsLog, read_metrics
from hetcomm.topo.audit import FindingSpec
from hetcomm.topo.model import Finding

__all__ = [
    "DOCTOR_CODES",
    "JobRecord",
    "ClockReading",
    "LogFile",
    "load_record",
    "diagnose",
    "render",
    "JITTER_FACTOR",
    "JITTER_FRACTION",
    "STARVED_SHARE",
    "CLOCK_OFFSET_S",
]

#: A step slower than this many times the median is a slow step ...
JITTER_FACTOR = 2.0
#: ... and a job with at least this share of slow steps (after warm-up) jitters.
JITTER_FRACTION = 0.10
#: An expert below this share of its layer's token copies is starved (MegaScale's 0.5%).
STARVED_SHARE = 0.005
#: Clock offset (s) from the reference, or between nodes, that breaks timeouts and log order.
CLOCK_OFFSET_S = 0.1
#: HCCL's default communication buffer, MB (``HCCL_BUFFSIZE`` unset).
HCCL_DEFAULT_BUFFSIZE_MB = 200

DOCTOR_CODES: Dict[str, FindingSpec] = {
    s.code: s
    for s in (
        FindingSpec(
            "step-time-jitter", "warning", "step time jitters",
            "Some steps take much longer than the median: every rank waits for the slowest at each "
            "all-to-all and all-reduce, so one straggler or a periodic stall costs the whole job.",
        ),
        FindingSpec(
            "expert-starved", "warning", "an expert gets almost no tokens",
            "An expert below 0.5% of the tokens learns nothing and wastes its memory and its share "
            "of the all-to-all buffers; the gate has collapsed onto the others.",
        ),
        FindingSpec(
            "oom-prefetch", "error", "out of memory with expert prefetch on",
            "Prefetching experts keeps the next layers' weights resident beside the current ones; "
            "at peak the prefetched pages and the all-to-all buffers no longer fit.",
        ),
        FindingSpec("oom", "error", "out of memory", "A rank ran out of device or host memory."),
        FindingSpec(
            "loss-oscillation-migration", "warning", "loss oscillates while experts migrate",
            "Moving experts between ranks without their optimizer state, or too often, resets "
            "what they learned: the loss jumps after each migration and recovers, again and again.",
        ),
        FindingSpec(
            "init-hang", "error", "communicator initialisation did not finish",
            "A rank started initialising its communicator (or the rendezvous) and never completed: "
            "a peer is missing, a port or interface is unreachable, or clocks disagree so much that "
            "timeouts and certificate/handshake checks fail.",
        ),
        FindingSpec(
            "clock-offset", "warning", "node clocks are off",
            "Clocks that disagree make rendezvous and NCCL/HCCL timeouts fire early or late, and "
            "make logs of different nodes impossible to line up when a job hangs.",
        ),
        FindingSpec(
            "env-nccl-algo", "info", "NCCL algorithm or protocol forced",
            "All-to-all in NCCL is point-to-point send/recv: NCCL_ALGO and NCCL_PROTO do not "
            "speed it up, they only change the dense gradient all-reduce, usually for the worse.",
        ),
        FindingSpec(
            "env-roce-gid", "warning", "RoCE without an explicit GID index / HCA list",
            "On RoCE the GID index selects RoCE v1/v2 and IPv4/IPv6; a wrong default gives "
            "connect timeouts or traffic outside the lossless class, and without NCCL_IB_HCA "
            "NCCL may use management or storage NICs for the all-to-all.",
        ),
        FindingSpec(
            "env-hccl-buffsize", "warning", "HCCL buffer smaller than the all-to-all",
            "HCCL stages each collective through HCCL_BUFFSIZE MB per peer link; an all-to-all "
            "larger than the buffer is cut into several rounds.",
        ),
        FindingSpec(
            "work-lost", "warning", "a restart redid finished steps",
            "After a failure the job went on from the newest state every rank had: an in-memory "
            "snapshot (its own or a buddy's copy), a disk checkpoint, or nothing. The steps finished "
            "after that state were trained again.",
        ),
        FindingSpec(
            "env-async-error-handling", "warning", "asynchronous NCCL error handling off",
            "With TORCH_NCCL_ASYNC_ERROR_HANDLING=0 a dead or hung peer leaves the other ranks "
            "blocked in a collective forever instead of aborting the communicator, so torchrun "
            "never restarts the job.",
        ),
    )
}
DOCTOR_CODES.update(HEALTH_CODES)
DOCTOR_CODES.update(STORE_CODES)


@dataclass(frozen=True)
class LogFile:
    """A text log: its path and lines (1-based line numbers in findings)."""

    path: str
    lines: Tuple[str, ...]


@dataclass(frozen=True)
class ClockReading:
    """One clock report: offset from its reference in seconds (None if not stated), synced."""

    path: str
    tool: str
    offset_s: Optional[float]
    synchronised: bool
    line: int


@dataclass
class JobRecord:
    """Everything :func:`load_record` read."""

    metrics: Optional[MetricsLog] = None
    logs: List[LogFile] = field(default_factory=list)
    clocks: List[ClockReading] = field(default_factory=list)
    audit: List[Finding] = field(default_factory=list)
    health: List[HealthFile] = field(default_factory=list)

    def env(self) -> Dict[str, Tuple[str, str]]:
        """``{name: (value, where)}`` from the metrics ``run`` line, ``env`` dumps and NCCL's
        "set by environment" lines (later sources win)."""
        out: Dict[str, Tuple[str, str]] = {}
        if self.metrics is not None and self.metrics.run is not None:
            for k, v in self.metrics.run.env.items():
                out[k] = (v, f"{self.metrics.path} (run line)")
        for log in self.logs:
            for i, line in enumerate(log.lines, 1):
                m = _NCCL_ENV.search(line) or _ENV_DUMP.match(line)
                if m:
                    out[m.group(1)] = (m.group(2).strip().rstrip("."), f"{log.path}:{i}")
        return out


# -- reading ---------------------------------------------------------------------------------

_NCCL_ENV = re.compile(r"NCCL INFO ((?:NCCL|TORCH)_\w+) set by environment to (.*)$")
_ENV_DUMP = re.compile(r"^(?:export\s+)?((?:NCCL|HCCL|TORCH_NCCL|TORCH_DISTRIBUTED)_\w+)=(.*)$")
_CHRONY_SYS = re.compile(r"^System time\s*:\s*([\d.]+) seconds (fast|slow) of NTP time")
_CHRONY_LEAP = re.compile(r"^Leap status\s*:\s*(.+)$")
_TIMEDATECTL = re.compile(r"System clock synchronized:\s*(yes|no)")
_NTPQ_ROW = re.compile(r"^([*#o+x.\- ])(\S+)\s+\S+\s+\d+\s+\w\s+\S+\s+\d+\s+\d+\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)")


def _read_text(path: str) -> str:
    # Bounded, regular files only: a FIFO with no writer or a link to /dev/zero is refused.
    from hetcomm.ops.record_input import read_record_text

    return read_record_text(path)


def _number(text: str, path: str, line: int, key: str, scale: float = 1.0) -> float:
    """A clock report's number: finite and within a day, else a ConfigError naming the line."""
    from hetcomm.ops.record_input import finite_number

    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{text[:40]!r} is not a number", path=path, line=line, key=key) from None
    value = finite_number(value * scale, key=key, path=path, line=line)
    if abs(value) > 86400.0:
        raise ConfigError(f"an offset of {value:g} s (more than a day) is not a clock report's", path=path, line=line,
                          key=key)
    return value


def _clock_readings(path: str, lines: Sequence[str]) -> List[ClockReading]:
    out: List[ClockReading] = []
    text = "\n".join(lines)
    if "Reference ID" in text and "System time" in text:  # chronyc tracking
        offset, line_no, synced = None, 0, True
        for i, ln in enumerate(lines, 1):
            m = _CHRONY_SYS.match(ln.strip())
            if m:
                offset = _number(m.group(1), path, i, "System time", 1 if m.group(2) == "fast" else -1)
                line_no = i
            m = _CHRONY_LEAP.match(ln.strip())
            if m and "not synchronised" in m.group(1).lower():
                synced, line_no = False, line_no or i
        out.append(ClockReading(path, "chronyc tracking", offset, synced, line_no))
    elif re.search(r"remote\s+refid\s+st\s+t\s+when\s+poll\s+reach\s+delay\s+offset", text):  # ntpq -p
        best = None
        for i, ln in enumerate(lines, 1):
            m = _NTPQ_ROW.match(ln)
            if m and m.group(1) == "*":  # the peer ntpd is synchronised to
                best = ClockReading(path, "ntpq -p", _number(m.group(4), path, i, "offset", 1e-3), True, i)
        out.append(best or ClockReading(path, "ntpq -p", None, False, 1))
    for i, ln in enumerate(lines, 1):
        m = _TIMEDATECTL.search(ln)
        if m:
            out.append(ClockReading(path, "timedatectl", None, m.group(1) == "yes", i))
    return out


def load_record(paths: Sequence[str]) -> JobRecord:
    """Read every file of a job's record, recognising each by its content.

    Raises:
        ConfigError: an unreadable file, or a metrics/audit file that does not parse (naming
            file, line and key).
    """
    from hetcomm.ops.ops_records import is_health_records, read_records, sibling_path

    rec = JobRecord()
    given = {os.path.abspath(p) for p in paths}
    for path in paths:
        text = _read_text(path)
        head = text.lstrip()[:200]
        if head.startswith("{") and is_health_records(text.lstrip().split("\n", 1)[0]):
            rec.health.append(HealthFile(path, read_records(path)))
            continue
        if head.startswith("{") and '"kind"' in head.split("\n", 1)[0]:
            if rec.metrics is not None:
                raise ConfigError("a second metrics file; give one job's record at a time", path=path)
            rec.metrics = read_metrics(path)
            beside = sibling_path(path)
            if os.path.abspath(beside) not in given and os.path.isfile(beside):
                rec.health.append(HealthFile(beside, read_records(beside)))
            continue
        if head.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"not JSON: {e.msg}", path=path, line=e.lineno) from None
            except RecursionError:
                raise ConfigError("nested too deeply to be an audit report", path=path) from None
            except ValueError as e:  # a number too long to convert
                raise ConfigError(f"a number that cannot be read ({str(e)[:80]})", path=path) from None
            if not isinstance(obj, dict) or not isinstance(obj.get("findings"), list):
                raise ConfigError("a JSON file that is neither a metrics file nor `hetcomm audit --json` output", path=path)
            for i, f in enumerate(obj["findings"]):
                try:
                    if not all(isinstance(f[k], str) for k in ("code", "severity", "subject", "message")):
                        raise TypeError
                    rec.audit.append(Finding(f["code"], f["severity"], f["subject"], f["message"], str(f.get("fix", ""))))
                except (KeyError, TypeError, AssertionError, ValueError):
                    raise ConfigError("not an audit finding", path=path, key=f"findings[{i}]") from None
            continue
        lines = tuple(text.splitlines())
        clocks = _clock_readings(path, lines)
        rec.clocks.extend(clocks)
        if not clocks:
            rec.logs.append(LogFile(path, lines))
    return rec


# -- rules -----------------------------------------------------------------------------------

Rule = Callable[[JobRecord], List[Finding]]


def _finding(code: str, subject: str, message: str, fix: str, severity: Optional[str] = None) -> Finding:
    return Finding(code, severity or DOCTOR_CODES[code].severity, subject, message, fix)


def _steps_list(steps: Sequence[int], limit: int = 6) -> str:
    s = ", ".join(map(str, steps[:limit]))
    return s + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def rule_step_time_jitter(rec: JobRecord) -> List[Finding]:
    log = rec.metrics
    if log is None or len(log.steps) < 10:
        return []
    steps = log.steps[max(2, len(log.steps) // 10):]  # warm-up: allocator, first plans, replicas
    times = [s.step_s for s in steps]
    med = statistics.median(times)
    slow = [s for s in steps if s.step_s > JITTER_FACTOR * med]
    # Jitter is a steady share of slow steps; a few outliers (a checkpoint, a GC pass) are not.
    if len(slow) < JITTER_FRACTION * len(steps):
        return []
    p99 = sorted(times)[min(len(times) - 1, int(0.99 * (len(times) - 1) + 0.5))]
    normal = [s for s in steps if s.step_s <= med]
    # Where the extra time goes: the phase that grows most in slow steps, and who is slowest.
    excess = {
        p: statistics.mean(s.phase_s.get(p, 0.0) for s in slow) - statistics.mean(s.phase_s.get(p, 0.0) for s in normal)
        for p in slow[0].phase_s
    }
    phase = max(excess, key=excess.get)
    ranks: Dict[int, int] = {}
    for s in slow:
        r = max(range(len(s.step_s_by_rank)), key=lambda i: s.step_s_by_rank[i])
        ranks[r] = ranks.get(r, 0) + 1
    node = ""
    if log.run is not None and ranks:
        r0 = max(ranks, key=ranks.get)
        node = f"; rank {r0} ({log.run.ranks[r0]['node']}) is slowest in {ranks[r0]} of them"
    return [_finding(
        "step-time-jitter",
        f"{log.path}: steps {_steps_list([s.step for s in slow])}",
        f"{len(slow)} of {len(steps)} steps ({len(slow) / len(steps):.0%}) take more than {JITTER_FACTOR:g}x the "
        f"median step time ({med * 1e3:.0f} ms; p99 {p99 * 1e3:.0f} ms); the slow steps spend "
        f"+{excess[phase] * 1e3:.0f} ms in '{phase}'{node}.",
        "Find the straggler: `hetcomm launch` health check (per-rank all-reduce/all-to-all P99, "
        "--eject to leave a slow node out); pin each rank to its NUMA node and keep other jobs off "
        "its cores; if every rank stalls together, look for periodic work (Python GC: "
        "gc.freeze()/gc.disable() during steps, checkpoint or logging I/O, a noisy neighbour on "
        "the NIC).",
    )]


def rule_expert_starved(rec: JobRecord) -> List[Finding]:
    log = rec.metrics
    if log is None or len(log.steps) < 4:
        return []
    steps = log.steps[len(log.steps) // 2:]  # routing at the start is still settling
    out = []
    for li in range(len(steps[-1].expert_load)):
        loads = [sum(s.expert_load[li][e] for s in steps) for e in range(len(steps[-1].expert_load[li]))]
        total = sum(loads)
        if not total or any(math.isnan(v) for v in loads):
            continue
        starved = [(e, v / total) for e, v in enumerate(loads) if v / total < STARVED_SHARE]
        if not starved:
            continue
        desc = ", ".join(f"expert {e} {sh:.2%}" for e, sh in starved)
        out.append(_finding(
            "expert-starved",
            f"{log.path}: layer {li}, steps {steps[0].step}-{steps[-1].step}",
            f"{len(starved)} of {len(loads)} experts get under {STARVED_SHARE:.1%} of layer {li}'s token "
            f"copies: {desc} (a fair share is {1 / len(loads):.1%}).",
            "Turn on load-aware calibration (`hetcomm train --calibrate`, MoELayer(calibrate=True)) "
            "or raise its strength (calibration_strength) and the auxiliary-loss weight; check the "
            "gate's initialisation (a large init or learning rate collapses routing early); a "
            "capacity factor below 1 also starves experts of gradient.",
        ))
    return out


_OOM = re.compile(
    r"(CUDA out of memory|torch\.OutOfMemoryError|OutOfMemoryError|NPU out of memory|"
    r"RuntimeError: \[ERROR\] .*out of memory|Killed process \d+ .*out of memory|MemoryError\b)",
    re.IGNORECASE,
)
_RANK_PREFIX = re.compile(r"^\[?(?:rank|default)(\d+)\]?[:\s]")


def _prefetch_on(rec: JobRecord) -> Optional[str]:
    """Where the record says expert prefetch was on, or None."""
    if rec.metrics is not None and rec.metrics.run is not None:
        for k, v in rec.metrics.run.config.items():
            if "prefetch" in k and v not in (None, False, 0, "off", "false"):
                return f"{rec.metrics.path}: config {k}={v}"
            if k == "page_budget" and isinstance(v, (int, float)) and v > 0:
                # hetcomm train --page-budget: the pager prefetches experts predicted hot.
                return f"{rec.metrics.path}: config page_budget={v} (expert paging prefetches)"
    for k, (v, where) in rec.env().items():
        if "PREFETCH" in k and v not in ("0", "off", "false", ""):
            return f"{where}: {k}={v}"
    return None


def rule_oom(rec: JobRecord) -> List[Finding]:
    out = []
    prefetch = _prefetch_on(rec)
    for log in rec.logs:
        for i, line in enumerate(log.lines, 1):
            if not _OOM.search(line):
                continue
            m = _RANK_PREFIX.match(line)
            where = f"{log.path}:{i}" + (f" (rank {m.group(1)})" if m else "")
            seen = line.strip()[:160]
            if prefetch:
                out.append(_finding(
                    "oom-prefetch", where,
                    f"out of memory: '{seen}', with expert prefetch on ({prefetch}).",
                    "Lower the prefetch depth (prefetch one layer ahead, not several) or the number "
                    "of resident expert pages, or turn prefetch off for this model size; keep "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut fragmentation; then "
                    "check the peak in the metrics (max_rss_bytes) stays below the device memory.",
                ))
            else:
                out.append(_finding(
                    "oom", where, f"out of memory: '{seen}'.",
                    "Reduce the micro-batch or the capacity factor (all-to-all buffers grow with "
                    "it), or hold fewer experts per rank.",
                ))
            break  # one finding per log: the first OOM is the cause, the rest are echoes
    return out


def rule_loss_oscillation(rec: JobRecord) -> List[Finding]:
    log = rec.metrics
    if log is None or len(log.steps) < 10:
        return []
    steps = log.steps
    migr = sorted({s.step for s in steps if s.migrations} | {e.step for e in log.events if e.event == "migration"})
    if not migr:
        return []
    losses = [s.loss for s in steps]
    # A spike: the loss rises above the median of the 5 steps before it by more than 3 robust
    # standard deviations of the step-to-step changes (so a noisy but steady curve is quiet).
    diffs = [abs(b - a) for a, b in zip(losses, losses[1:])]
    mad = statistics.median(diffs) or 1e-12
    spikes = []
    for i in range(5, len(steps)):
        base = statistics.median(losses[i - 5 : i])
        if losses[i] - base > 3.0 * 1.4826 * mad:
            if not spikes or steps[i].step > spikes[-1] + 1:  # one spike per excursion
                spikes.append(steps[i].step)
    after = [t for t in spikes if any(0 <= t - m <= 3 for m in migr)]
    if len(after) < 2 or len(after) < 0.5 * len(spikes):
        return []
    return [_finding(
        "loss-oscillation-migration",
        f"{log.path}: steps {_steps_list(after)}",
        f"the loss jumps at {len(after)} of {len(spikes)} spikes within 3 steps after an expert "
        f"migration (migrations at steps {_steps_list(migr)}).",
        "Migrate experts with their optimizer state (MoELayer.rebalance(optimizer=...)), migrate "
        "less often (a longer balancer window, hysteresis: move only when the imbalance is well "
        "above the threshold), and move fewer experts per rebalance.",
    )]


_NCCL_INIT = re.compile(r"^(\S+?):(\d+):\d+ \[\d+\] NCCL INFO ncclCommInitRank\w* comm (0x[0-9a-f]+) rank (\d+) nranks (\d+).* - Init (START|COMPLETE)")
_SETUP_TIMEOUT = re.compile(
    r"(DistStoreError|Timed out after \d+ seconds waiting for clients|Socket Timeout|"
    r"socketStartConnect: Connect to .* failed|RendezvousTimeoutError|EI0006|"
    r"Getting socket times out|HCCL.*[Tt]imeout|did not answer within)"
)


def rule_init_hang(rec: JobRecord) -> List[Finding]:
    out = []
    clocks = [c for c in rec.clocks if not c.synchronised or (c.offset_s is not None and abs(c.offset_s) > CLOCK_OFFSET_S)]
    clock_hint = (
        " Clock reports show offsets (" + ", ".join(os.path.basename(c.path) for c in clocks) + "): fix them first."
        if clocks else ""
    )
    for log in rec.logs:
        started: Dict[Tuple[str, str, str], Tuple[int, str]] = {}
        for i, line in enumerate(log.lines, 1):
            m = _NCCL_INIT.match(line)
            if m:
                key = (m.group(1), m.group(3), m.group(4))
                if m.group(6) == "START":
                    started[key] = (i, m.group(5))
                else:
                    started.pop(key, None)
        if started:
            first = min(started.values())[0]
            ranks = sorted(int(k[2]) for k in started)
            hosts = sorted({k[0] for k in started})
            out.append(_finding(
                "init-hang",
                f"{log.path}:{first} (ranks {_steps_list(ranks, 8)} on {', '.join(hosts)})",
                f"{len(started)} NCCL communicator(s) logged 'Init START' but never 'Init COMPLETE'.{clock_hint}",
                "Check that every rank of the job started (torchrun's --nnodes and rendezvous), that "
                "NCCL_SOCKET_IFNAME names an interface every node can reach (see the 'Bootstrap: "
                "Using' lines), that the bootstrap ports are open between nodes, and that node clocks "
                "agree (`chronyc tracking` on each node); rerun with NCCL_DEBUG=INFO "
                "NCCL_DEBUG_SUBSYS=INIT,NET to see the last step each rank reached.",
            ))
            continue
        for i, line in enumerate(log.lines, 1):
            if _SETUP_TIMEOUT.search(line):
                out.append(_finding(
                    "init-hang", f"{log.path}:{i}",
                    f"setup timed out: '{line.strip()[:160]}'.{clock_hint}",
                    "A peer never joined or cannot be reached: check every node started (torchrun "
                    "--nnodes MIN:MAX lets the job start without an ejected node), the master "
                    "address/port and interfaces (NCCL_SOCKET_IFNAME, HCCL_IF_IP, "
                    "HCCL_CONNECT_TIMEOUT on Ascend), firewalls, and clock sync on every node.",
                ))
                break
    return out


def rule_clock_offset(rec: JobRecord) -> List[Finding]:
    out = []
    for c in rec.clocks:
        where = f"{c.path}:{c.line} ({c.tool})"
        if not c.synchronised:
            out.append(_finding(
                "clock-offset", where, "the clock is not synchronised to any time source.",
                "Start and enable chronyd (`systemctl enable --now chronyd`) with the same servers "
                "on every node, wait for `chronyc tracking` to show 'Leap status: Normal', then "
                "restart the job.",
            ))
        elif c.offset_s is not None and abs(c.offset_s) > CLOCK_OFFSET_S:
            out.append(_finding(
                "clock-offset", where,
                f"the clock is {abs(c.offset_s) * 1e3:.0f} ms {'ahead of' if c.offset_s > 0 else 'behind'} its reference "
                f"(limit {CLOCK_OFFSET_S * 1e3:.0f} ms).",
                "Step the clock once (`chronyc makestep`) and let chronyd keep it (or fix ntpd's "
                "servers); all nodes should follow the same source.",
            ))
    known = [c for c in rec.clocks if c.offset_s is not None and c.synchronised]
    if len(known) >= 2:
        lo, hi = min(known, key=lambda c: c.offset_s), max(known, key=lambda c: c.offset_s)
        if hi.offset_s - lo.offset_s > CLOCK_OFFSET_S and not any(f.subject.startswith(hi.path) or f.subject.startswith(lo.path) for f in out):
            out.append(_finding(
                "clock-offset", f"{lo.path} vs {hi.path}",
                f"nodes disagree by {(hi.offset_s - lo.offset_s) * 1e3:.0f} ms.",
                "Point every node at the same time servers (a local stratum-1/2 source) and step "
                "the clocks once with `chronyc makestep`.",
            ))
    return out


def _alltoall_heavy(rec: JobRecord) -> bool:
    """All-to-all heavy: the metrics show MoE exchange, or NCCL logs exist (no metrics to tell)."""
    log = rec.metrics
    if log is None:
        return True
    return any(s.bytes_by_link_class for s in log.steps)


def rule_env_nccl_algo(rec: JobRecord) -> List[Finding]:
    if not _alltoall_heavy(rec):
        return []
    out = []
    for name in ("NCCL_ALGO", "NCCL_PROTO"):
        got = rec.env().get(name)
        if got is None:
            continue
        value, where = got
        out.append(_finding(
            "env-nccl-algo", f"{where}: {name}={value}",
            f"{name} is forced to {value}. NCCL's all-to-all is point-to-point send/recv and ignores "
            f"it; it only changes the dense all-reduce. Caveat: Ring gives the best bandwidth for "
            f"large all-reduces on few nodes, but its latency grows with the number of ranks; Tree "
            f"(double binary tree) scales in latency yet can lose bandwidth within a node, so "
            f"neither is right for every message size."
            + (" LL128 on a platform NCCL does not enable it for can corrupt data." if "LL128" in value else ""),
            f"Unset {name} and let NCCL's tuner choose per message size; if a measurement "
            f"(nccl-tests all_reduce_perf at your gradient bucket size) shows one algorithm wins, "
            f"set it for that job only, never cluster-wide.",
        ))
    return out


def rule_env_roce_gid(rec: JobRecord) -> List[Finding]:
    env = rec.env()
    out = []
    for log in rec.logs:
        for i, line in enumerate(log.lines, 1):
            if "NCCL INFO NET/IB : Using" in line and "/RoCE" in line:
                if "NCCL_IB_GID_INDEX" not in env:
                    nics = re.findall(r"\[\d+\](\w+):\d+/RoCE", line)
                    hca = "" if "NCCL_IB_HCA" in env else " (nor NCCL_IB_HCA)"
                    out.append(_finding(
                        "env-roce-gid", f"{log.path}:{i}",
                        f"NCCL runs over RoCE ({', '.join(nics[:8])}) without NCCL_IB_GID_INDEX{hca}: "
                        f"it takes GID index 0, which is RoCE v1 / link-local on most NICs.",
                        "Run `show_gids` on each node and set NCCL_IB_GID_INDEX to the RoCE v2 "
                        "IPv4 entry (often 3); set NCCL_IB_HCA to exactly the rail NICs "
                        f"(e.g. NCCL_IB_HCA={','.join(nics[:8]) or 'mlx5_0,mlx5_1'}) and NCCL_IB_TC "
                        "to the lossless traffic class your switches use.",
                    ))
                return out  # one per job: every rank prints the same line
    return out


def rule_env_hccl_buffsize(rec: JobRecord) -> List[Finding]:
    log = rec.metrics
    if log is None or log.run is None:
        return []
    ascend = [r for r in log.run.ranks if str(r.get("model", "")).startswith(("910", "Ascend"))]
    if not ascend or not log.steps:
        return []
    got = rec.env().get("HCCL_BUFFSIZE")
    try:
        buf_mb = float(got[0]) if got else HCCL_DEFAULT_BUFFSIZE_MB
    except ValueError:
        buf_mb = HCCL_DEFAULT_BUFFSIZE_MB
    # Per rank and step: the all-to-all bytes over every class, spread over the ranks.
    per_rank = max(sum(s.bytes_by_link_class.values()) for s in log.steps) / max(1, log.run.world_size)
    need_mb = per_rank / 2**20
    if need_mb <= buf_mb:
        return []
    return [_finding(
        "env-hccl-buffsize",
        f"{log.path}: ranks {', '.join(str(r['rank']) for r in ascend)} ({ascend[0]['model']})",
        f"a rank sends up to {need_mb:.0f} MB per step in all-to-all but HCCL_BUFFSIZE is "
        f"{buf_mb:.0f} MB{'' if got else ' (the default)'}: HCCL splits each exchange into "
        f"{math.ceil(need_mb / buf_mb)} rounds.",
        f"export HCCL_BUFFSIZE={int(2 ** math.ceil(math.log2(need_mb)))} on every Ascend node (MB; it "
        f"costs that much device memory per communicator), or dispatch in chunks "
        f"(MoELayer(num_chunks=...)).",
    )]


def rule_env_async_error_handling(rec: JobRecord) -> List[Finding]:
    env = rec.env()
    out = []
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        got = env.get(name)
        if got is not None and got[0].strip() == "0":
            out.append(_finding(
                "env-async-error-handling", f"{got[1]}: {name}=0",
                f"{name}=0: a rank that dies mid-step leaves the others blocked in NCCL until the "
                f"watchdog timeout (or forever), and torchrun never sees a failure to restart from.",
                "Unset it (torch's default aborts the communicator on error) or set "
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=1, keep a collective timeout "
                "(init_process_group(timeout=...)), and run under `hetcomm launch` "
                "(torchrun --max-restarts) with --checkpoint-every so a restart loses few steps.",
            ))
    return out


def rule_health_records(rec: JobRecord) -> List[Finding]:
    """``slow-rank`` / ``slow-link`` / ``membership-change`` (:mod:`hetcomm.ops.doctor_health`)."""
    events = []
    if rec.metrics is not None:
        events = [(rec.metrics.path, e.step, e.detail) for e in rec.metrics.events if e.event == "membership"]
    return rule_slow_rank(rec.health) + rule_membership_change(rec.health, events)


def rule_store_connections(rec: JobRecord) -> List[Finding]:
    """``store-reverse-dns`` (:mod:`hetcomm.ops.doctor_store`)."""
    return rule_store_reverse_dns(rec.logs)


_LOST = re.compile(r"lost (\d+) step")


def rule_work_lost(rec: JobRecord) -> List[Finding]:
    """``work-lost``: each ``resume`` event that names steps lost."""
    if rec.metrics is None:
        return []
    out = []
    for e in rec.metrics.events:
        m = _LOST.search(e.detail) if e.event == "resume" else None
        if m is None or int(m.group(1)) == 0:
            continue
        lost = int(m.group(1))
        if e.detail.startswith("from nothing"):
            what = "started again from step 0: no in-memory snapshot or disk checkpoint held every rank's state"
            fix = ("Keep snapshots on (--snapshot-every, with a buddy copy on another node: do not pass "
                   "--no-snapshot-peer) and write disk checkpoints (--checkpoint-dir, --checkpoint-every) "
                   "so that a lost node's state survives elsewhere.")
        elif e.detail.startswith("from memory"):
            what = f"went on after step {e.step} from an in-memory snapshot" + (
                " (some ranks from their buddies' copies)" if "peer" in e.detail else "")
            fix = "Nothing to do for one step; more means snapshots were taken less often (--snapshot-every)."
        else:
            what = f"went on after step {e.step} from the disk checkpoint (no snapshot held every rank's state)"
            fix = "Checkpoint more often (--checkpoint-every) or keep in-memory snapshots on (--snapshot-every)."
        out.append(_finding(
            "work-lost", f"{rec.metrics.path}: resume at step {e.step}",
            f"The job {what}; {lost} finished step(s) were trained again (resume event: {e.detail}).",
            fix,
            severity="info" if lost <= 1 else None,
        ))
    return out


RULES: Tuple[Rule, ...] = (
    rule_init_hang,
    rule_clock_offset,
    rule_oom,
    rule_step_time_jitter,
    rule_expert_starved,
    rule_loss_oscillation,
    rule_env_nccl_algo,
    rule_env_roce_gid,
    rule_env_hccl_buffsize,
    rule_env_async_error_handling,
    rule_health_records,
    rule_work_lost,
    rule_store_connections,
)

_ORDER = {"error": 0, "warning": 1, "info": 2}


def diagnose(rec: JobRecord) -> List[Finding]:
    """Every rule's findings plus the audit's, errors first."""
    out: List[Finding] = []
    for rule in RULES:
        out.extend(rule(rec))
    out.extend(rec.audit)
    return sorted(out, key=lambda f: _ORDER[f.severity])


def render(rec: JobRecord, findings: Sequence[Finding]) -> str:
    """The doctor's report: what was read, then each finding with its meaning and fix."""
    read = []
    if rec.metrics is not None:
        read.append(f"metrics {rec.metrics.path} ({len(rec.metrics.steps)} steps)")
    read += [f"log {lg.path} ({len(lg.lines)} lines)" for lg in rec.logs]
    read += [f"clock {c.path} ({c.tool})" for c in rec.clocks]
    read += [f"health records {h.path} ({len(h.records)} records)" for h in rec.health]
    if rec.audit:
        read.append(f"audit ({len(rec.audit)} findings)")
    out = ["hetcomm doctor: read " + ("; ".join(read) if read else "nothing")]
    if not findings:
        out.append("No problems found: none of the troubleshooting rules matched this record.")
        return "\n".join(out)
    from hetcomm.topo.audit import FINDING_CODES

    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    out.append("Findings (" + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ")")
    for f in findings:
        spec = DOCTOR_CODES.get(f.code) or FINDING_CODES.get(f.code)
        out.append(f"  [{f.severity.upper()}] {f.code}: {f.subject}")
        out.append(f"      {f.message}")
        if spec is not None:
            out.append(f"      means: {spec.meaning}")
        if f.fix:
            out.append(f"      fix: {f.fix}")
    return "\n".join(out)
