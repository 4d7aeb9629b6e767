"""Build and remove an emulated cluster in the kernel: namespaces, veths, bridges, shapers,
and (with compute emulation) one cpu cgroup per rank.

:func:`bring_up` records every name in the state file first, then creates the objects; any
failure on the way tears down what exists and re-raises. :func:`tear_down` works from the state
file alone, so it also cleans up after a crash, and it acts only on what that (checked) state
records: names that are not in it are left to ``down --sweep``, which removes only provable
orphans (:mod:`hetcomm.emulate.orphans`). Deleting a namespace only frees its interfaces once no
process lives in it, so tear-down kills the processes inside first.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import stat
import sys
import time
from typing import Callable, List, Optional

from hetcomm import settings
from hetcomm.emulate.cgroup import (
    cgroup_dir_for,
    create_cgroup,
    find_cpu_hierarchy,
    list_run_cgroups,
    remove_cgroup,
)
from hetcomm.emulate.kernel import KernelError, batch, list_netns, netns_pids, run_tool
from hetcomm.emulate.spec import NetPlan, Shaper
from hetcomm.emulate.state import (
    SHM_ROOT,
    EmulationState,
    rank_cgroup_name,
    save_state,
    shm_dir_for,
    state_path,
    unregister_run,
)
from hetcomm.errors import UsageError

__all__ = ["new_run_id", "bring_up", "tear_down", "leftovers", "shm_dir_for", "SHM_ROOT"]
# Smallest tbf bucket: one 64 KiB GSO super-packet must fit, or tbf would have to split every
# TCP segment veth hands it (it can, but the bucket then also caps the shaper's accuracy).
_MIN_BURST_BYTES = 64 * 1024
# HTB quantum: one full-size GSO packet per round; the default (rate/r2q) is far too big here.
_HTB_QUANTUM = 65536


def new_run_id() -> str:
    """Six random hex digits (``3f9a1c``), not the prefix of anything that exists already (a
    namespace, /dev/shm entry, cpu cgroup or index entry), so that a failed bring-up can never
    remove another run's objects."""
    from hetcomm.emulate.state import registered_state_dir

    while True:
        rid = secrets.token_hex(3)
        if not leftovers(rid) and registered_state_dir(rid) is None:
            return rid


def _say(progress: Optional[Callable[[str], None]], msg: str) -> None:
    if progress is not None:
        progress(msg)


def bring_up(
    plan: NetPlan,
    *,
    state_dir: str,
    cluster_path: str,
    progress: Optional[Callable[[str], None]] = None,
) -> EmulationState:
    """Create everything ``plan`` describes; return the state (status ``up``).

    Raises:
        KernelError: a command was refused; everything created so far has been removed.
        UsageError: compute emulation was asked for but this host has no cpu cgroup controller.
    """
    hierarchy = None
    if any(n.cpus is not None for n in plan.nodes):
        hierarchy = find_cpu_hierarchy()
        if hierarchy is None:
            raise UsageError(
                "compute emulation needs the cgroup 'cpu' controller (cgroup v2 with cpu enabled, "
                "or a v1 'cpu' hierarchy); none is mounted here: mount one, or drop "
                "emulation.compute / emulation.compute_scale"
            )
    state = EmulationState(
        run_id=plan.run_id,
        cluster_name=plan.cluster_name,
        cluster_path=os.path.abspath(cluster_path),
        scale=plan.settings.scale,
        mode=plan.settings.mode,
        subnet=str(plan.settings.subnet),
        master_port=plan.settings.master_port,
        namespaces=plan.namespaces,
        shm_dirs=[shm_dir_for(plan.run_id, n.node) for n in plan.nodes],
        cgroups=[
            cgroup_dir_for(hierarchy, plan.run_id, rank_cgroup_name(n.node, r))
            for n in plan.nodes
            for r in n.ranks
        ]
        if hierarchy
        else [],
        cgroup_version=hierarchy.version if hierarchy else 0,
        interfaces=[f"{v.ns_a}/{v.name_a}" for v in plan.veths]
        + [f"{v.ns_b}/{v.name_b}" for v in plan.veths],
        qdiscs=[_describe_shaper(s) for s in plan.shapers],
        nodes=[
            {
                "ns": n.ns,
                "node": n.node,
                "index": n.index,
                "vendor": n.vendor,
                "ranks": list(n.ranks),
                "compute_scale": n.compute_scale,
                "cpus": n.cpus,
                "device_cpus": n.device_cpus,
                "ifaces": [
                    {
                        "name": i.name,
                        "address": str(i.address),
                        "rail": i.rail,
                        "rate_bps": i.rate_bps,
                        "class": i.link_class.name,
                        "nominal_gbps": i.nominal_gbps,
                    }
                    for i in n.ifaces
                ],
            }
            for n in plan.nodes
        ],
        notes=list(plan.notes),
    )
    # The names go to disk before the first object exists: a crash from here on is recoverable.
    save_state(state_dir, state)
    t0 = time.monotonic()
    try:
        _create(plan, state, progress)
    except BaseException:
        tear_down(state, state_dir=state_dir)
        raise
    state.status = "up"
    save_state(state_dir, state)
    _say(
        progress,
        f"emulate: hc{plan.run_id} up in {time.monotonic() - t0:.1f} s: {len(plan.nodes)} nodes, "
        f"{plan.num_ranks} ranks, {len(plan.veths)} veth pairs, {len(plan.shapers)} shaped ends, "
        f"mode {plan.settings.mode}, scale {plan.settings.scale:g}",
    )
    return state


