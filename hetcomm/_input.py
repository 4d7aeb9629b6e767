"""Reading user-supplied files with a bound: every byte hetcomm reads from a path is counted.

Every input file (cluster YAML, ``--cost`` JSON, captured tool output) goes through
:func:`read_bounded`: a file larger than its cap is refused *before* it is read (for regular
files, from ``fstat``) or as soon as the cap is passed (pipes and standard input), so
``hetcomm topo -i /dev/zero`` ends at once with a clear error instead of reading until the kernel's
OOM killer stops it. Files that can never end (character and block devices such as
``/dev/zero``, sockets) are refused outright; FIFOs (``-i <(nvidia-smi topo -m)``) and standard
input are read up to the cap, unless the caller refuses FIFOs too (a job's record files, which
are always regular files: ``refuse_fifo=True``). :func:`decode_text` turns the bytes into text: UTF-8 (with or
without BOM) or UTF-16 with a BOM; anything else is an error naming the line of the first bad
byte. Python's ``open(...).read()`` offers neither bound nor file-type check, hence this module.

The caps are documented in ``docs/INPUT_FORMATS.md``.
"""

from __future__ import annotations

import os
import select
import stat
import sys
from typing import BinaryIO, Callable, Optional

from hetcomm.errors import HetcommError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CAPTURE_BYTES",
    "CAPTURE_CAP_ENV",
    "capture_cap",
    "read_bounded",
    "decode_text",
]

#: Cluster YAML and cost JSON: the largest shipped cluster file is ~2 KB; 1 MiB leaves room for
#: a generated file with thousands of node groups while keeping the pure-Python YAML parser
#: (about 1 s per MiB here) quick.
MAX_CONFIG_BYTES = 1 << 20
#: One captured tool output (after gzip decompression). Real captures are KBs (``topo -m``,
#: ``ibstat``) up to a few MB (an NCCL_DEBUG=INFO log of one job); 16 MiB parses in ~6 s and
#: ~200 MB here. Raise it with ``$HETCOMM_MAX_INPUT_BYTES`` (e.g. ``64M``) for a bigger log.
MAX_CAPTURE_BYTES = 16 << 20
CAPTURE_CAP_ENV = "HETCOMM_MAX_INPUT_BYTES"

ErrorFactory = Callable[..., HetcommError]


def capture_cap() -> int:
    """The cap on one captured tool output: ``$HETCOMM_MAX_INPUT_BYTES`` or 16 MiB.

    Raises:
        UsageError: the variable is set to something that is not a size.
    """
    from hetcomm import settings

    return settings.MAX_INPUT_BYTES.get()


def _too_big(limit: int, what: str, hint: str) -> str:
    from hetcomm.units import format_bytes

    return f"{what} is larger than the {format_bytes(limit)} hetcomm reads{hint}"


