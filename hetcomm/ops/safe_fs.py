"""Files and directories a (possibly root) hetcomm command writes: private, never through a link.

Every directory hetcomm writes its own files into (``hetcomm launch``'s work directory, a
checkpoint directory and its step directories) is checked by :func:`check_private_dir` or made
by :func:`private_dir`: a real directory (not a symbolic link), owned by the caller, not
writable by group or others. Every file written there goes through :func:`write_private`: the
bytes go to a fresh name opened ``O_CREAT | O_EXCL | O_NOFOLLOW`` (so nothing planted at that
name is followed or reused), mode ``0600``, flushed, then renamed over the target (a rename
replaces a planted link, it never writes through it). Both are relative to a directory file
descriptor opened ``O_NOFOLLOW | O_DIRECTORY``, so the checked directory is the one written.

Why by hand: Python's ``tempfile`` makes private *new* names but cannot check a directory that
already exists (a multi-node job's agreed work directory, a checkpoint directory of an earlier
run), and ``open(path, "w")`` follows links and reuses what is there. SECURITY.md lists every
path a command writes with the check that protects it.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import tempfile
from typing import Optional, Union

from hetcomm.errors import UnsafePathError

__all__ = [
    "UnsafePathError",
    "FILE_MODE",
    "NO_SPACE",
    "DIR_MODE",
    "check_private_dir",
    "private_dir",
    "private_temp_dir",
    "write_private",
    "read_nofollow",
    "remove_tree",
    "remove_own_tree",
    "open_append_private",
    "launch_work_dir",
]

#: Mode of every file hetcomm writes into its own directories (health reports, checkpoints).
FILE_MODE = 0o600
#: Mode of every directory hetcomm creates for itself.
DIR_MODE = 0o700
#: errnos of a full file system or an exhausted quota.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _who(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _refuse_stat(path: str, st: os.stat_result, what: str, fix: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} is a symbolic link; refusing to follow it; {fix}", path=path, reason="symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} is not a directory; {fix}", path=path, reason="not-a-directory")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{what} is owned by {_who(st.st_uid)}, not by you ({_who(os.geteuid())}): whoever owns it "
            f"decides what is in it; {fix}",
            path=path, reason="owner",
        )
    if st.st_mode & 0o022:
        raise UnsafePathError(
            f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): anyone could "
            f"plant files or links in it; run 'chmod go-w {path}' or {fix}",
            path=path, reason="mode",
        )


def check_private_dir(path: str, *, what: str = "directory", fix: str = "use a directory only you can write") -> None:
    """Refuse ``path`` unless it is a directory (not a link) of the caller, not group/other-writable.

    Raises:
        UnsafePathError: it is missing, a link, not a directory, someone else's, or writable by
            group or others; the message names the path, the owner or mode, and the fix.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafePathError(f"{what} does not exist", path=path, reason="missing") from None
    _refuse_stat(path, st, what, fix)


def private_dir(path: str, *, what: str = "directory", fix: str = "use a directory only you can write") -> str:
    """``path`` as a private directory: created ``0700`` (parents too) if missing, else checked.

    Returns:
        ``path``.

    Raises:
        UnsafePathError: see :func:`check_private_dir`, or it cannot be created.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        try:
            os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        except OSError as e:
            raise UnsafePathError(f"cannot create {what}'s parent: {e.strerror}; {fix}", path=parent, reason="create") from None
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as e:
        raise UnsafePathError(f"cannot create {what}: {e.strerror}; {fix}", path=path, reason="create") from None
    check_private_dir(path, what=what, fix=fix)
    return path


def private_temp_dir(parent: str, prefix: str) -> str:
    """A fresh ``0700`` directory ``parent/<prefix>XXXXXXXX`` (``parent`` must be private)."""
    check_private_dir(parent)
    for _ in range(100):
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            continue
        return path
    raise UnsafePathError("no free temporary name after 100 tries", path=parent, reason="create")  # pragma: no cover


def _open_dir(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        why = "it is a symbolic link" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
        raise UnsafePathError(f"cannot open the directory: {why}", path=path, reason="open") from None


def write_private(path: str, data: Union[bytes, str], *, mode: int = FILE_MODE, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically without following links (see the module docstring).

    The directory of ``path`` must exist and not be a link; a link or file already at ``path``
    is replaced, never written through.

    Raises:
        UnsafePathError: the directory is a link or missing, or the write fails.
        OSError: with an errno of :data:`NO_SPACE`: the file system is full (nothing is left
            behind).
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory, name = os.path.split(os.path.abspath(path))
    dfd = _open_dir(directory)
    try:
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno in NO_SPACE:
                raise  # a full file system, not an unsafe path: the caller may skip the write
            raise UnsafePathError(f"cannot create a file in the directory: {e.strerror}", path=path, reason="create") from None
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits away; never adds any
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dfd)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def read_nofollow(path: str, *, limit: int, what: str = "file") -> bytes:
    """The bytes of a regular file at ``path``, not following a link at its last component,
    at most ``limit`` of them.

    Raises:
        UnsafePathError: a link, not a regular file (a FIFO, a device), unreadable, or larger
            than ``limit``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise UnsafePathError(f"cannot read the {what}: {why}", path=path, reason="open") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"the {what} is not a regular file", path=path, reason="not-a-file")
        if st.st_size > limit:
            raise UnsafePathError(f"the {what} is {st.st_size} bytes, more than the {limit} expected", path=path,
                                  reason="size")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafePathError(f"the {what} is more than the {limit} bytes expected", path=path, reason="size")
    return data