def _create(plan: NetPlan, state: EmulationState, progress) -> None:
    for d in state.shm_dirs:
        # Never reuse: a directory that exists already (or a link planted there) is not ours.
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            raise KernelError(f"{d} exists already; it is not this emulation's") from None
        # Sticky and world-writable like /dev/shm itself: ranks may run as any user.
        os.chmod(d, 0o1777)
    if state.cgroups:
        hierarchy = find_cpu_hierarchy()
        assert hierarchy is not None  # checked in bring_up
        by_name = {rank_cgroup_name(n.node, r): n for n in plan.nodes for r in n.ranks}
        for path in state.cgroups:
            node = by_name[os.path.basename(path)[len(state.prefix) :]]
            assert node.cpus is not None
            create_cgroup(hierarchy, path, node.cpus, node.device_cpus)
        _say(
            progress,
            f"emulate: {len(state.cgroups)} cpu cgroups (v{hierarchy.version}) limit compute",
        )
    for ns in plan.namespaces:
        run_tool(["ip", "netns", "add", ns])
        batch("ip", ns, ["link set lo up"])
    for n in plan.nodes:
        # Rail-matched ranks send on the rail of the peer's port and hear back on their own:
        # asymmetric paths, which strict reverse-path filtering would drop.
        sysctl = ["net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"]
        run_tool(["ip", "netns", "exec", n.ns, "sysctl", "-qw", *sysctl])
    _say(progress, f"emulate: {len(plan.namespaces)} namespaces created")
    if plan.fabric_ns:
        lines = []
        for br in plan.bridges:
            # No STP and no forwarding delay: ports forward as soon as they are up.
            lines += [f"link add {br} type bridge forward_delay 0 stp_state 0", f"link set {br} up"]
        batch("ip", plan.fabric_ns, lines)
    # veths are created inside the namespaces (peer end straight into the other one), so not even
    # for an instant does an emulated interface exist in the root namespace.
    by_ns = {}
    for v in plan.veths:
        by_ns.setdefault(v.ns_a, []).append(
            f"link add {v.name_a} type veth peer name {v.name_b} netns {v.ns_b}"
        )
    for ns, lines in by_ns.items():
        batch("ip", ns, lines)
    for n in plan.nodes:
        lines = []
        for i in n.ifaces:
            lines += [f"addr add {i.address} dev {i.name}", f"link set {i.name} up"]
        lines += [
            f"route add {cidr} dev {dev} src {src}"
            for ns, cidr, dev, src in plan.routes
            if ns == n.ns
        ]
        batch("ip", n.ns, lines)
    if plan.fabric_ns:
        lines = []
        for v in plan.veths:
            rail = v.name_b.split("r", 1)[1]
            lines += [f"link set {v.name_b} master br{rail}", f"link set {v.name_b} up"]
        batch("ip", plan.fabric_ns, lines)
    _say(progress, f"emulate: {len(plan.veths)} veth pairs wired")
    tc_by_ns = {}
    for s in plan.shapers:
        tc_by_ns.setdefault(s.ns, []).extend(_tc_lines(s, plan.settings.queue_ms))
    for ns, lines in tc_by_ns.items():
        batch("tc", ns, lines)
    _wait_links_up(plan)