def read_bounded(
    path: str,
    *,
    limit: int,
    error: ErrorFactory,
    what: str = "file",
    hint: str = "",
    stdin: Optional[BinaryIO] = None,
    refuse_fifo: bool = False,
) -> bytes:
    """The bytes of ``path`` (``-`` = standard input), at most ``limit`` of them.

    Args:
        path: the file; ``-`` reads ``stdin`` (default ``sys.stdin.buffer``).
        limit: the most bytes accepted; one more is an error.
        error: builds the exception, called as ``error(message, path=path)``
            (:class:`ConfigError` for config files, :class:`TopologyParseError` for captures).
        what: what the file is, for messages ("cluster file", "capture").
        hint: appended to the too-large message (how to get under the cap).
        stdin: the stream ``-`` reads (tests).
        refuse_fifo: a FIFO is an error at once instead of being waited on for a writer
            (files that are only ever written as regular files: metrics, logs).

    Raises:
        whatever ``error`` builds: the file is missing, unreadable, a directory, a device or
        socket (which may never end), a FIFO when ``refuse_fifo``, or larger than ``limit``.
    """
    if path == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        return _read_stream(stream, limit, error, "<stdin>", what, hint)
    try:
        # O_NONBLOCK: opening a FIFO with no writer must not hang; cleared again below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise error("is a directory, expected a file", path=path) from None
    except OSError as e:
        raise error(f"cannot read file: {e.strerror or e}; check the path and permissions", path=path) from None
    try:
        st = os.fstat(fd)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            raise error("is a directory, expected a file", path=path)
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
            kind = "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket"
            raise error(
                f"is {kind}, not a regular file: it may never end; save the {what} to a file "
                f"first (or pipe it through '-')",
                path=path,
            )
        if refuse_fifo and stat.S_ISFIFO(mode):
            raise error(f"is a FIFO, not a regular file; give the {what} itself (save it to a file first)",
                        path=path)
        if stat.S_ISREG(mode) and st.st_size > limit:
            raise error(_too_big(limit, f"{what} ({st.st_size} bytes)", hint), path=path)
        if stat.S_ISFIFO(mode):
            _wait_for_writer(fd, path, what, error)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            return _read_stream(f, limit, error, path, what, hint)
    finally:
        if fd >= 0:
            os.close(fd)


#: How long a named FIFO may go without a writer (``mkfifo f; hetcomm topo -i f`` alone).
FIFO_WAIT_S = 60.0


def _wait_for_writer(fd: int, path: str, what: str, error: ErrorFactory) -> None:
    """Wait until a FIFO opened without blocking has data or a writer that closed it.

    A FIFO that no writer has opened yet reads as empty at once; ``cat`` would block in
    ``open`` instead, without a timeout. This waits like ``cat``, but at most FIFO_WAIT_S.
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    if not poller.poll(int(FIFO_WAIT_S * 1000)):
        raise error(
            f"is a FIFO that nothing wrote to within {FIFO_WAIT_S:.0f} s; start the tool that "
            f"writes the {what} first, or save it to a file",
            path=path,
        )


def _read_stream(stream: BinaryIO, limit: int, error: ErrorFactory, path: str, what: str, hint: str) -> bytes:
    # Read one byte past the cap: a file of exactly `limit` bytes is fine, one more is not.
    try:
        data = stream.read(limit + 1)
    except OSError as e:
        raise error(f"cannot read {what}: {e.strerror or e}", path=path) from None
    if data is None:  # a non-blocking stream with nothing to read yet
        data = b""
    if len(data) > limit:
        raise error(_too_big(limit, what, hint), path=path)
    return data


def decode_text(data: bytes, path: str, error: ErrorFactory, *, convert_hint: str = "") -> str:
    """``data`` as text: UTF-8 (a BOM is dropped) or UTF-16 with a BOM (PowerShell's ``>``).

    Raises:
        whatever ``error`` builds (called as ``error(message, path=path, line=line)``): invalid
        UTF-16, a NUL byte (a binary file), or bytes that are not UTF-8; the line of the first
        bad byte is named.
    """
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise error(f"invalid UTF-16 text ({e.reason} at byte {e.start})", path=path, line=None) from None
    nul = data.find(b"\x00")
    if nul >= 0:
        # ASCII text saved as UTF-16 without a byte-order mark: every other byte is NUL.
        utf16 = data[1::2].count(0) + data[0::2].count(0) >= len(data) // 2 > 0
        looks = "; it looks like UTF-16 without a byte-order mark: save it as UTF-8" if utf16 else ""
        raise error(
            f"binary file (NUL byte at offset {nul}): expected text{looks}",
            path=path,
            line=data[:nul].count(b"\n") + 1,
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        hint = convert_hint or "convert it first, e.g. 'iconv -f GBK -t UTF-8 in > out'"
        raise error(
            f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); {hint}",
            path=path,
            line=data[: e.start].count(b"\n") + 1,
        ) from None
