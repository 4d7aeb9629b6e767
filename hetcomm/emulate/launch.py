"""Run one process per rank inside its node's namespace, and wait for all of them.

Each rank runs as ``ip netns exec <node-ns> sh -c 'mount --bind <shm-dir> /dev/shm; exec CMD'``:
``ip netns exec`` already gives the process a private mount namespace, and the bind mount makes
``/dev/shm`` a per-node directory of the host (``/dev/shm/hc<id>-<node>``). Ranks of one node
share it (so the ``shm`` rail works between them, as GPUs of one box share memory), ranks of
different nodes cannot see each other's segments, and tear-down removes every segment by
removing the directory, even when a rank was killed before it could unlink.

With compute emulation a small shell in the root namespace first moves itself into the rank's
cpu cgroup (``echo $$ > <cgroup>/cgroup.procs``) and then execs ``ip netns exec ...``: the rank
and everything it starts inherit the cgroup. It is done before ``ip netns exec`` because that
remounts ``/sys`` for the namespace, which hides the host's cgroup mounts.

Environment of every rank (on top of the caller's)::

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK   torchrun's names and meanings
    MASTER_ADDR, MASTER_PORT      rank 0's address on the emulated network (its node's nic0)
    HETCOMM_CLUSTER               absolute path of the cluster YAML (rank placement comes from it)
    GLOO_SOCKET_IFNAME            the rank's rail-matched NIC: nic<LOCAL_RANK mod #NICs>, as a GPU
                                  uses its nearest NIC (p<j> in p2p mode)
    HETCOMM_EMULATE               the run id (hc<id>)
    HETCOMM_EMULATE_SCALE         the rate scale (rates on the wire are gbps * scale)
    HETCOMM_EMULATE_NODE          the node name (a100-0)
    HETCOMM_EMULATE_IFNAMES       every emulated NIC of the node, rail order (nic0,nic1,...)
    HETCOMM_EMULATE_ADDRS         their IPv4 addresses, same order
    HETCOMM_EMULATE_COMPUTE       with --compute: the node's relative speed and the rank's CPU
                                  quota, ``<speed>/<cpus>`` (``0.5/0.25``); unset otherwise
    OMP_NUM_THREADS               1 unless set: N ranks on a few cores must not oversubscribe
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, TextIO

from hetcomm.emulate.state import EmulationState, rank_cgroup_name, save_state
from hetcomm.errors import UsageError

__all__ = ["RankResult", "RunOutcome", "rank_env", "run_ranks"]

# After the first failure the other ranks get this long to exit on SIGTERM before SIGKILL.
_KILL_GRACE_S = 3.0
_POLL_S = 0.05


@dataclass(frozen=True)
class RankResult:
    """How one rank ended: ``returncode`` (negative = killed by that signal, None = still ran
    when the run ended) and where its output went."""

    rank: int
    node: str
    returncode: Optional[int]
    log_path: Optional[str]


@dataclass(frozen=True)
class RunOutcome:
    """The result of :func:`run_ranks`.

    Attributes:
        exit_code: 0 when every rank exited 0; else the first failing rank's code (128+signal
            when killed by a signal); 3 on timeout.
        first_failed_rank: rank whose failure ended the run, or None.
        timed_out: ranks still running when the timeout hit (empty when none).
        ranks: per-rank results.
        wall_s: seconds from the first launch to the end.
        message: one line saying what happened, for the user.
    """

    exit_code: int
    first_failed_rank: Optional[int]
    timed_out: List[int]
    ranks: List[RankResult]
    wall_s: float
    message: str


def rank_env(
    state: EmulationState, rank: int, base: Optional[Dict[str, str]] = None
) -> Dict[str, str]:
    """The environment rank ``rank`` runs with (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    node = _node_of(state, rank)
    rank0_node = _node_of(state, 0)
    world = sum(len(n["ranks"]) for n in state.nodes)
    ifaces = node["ifaces"]
    master = (
        rank0_node["ifaces"][0]["address"].split("/")[0] if rank0_node["ifaces"] else "127.0.0.1"
    )
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(node["ranks"].index(rank)),
        LOCAL_WORLD_SIZE=str(len(node["ranks"])),
        NODE_RANK=str(node["index"]),
        MASTER_ADDR=master,
        MASTER_PORT=str(state.master_port),
        HETCOMM_CLUSTER=state.cluster_path,
        GLOO_SOCKET_IFNAME=_rank_ifname(node, rank),
        HETCOMM_EMULATE=f"hc{state.run_id}",
        HETCOMM_EMULATE_SCALE=repr(state.scale),
        HETCOMM_EMULATE_NODE=node["node"],
        HETCOMM_EMULATE_IFNAMES=",".join(i["name"] for i in ifaces),
        HETCOMM_EMULATE_ADDRS=",".join(i["address"].split("/")[0] for i in ifaces),
    )
    if node.get("cpus") is not None:
        env["HETCOMM_EMULATE_COMPUTE"] = f"{node.get('compute_scale', 1.0):g}/{node['cpus']:g}"
    else:
        env.pop("HETCOMM_EMULATE_COMPUTE", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    # `hetcomm ...` inside a rank must be this installation's, whatever PATH the caller had.
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "/usr/bin:/bin")
    return env


def _rank_ifname(node: Dict, rank: int) -> str:
    """Rail matching: local rank k binds gloo to port k (mod the node's ports). Peers send to
    that port's address, so a multi-NIC node receives on all of its ports, the way each GPU of
    a rail-optimised node has its own NIC. In p2p mode every veth carries the node's one
    address, so the first is as good as any."""
    ifaces = node["ifaces"]
    if not ifaces:
        return "lo"
    nics = [i["name"] for i in ifaces if i["name"].startswith("nic")]  # rail order
    if not nics:
        return ifaces[0]["name"]
    return nics[node["ranks"].index(rank) % len(nics)]