def _tc_lines(s: Shaper, queue_ms: float) -> List[str]:
    """tc commands shaping what leaves ``s.dev``.

    ::

        tbf 1: (the port rate, every byte)
         `- htb 10: default 10
             |- direct queue  <- packets under 128 bytes (TCP ACKs, handshakes)
             |- 10:10 bulk    rate = port rate                    bfifo
             `- 10:20 bridge  rate = ceil = cross-vendor share     bfifo  <- to/from other vendor

    Why the direct queue: the ACKs of a node's incoming flows leave through the same shaped port
    as its outgoing data; queued behind a full second of data they would throttle the incoming
    flows far below their shaped rate (an artefact of TCP that RDMA fabrics do not have).
    The bfifo limits keep each queue to ``queue_ms`` of traffic at its rate.
    """
    burst = max(_MIN_BURST_BYTES, s.rate_bps // 8 // 500)  # >= 2 ms of traffic
    limit = max(4 * _MIN_BURST_BYTES, int(s.rate_bps / 8 * queue_ms / 1e3))
    lines = [
        f"qdisc add dev {s.dev} root handle 1: tbf rate {s.rate_bps}bit burst {burst} latency "
        f"{queue_ms:g}ms",
        f"qdisc add dev {s.dev} parent 1:1 handle 10: htb default 10",
        f"class add dev {s.dev} parent 10: classid 10:10 htb rate {s.rate_bps}bit ceil "
        f"{s.rate_bps}bit "
        f"quantum {_HTB_QUANTUM}",
        f"qdisc add dev {s.dev} parent 10:10 bfifo limit {limit}",
        # IP total length < 128 bytes: to htb's direct queue (flowid = the qdisc's own handle).
        f"filter add dev {s.dev} parent 10: protocol ip prio 1 u32 match u16 0x0000 0xff80 at 2 "
        "flowid 10:0",
    ]
    if s.bridge_rate_bps is not None and s.bridge_match[1]:
        blimit = max(4 * _MIN_BURST_BYTES, int(s.bridge_rate_bps / 8 * queue_ms / 1e3))
        lines += [
            f"class add dev {s.dev} parent 10: classid 10:20 htb rate {s.bridge_rate_bps}bit "
            f"ceil {s.bridge_rate_bps}bit quantum {_HTB_QUANTUM}",
            f"qdisc add dev {s.dev} parent 10:20 bfifo limit {blimit}",
        ]
        direction, cidrs = s.bridge_match
        for cidr in cidrs:
            lines.append(
                f"filter add dev {s.dev} parent 10: protocol ip prio 2 u32 match ip {direction} "
                f"{cidr} flowid 10:20"
            )
    return lines


def _describe_shaper(s: Shaper) -> str:
    text = f"{s.ns}/{s.dev}: tbf {s.rate_bps / 1e6:g} Mbit/s"
    if s.bridge_rate_bps is not None and s.bridge_match[1]:
        direction, cidrs = s.bridge_match
        mbit = s.bridge_rate_bps / 1e6
        text += f", cross-vendor ({direction} {len(cidrs)} addrs) htb {mbit:g} Mbit/s"
    return text


def _wait_links_up(plan: NetPlan, timeout_s: float = 10.0) -> None:
    """Wait until every node interface reports carrier (veth is up once both ends are)."""
    deadline = time.monotonic() + timeout_s
    for n in plan.nodes:
        for i in n.ifaces:
            while True:
                out = run_tool(["ip", "-n", n.ns, "-o", "link", "show", i.name], check=False)
                if "LOWER_UP" in out:
                    break
                if time.monotonic() > deadline:
                    raise KernelError(
                        f"interface {i.name} in namespace {n.ns} has no carrier after "
                        f"{timeout_s:g} s"
                    )
                time.sleep(0.05)


def _kill_ns_processes(ns: str, grace_s: float = 2.0) -> List[int]:
    pids = netns_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            break
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still answers; reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def tear_down(
    state: EmulationState,
    *,
    state_dir: Optional[str] = None,
    keep_logs: bool = False,
) -> List[str]:
    """Remove everything ``state`` records: rank processes, processes inside its namespaces,
    namespaces (and so their veths and qdiscs), cpu cgroups, shared-memory directories; then the
    state file, its index entry and, unless ``keep_logs``, the rank logs. Idempotent.

    ``state`` must have passed :func:`hetcomm.emulate.state.validate_state` (``load_state`` does
    it): only names that carry the run's prefix and that its own records produce are touched.

    Returns:
        Problems that remain (empty when everything is gone).
    """
    problems: List[str] = []
    for pid in state.rank_pids:
        # After a crash long ago the pid may belong to someone else now: only a process that
        # still carries this run's id in its environment, runs as us and leads its own process
        # group (ranks get their own session) is one of our ranks.
        if not _is_our_rank(pid, state.run_id):
            continue
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.2)
    names = [n for n in state.namespaces if n.startswith(state.prefix)]
    existing = list_netns()
    # Node namespaces first (killing their processes), then the fabric.
    names.sort(key=lambda n: n.endswith("-fabric"))
    for ns in names:
        if ns not in existing:
            continue
        stuck = _kill_ns_processes(ns)
        if stuck:
            problems.append(f"processes {stuck} in namespace {ns} survived SIGKILL")
        try:
            run_tool(["ip", "netns", "delete", ns])
        except KernelError as e:
            problems.append(str(e))
    for path in state.cgroups:
        if not os.path.basename(path).startswith(state.prefix):
            continue
        problem = remove_cgroup(path)
        if problem:
            problems.append(problem)
    for d in sorted(set(state.shm_dirs)):
        problem = _remove_shm_dir(d, state.prefix)
        if problem:
            problems.append(problem)
    if state_dir is not None and not problems:
        if not keep_logs:
            shutil.rmtree(os.path.join(state_dir, f"hc{state.run_id}"), ignore_errors=True)
        try:
            os.unlink(state_path(state_dir, state.run_id))
        except FileNotFoundError:
            pass
        unregister_run(state.run_id)
    return problems


