"""Which ``hc<id>-*`` objects on this machine no emulation owns any more, provably.

``hetcomm emulate down --sweep`` removes them and ``hetcomm emulate status`` lists them. Counting
every ``hc<6 hex>-*`` name that the *current* state directory did not list
as an orphan would make a sweep destroy emulations recorded in other state directories, live
ranks included. So a run's objects (namespaces, ``/dev/shm`` entries, cpu cgroups) are a
*provable orphan* only when both hold:

- no state file records the run anywhere hetcomm knows of: the state directory in use, the
  default one, and the directory the index (``/run/hetcomm/emulate-index``) names for the run;
- no process is alive in its namespaces or its cgroups, and none carries its id in
  ``HETCOMM_EMULATE``.

Everything else is reported with the reason it is skipped. A ``/dev/shm`` entry is removed only
when it is a real directory of the caller (``fabric._remove_shm_dir``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

from hetcomm import settings
from hetcomm.emulate.cgroup import cgroup_pids, find_cpu_hierarchy, list_run_cgroups, remove_cgroup
from hetcomm.emulate.kernel import KernelError, list_netns, netns_pids, run_tool
from hetcomm.emulate.state import (
    DEFAULT_STATE_DIR,
    SHM_ROOT,
    registered_state_dir,
    state_path,
    unregister_run,
)
from hetcomm.errors import UsageError

__all__ = ["Unrecorded", "find_unrecorded", "remove_orphan"]

_NAME_RE = re.compile(r"^hc([0-9a-f]{6})-")


@dataclass(frozen=True)
class Unrecorded:
    """The objects of one run that the state directory in use does not record.

    Attributes:
        run_id: 6 hex digits.
        namespaces / shm_entries / cgroups: what exists with its prefix (names; full paths for
            /dev/shm entries and cgroups).
        recorded_in: a state file elsewhere that records the run, or None.
        pids: live processes that belong to it.
    """

    run_id: str
    namespaces: Tuple[str, ...]
    shm_entries: Tuple[str, ...]
    cgroups: Tuple[str, ...]
    recorded_in: Optional[str]
    pids: Tuple[int, ...]

    @property
    def orphan(self) -> bool:
        """Provably nobody's: no state file anywhere known and no live process."""
        return self.recorded_in is None and not self.pids

    @property
    def objects(self) -> List[str]:
        return (
            [f"netns {n}" for n in self.namespaces]
            + list(self.shm_entries)
            + [f"cgroup {c}" for c in self.cgroups]
        )

    def reason(self) -> str:
        """Why a sweep leaves it alone ('' for an orphan)."""
        if self.recorded_in is not None:
            return (
                f"recorded in {self.recorded_in} (live elsewhere; remove it with 'hetcomm emulate "
                f"down --state-dir {os.path.dirname(self.recorded_in)} --id hc{self.run_id}')"
            )
        if self.pids:
            return f"processes {list(self.pids)} are alive in it; stop them first"
        return ""


def _pids_with_env(needle: bytes) -> Dict[bytes, List[int]]:
    """Every process whose environment has ``HETCOMM_EMULATE=...``: value -> pids."""
    found: Dict[bytes, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(needle):
                found.setdefault(var[len(needle) :], []).append(int(entry))
    return found


def _recorded_in(run_id: str, state_dirs: Sequence[str]) -> Optional[str]:
    dirs = list(state_dirs) + [DEFAULT_STATE_DIR]
    try:
        indexed = registered_state_dir(run_id)
    except UsageError:
        indexed = None
    if indexed is not None:
        dirs.append(indexed)
    for d in dirs:
        path = state_path(d, run_id)
        if os.path.lexists(path):
            return path
    return None


def find_unrecorded(
    state_dirs: Sequence[str], known_ids: Set[str], only: Optional[str] = None
) -> List[Unrecorded]:
    """Every run with ``hc<id>-*`` objects on this machine whose id is not in ``known_ids`` (the
    runs the state directory in use records), classified as orphan or not.

    Args:
        state_dirs: state directories to look for a run's state file in (besides the default
            and the index's).
        known_ids: run ids recorded in the state directory in use (handled by plain ``down``).
        only: restrict to this run id.
    """
    by_id: Dict[str, Dict[str, List[str]]] = {}

    def add(kind: str, name: str, value: str) -> None:
        m = _NAME_RE.match(name)
        if m is None or m.group(1) in known_ids or (only is not None and m.group(1) != only):
            return
        by_id.setdefault(m.group(1), {"ns": [], "shm": [], "cg": []})[kind].append(value)

    for n in list_netns():
        add("ns", n, n)
    try:
        for n in sorted(os.listdir(SHM_ROOT)):
            add("shm", n, os.path.join(SHM_ROOT, n))
    except OSError:
        pass
    h = find_cpu_hierarchy()
    for n in list_run_cgroups(h):
        assert h is not None
        add("cg", n, os.path.join(h.root, n))
    env_pids = _pids_with_env(f"{settings.EMULATE.name}=".encode()) if by_id else {}
    out = []
    for rid in sorted(by_id):
        objs = by_id[rid]
        pids: Set[int] = set(env_pids.get(f"hc{rid}".encode(), []))
        for ns in objs["ns"]:
            pids.update(netns_pids(ns))
        for cg in objs["cg"]:
            pids.update(cgroup_pids(cg))
        out.append(
            Unrecorded(
                run_id=rid,
                namespaces=tuple(objs["ns"]),
                shm_entries=tuple(objs["shm"]),
                cgroups=tuple(objs["cg"]),
                recorded_in=_recorded_in(rid, state_dirs),
                pids=tuple(sorted(pids)),
            )
        )
    return out


def remove_orphan(u: Unrecorded) -> List[str]:
    """Remove a provable orphan's objects; return the problems left (empty when all gone).

    Raises:
        AssertionError: ``u`` is not an orphan (callers check ``u.orphan``).
    """
    from hetcomm.emulate.fabric import _remove_shm_dir

    assert u.orphan, u
    problems: List[str] = []
    # Fabric last: node namespaces hold the other ends of its veths.
    for ns in sorted(u.namespaces, key=lambda n: n.endswith("-fabric")):
        if netns_pids(ns):  # something started in it since it was classified
            problems.append(f"namespace {ns} gained processes; left alone")
            continue
        try:
            run_tool(["ip", "netns", "delete", ns])
        except KernelError as e:
            problems.append(str(e))
    for cg in u.cgroups:
        if cgroup_pids(cg):
            problems.append(f"cgroup {cg} gained processes; left alone")
            continue
        problem = remove_cgroup(cg)
        if problem:
            problems.append(problem)
    for d in u.shm_entries:
        problem = _remove_shm_dir(d, f"hc{u.run_id}-")
        if problem:
            problems.append(problem)
    if not problems:
        unregister_run(u.run_id)
    return problems
