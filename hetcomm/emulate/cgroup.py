"""CPU cgroups that make an emulated node compute at its device's relative speed.

Every rank runs in a cgroup of its own, ``<cpu root>/hc<id>-<node>-r<rank>``, whose CFS bandwidth
limit (cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, cgroup v2 ``cpu.max``) is its
device's CPU share: ``compute_scale x cpu_per_rank`` CPUs. A rank that could use a whole core
gets its share of each period and is throttled for the rest, so the same GEMM takes
``1/compute_scale`` times as long on a node at ``compute_scale`` as on the fastest node: the way a
910B rank computes more slowly than an H800 rank. One cgroup per rank rather than per node
because a device's speed does not depend on whether the GPU beside it is busy: with a node-wide
quota a rank whose sibling waits for the network would compute twice as fast. The kernel's
bandwidth controller is the only tool that bounds CPU *time* (``nice``/``cpu.shares`` only weigh
contenders and give an idle machine's cores to
anyone), so that is what this module drives; it writes the files directly because there is no
library for cgroupfs that covers both versions.

The quota alone caps a node but does not guarantee it its share: under contention CFS splits
the cores by weight, and a cgroup at the default weight counts as *one* task against every other
task on the machine, so on a loaded host every node would get the same sliver and the emulated
speeds would flatten. Each node's cgroup therefore gets a high weight (v1 ``cpu.shares``, v2
``cpu.weight``): the quota, not the neighbours, sets its pace. That is safe for the host because
the quotas add up to at most the machine's cores by default (``emulation.cpu_per_rank``).

**Host threads not slowed** (``emulation.host_share``). A whole-process quota slows a rank's
communication threads with its compute, which a real node does not: a slow accelerator does
not slow the host threads that feed its NICs. With a host share the rank's cgroup is limited to
``cpu_per_rank`` and its training thread (the process's main thread, where every forward and
backward runs) is moved into a child cgroup, ``<rank cgroup>/device``, limited to the device's
share: ``compute_scale x cpu_per_rank x (1 - host_share)``. The quotas are hierarchical, so the
two together never exceed ``cpu_per_rank``. A thread inherits its creator's cgroup, so threads
the training thread starts later land in ``device`` too; :func:`release_host_threads` moves them
back out, and the emulation's runner calls it a few times a second while its ranks run. cgroup
v1 only, because it is the only version that places single threads without making the rank's
cgroup a threaded domain; a v2 host gets a clear error.

Which hierarchy: cgroup v2 where the unified hierarchy has the ``cpu`` controller, else the v1
hierarchy the ``cpu`` controller is mounted on (this machine: v1 at /sys/fs/cgroup/cpu, a v2 mount
without controllers at /sys/fs/cgroup/unified). Found from ``/proc/self/mounts``.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from hetcomm.emulate.kernel import KernelError

__all__ = [
    "CpuHierarchy",
    "MIN_PERIOD_US",
    "period_us_for",
    "find_cpu_hierarchy",
    "cgroup_dir_for",
    "quota_us_for",
    "create_cgroup",
    "read_cpu_limit",
    "cgroup_pids",
    "DEVICE_CGROUP",
    "device_cgroup_dir",
    "move_thread",
    "release_host_threads",
    "throttle_stats",
    "remove_cgroup",
    "list_run_cgroups",
]

#: Shortest CFS period given to a rank. The period is as short as the kernel's 1 ms minimum
#: quota allows, because a throttled rank runs its quota and then stalls for the rest of the
#: period: at 20 ms a 0.25-CPU rank ran 5 ms and stalled 15 ms, so an expert call's time depended
#: on where in the period it began, and the per-rank expert time the balancer measures was noisy
#: (benchmarks/README.md, moe_workloads.py: at 4 ms the half-speed rows' median per-rank max/mean
#: fell from 1.33 to 1.21). Not shorter than 4 ms: each period costs the kernel a timer and a
#: refill per cgroup.
MIN_PERIOD_US = 4_000
#: The kernel's longest period (1 s).
_MAX_PERIOD_US = 1_000_000
#: The kernel refuses quotas under 1 ms.
_MIN_QUOTA_US = 1_000
#: Weights that make the quota the binding limit (64x the v1 default; the v2 maximum).
SHARES_V1 = 65_536
WEIGHT_V2 = 10_000


@dataclass(frozen=True)
class CpuHierarchy:
    """Where cpu cgroups are made: ``version`` 1 or 2, ``root`` the mount point."""

    version: int
    root: str


def find_cpu_hierarchy(mounts_path: str = "/proc/self/mounts") -> Optional[CpuHierarchy]:
    """The hierarchy carrying the ``cpu`` controller (v2 preferred), or None when there is none."""
    v1: Optional[str] = None
    v2: Optional[str] = None
    try:
        with open(mounts_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt = parts[1].replace("\\040", " ")
        if parts[2] == "cgroup2" and v2 is None:
            try:
                with open(os.path.join(mnt, "cgroup.controllers"), encoding="utf-8") as f:
                    if "cpu" in f.read().split():
                        v2 = mnt
            except OSError:
                pass
        elif parts[2] == "cgroup" and "cpu" in parts[3].split(",") and v1 is None:
            v1 = mnt
    if v2 is not None:
        return CpuHierarchy(2, v2)
    if v1 is not None:
        return CpuHierarchy(1, v1)
    return None


def cgroup_dir_for(h: CpuHierarchy, run_id: str, node: str) -> str:
    """``<root>/hc<run_id>-<node>``."""
    return os.path.join(h.root, f"hc{run_id}-{node}")


def period_us_for(cpus: float) -> int:
    """The CFS period of a rank limited to ``cpus`` CPUs: the shortest (at least
    :data:`MIN_PERIOD_US`) whose quota is not under the kernel's 1 ms, so that a slow rank's
    share is exact rather than rounded up to 1 ms per period (with one 4 ms period for all, an
    A100 rank at 0.16 CPU of mixed-mini would have got 0.25)."""
    # The 1e-9 keeps float error (1000 / 0.1 = 10000.000...1) from adding a microsecond.
    return min(_MAX_PERIOD_US, max(MIN_PERIOD_US, math.ceil(_MIN_QUOTA_US / cpus - 1e-9)))


def quota_us_for(cpus: float, period_us: Optional[int] = None) -> int:
    """CFS quota of ``cpus`` CPUs per ``period_us`` (default :func:`period_us_for`; at least the
    kernel's 1 ms)."""
    period = period_us_for(cpus) if period_us is None else period_us
    return max(_MIN_QUOTA_US, int(round(cpus * period)))


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise KernelError(f"cannot write {text!r} to {path}: {e.strerror}") from None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


#: Name of the child cgroup that holds a rank's training thread under a host share.
DEVICE_CGROUP = "device"


def device_cgroup_dir(path: str) -> str:
    """``<rank cgroup>/device``: where a rank's training thread runs under a host share."""
    return os.path.join(path, DEVICE_CGROUP)


def create_cgroup(
    h: CpuHierarchy, path: str, cpus: float, device_cpus: Optional[float] = None
) -> Tuple[int, int]:
    """Make cgroup ``path`` (it must not exist) limited to ``cpus`` CPUs; return (quota, period)
    in microseconds. With ``device_cpus``, also make its ``device`` child limited to that many
    (module docstring: host threads not slowed).

    Raises:
        KernelError: the directory exists already, the kernel refused the limit, or a device
            child was asked for on cgroup v2.
    """
    if os.path.dirname(path) != h.root:
        raise KernelError(f"cgroup {path} is not directly under the cpu hierarchy {h.root}")
    if device_cpus is not None and h.version != 1:
        raise KernelError(
            f"emulation.host_share needs the cgroup v1 'cpu' hierarchy (single threads are placed "
            f"through its 'tasks' file); this host's cpu controller is on v2 at {h.root}: set "
            f"emulation.host_share to 0"
        )
    if h.version == 2:
        ctl = os.path.join(h.root, "cgroup.subtree_control")
        if "cpu" not in _read(ctl).split():
            # Children of the root get cpu.max only once the root delegates the controller.
            _write(ctl, "+cpu")
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        raise KernelError(
            f"cgroup {path} exists already; is another emulation using this id?"
        ) from None
    except OSError as e:
        raise KernelError(f"cannot create cgroup {path}: {e.strerror}") from None
    quota, period = _limit(h, path, cpus)
    if device_cpus is not None:
        child = device_cgroup_dir(path)
        try:
            os.mkdir(child, 0o755)
        except OSError as e:
            raise KernelError(f"cannot create cgroup {child}: {e.strerror}") from None
        # The same high weight as the rank's: a busy host thread can still take some of the
        # training thread's share of the rank's quota (the quota, not the weight, is the bound).
        _limit(h, child, device_cpus)
    return quota, period


def _limit(h: CpuHierarchy, path: str, cpus: float) -> Tuple[int, int]:
    period = period_us_for(cpus)
    quota = quota_us_for(cpus, period)
    if h.version == 2:
        _write(os.path.join(path, "cpu.max"), f"{quota} {period}")
        _write(os.path.join(path, "cpu.weight"), str(WEIGHT_V2))
    else:
        _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
        _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        _write(os.path.join(path, "cpu.shares"), str(SHARES_V1))
    return quota, period


def move_thread(path: str, tid: int) -> bool:
    """Move thread ``tid`` alone into v1 cgroup ``path``; False when it has exited already."""
    try:
        with open(os.path.join(path, "tasks"), "w", encoding="utf-8") as f:
            f.write(str(tid))
    except ProcessLookupError:
        return False
    except OSError as e:
        raise KernelError(f"cannot move thread {tid} into {path}: {e.strerror}") from None
    return True


def release_host_threads(path: str, main_tids: Sequence[int]) -> int:
    """Move every thread in ``path``'s ``device`` child except ``main_tids`` (the ranks'
    training threads) back into ``path``; return how many moved. v1 only."""
    try:
        tids = [int(x) for x in _read(os.path.join(device_cgroup_dir(path), "tasks")).split()]
    except OSError:
        return 0  # not made yet, or torn down
    return sum(move_thread(path, t) for t in tids if t not in main_tids)


def read_cpu_limit(h: CpuHierarchy, path: str) -> Tuple[Optional[int], int]:
    """(quota, period) in microseconds; quota None means unlimited."""
    if h.version == 2:
        quota_s, period_s = _read(os.path.join(path, "cpu.max")).split()
        return (None if quota_s == "max" else int(quota_s)), int(period_s)
    quota = int(_read(os.path.join(path, "cpu.cfs_quota_us")))
    period = int(_read(os.path.join(path, "cpu.cfs_period_us")))
    return (None if quota < 0 else quota), period


def cgroup_pids(path: str) -> List[int]:
    """Processes with a thread in cgroup ``path`` or its ``device`` child (empty when it does
    not exist)."""
    pids: List[int] = []
    for d in (path, device_cgroup_dir(path)):
        try:
            pids += [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
        except OSError:
            pass
    return sorted(set(pids))


def throttle_stats(path: str) -> Dict[str, int]:
    """``cpu.stat`` of the cgroup (``nr_periods``, ``nr_throttled``, ...)."""
    out: Dict[str, int] = {}
    for line in _read(os.path.join(path, "cpu.stat")).splitlines():
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def remove_cgroup(path: str, grace_s: float = 5.0) -> Optional[str]:
    """Kill what is left in cgroup ``path`` and remove it; return a problem, or None when it is
    gone. Only call it for a cgroup this emulation recorded (see ``state.validate_state``): only
    root can move a process into it, so whatever runs there was started by the emulation."""
    child = device_cgroup_dir(path)
    if os.path.isdir(child):
        problem = remove_cgroup(child, grace_s)
        if problem is not None:
            return problem
    deadline = time.monotonic() + grace_s
    while os.path.isdir(path):
        for pid in cgroup_pids(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(path)
            return None
        except FileNotFoundError:
            return None
        except OSError as e:
            # EBUSY while the killed tasks are still exiting.
            if time.monotonic() > deadline:
                return f"could not remove cgroup {path}: {e.strerror} (tasks {cgroup_pids(path)})"
            time.sleep(0.05)
    return None


def list_run_cgroups(h: Optional[CpuHierarchy]) -> List[str]:
    """Names of every ``hc<...>`` cgroup directly under the cpu root."""
    if h is None:
        return []
    try:
        return sorted(
            n
            for n in os.listdir(h.root)
            if n.startswith("hc") and os.path.isdir(os.path.join(h.root, n))
        )
    except OSError:
        return []