def _remove_shm_dir(d: str, prefix: str) -> Optional[str]:
    """Remove ``/dev/shm/<prefix>...`` if it is a real directory owned by us; a link or another
    user's entry there is not ours and stays."""
    if os.path.dirname(d) != SHM_ROOT or not os.path.basename(d).startswith(prefix):
        return f"{d} is not under {SHM_ROOT} with prefix {prefix}; left alone"
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return f"{d} is not a directory of yours (a link or another user's); left alone"
    # rmtree works through directory file descriptors and never follows a link inside.
    shutil.rmtree(d, ignore_errors=True)
    if os.path.lexists(d):
        return f"could not remove {d}"
    return None


def _is_our_rank(pid: int, run_id: str) -> bool:
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid() or os.getpgid(pid) != pid:
            return False
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{settings.EMULATE.name}=hc{run_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def leftovers(run_id: str) -> List[str]:
    """Anything of run ``run_id`` still present: namespaces, /dev/shm entries and cpu cgroups
    (for tests and ``status``)."""
    prefix = f"hc{run_id}-"
    found = [f"netns {n}" for n in list_netns() if n.startswith(prefix)]
    try:
        found += [f"{SHM_ROOT}/{n}" for n in os.listdir(SHM_ROOT) if n.startswith(prefix)]
    except OSError:
        pass
    h = find_cpu_hierarchy()
    found += [f"cgroup {h.root}/{n}" for n in list_run_cgroups(h) if n.startswith(prefix)]
    return found


def log(msg: str) -> None:
    """Progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)
