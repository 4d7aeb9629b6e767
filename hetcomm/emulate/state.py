"""The state file: what an emulation made, written down *before* it is made.

One JSON file per emulation, ``<state_dir>/hc<id>.json``, plus a directory ``<state_dir>/hc<id>/``
for rank logs. Every namespace and shared-memory directory is listed in the file before the
first ``ip netns add``, and every rank process id before ``down`` could need it, so ``hetcomm
emulate down`` can remove everything even when the process that built it was killed.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from hetcomm.errors import ConfigError, UsageError

__all__ = [
    "EmulationState",
    "DEFAULT_STATE_DIR",
    "state_path",
    "load_state",
    "save_state",
    "list_states",
]

#: /run is a tmpfs: it vanishes on reboot exactly like the namespaces it describes.
DEFAULT_STATE_DIR = "/run/hetcomm/emulate"
_FILE_RE = re.compile(r"^hc([0-9a-f]{6})\.json$")


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
        interfaces: ``ns/dev`` of every veth end (gone with their namespaces).
        qdiscs: ``ns/dev: description`` of every shaper.
        nodes: per node: ns, node, ranks, ifaces ``[{name, address, rate_bps}]``.
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
    interfaces: List[str] = field(default_factory=list)
    qdiscs: List[str] = field(default_factory=list)
    nodes: List[Dict[str, Any]] = field(default_factory=list)
    rank_pids: List[int] = field(default_factory=list)
    master_port: int = 29500
    notes: List[str] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        return f"hc{self.run_id}-"


def state_path(state_dir: str, run_id: str) -> str:
    """``<state_dir>/hc<run_id>.json``."""
    return os.path.join(state_dir, f"hc{run_id}.json")


def save_state(state_dir: str, state: EmulationState) -> str:
    """Write ``state`` atomically (temp file + rename); return its path.

    Raises:
        UsageError: the state directory cannot be created or written.
    """
    try:
        os.makedirs(state_dir, exist_ok=True)
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


def load_state(path: str) -> EmulationState:
    """Read one state file.

    Raises:
        ConfigError: the file is unreadable or not a state file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return EmulationState(**data)
    except OSError as e:
        raise ConfigError(f"cannot read emulation state: {e.strerror}", path=path) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"not an emulation state file ({e}); remove it and run 'hetcomm emulate down --sweep'",
            path=path,
        ) from None


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
