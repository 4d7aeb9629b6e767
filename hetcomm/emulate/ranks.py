"""Run one process per rank inside its node's namespace, and wait for all of them.

The ranks are started and watched by the one launcher (:func:`hetcomm.launcher.launch`, as for
``bench``, ``train`` and the tests); this module supplies what is emulate's own: each rank's
command prefix (below), its environment, its log file, and the run's exit code and message.

Each rank runs as ``ip netns exec <node-ns> sh -c 'mount --bind <shm-dir> /dev/shm; exec CMD'``:
``ip netns exec`` already gives the process a private mount namespace, and the bind mount makes
``/dev/shm`` a per-node directory of the host (``/dev/shm/hc<id>-<node>``). Ranks of one node
share it (so the ``shm`` rail works between them, as GPUs of one box share memory), ranks of
different nodes cannot see each other's segments, and tear-down removes every segment by
removing the directory, even when a rank was killed before it could unlink.

With compute emulation a small shell in the root namespace first moves itself into the rank's
cpu cgroup (``echo $$ > <cgroup>/cgroup.procs``) and then execs ``ip netns exec ...``: the rank
and everything it starts inherit the cgroup. It is done before ``ip netns exec`` because that
remounts ``/sys`` for the namespace, which hides the host's cgroup mounts. Under a host share the
shell also moves its one thread into the rank's ``device`` child, so the rank's main (training)
thread starts there, and the run moves every other thread of the rank back out while it runs
(:class:`_HostThreadSweeper`). The rank is also pinned
to one core (``taskset -c``), rank ``r`` on the ``r mod n``-th of the ``n`` cores this process may
use (two ranks a core for four ranks on two): a rank free to run on every core spreads its quota
over all of them, and its time then depends on where its neighbours run as much as on its quota.

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
                                  (the rank is then also pinned to one core, above)
    OMP_NUM_THREADS               1 unless set: N ranks on a few cores must not oversubscribe
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, TextIO, Union

from hetcomm.emulate.cgroup import device_cgroup_dir, release_host_threads
from hetcomm.emulate.kernel import KernelError
from hetcomm.emulate.state import EmulationState, rank_cgroup_name, save_state
from hetcomm.errors import UsageError

__all__ = ["RankResult", "RunOutcome", "rank_env", "run_ranks"]

# After the first failure the other ranks get this long to exit on SIGTERM before SIGKILL.
_KILL_GRACE_S = 3.0
# How often host threads are moved out of the device cgroups (a thread started by the training
# thread runs at the device's quota until then; each sweep reads one small file per rank).
_SWEEP_S = 0.05


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
    the run: the others get SIGTERM, then SIGKILL. The ranks are started by the one launcher
    (:func:`hetcomm.launcher.launch`); the namespace, ``/dev/shm`` and cgroup wrappers are its
    per-rank command prefix.

    Args:
        state: an emulation that is ``up``.
        cmd: the program and its arguments (looked up on the rank's PATH).
        state_dir: where the state file and the log directory live.
        timeout_s: wall-clock limit for the whole run.

    Raises:
        UsageError: ``cmd`` is empty or the emulation is not up.
    """
    from hetcomm.launcher import launch

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
    logs: Dict[int, Optional[str]] = {
        r: (None if r == 0 else os.path.join(log_dir, f"rank{r}.log")) for r in range(world)
    }
    outputs: Dict[int, Union[str, int]] = {r: p for r, p in logs.items() if p is not None}
    if rank0_out is not None:
        outputs[0] = rank0_out.fileno()

    sweeper = _HostThreadSweeper(_device_split_cgroups(state))

    def on_start(rank: int, pid: int) -> None:
        state.rank_pids.append(pid)
        sweeper.add_main_thread(pid)
        if rank == world - 1:
            save_state(state_dir, state)

    sweeper.start()
    try:
        outcome = launch(
            list(cmd),
            world,
            prefix=lambda rank: _rank_prefix(state, rank),
            rank_env=lambda rank: _launch_env(state, rank),
            logs=outputs,
            timeout_s=timeout_s,
            grace_s=0.0,
            kill_grace_s=_KILL_GRACE_S,
            # A killed `run` leaves its ranks to `hetcomm emulate down`, which reads rank_pids.
            die_with_launcher=False,
            name="emulate",
            on_start=on_start,
        )
    finally:
        sweeper.stop()
        state.rank_pids = []
        save_state(state_dir, state)
    return _run_outcome(state, outcome, logs, timeout_s)