def _node_of(state: EmulationState, rank: int) -> Dict:
    for n in state.nodes:
        if rank in n["ranks"]:
            return n
    raise UsageError(f"rank {rank} is not placed in emulation hc{state.run_id}")


def run_ranks(
    state: EmulationState,
    cmd: Sequence[str],
    *,
    state_dir: str,
    timeout_s: float,
    rank0_out: Optional[TextIO] = None,
) -> RunOutcome:
    """Start ``cmd`` once per rank in its node's namespace; wait for all.

    Rank 0's stdout and stderr go to ``rank0_out`` (default: this process's); every other
    rank's to ``<state_dir>/hc<id>/rank<N>.log``. The first rank to fail (non-zero exit) ends
    the run: the others get SIGTERM, then SIGKILL.

    Args:
        state: an emulation that is ``up``.
        cmd: the program and its arguments (looked up on the rank's PATH).
        state_dir: where the state file and the log directory live.
        timeout_s: wall-clock limit for the whole run.

    Raises:
        UsageError: ``cmd`` is empty or the emulation is not up.
    """
    if not cmd:
        raise UsageError(
            "nothing to run: give the command after '--', e.g. "
            "'hetcomm emulate run --cluster C.yaml -- hetcomm bench alltoall'"
        )
    if state.status != "up":
        raise UsageError(
            f"emulation hc{state.run_id} is '{state.status}', not 'up'; run 'hetcomm emulate up' "
            "first"
        )
    log_dir = os.path.join(state_dir, f"hc{state.run_id}")
    os.makedirs(log_dir, exist_ok=True)
    world = sum(len(n["ranks"]) for n in state.nodes)
    procs: Dict[int, subprocess.Popen] = {}
    logs: Dict[int, Optional[str]] = {}
    shm = {
        n["node"]: os.path.join("/dev/shm", f"hc{state.run_id}-{n['node']}") for n in state.nodes
    }
    # The recorded (and validated) cgroups, by "<node>-r<rank>".
    cgroups = {os.path.basename(c)[len(state.prefix) :]: c for c in state.cgroups}
    t0 = time.monotonic()
    try:
        for rank in range(world):
            node = _node_of(state, rank)
            argv = [
                "ip",
                "netns",
                "exec",
                node["ns"],
                "sh",
                "-c",
                'mount --bind "$0" /dev/shm && exec "$@"',
                shm[node["node"]],
                *cmd,
            ]
            cg = cgroups.get(rank_cgroup_name(node["node"], rank))
            if cg is not None:
                argv = [
                    "sh",
                    "-c",
                    'echo $$ > "$0" && exec "$@"',
                    os.path.join(cg, "cgroup.procs"),
                    *argv,
                ]
            if rank == 0:
                out = rank0_out if rank0_out is not None else None
                logs[rank] = None
                stdout = out.fileno() if out is not None else None
                stderr = subprocess.STDOUT if out is not None else None
            else:
                logs[rank] = os.path.join(log_dir, f"rank{rank}.log")
                stdout = open(logs[rank], "wb")
                stderr = subprocess.STDOUT
            try:
                # Own session per rank: tear-down can kill a rank and all it spawned by group.
                procs[rank] = subprocess.Popen(
                    argv,
                    env=rank_env(state, rank),
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    start_new_session=True,
                )
            finally:
                if rank != 0:
                    stdout.close()
            state.rank_pids.append(procs[rank].pid)
        save_state(state_dir, state)
        return _wait(procs, logs, state, timeout_s, t0)
    finally:
        _kill_all(procs)
        state.rank_pids = []
        save_state(state_dir, state)


def _wait(procs, logs, state: EmulationState, timeout_s: float, t0: float) -> RunOutcome:
    deadline = t0 + timeout_s
    first: Optional[int] = None
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        failed = [r for r, c in codes.items() if c not in (None, 0)]
        if failed and first is None:
            first = failed[0]
            break
        if all(c is not None for c in codes.values()):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    running = [r for r, p in procs.items() if p.poll() is None]
    timed_out = running if first is None and running else []
    _kill_all(procs)
    wall = time.monotonic() - t0
    results = [
        RankResult(r, _node_of(state, r)["node"], procs[r].returncode, logs[r])
        for r in sorted(procs)
    ]
    if first is not None:
        code = procs[first].returncode
        exit_code = code if code > 0 else 128 + (-code)
        how = (
            f"exited with code {code}"
            if code > 0
            else f"was killed by {signal.Signals(-code).name}"
        )
        where = _node_of(state, first)["node"]
        msg = f"rank {first} (node {where}) {how} after {wall:.1f} s; the other ranks were stopped"
        if logs[first]:
            msg += f"; its output: {logs[first]}"
        return RunOutcome(exit_code, first, [], results, wall, msg)
    if timed_out:
        msg = (
            f"ranks {timed_out} did not finish within {timeout_s:g} s (--timeout); they were "
            "killed; "
            f"check their logs in {os.path.dirname(logs[timed_out[-1]] or '') or 'the state dir'}"
        )
        return RunOutcome(3, None, timed_out, results, wall, msg)
    return RunOutcome(
        0, None, [], results, wall, f"all {len(procs)} ranks exited 0 in {wall:.1f} s"
    )


def _kill_all(procs: Dict[int, subprocess.Popen]) -> None:
    live = [p for p in procs.values() if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + _KILL_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(_POLL_S)
        live = [p for p in live if p.poll() is None]
        if not live:
            break
    for p in procs.values():
        try:
            p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass


def tail(path: Optional[str], num_lines: int = 15) -> str:
    """The last lines of a rank log (empty when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])
