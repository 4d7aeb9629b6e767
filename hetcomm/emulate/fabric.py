"""Build and remove an emulated cluster in the kernel: namespaces, veths, bridges, shapers.

:func:`bring_up` records every name in the state file first, then creates the objects; any
failure on the way tears down what exists and re-raises. :func:`tear_down` works from the state
file alone (plus a sweep of names carrying the run's prefix), so it also cleans up after a crash.
Deleting a namespace only frees its interfaces once no process lives in it, so tear-down kills
the processes inside first.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import time
from typing import Callable, List, Optional

from hetcomm.emulate.kernel import KernelError, batch, list_netns, netns_pids, run_tool
from hetcomm.emulate.spec import NetPlan, Shaper
from hetcomm.emulate.state import EmulationState, load_state, save_state, state_path

__all__ = ["new_run_id", "bring_up", "tear_down", "leftovers", "shm_dir_for", "SHM_ROOT"]

SHM_ROOT = "/dev/shm"
# Smallest tbf bucket: one 64 KiB GSO super-packet must fit, or tbf would have to split every
# TCP segment veth hands it (it can, but the bucket then also caps the shaper's accuracy).
_MIN_BURST_BYTES = 64 * 1024
# HTB quantum: one full-size GSO packet per round; the default (rate/r2q) is far too big here.
_HTB_QUANTUM = 65536


def new_run_id() -> str:
    """Six random hex digits (``3f9a1c``)."""
    return secrets.token_hex(3)


def shm_dir_for(run_id: str, node: str) -> str:
    """Host directory bind-mounted as ``/dev/shm`` for the ranks of ``node``."""
    return os.path.join(SHM_ROOT, f"hc{run_id}-{node}")


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
    """
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
        os.makedirs(d, mode=0o1777, exist_ok=True)
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
    sweep: bool = True,
    keep_logs: bool = False,
) -> List[str]:
    """Remove everything ``state`` lists (and, with ``sweep``, anything else named with its
    prefix): rank processes, processes inside its namespaces, namespaces (and so their veths and
    qdiscs), shared-memory directories; then the state file and, unless ``keep_logs``, the rank
    logs. Idempotent.

    Returns:
        Problems that remain (empty when everything is gone).
    """
    problems: List[str] = []
    for pid in state.rank_pids:
        # After a crash long ago the pid may belong to someone else now: only a process that
        # still carries this run's id in its environment is one of our ranks.
        if not _is_our_rank(pid, state.run_id):
            continue
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.2)
    names = list(state.namespaces)
    existing = list_netns()
    if sweep:
        names += [n for n in existing if n.startswith(state.prefix) and n not in names]
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
    shm = list(state.shm_dirs)
    if sweep:
        try:
            shm += [
                os.path.join(SHM_ROOT, n)
                for n in os.listdir(SHM_ROOT)
                if n.startswith(state.prefix)
            ]
        except OSError:
            pass
    for d in sorted(set(shm)):
        shutil.rmtree(d, ignore_errors=True)
        if os.path.exists(d):
            problems.append(f"could not remove {d}")
    if state_dir is not None and not problems:
        if not keep_logs:
            shutil.rmtree(os.path.join(state_dir, f"hc{state.run_id}"), ignore_errors=True)
        try:
            os.unlink(state_path(state_dir, state.run_id))
        except FileNotFoundError:
            pass
    return problems


def _is_our_rank(pid: int, run_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"HETCOMM_EMULATE=hc{run_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def leftovers(run_id: str) -> List[str]:
    """Anything of run ``run_id`` still present: namespaces and /dev/shm entries (for tests and
    ``status``)."""
    prefix = f"hc{run_id}-"
    found = [f"netns {n}" for n in list_netns() if n.startswith(prefix)]
    try:
        found += [f"{SHM_ROOT}/{n}" for n in os.listdir(SHM_ROOT) if n.startswith(prefix)]
    except OSError:
        pass
    return found


def load_and_tear_down(path: str, state_dir: str) -> List[str]:
    """Tear down the emulation a state file describes."""
    return tear_down(load_state(path), state_dir=state_dir)


def log(msg: str) -> None:
    """Progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)