def _device_split_cgroups(state: EmulationState) -> List[str]:
    """The rank cgroups whose training thread runs in a ``device`` child (a host share)."""
    return [c for c in state.cgroups if os.path.isdir(device_cgroup_dir(c))]


class _HostThreadSweeper:
    """Keeps every thread but the ranks' training threads out of their ``device`` cgroups while
    the ranks run (:mod:`hetcomm.emulate.cgroup`, host threads not slowed). A thread starts in
    its creator's cgroup, so one started by the training thread runs at the device's quota until
    the next sweep, at most :data:`_SWEEP_S` later."""

    def __init__(self, cgroups: Sequence[str]) -> None:
        self._cgroups = list(cgroups)
        self._main: List[int] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def add_main_thread(self, pid: int) -> None:
        # A rank's wrapper execs down to the rank itself, so its pid is the training thread's id.
        self._main.append(pid)

    def start(self) -> None:
        if self._cgroups:
            self._thread = threading.Thread(target=self._run, name="emulate-host-threads", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _SWEEP_S)

    def _run(self) -> None:
        while not self._stop.wait(_SWEEP_S):
            main = frozenset(self._main)
            for cg in self._cgroups:
                try:
                    release_host_threads(cg, main)
                except KernelError as e:
                    print(f"emulate: host threads of {cg} stay at the device's quota: {e}", file=sys.stderr)
                    self._cgroups.remove(cg)
                    break


def _rank_prefix(state: EmulationState, rank: int) -> List[str]:
    """The wrapper a rank's command runs in: its node's namespace with the node's ``/dev/shm``
    bound over ``/dev/shm`` and, with compute emulation, its cpu cgroup (module docstring)."""
    node = _node_of(state, rank)
    shm = os.path.join("/dev/shm", f"hc{state.run_id}-{node['node']}")
    argv = ["ip", "netns", "exec", node["ns"], "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', shm]
    # The recorded (and validated) cgroups, by "<node>-r<rank>".
    cgroups = {os.path.basename(c)[len(state.prefix) :]: c for c in state.cgroups}
    cg = cgroups.get(rank_cgroup_name(node["node"], rank))
    if cg is not None and os.path.isdir(device_cgroup_dir(cg)):
        # The rank in its cgroup, then its one thread (the training thread to be) in `device`.
        argv = ["sh", "-c", 'echo $$ > "$0" && echo $$ > "$1" && shift && exec "$@"',
                os.path.join(cg, "cgroup.procs"), os.path.join(device_cgroup_dir(cg), "tasks"),
                "taskset", "-c", str(rank_core(rank)), *argv]
    elif cg is not None:
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(cg, "cgroup.procs"),
                "taskset", "-c", str(rank_core(rank)), *argv]
    return argv


def rank_core(rank: int) -> int:
    """The core a compute-emulated rank is pinned to: the ``rank mod n``-th of the ``n`` cores
    this process may run on (module docstring)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[rank % len(cores)]


def _launch_env(state: EmulationState, rank: int) -> Dict[str, Optional[str]]:
    env: Dict[str, Optional[str]] = dict(rank_env(state, rank))
    env.setdefault("HETCOMM_EMULATE_COMPUTE", None)  # unset unless this run emulates compute
    return env


def _run_outcome(state: EmulationState, outcome, logs: Dict[int, Optional[str]], timeout_s: float) -> RunOutcome:
    wall = outcome.wall_s
    results = [RankResult(r.rank, _node_of(state, r.rank)["node"], r.exitcode, logs[r.rank]) for r in outcome.ranks]
    first = outcome.first_failure
    if first is not None:
        code = outcome.ranks[first].exitcode
        code = code if code is not None else -signal.SIGKILL  # unreapable: reported as killed
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
    timed_out = list(outcome.timed_out)
    if timed_out:
        msg = (
            f"ranks {timed_out} did not finish within {timeout_s:g} s (--timeout); they were "
            "killed; "
            f"check their logs in {os.path.dirname(logs[timed_out[-1]] or '') or 'the state dir'}"
        )
        return RunOutcome(3, None, timed_out, results, wall, msg)
    return RunOutcome(
        0, None, [], results, wall, f"all {len(results)} ranks exited 0 in {wall:.1f} s"
    )


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
