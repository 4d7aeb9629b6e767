"""The files of a checkpoint directory: where a save stages, how it commits, what a load trusts.

Layout of ``--checkpoint-dir DIR`` (every directory ``0700``, every file ``0600``)::

    DIR/latest                   the name of the step directory to resume from ("step-00000008")
    DIR/step-00000008/           one committed checkpoint: DCP's .metadata + *.distcp shards,
        hetcomm-checksums.json   and the size and SHA-256 of each of them
    DIR/.partial-step-00000012/  a save in progress (or killed): never loaded, removed by the next save
    (the newest ``keep`` committed step directories stay; older ones are deleted once a newer
    one is committed: :func:`prune`)
    DIR/verdict.json             the finished run's verdict (hetcomm train), for a resume with
                                 nothing left to train

**Commit.** A save writes into ``.partial-step-<N>`` (made fresh by rank 0), rank 0 then writes the
checksums, renames the directory to a name nothing has (``step-<N>``, or ``step-<N>.1`` ... when a
directory of that step exists already, e.g. the one ``latest`` names from an earlier job) and only
then points ``latest`` at it (a new file renamed over it). A kill at any point leaves ``latest``
naming a complete checkpoint whose files nobody touched.

**Load.** ``DIR``, the step directory and ``latest`` must not be symbolic links, must be owned by
the caller and not writable by group or others (as ``hetcomm emulate`` checks its state
directory); ``latest`` must name a ``step-<N>`` directory; every file the checksums list must be a
regular file of the recorded size and SHA-256 *before* DCP opens any of them, because DCP's
``.metadata`` is a pickle: loading a checkpoint runs whatever its writer put there (SECURITY.md).
The checksums catch damage (a torn copy, a disk error, overwritten bytes), not a hostile writer:
whoever can write the directory can write the checksums too, which is why the directory must be
the caller's alone.

Why by hand: DCP's ``FileSystemWriter`` writes in place and has no integrity check of its own.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from typing import Dict, Optional

from hetcomm.errors import CheckpointError, ConfigError, UnsafePathError
from hetcomm.ops.safe_fs import (
    FILE_MODE, check_private_dir, private_dir, read_nofollow, remove_tree, write_private,
)

__all__ = [
    "CHECKSUMS", "LATEST", "VERDICT", "prepare_root", "staging_dir", "begin_staging", "commit",
    "latest_checkpoint", "verify_checkpoint", "step_dir_name", "prune",
]

LATEST = "latest"
CHECKSUMS = "hetcomm-checksums.json"
VERDICT = "verdict.json"
_STEP_RE = re.compile(r"step-\d{8}(\.\d+)?")
_PARTIAL = ".partial-"
_FIX = "use a checkpoint directory only you can write (mode 0700), e.g. a fresh one under your home"
_MAX_SMALL = 1 << 20  # latest, the checksums file, the verdict


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def prepare_root(root: str) -> str:
    """``root`` created ``0700`` or checked private (every rank calls it; concurrent is fine)."""
    return private_dir(root, what="the checkpoint directory", fix=_FIX)


def staging_dir(root: str, step: int) -> str:
    return os.path.join(root, _PARTIAL + step_dir_name(step))


def begin_staging(root: str, step: int) -> str:
    """Rank 0: remove what killed saves left, make the fresh ``0700`` staging directory."""
    for name in os.listdir(root):
        if name.startswith(_PARTIAL):
            path = os.path.join(root, name)
            if os.path.islink(path):
                os.unlink(path)
            else:
                remove_tree(path)
    path = staging_dir(root, step)
    os.mkdir(path, 0o700)
    return path


def _digest(path: str) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def commit(root: str, staging: str, step: int, keep: int = 0) -> str:
    """Rank 0, after every rank's shards are on disk: checksums, modes, rename, ``latest``,
    then (``keep`` > 0) :func:`prune` to the ``keep`` newest committed checkpoints.

    Returns:
        The committed step directory.
    """
    files: Dict[str, Dict[str, object]] = {}
    for name in sorted(os.listdir(staging)):
        path = os.path.join(staging, name)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError("DCP left something that is not a regular file in the checkpoint", path=path,
                                  reason="not-a-file")
        os.chmod(path, FILE_MODE)
        files[name] = {"bytes": st.st_size, "sha256": _digest(path)}
    write_private(os.path.join(staging, CHECKSUMS), json.dumps({"step": step, "files": files}, indent=1))
    base = step_dir_name(step)
    name, n = base, 0
    while os.path.lexists(os.path.join(root, name)):  # never replace or enter an existing one
        n += 1
        name = f"{base}.{n}"
    final = os.path.join(root, name)
    os.rename(staging, final)
    write_private(os.path.join(root, LATEST), name + "\n")
    if keep > 0:
        prune(root, keep, final)
    return final


def prune(root: str, keep: int, newest: str) -> list:
    """Delete the committed checkpoints of ``root`` older than the ``keep`` newest (``newest``,
    the one just committed and named by ``latest``, always among them).

    Called only after ``newest`` is complete (checksums written, renamed, ``latest`` moved), so
    a kill at any point leaves at least one complete checkpoint. "Older" is commit order (the
    checksums file's time), not the step number: after a resume from an earlier step, the
    abandoned later steps of the run before go first. Only this user's real step directories
    with a checksums file are candidates (a link, someone else's directory or an uncommitted
    one is never touched).

    Returns:
        The directories deleted.
    """
    from hetcomm.ops.safe_fs import remove_own_tree

    done = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not _STEP_RE.fullmatch(name) or path == newest:
            continue
        try:
            st = os.lstat(path)
            sums = os.lstat(os.path.join(path, CHECKSUMS))
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_ISREG(sums.st_mode):
            done.append((sums.st_mtime_ns, name, path))
    gone = []
    for _, _, path in sorted(done)[:max(0, len(done) - (keep - 1))]:
        if remove_own_tree(path):
            gone.append(path)
    return gone


def latest_checkpoint(root: str) -> Optional[str]:
    """The step directory ``root/latest`` names, or None when there is no checkpoint yet.

    Raises:
        UnsafePathError: ``root``, ``latest`` or the step directory is a link, someone else's,
            or writable by group or others.
        CheckpointError: ``latest`` does not name a step directory.
        ConfigError: the directory it names is missing.
    """
    if not os.path.lexists(root):
        return None
    check_private_dir(root, what="the checkpoint directory", fix=_FIX)
    latest = os.path.join(root, LATEST)
    try:
        raw = read_nofollow(latest, limit=256, what="'latest' file")
    except FileNotFoundError:
        return None
    name = raw.decode("utf-8", "replace").strip()
    if not _STEP_RE.fullmatch(name):
        raise CheckpointError(
            f"names {name[:40]!r}, not a step directory (step-NNNNNNNN); delete it to start fresh or "
            f"write the name of the step directory to resume from",
            path=latest, reason="metadata",
        )
    path = os.path.join(root, name)
    if not os.path.lexists(path):
        raise ConfigError(
            f"'latest' names {name!r} but that directory is missing; point --checkpoint-dir at the "
            f"job's directory or delete 'latest' to start fresh",
            path=latest,
        )
    check_private_dir(path, what="the checkpoint's step directory", fix=_FIX)
    return path


def verify_checkpoint(path: str) -> None:
    """Check every file of a committed checkpoint against its recorded size and SHA-256.

    Raises:
        CheckpointError: no or unreadable checksums, a file missing, not a regular file, of
            another size or with other bytes — naming the file and the fix.
    """
    listing = os.path.join(path, CHECKSUMS)
    fix = "resume from an earlier step (write its directory's name to 'latest') or start fresh"
    try:
        doc = json.loads(read_nofollow(listing, limit=_MAX_SMALL, what="checksums file"))
        files = doc["files"]
        if not isinstance(files, dict):
            raise TypeError
    except FileNotFoundError:
        raise CheckpointError(
            f"has no {CHECKSUMS}: not a checkpoint committed by hetcomm (or written before checksums); {fix}",
            path=path, reason="checksum",
        ) from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"is not a valid checksums file; {fix}", path=listing, reason="checksum") from None
    if ".metadata" not in files:
        raise CheckpointError(f"lists no .metadata; {fix}", path=listing, reason="checksum")
    for name, want in sorted(files.items()):
        if not isinstance(want, dict) or os.sep in name or name in ("", ".", ".."):
            raise CheckpointError(f"has a bad entry {name[:40]!r}; {fix}", path=listing, reason="checksum")
        file = os.path.join(path, name)
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            raise CheckpointError(f"is missing (the checkpoint lists it); {fix}", path=file, reason="shard") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"is not a regular file (a link?); {fix}", path=file, reason="shard")
        if st.st_size != want.get("bytes"):
            raise CheckpointError(
                f"is {st.st_size} bytes, the checkpoint recorded {want.get('bytes')} (truncated or replaced); {fix}",
                path=file, reason="shard",
            )
        try:
            digest = _digest(file)
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
            raise CheckpointError(f"cannot be read ({why}); {fix}", path=file, reason="shard") from None
        if digest != want.get("sha256"):
            raise CheckpointError(
                f"does not match its recorded SHA-256 (its bytes changed after the save); {fix}",
                path=file, reason="checksum",
            )


def write_verdict(root: str, record: Dict[str, object]) -> None:
    """Rank 0 at the end of a run: the verdict a resume with nothing left to train reports."""
    write_private(os.path.join(root, VERDICT), json.dumps(record))


def read_verdict(root: str) -> Optional[Dict[str, object]]:
    try:
        rec = json.loads(read_nofollow(os.path.join(root, VERDICT), limit=_MAX_SMALL, what="verdict file"))
    except (FileNotFoundError, ValueError, UnicodeDecodeError, UnsafePathError):
        return None
    return rec if isinstance(rec, dict) else None
