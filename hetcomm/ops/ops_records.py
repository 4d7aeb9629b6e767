"""The job's health records: JSON lines the training job and ``hetcomm launch`` leave for ``hetcomm doctor``.

One object per line, told apart by ``kind``:

* ``health`` — a rank slower than its class (:func:`hetcomm.ops.health_class.records`): written
  by the launch health check (``step`` null) and by the in-training probe (:mod:`.probe`,
  ``step`` = the window's last step, ``source: probe``);
* ``probe`` — one in-training probe window (:mod:`.probe`): every rank's factor against its
  class baseline, so a record shows the probe ran and what it saw even when nobody was slow;
* ``membership`` — a change of the job's ranks at a resume (:mod:`.membership`): who left or
  joined, the cause, the cost (steps redone, seconds down) and the experts present.

Where (:func:`record_paths`): beside the metrics file (``m.jsonl`` -> ``m.health.jsonl``) when the
job writes metrics, and ``health-records.jsonl`` in the launch directory under ``hetcomm launch``
(the file the launch health check starts). Lines are appended (``O_APPEND``, one ``write`` per
line, mode 0600, never through a link), so ranks' threads and restarts add to one file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional

from hetcomm import settings

__all__ = ["HEALTH_RECORDS", "KINDS", "sibling_path", "record_paths", "append_records", "read_records"]

#: The launch directory's file (``hetcomm launch`` writes the launch health check's findings there).
HEALTH_RECORDS = "health-records.jsonl"
#: The kinds of line a health record holds.
KINDS = ("health", "probe", "membership")
_MAX_BYTES = 64 << 20


def sibling_path(metrics_path: str) -> str:
    """The health records beside a metrics file: ``run/m.jsonl`` -> ``run/m.health.jsonl``."""
    root, _ = os.path.splitext(metrics_path)
    return root + ".health.jsonl"


def record_paths(metrics_path: Optional[str]) -> List[str]:
    """Where this job's records go: beside ``metrics_path`` (if any) and in the launch directory
    (``$HETCOMM_LAUNCH_DIR``, set by ``hetcomm launch``); [] when neither exists."""
    out = []
    if metrics_path:
        out.append(sibling_path(metrics_path))
    launch = settings.LAUNCH_DIR.get()
    if launch and os.path.isdir(launch):
        out.append(os.path.join(launch, HEALTH_RECORDS))
    return out


def append_records(paths: Iterable[str], records: Iterable[Dict[str, Any]]) -> None:
    """Append ``records`` (JSON-ready dicts with a ``kind``) to every file of ``paths``.

    A file that cannot be opened (a link, a missing directory) is skipped: the records are
    advisory and must never fail the job.
    """
    lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode("utf-8")
    if not lines:
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            continue
        try:
            os.write(fd, lines)
        except OSError:
            pass
        finally:
            os.close(fd)


def read_records(path: str) -> List[Dict[str, Any]]:
    """The records of a health-records file, in file order (a torn last line is skipped).

    Raises:
        ConfigError: unreadable, or a line that is not a JSON object of a known kind (naming
            the file and line).
    """
    from hetcomm.errors import ConfigError
    from hetcomm.ops.record_input import read_record_text

    lines = read_record_text(path, "health records").splitlines()
    out: List[Dict[str, Any]] = []
    for no, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError, ValueError):
            if no == len(lines):
                continue  # a job killed mid-write
            raise ConfigError("not a JSON object", path=path, line=no) from None
        if not isinstance(obj, dict) or obj.get("kind") not in KINDS:
            raise ConfigError(f"expected an object with kind {', '.join(KINDS)}", path=path, line=no, key="kind")
        out.append(obj)
    return out


def is_health_records(first_line: str) -> bool:
    """Whether a file whose first line is ``first_line`` is a health-records file."""
    try:
        obj = json.loads(first_line)
    except (json.JSONDecodeError, RecursionError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get("kind") in KINDS
