"""Per-rank end marks in the launch directory: who finished, who failed (and blamed whom), who died.

torchrun reports a failed phase as "exit 1", and its root cause is the first worker to *exit*
non-zero, which is usually a survivor that raised after the real culprit died. Each worker of a ``hetcomm launch`` phase therefore leaves one mark when it ends,
``<phase>-<attempt>-rank<r>.json`` in the launch directory:

* ``{"status": "done"}`` — it finished;
* ``{"status": "failed", "error": ..., "peer": P}`` — it raised; ``peer`` is the rank a
  hetcomm error named (the backend's fault diagnosis), if any;
* ``{"status": "stopped", "signal": S}`` — the agent stopped it (SIGTERM after another failure).

Each also leaves ``{"status": "started"}`` (``...rank<r>.started``) once its marks are set up. A
rank that started and left no end mark died without a word (SIGKILL, a segfault, the OOM
killer). :func:`culprits` turns the marks of one attempt into the ranks at fault: those, else the
peers the failed ranks named, else the failed ranks, else the ranks that never started (a rank
killed while the others were still importing torch leaves them unmarked too: then the line says
that it cannot tell them apart).

Files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, so a planted link or file
is never written through. A mark file's modification time is when the rank ended (what
``benchmarks/snapshot_kill.py`` reads for the "notice" and "stop" parts of a recovery).

**Startup marks** (:func:`startup`, :func:`startup_marks`): the unix time this process reached
each phase of a training start (:data:`STARTUP_PHASES`: process start, imports done, group
joined, model built, state restored), carried by the ``resume`` metrics event so that a
recovery's time can be split into its parts without timing anything twice.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional

__all__ = [
    "RankMark", "write_mark", "read_marks", "culprits", "describe", "install_stop_mark", "marked", "last_attempt",
    "give_up_line", "clear_marks", "mark_times", "STARTUP_PHASES", "startup", "startup_marks", "process_start_time",
]

#: The phases of a training start, in order (:func:`startup_marks`).
STARTUP_PHASES = ("process", "imports", "group", "model", "restore")
_startup: Dict[str, float] = {}


def process_start_time(pid: str = "self") -> Optional[float]:
    """The unix time process ``pid`` started (``/proc``: boot time + its start in clock ticks),
    or None where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def startup(phase: str) -> None:
    """Mark that this process reached ``phase`` (one of :data:`STARTUP_PHASES`) now; the first
    mark of a phase wins."""
    assert phase in STARTUP_PHASES, phase
    _startup.setdefault(phase, time.time())


def startup_marks() -> Dict[str, float]:
    """``{phase: unix time}`` of this process's start so far (``process`` from ``/proc``)."""
    out: Dict[str, float] = {}
    start = process_start_time()
    if start is not None:
        out["process"] = start
    out.update(_startup)
    return out


_MAX_MARK_BYTES = 64 << 10


@dataclass(frozen=True)
class RankMark:
    """One rank's end of one attempt of a phase (see the module docstring)."""

    rank: int
    status: str
    error: str = ""
    peer: Optional[int] = None
    node: str = ""


def _path(work_dir: str, phase: str, attempt: int, rank: int, suffix: str = ".json") -> str:
    return os.path.join(work_dir, f"{phase}-{attempt}-rank{rank}{suffix}")


