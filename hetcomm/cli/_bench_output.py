"""The ``-J/--output_file PATH`` JSON document of ``hetcomm bench``: opened before any rank starts,
written at the end, removed when the run never filled it.

One place for every benchmark (alltoall/allreduce, dispatch, compute), so that a path that cannot
be written is one ``-J/--output_file PATH: ...`` line and exit 2, never a traceback, whether the
open fails (no such directory) or the write does (a full disk, ``/dev/full``).
"""

from __future__ import annotations

import json
import os
import stat
from typing import IO, Any, Dict, Optional

from hetcomm.errors import UsageError

__all__ = ["open_output", "write_output", "discard_output"]


def _error(path: str, e: OSError) -> UsageError:
    return UsageError(
        f"-J/--output_file {path}: cannot write it ({e.strerror or e}); check that the directory exists "
        f"and is writable and the disk has room, or choose another path"
    )


def open_output(path: Optional[str]) -> Optional[IO[str]]:
    """Open ``-J PATH`` for writing before any rank starts: a path that cannot be opened fails in
    milliseconds (exit 2), not after the whole benchmark. None when ``path`` is empty."""
    if not path:
        return None
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise _error(path, e) from None


def write_output(out: IO[str], doc: Dict[str, Any]) -> None:
    """Write ``doc`` as indented JSON into ``out`` and close it.

    Raises:
        UsageError: the write or the close failed (a full disk reports only when the buffer is
            flushed); the partial file is removed first.
    """
    try:
        with out:
            json.dump(doc, out, indent=2)
            out.write("\n")
    except OSError as e:
        discard_output(out)
        raise _error(out.name, e) from None


def discard_output(out: Optional[IO[str]]) -> None:
    """Close and remove an output file the run never filled (no empty or partial JSON left).

    Only a regular file is removed: ``-J /dev/null`` or ``/dev/full`` name a device, which
    unlinking (as root) would delete for every process on the machine."""
    if out is None:
        return
    try:
        out.close()
    except OSError:
        pass  # the close flushes: on a full disk it fails again, and the file goes anyway
    try:
        if stat.S_ISREG(os.lstat(out.name).st_mode):
            os.unlink(out.name)
    except OSError:
        pass