def remove_tree(path: Optional[str]) -> None:
    """Remove a directory hetcomm made, without following links in it (``shutil.rmtree``
    unlinks a link, it does not descend into it)."""
    if path and os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)


def remove_own_tree(path: str) -> bool:
    """Remove ``path`` only if it is a real directory owned by the caller (not a link, not
    another user's): a root job must never delete what another user made under a name it
    expected to be its own (``/dev/shm`` and ``$TMPDIR`` are writable by everyone).

    Returns:
        True when it was removed; False when it is missing, a link, not a directory or
        someone else's (left as it is).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def open_append_private(path: str, *, what: str = "file") -> "io.TextIOWrapper":
    """``path`` opened for appending text, created ``0600`` if missing, never through a link.

    A symbolic link at ``path`` is refused (``O_NOFOLLOW``), not followed: a link another user
    planted at a name a (root) job appends to would otherwise make it write wherever the link
    points. What is opened must be a regular file of the caller with one link (a hard link to
    someone's file would pass every other check).

    Raises:
        UnsafePathError: a link, not a regular file, someone else's, several hard links, or
            it cannot be opened; the message names the path, the owner and the fix.
    """
    import io

    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            try:
                owner = _who(os.lstat(path).st_uid)
            except OSError:
                owner = "unknown owner"
            raise UnsafePathError(
                f"the {what} is a symbolic link (owned by {owner}); hetcomm never writes through a link: "
                f"remove it or pass the real file's path", path=path, reason="symlink") from None
        if e.errno == errno.ENXIO:  # a FIFO nobody reads (O_NONBLOCK): never block on it
            raise UnsafePathError(f"the {what} is not a regular file; pass a file path", path=path,
                                  reason="not-a-file") from None
        raise UnsafePathError(f"cannot open the {what}: {e.strerror}", path=path, reason="open") from None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = ("not-a-file", f"the {what} is not a regular file; pass a file path")
    elif st.st_uid != os.geteuid():
        why = ("owner", f"the {what} is owned by {_who(st.st_uid)}, not by you ({_who(os.geteuid())}); "
                        "pass a file of your own")
    elif st.st_nlink != 1:
        why = ("owner", f"the {what} has {st.st_nlink} hard links (another name for someone's file?); "
                        "pass a file with one name")
    if why is not None:
        os.close(fd)
        raise UnsafePathError(why[1], path=path, reason=why[0])
    os.set_blocking(fd, True)
    return io.open(fd, "a", encoding="utf-8")


def launch_work_dir(work_dir: Optional[str], rdzv_id: str) -> str:
    """``hetcomm launch``'s directory for its health report, verdict and job files.

    ``work_dir`` (``--work-dir``, kept after the launch): created ``0700`` or checked private.
    Otherwise a fresh ``0700`` directory ``$TMPDIR/hetcomm-launch-<uid>/<rdzv-id>-XXXXXXXX`` under a
    checked private ``$TMPDIR/hetcomm-launch-<uid>`` (the caller removes it at the end): a name
    someone else made first, or a link planted there, is refused instead of reused.

    Raises:
        UnsafePathError: the directory (or the per-user parent) is not private to the caller.
    """
    if work_dir is not None:
        return private_dir(os.path.abspath(work_dir), what="--work-dir", fix="pass a --work-dir only you can write")
    base = private_dir(
        os.path.join(tempfile.gettempdir(), f"hetcomm-launch-{os.getuid()}"), what="the launch directory",
        fix="remove it (someone else may have made it) or pass --work-dir DIR",
    )
    return private_temp_dir(base, f"{rdzv_id}-")