def write_mark(work_dir: str, phase: str, attempt: int, rank: int, status: str, *, error: str = "",
               peer: Optional[int] = None, node: str = "") -> None:
    """Leave this rank's mark (first one wins: a rank that failed and was then stopped stays failed)."""
    body = json.dumps({"rank": rank, "status": status, "error": error[:4000], "peer": peer, "node": node})
    suffix = ".started" if status == "started" else ".json"
    try:
        fd = os.open(_path(work_dir, phase, attempt, rank, suffix), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return  # already marked, or no launch directory: the mark is advisory
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(body)


def mark_times(work_dir: str, phase: str, attempt: int, world_size: int) -> Dict[int, float]:
    """When each rank of one attempt left its end mark (the file's modification time), by rank."""
    out: Dict[int, float] = {}
    for r in range(world_size):
        try:
            out[r] = os.lstat(_path(work_dir, phase, attempt, r)).st_mtime
        except OSError:
            continue
    return out


def read_marks(work_dir: str, phase: str, attempt: int, world_size: int) -> Dict[int, RankMark]:
    """The marks of one attempt of ranks ``0 .. world_size - 1``, by rank (a rank without one is absent)."""
    out: Dict[int, RankMark] = {}
    for r in range(world_size):
        try:
            fd = os.open(_path(work_dir, phase, attempt, r), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            if os.path.lexists(_path(work_dir, phase, attempt, r, ".started")):
                out[r] = RankMark(r, "started")
            continue
        with os.fdopen(fd, "rb") as f:
            raw = f.read(_MAX_MARK_BYTES)
        try:
            d = json.loads(raw.decode("utf-8"))
            peer = d.get("peer")
            out[r] = RankMark(r, str(d["status"]), str(d.get("error", "")), int(peer) if isinstance(peer, int) else None,
                              str(d.get("node", "")))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            continue  # a torn mark (the rank died writing it) counts as none
    return out


def last_attempt(work_dir: str, phase: str) -> int:
    """The highest attempt (torchrun restart count) that left a mark; 0 when none did."""
    best = 0
    try:
        names = os.listdir(work_dir)
    except OSError:
        return 0
    for name in names:
        head, _, rest = name.partition("-")
        attempt = rest.split("-", 1)[0]
        if head == phase and attempt.isdigit():
            best = max(best, int(attempt))
    return best


def clear_marks(work_dir: str, phase: str) -> None:
    """Remove every mark of ``phase`` (a launch directory reused by the next launch of a job)."""
    try:
        names = os.listdir(work_dir)
    except OSError:
        return
    for name in names:
        if name.startswith(f"{phase}-") and "-rank" in name and name.endswith((".json", ".started")):
            try:
                os.unlink(os.path.join(work_dir, name))
            except OSError:
                pass


def culprits(marks: Dict[int, RankMark], world_size: Optional[int]) -> List[int]:
    """The ranks at fault for a failed attempt (see the module docstring); [] when all finished.

    ``world_size`` None: the marks are those of this node's ranks only (a multi-node job; the
    other nodes' marks are on their machines), so a missing mark proves nothing.
    """
    ranks = range(world_size) if world_size is not None else sorted(marks)
    if all(r in marks and marks[r].status == "done" for r in ranks):
        return []
    silent = [r for r in ranks if r in marks and marks[r].status == "started"]
    if silent:
        return silent
    named = Counter(m.peer for m in marks.values() if m.status == "failed" and m.peer is not None)
    if named:
        top = max(named.values())
        return sorted(p for p, c in named.items() if c == top)
    failed = sorted(r for r, m in marks.items() if m.status == "failed")
    return failed or [r for r in ranks if r not in marks]


def describe(marks: Dict[int, RankMark], world_size: Optional[int]) -> str:
    """One line naming the failing rank(s) and what they or their peers said."""
    bad = culprits(marks, world_size)
    if not bad:
        return "no rank left a failure mark" if world_size is None else "every rank finished"
    parts = []
    for r in bad:
        m = marks.get(r)
        if m is None:
            parts.append(f"rank {r} ended before it started (killed or crashed while starting, or stopped by "
                         "torchrun after another rank's early death: the marks cannot tell)")
        elif m.status == "started":
            parts.append(f"rank {r} exited without a word (killed, crashed or out of memory)")
        elif m.status == "failed":
            parts.append(f"rank {r}{' on ' + m.node if m.node else ''} failed: {m.error.splitlines()[0] if m.error else '?'}")
        else:
            parts.append(f"rank {r} was {m.status}")
    witness = next((m for m in marks.values() if m.status == "failed" and m.peer in bad and m.rank not in bad), None)
    if witness is not None and witness.error:
        parts.append(f"rank {witness.rank} saw: {witness.error.splitlines()[0]}")
    return "; ".join(parts)


def give_up_line(work_dir: str, max_restarts: int, code: int, num_ranks: int, world_size: Optional[int]) -> str:
    """``hetcomm launch``'s line when torchrun gave up on the job: this node's restarts, and who failed.

    The count is this node's own: the last attempt its workers left marks for (their
    ``TORCHELASTIC_RESTART_COUNT``), not the ``--max-restarts`` limit. torchrun's agent counts
    the restarts of its node from its own start, so a node that joined a later rendezvous round
    (a node back after a loss, growing the job) gives up having restarted fewer times than the
    nodes that were there from the start; saying "after MAX restart(s)" there would be false.

    Args:
        work_dir: this node's launch directory (its marks).
        max_restarts: ``--max-restarts``.
        code: torchrun's exit code.
        num_ranks / world_size: as :func:`read_marks` / :func:`describe` (``world_size`` None on a
            multi-node job: only this node's marks are here).
    """
    attempt = last_attempt(work_dir, "job")
    why = describe(read_marks(work_dir, "job", attempt, num_ranks), world_size)
    if attempt >= max_restarts:
        head = (f"the job failed for good after {attempt} restart(s) (--max-restarts {max_restarts} spent; "
                f"torchrun exit {code})")
    else:
        head = (f"the job failed for good after {attempt} restart(s) on this node, fewer than --max-restarts "
                f"{max_restarts}: this node joined a later rendezvous round (torchrun counts each node's restarts "
                f"from its own start), or its next rendezvous failed before the workers started; torchrun exit {code}")
    return f"{head}; last attempt: {why}"


def install_stop_mark(work_dir: str, phase: str, attempt: int, rank: int, node: str = "") -> None:
    """On SIGTERM (torchrun stopping the survivors), mark this rank ``stopped``, then exit 143.

    A Python signal handler runs only when the main thread returns to the interpreter, and a
    survivor is usually blocked inside a C++ wait (gloo, the store) when the agent stops it: the
    handler would never run. So SIGTERM is blocked in the calling (main) thread, and every
    thread started after it, and one thread takes it with ``sigwait``. Call it before any other
    thread exists. The exit is what SIGTERM's default action would be (no clean-up either way).
    """
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_term() -> None:
        signum = signal.sigwait({signal.SIGTERM})
        write_mark(work_dir, phase, attempt, rank, "stopped", node=node, error=f"signal {signum}")
        os._exit(128 + signum)

    threading.Thread(target=wait_for_term, name="hetcomm-stop-mark", daemon=True).start()


class marked:
    """``with marked(work_dir, phase, attempt, rank):`` — the body's end becomes this rank's mark.

    ``done`` on a normal exit, ``failed`` (with the error and the peer a
    :class:`~hetcomm.errors.CollectiveError` names) on an exception, which propagates;
    ``stopped`` on SIGTERM. With ``work_dir`` None nothing is written.
    """

    def __init__(self, work_dir: Optional[str], phase: str, attempt: int, rank: int, node: str = "") -> None:
        self.args = (work_dir, phase, attempt, rank)
        self.node = node

    def __enter__(self) -> "marked":
        if self.args[0] is not None:
            install_stop_mark(*self.args, node=self.node)
            write_mark(*self.args, "started", node=self.node)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.args[0] is None:
            return False
        if exc is None:
            write_mark(*self.args, "done", node=self.node)
        elif not isinstance(exc, SystemExit):
            from hetcomm.errors import CollectiveError

            peer = exc.peer if isinstance(exc, CollectiveError) else None
            write_mark(*self.args, "failed", error=f"{type(exc).__name__}: {exc}", peer=peer, node=self.node)
        return False
