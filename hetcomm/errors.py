"""The exceptions hetcomm raises for things a user can get wrong.

Every user-facing error derives from :class:`HetcommError` and from the builtin a caller would
naturally catch (``ValueError`` for bad input, ``RuntimeError`` for a failed collective), so
``except ValueError`` keeps working for code that does not know hetcomm. ``assert`` is kept for
hetcomm's own invariants only.

Messages follow one template: *what* went wrong, *where* (file and line, rank and peer, key),
and *how to fix it*.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "HetcommError",
    "ConfigError",
    "SettingError",
    "TopologyParseError",
    "TruncatedCaptureError",
    "CollectiveError",
    "PeerTimeout",
    "GroupStoppedWaiting",
    "UsageError",
    "CrossRankMismatch",
    "RecvCapacityError",
    "UnsafePathError",
    "CheckpointError",
]


class HetcommError(Exception):
    """Base class of every error hetcomm raises on purpose."""


class UsageError(HetcommError, ValueError):
    """A command line or API call that cannot be carried out as given (CLI exit code 2)."""


class CrossRankMismatch(UsageError):
    """Ranks called one collective with arguments that do not fit together (split sizes, dtype,
    shape, reduce op, root, or a different collective altogether); raised on every rank of the
    group before any byte moves, and the group stays usable.

    Args:
        message: every rank at odds, with both values, and how to fix the callers.
        op: the collective, e.g. ``all_reduce``.
        rank: the rank that raised.
        ranks: the ranks at odds with the others.
        field: the kind of mismatch: ``order``, ``arguments``, ``dtype``, ``shape``, ``count``,
            ``reduce_op``, ``root`` or ``splits``.
    """

    def __init__(self, message: str, *, op: str, rank: int, ranks: "list[int]", field: str) -> None:
        self.op = op
        self.rank = rank
        self.ranks = list(ranks)
        self.field = field
        super().__init__(message)


class RecvCapacityError(UsageError):
    """A token exchange would deliver more rows to some rank than that rank has room for
    (``hetcomm.TokenSwitch``'s ``max_recv_tokens_per_rank``, or a dispatch's ``max_recv_tokens`` /
    ``out=`` buffers). Raised on every rank of the group, from the exchanged counts, before any
    row moves; the group stays usable.

    Args:
        message: every rank over its room, with its rows and its room, and the fix.
        rank: the rank that raised.
        ranks: the ranks that would overflow.
        needed: rows each of ``ranks`` would receive.
        room: the room each of ``ranks`` has.
    """

    def __init__(self, message: str, *, rank: int, ranks: "list[int]", needed: "list[int]", room: "list[int]") -> None:
        self.rank = rank
        self.ranks = list(ranks)
        self.needed = list(needed)
        self.room = list(room)
        super().__init__(message)


class ConfigError(HetcommError, ValueError):
    """A configuration value (cluster YAML, config dataclass) is missing, unknown or invalid.

    Args:
        message: what is wrong and how to fix it.
        key: dotted key of the offending value, e.g. ``nodes[2].nics[0].gbps``.
        path: file the value came from, when it came from a file.
        line: 1-based line of the value in ``path``.

    Attributes:
        detail: ``message`` alone, without the ``file:line, key`` prefix.
    """

    def __init__(
        self,
        message: str,
        *,
        key: Optional[str] = None,
        path: Optional[str] = None,
        line: Optional[int] = None,
    ) -> None:
        self.detail = message
        self.key = key
        self.path = path
        self.line = line
        where = []
        if path is not None:
            where.append(f"{path}:{line}" if line is not None else str(path))
        if key is not None:
            where.append(f"key '{key}'")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)


class SettingError(ConfigError):
    """A ``HETCOMM_*`` environment variable whose value cannot be read (see :mod:`hetcomm.settings`).

    Args:
        name: the variable, e.g. ``HETCOMM_CHECK``.
        value: the value as set in the environment.
        allowed: the values or forms the variable accepts, in words.

    ``key`` (of :class:`ConfigError`) is the variable's name too, so code that already decides
    by ``ConfigError.key`` keeps working.
    """

    def __init__(self, name: str, value: str, allowed: str, *, reason: str = "") -> None:
        self.name = name
        self.value = value
        self.allowed = allowed
        why = f" ({reason})" if reason else ""
        message = f"{name}={value!r} is not valid{why}; allowed: {allowed}; fix or unset the variable"
        super().__init__(message, key=name)
        self.args = (message,)  # the message already names the variable: no "key '...'" prefix


class TopologyParseError(HetcommError, ValueError):
    """Captured tool output that cannot be parsed (empty, truncated, unknown format).

    Args:
        message: what is wrong and how to fix it.
        path: the file being parsed (``<stdin>``/``<text>`` when not from a file).
        line: 1-based line number in that file, when one line is to blame.
    """

    def __init__(self, message: str, *, path: Optional[str] = None, line: Optional[int] = None):
        self.path = path
        self.line = line
        where = path or "<text>"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {message}")


class TruncatedCaptureError(TopologyParseError):
    """Captured tool output that ends in the middle of a record (``head``, a full disk, a closed
    terminal). Never downgraded to a warning, even when other tools' output in the same file
    parses: a cut-off record would otherwise read as missing hardware (a GPU with 3 of its 12
    NVLinks) that is not missing at all."""


class CollectiveError(HetcommError, RuntimeError):
    """A collective failed on this rank: a peer died, a rail broke, or ranks disagreed.

    Args:
        message: what happened and what to check.
        op: the collective, e.g. ``all_to_all_single``.
        rank: this process's rank in the group.
        peer: the peer rank at fault, when one is known.
        rail: the rail (``shm``, ``gloo``, ``nccl``, ``hccl``, ``bridge``) carrying that peer.
        diagnosed: True once fault diagnosis has named the rank at fault (the error is final).

    Attributes:
        detail: ``message`` alone, without the ``op, rank, peer, rail`` prefix (for code that
            re-raises the error with other fields: never parse ``str(error)``).
    """

    def __init__(
        self,
        message: str,
        *,
        op: Optional[str] = None,
        rank: Optional[int] = None,
        peer: Optional[int] = None,
        rail: Optional[str] = None,
        diagnosed: bool = False,
    ) -> None:
        self.detail = message
        self.op = op
        self.rank = rank
        self.peer = peer
        self.rail = rail
        self.diagnosed = diagnosed
        parts = []
        if op is not None:
            parts.append(op)
        if rank is not None:
            parts.append(f"rank {rank}")
        if peer is not None:
            parts.append(f"peer {peer}")
        if rail is not None:
            parts.append(f"rail {rail}")
        prefix = ("hetcomm " + ", ".join(parts) + ": ") if parts else "hetcomm: "
        super().__init__(prefix + message)


class PeerTimeout(CollectiveError):
    """A peer did not answer within the group timeout."""


class UnsafePathError(UsageError):
    """A path hetcomm would write or trust is not safe: a symbolic link, someone else's, or
    writable by group or others (``hetcomm.ops.safe_fs``; SECURITY.md lists every such path).

    Args:
        message: what is wrong with the path and how to fix it.
        path: the path refused.
        reason: ``symlink``, ``not-a-directory``, ``not-a-file``, ``owner``, ``mode``,
            ``missing``, ``size``, ``open`` or ``create``.
    """

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        self.detail = message
        super().__init__(f"{path}: {message}")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded into this job: damaged (bad metadata, a missing,
    truncated or altered shard), saved by another model or with other optional state, or a
    checkpoint directory that is not safe to load from. One line naming the file and the fix.

    Args:
        message: what is wrong and how to fix it.
        path: the file (or directory) at fault.
        key: the state key at fault, when one is.
        reason: ``metadata``, ``shard``, ``checksum``, ``mismatch``, ``missing-state`` or ``unsafe``.
    """

    def __init__(self, message: str, *, path: str, key: Optional[str] = None, reason: str) -> None:
        self.reason = reason
        super().__init__(message, path=path, key=key)


class GroupStoppedWaiting(CollectiveError):
    """This rank came late: a peer (``peer``) timed out waiting for it in an earlier or the same
    collective and left the group, so this rank's collective failed when it finally arrived."""
