"""The state file: what an emulation made, written down *before* it is made, and trusted only
as far as it can be checked.

One JSON file per emulation, ``<state_dir>/hc<id>.json``, plus a directory ``<state_dir>/hc<id>/``
for rank logs. Every namespace, shared-memory directory and cgroup is listed in the file before
the first ``ip netns add``, and every rank process id before ``down`` could need it, so ``hetcomm
emulate down`` can remove everything even when the process that built it was killed.

``down`` runs as root and deletes what the file names, so the file is an attack surface.
Three layers keep it from being one:

- the state directory must be private: a real directory (not a symbolic link) owned by the
  caller, not writable by group or others, under ancestors that only root or the caller can
  change (:func:`secure_state_dir`);
- the state file must be a regular file owned by the caller and not writable by others, read
  without following links (:func:`load_state`);
- every name in it must be one this run's own records produce, and the run must not be indexed
  to another state directory: ``hc<id>-<node>`` namespaces of
  the nodes it lists, ``/dev/shm/hc<id>-<node>``, ``<cpu cgroup root>/hc<id>-<node>-r<rank>``
  (:func:`validate_state`). Anything else refuses the whole file; nothing of it is acted on.

Every state directory in use is also entered in a small index, ``/run/hetcomm/emulate-index/hc<id>``
(file content: the state directory). ``down --sweep`` consults it so that it never takes another
state directory's live emulation for an orphan.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

from hetcomm.errors import ConfigError, UsageError

__all__ = [
    "EmulationState",
    "DEFAULT_STATE_DIR",
    "INDEX_DIR",
    "SHM_ROOT",
    "NODE_NAME_RE",
    "shm_dir_for",
    "rank_cgroup_name",
    "state_path",
    "secure_state_dir",
    "load_state",
    "validate_state",
    "save_state",
    "list_states",
    "run_id_of",
    "register_run",
    "unregister_run",
    "registered_state_dir",
]

#: /run is a tmpfs: it vanishes on reboot exactly like the namespaces it describes.
DEFAULT_STATE_DIR = "/run/hetcomm/emulate"
#: run id -> state directory, for every emulation hetcomm has recorded on this machine.
INDEX_DIR = "/run/hetcomm/emulate-index"
SHM_ROOT = "/dev/shm"
#: A node name as hetcomm.emulate.spec allows it (group name + "-<index>").
NODE_NAME_RE = re.compile(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*")
_FILE_RE = re.compile(r"^hc([0-9a-f]{6})\.json$")
_RUN_ID_RE = re.compile(r"[0-9a-f]{6}")
# A 999-node state file is ~1 MB; anything far bigger is not ours.
_MAX_STATE_BYTES = 16 << 20
_STATUSES = ("creating", "up", "down")


@dataclass
class EmulationState:
    """What one emulation owns.

    Attributes:
        run_id: 6 hex digits.
        cluster_name / cluster_path: the cluster it emulates (the path is absolute).
        status: ``creating`` (names recorded, kernel objects being made), ``up``, ``down``.
        created: UNIX time the state was first written.
        owner_pid: process that created it.
        scale / mode / subnet: the settings it was built with.
        namespaces: every namespace name (fabric first).
        shm_dirs: host directories bind-mounted as ``/dev/shm`` in each node.
        cgroups: cpu cgroup directories, one per rank, when compute speed is emulated.
        cgroup_version: 1 or 2 (0 when there are no cgroups).
        interfaces: ``ns/dev`` of every veth end (gone with their namespaces).
        qdiscs: ``ns/dev: description`` of every shaper.
        nodes: per node: ns, node, ranks, ifaces ``[{name, address, rate_bps}]``, and with compute
            emulation ``compute_scale`` (relative speed) and ``cpus`` (each rank's CPU quota).
        rank_pids: process ids of rank launchers of a ``run`` in progress.
        notes: facts from the plan.
    """

    run_id: str
    cluster_name: str
    cluster_path: str
    status: str = "creating"
    created: float = field(default_factory=time.time)
    owner_pid: int = field(default_factory=os.getpid)
    scale: float = 1e-3
    mode: str = "bridge"
    subnet: str = ""
    namespaces: List[str] = field(default_factory=list)
    shm_dirs: List[str] = field(default_factory=list)
    cgroups: List[str] = field(default_factory=list)
    cgroup_version: int = 0
    interfaces: List[str] = field(default_factory=list)
    qdiscs: List[str] = field(default_factory=list)
    nodes: List[Dict[str, Any]] = field(default_factory=list)
    rank_pids: List[int] = field(default_factory=list)
    master_port: int = 29500
    notes: List[str] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        return f"hc{self.run_id}-"


def shm_dir_for(run_id: str, node: str) -> str:
    """Host directory bind-mounted as ``/dev/shm`` for the ranks of ``node``."""
    return os.path.join(SHM_ROOT, f"hc{run_id}-{node}")


def rank_cgroup_name(node: str, rank: int) -> str:
    """``<node>-r<rank>``: the cgroup of one rank is ``<cpu root>/hc<id>-<node>-r<rank>`` (node
    names end in a digit, so no node is ever named like a rank's cgroup)."""
    return f"{node}-r{rank}"


def state_path(state_dir: str, run_id: str) -> str:
    """``<state_dir>/hc<run_id>.json``."""
    return os.path.join(state_dir, f"hc{run_id}.json")


def _safe_ancestor(st: os.stat_result) -> bool:
    """Only root or the caller can rename entries in it (owner, and not writable by others
    unless sticky, like /tmp)."""
    if st.st_uid not in (0, os.geteuid()):
        return False
    return not (st.st_mode & 0o022) or bool(st.st_mode & stat.S_ISVTX)


def _who(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def secure_state_dir(state_dir: str, *, create: bool, what: str = "--state-dir") -> Optional[str]:
    """Check that ``state_dir`` is private to the caller; create it (mode 0700) if ``create``.

    Returns:
        The directory with its ancestors' links resolved (use it from then on), or None when it
        does not exist and ``create`` is False.

    Raises:
        UsageError: it is a link, not a directory, owned by someone else, writable by group or
            others, or sits under a directory others can change; the message names the path,
            the owner or mode, and the fix.
    """
    parent = os.path.realpath(os.path.dirname(os.path.abspath(state_dir)))
    path = os.path.join(parent, os.path.basename(os.path.abspath(state_dir)))
    fix = f"use a directory only you can write, e.g. the default {DEFAULT_STATE_DIR}"
    # Ancestors: resolved, each must be changeable only by root or the caller.
    probe = parent
    while True:
        try:
            st = os.stat(probe)
        except FileNotFoundError:
            st = None
        if st is not None and not _safe_ancestor(st):
            raise UsageError(
                f"{what} {state_dir}: its ancestor {probe} is owned by {_who(st.st_uid)} with mode "
                f"{stat.S_IMODE(st.st_mode):o}: someone else could swap the state directory; {fix}"
            )
        if probe == os.path.dirname(probe):
            break
        probe = os.path.dirname(probe)
    if create:
        try:
            os.makedirs(parent, mode=0o755, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise UsageError(f"cannot create {what} {state_dir}: {e.strerror}; {fix}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{what} {state_dir} is a symbolic link; refusing to follow it; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{what} {state_dir} is not a directory; {fix}")
    if st.st_uid != os.geteuid():
        raise UsageError(
            f"{what} {state_dir} is owned by {_who(st.st_uid)}, not by you ({_who(os.geteuid())}): "
            f"its state files could name anything; {fix}"
        )
    if st.st_mode & 0o022:
        raise UsageError(
            f"{what} {state_dir} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): anyone could plant a state file; run 'chmod go-w "
            f"{state_dir}' or {fix}"
        )
    return path


def save_state(state_dir: str, state: EmulationState) -> str:
    """Write ``state`` atomically (temp file + rename) into a private ``state_dir`` (created
    0700 if missing), enter the run in the index first; return the file's path.

    Raises:
        UsageError: the state directory is not private, or cannot be created or written.
    """
    state_dir = secure_state_dir(state_dir, create=True) or state_dir
    register_run(state.run_id, state_dir)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".hc{state.run_id}.", dir=state_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(state), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        path = state_path(state_dir, state.run_id)
        os.replace(tmp, path)
        return path
    except OSError as e:
        raise UsageError(
            f"cannot write the emulation state file in {state_dir}: {e.strerror}; pass a writable "
            f"--state-dir"
        ) from None


def _read_private_file(path: str) -> str:
    """Read a file that must be a regular file owned by the caller, not writable by others,
    without following a link at its last component.

    Raises:
        ConfigError: it is not such a file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise ConfigError(f"cannot read emulation state: {why}", path=path) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                "not a regular file; refusing to use it as emulation state", path=path
            )
        if st.st_uid != os.geteuid():
            raise ConfigError(
                f"the state file is owned by {_who(st.st_uid)}, not by you ({_who(os.geteuid())}); "
                f"refusing to act on it (remove it if you did not expect it)",
                path=path,
            )
        if st.st_mode & 0o022:
            raise ConfigError(
                "the state file is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):o}); "
                f"refusing to act on it",
                path=path,
            )
        data = f.read(_MAX_STATE_BYTES + 1)
    if len(data) > _MAX_STATE_BYTES:
        raise ConfigError(f"larger than {_MAX_STATE_BYTES >> 20} MiB: not a state file", path=path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8: not an emulation state file", path=path) from None


def load_state(path: str) -> EmulationState:
    """Read and check one state file (see the module docstring for what is checked).

    Raises:
        ConfigError: the file is unreadable, not trusted, not a state file, or names an object
            this run's records do not produce.
    """
    text = _read_private_file(path)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"not an emulation state file ({e})", path=path) from None
    if not isinstance(data, dict):
        raise ConfigError("not an emulation state file (expected a JSON object)", path=path)
    known = {f.name for f in fields(EmulationState)}
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise ConfigError(f"not an emulation state file: unknown keys {unknown}", path=path)
    try:
        state = EmulationState(**data)
    except TypeError as e:
        raise ConfigError(f"not an emulation state file ({e})", path=path) from None
    expected = run_id_of(path)
    if expected is not None and state.run_id != expected:
        raise ConfigError(
            f"run_id {state.run_id!r} does not match the file name (hc{expected}); refusing to act "
            f"on it",
            key="run_id",
            path=path,
        )
    validate_state(state, path)
    # hetcomm's own record of where this run lives: a copy of its state file elsewhere (another
    # state directory of the same user) must not let that directory's `down` act on it.
    owner = registered_state_dir(state.run_id)
    here = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if owner is not None and os.path.realpath(owner) != here:
        raise ConfigError(
            f"run hc{state.run_id} is recorded in {owner} (the emulation index), not here: this "
            f"file is a copy and is not acted on; use --state-dir {owner}",
            path=path,
        )
    return state


def validate_state(state: EmulationState, path: Optional[str] = None) -> None:
    """Check that every object ``state`` would have ``down`` act on is one its own records
    produce: the namespaces ``hc<id>-<node>`` of its nodes (and ``hc<id>-fabric``), their
    ``/dev/shm`` directories and cpu cgroups, integer rank pids.

    Raises:
        ConfigError: naming the key and the offending value.
    """

    def bad(key: str, message: str) -> ConfigError:
        return ConfigError(
            message + "; refusing to act on this state file (remove it if you did not write it)",
            key=key,
            path=path,
        )

    rid = state.run_id
    if not isinstance(rid, str) or not _RUN_ID_RE.fullmatch(rid):
        raise bad("run_id", f"expected 6 lowercase hex digits, got {rid!r}")
    prefix = f"hc{rid}-"
    if state.status not in _STATUSES:
        raise bad("status", f"expected one of {', '.join(_STATUSES)}, got {state.status!r}")
    for key in ("namespaces", "shm_dirs", "cgroups", "interfaces", "qdiscs", "notes"):
        value = getattr(state, key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(key, "expected a list of strings")
    if not isinstance(state.nodes, list):
        raise bad("nodes", "expected a list of nodes")
    node_names: List[str] = []
    rank_cgroups: List[str] = []
    for i, n in enumerate(state.nodes):
        key = f"nodes[{i}]"
        if not isinstance(n, dict):
            raise bad(key, "expected a mapping")
        name = n.get("node")
        if not isinstance(name, str) or not NODE_NAME_RE.fullmatch(name) or len(name) > 80:
            raise bad(f"{key}.node", f"{name!r} is not a node name hetcomm makes")
        if n.get("ns") != prefix + name:
            raise bad(f"{key}.ns", f"{n.get('ns')!r} is not this run's namespace {prefix}{name}")
        ranks = n.get("ranks")
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
        ):
            raise bad(f"{key}.ranks", "expected a list of non-negative integers")
        if not isinstance(n.get("ifaces", []), list):
            raise bad(f"{key}.ifaces", "expected a list")
        node_names.append(name)
        rank_cgroups += [rank_cgroup_name(name, r) for r in ranks]
    allowed_ns = {prefix + "fabric"} | {prefix + x for x in node_names}
    for i, ns in enumerate(state.namespaces):
        if ns not in allowed_ns:
            raise bad(
                f"namespaces[{i}]",
                f"namespace {ns!r} is not one this run creates (hc{rid}-fabric or {prefix}<node> "
                f"of the nodes it lists)",
            )
    allowed_shm = {shm_dir_for(rid, x) for x in node_names}
    for i, d in enumerate(state.shm_dirs):
        if d not in allowed_shm:
            raise bad(
                f"shm_dirs[{i}]",
                f"{d!r} is not one of this run's shared-memory directories "
                f"({SHM_ROOT}/{prefix}<node> of the nodes it lists)",
            )
    if state.cgroups:
        from hetcomm.emulate.cgroup import cgroup_dir_for, find_cpu_hierarchy

        h = find_cpu_hierarchy()
        allowed_cg = {cgroup_dir_for(h, rid, x) for x in rank_cgroups} if h is not None else set()
        for i, d in enumerate(state.cgroups):
            if d not in allowed_cg:
                raise bad(
                    f"cgroups[{i}]",
                    f"{d!r} is not one of this run's cgroups (<cpu cgroup root>/"
                    f"{prefix}<node>-r<rank> of the nodes and ranks it lists)",
                )
    if not isinstance(state.rank_pids, list) or not all(
        isinstance(p, int) and not isinstance(p, bool) and p > 1 for p in state.rank_pids
    ):
        raise bad("rank_pids", "expected a list of process ids")


def list_states(state_dir: str) -> List[str]:
    """Paths of every state file in ``state_dir`` (sorted; empty if the directory is missing)."""
    try:
        names = sorted(os.listdir(state_dir))
    except FileNotFoundError:
        return []
    return [os.path.join(state_dir, n) for n in names if _FILE_RE.match(n)]


def run_id_of(path: str) -> Optional[str]:
    """The run id encoded in a state file's name, or None."""
    m = _FILE_RE.match(os.path.basename(path))
    return m.group(1) if m else None


# -- the index: which state directory records which run -----------------------------------------


def _index_dir(create: bool) -> Optional[str]:
    return secure_state_dir(INDEX_DIR, create=create, what="the emulation index")


def register_run(run_id: str, state_dir: str) -> None:
    """Enter ``run_id`` -> ``state_dir`` in the index (before anything of the run exists)."""
    index = _index_dir(create=True)
    assert index is not None
    entry = os.path.join(index, f"hc{run_id}")
    target = os.path.abspath(state_dir)
    if registered_state_dir(run_id) == target:
        return
    fd, tmp = tempfile.mkstemp(prefix=f".hc{run_id}.", dir=index)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(target)
    os.replace(tmp, entry)


def unregister_run(run_id: str) -> None:
    """Drop ``run_id`` from the index (after its state file is gone)."""
    try:
        index = _index_dir(create=False)
        if index is not None:
            os.unlink(os.path.join(index, f"hc{run_id}"))
    except (FileNotFoundError, UsageError):
        pass


def registered_state_dir(run_id: str) -> Optional[str]:
    """The state directory the index records for ``run_id``, or None.

    Raises:
        UsageError: the index directory itself is not private.
    """
    index = _index_dir(create=False)
    if index is None:
        return None
    try:
        text = _read_private_file(os.path.join(index, f"hc{run_id}"))
    except ConfigError:
        return None
    text = text.strip()
    return text if os.path.isabs(text) else None
