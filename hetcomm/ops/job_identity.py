"""Which launch a job's node-local state belongs to, and whether that launch still runs.

A job's in-memory snapshots live in ``<root>/hetcomm-<uid>-<job id>/`` (:mod:`hetcomm.ops.snapshot`),
and the job id alone does not say *which run* wrote them: plain torchrun's default run id is
``none`` for every job, and ``hetcomm launch --rdzv-id X`` may be given the same ``X`` again. A job
that read whatever a crashed namesake left would continue the crashed job's training from its step,
silently, ignoring its own seed. So every directory carries a record (:data:`RECORD`) of the launch
that owns it, and every snapshot header the same identity:

* the **launch nonce**: made once per ``hetcomm launch`` (random, passed to the workers in
  ``HETCOMM_LAUNCH_NONCE``) and so stable across torchrun's restarts of its workers; under plain
  torchrun, the torchrun agent's own process mark (the workers' parent lives as long as the launch,
  across its restarts); else (``hetcomm train``'s own ranks, tests) rank 0's process mark, agreed
  by the caller.
* the **owners**: process marks (``<boot id>:<pid>:<start time>``) of the processes whose life is
  the launch's (``hetcomm launch`` itself, the torchrun agent). A launch is alive while any owner
  is: same boot, and the pid's start time (``/proc/<pid>/stat``) unchanged, so a reused pid or a
  reboot never passes for the old process.

A restart of the same launch finds its own nonce and restores; a directory of a dead launch is
stale state, reclaimed with a one-line notice; one of a live other launch (two jobs given one id)
is refused by name. :func:`sweep` removes what dead launches of this user left: their snapshot
directories and ``hetcomm launch``'s default work directories (each with its record).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hetcomm import settings

__all__ = ["RECORD", "Launch", "boot_id", "process_mark", "mark_alive", "this_launch", "new_launch_env",
           "read_record", "write_record", "record_alive", "describe", "sweep", "sweep_line"]

#: The owner record in a job's snapshot directory and in a launch's work directory.
RECORD = "owner.json"
_MAX_RECORD = 64 << 10


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``); '' where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks after boot (``/proc/<pid>/stat`` field 22), None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def process_mark(pid: int) -> str:
    """``<boot id>:<pid>:<start time>``: one process of one boot, never a later one with its pid."""
    return f"{boot_id()}:{pid}:{_start_time(pid)}"


def mark_alive(mark: str) -> bool:
    """Whether the process a :func:`process_mark` names still runs (same boot, same start)."""
    try:
        boot, pid, start = mark.rsplit(":", 2)
        return boot == boot_id() and start != "None" and _start_time(int(pid)) == int(start)
    except ValueError:
        return False


@dataclass
class Launch:
    """One launch of a job on this node: its job id, nonce and owner process marks."""

    job: str
    nonce: str
    owners: List[str] = field(default_factory=list)

    def record(self) -> Dict[str, object]:
        return {"job": self.job, "launch": self.nonce, "owners": list(self.owners), "uid": os.geteuid()}


def _agent_mark() -> Optional[str]:
    """The torchrun agent's mark when this process is a torchrun worker (its parent), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return process_mark(os.getppid())


def this_launch(job: str, fallback: Optional[str] = None) -> Launch:
    """This process's launch (see the module docstring).

    Args:
        job: the job id.
        fallback: the nonce and owner to use outside ``hetcomm launch`` and torchrun: rank 0's
            :func:`process_mark`, agreed by the caller (every rank of the job gets one answer).
    """
    agent = _agent_mark()
    nonce = settings.LAUNCH_NONCE.get() or (f"torchrun-{agent}" if agent else "") or f"proc-{fallback}"
    owners = [m for m in (settings.LAUNCH_OWNER.get(), agent) if m] or ([fallback] if fallback else [])
    return Launch(job, nonce, owners)


def new_launch_env() -> Dict[str, str]:
    """What ``hetcomm launch`` puts in its workers' environment: a fresh nonce and its own mark."""
    return {settings.LAUNCH_NONCE.name: secrets.token_hex(8), settings.LAUNCH_OWNER.name: process_mark(os.getpid())}


def read_record(directory: str) -> Optional[Dict[str, object]]:
    """The owner record in ``directory`` (None: none, or unreadable: an older hetcomm's)."""
    from hetcomm.errors import UnsafePathError
    from hetcomm.ops.safe_fs import read_nofollow

    try:
        rec = json.loads(read_nofollow(os.path.join(directory, RECORD), limit=_MAX_RECORD, what="owner record"))
    except (FileNotFoundError, NotADirectoryError, UnsafePathError, ValueError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


def write_record(directory: str, launch: Launch) -> None:
    from hetcomm.ops.safe_fs import write_private

    write_private(os.path.join(directory, RECORD), json.dumps(launch.record()), fsync=False)


def record_alive(rec: Optional[Dict[str, object]]) -> bool:
    """Whether any owner the record names still runs (False for no record)."""
    owners = rec.get("owners") if rec else None
    return isinstance(owners, list) and any(isinstance(m, str) and mark_alive(m) for m in owners)


def describe(rec: Optional[Dict[str, object]]) -> str:
    """``launch <nonce> (pids 12, 34)`` for messages."""
    if not rec:
        return "an unknown launch (no owner record: an older hetcomm's)"
    owners = rec.get("owners")
    pids = [str(m).rsplit(":", 2)[1] for m in (owners if isinstance(owners, list) else []) if str(m).count(":") >= 2]
    return f"launch {rec.get('launch')} (pids {', '.join(pids) or '?'})"
def sweep(parent: str, prefix: str, keep: Optional[str] = None) -> List[str]:
    """Remove the directories ``parent/<prefix>*`` of this user whose owner record names only
    dead processes (a killed job's leftovers). Never another user's (owner checked with
    ``lstat``, no link followed), never a live launch's, never one without a record (it may be
    in the making, or an older hetcomm's: left for the operator), never ``keep``.

    Returns:
        The directories removed.
    """
    import shutil

    removed: List[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in sorted(names):
        path = os.path.join(parent, name)
        if not name.startswith(prefix) or path == keep:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            continue
        rec = read_record(path)
        if rec is None or record_alive(rec):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def sweep_line(removed: List[str]) -> str:
    """The one-line notice of a :func:`sweep` ('' when it removed nothing)."""
    if not removed:
        return ""
    return (f"hetcomm: removed {len(removed)} director{'y' if len(removed) == 1 else 'ies'} left by jobs of yours "
            f"that no longer run: {', '.join(removed)}")
