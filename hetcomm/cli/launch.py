"""``hetcomm launch``: a job in three phases on top of torchrun (its rendezvous and restarts).

    hetcomm launch [--cluster YAML] [--node NAME --nnodes MIN:MAX --rdzv-endpoint HOST:PORT]
                   [--nproc-per-node N] [--max-restarts R]
                   [--no-health] [--threshold 3] [--eject] [--probe-size 64K] [--probe-iters 10] [--probe-compute S]
                   [--warmup-from METRICS.jsonl] [--group-size N --group-delay S]
                   [--shrink-in-place [--grow-back]] [-- train ARGS...]

Run it once per node (like torchrun). Without ``--node`` it is a one-machine job: one
``torchrun --standalone`` with the cluster's ranks.

1. **Health check** (``hetcomm.ops.health`` under torchrun, rendezvous id ``<id>-health``):
   all-reduce, all-to-all and pairwise probes, P50/P99 per rank and link class printed; ranks and
   nodes whose best-peer time, over what its declared link class makes it take
   (:func:`hetcomm.ops.health.expected_pair_seconds`), exceeds ``--threshold`` x the median are
   reported (a node behind a declared slower bridge is not slow for it), and with
   ``--probe-compute S`` each rank's GEMM time against its device class
   (:mod:`hetcomm.ops.health_class`). With ``--eject`` a slow node's launch stops here (exit 0,
   saying so) and the others start the job with ``--nnodes <remaining>:<all>``, so torchrun's
   rendezvous completes without it; the node hosting the rendezvous store is never ejected.
2. **Warm-up**: ``--warmup-from`` a previous run's metrics file seeds every MoE layer's
   calibrator history and replicates (pages in) its hottest experts before the first step
   (passed to ``hetcomm train --warmup-from``).
3. **Grouped start**: ranks start in waves of ``--group-size`` every ``--group-delay`` seconds
   (``hetcomm.cli.launch_worker``), so a large job does not hit the store and the NICs all at once.

Before torchrun starts, every option and the job after ``--`` are checked
(:mod:`hetcomm.cli._launch_checks`: exit 2, one line). Each phase runs supervised
(:mod:`hetcomm.ops.supervise`: SIGTERM/SIGINT forwarded, SIGKILL after a grace, nothing
orphaned), and each worker leaves an end mark (:mod:`hetcomm.ops.rank_marks`) so that a failed
phase names the rank at fault. The job runs under torchrun with ``--max-restarts``: a rank that
dies makes the survivors raise (naming it), torchrun restarts every worker, and ``hetcomm train
--resume`` continues from the last checkpoint. A worker that is stopped (SIGSTOP, a debugger)
and named by its attempt's failure marks is SIGKILLed by the launch (torchrun's SIGTERM would
wait out its 30 s grace first). Exit code: the job's (0 ok, 1 a worker failed
for good, with a summary line), 2 bad usage, 128 + signal after SIGTERM/SIGINT.

With ``--shrink-in-place`` (one machine, torch >= 2.14, a ``train`` job) the job phase runs on
hetcomm's own launcher instead of torchrun (:mod:`hetcomm.cli._launch_inplace`): a rank that
dies is dropped by the survivors (``dist.shrink_group``), which finish in their processes; no
restarts. The exit code is then the lowest survivor's verdict, and the last line names the
ranks that died and those that finished in place. ``--grow-back`` (passed on to the job) also
starts a replacement in a dead rank's slot, which the survivors take back in
(:mod:`hetcomm.train.growback`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from typing import Callable, List, Optional, Tuple

from hetcomm import settings
from hetcomm.errors import UsageError

__all__ = ["add_parser", "run", "torchrun_command", "eject_plan"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "launch",
        help="start a job under torchrun: health check, warm-up, grouped start, restarts",
        description="Launch a hetcomm job on top of torchrun in three phases (health check with "
        "optional ejection of slow nodes, warm-up, grouped start) with elastic restarts; or, with "
        "--shrink-in-place on one machine, the job on hetcomm's own launcher so that the survivors of a "
        "lost rank shrink the group and finish without a restart.",
    )
    p.add_argument("--cluster", default=None, help="cluster YAML (default: $HETCOMM_CLUSTER or the demo's)")
    p.add_argument("--node", default=None, help="this node's name in the cluster YAML (multi-node jobs)")
    p.add_argument("--nnodes", default=None, help="nodes, N or MIN:MAX (default: all the cluster's nodes with --node, else 1)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks on this node (default: from the cluster)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (multi-node jobs)")
    p.add_argument("--rdzv-id", default=None, help="job id shared by every node's launch (default: random)")
    p.add_argument("--local-addr", default=None, help="this node's address other nodes reach it by (torchrun --local-addr)")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts after a worker failure (default 3)")
    p.add_argument("--shrink-in-place", action="store_true",
                   help="one machine, torch >= 2.14, a train job: run the job phase on hetcomm's own launcher instead "
                   "of torchrun, so that when a rank dies the survivors drop it (dist.shrink_group) and finish in "
                   "their processes from the in-memory snapshots (no restarts; --max-restarts does not apply; "
                   "multi-node jobs and torch 2.13 keep the restart path; docs/OPERATIONS.md)")
    p.add_argument("--grow-back", action="store_true",
                   help="with --shrink-in-place: start a replacement in a dead rank's slot, which the survivors take "
                   "back in through dist._reconfigure (passed on to the train job as --grow-back; docs/OPERATIONS.md)")
    p.add_argument("--no-health", dest="health", action="store_false", help="skip phase 1")
    p.add_argument("--threshold", type=float, default=3.0, help="slow = best-peer probe time above this x the median (default 3)")
    p.add_argument("--eject", action="store_true", help="leave slow nodes out of the job")
    p.add_argument("--probe-size", default="1M", help="bytes per probe message (default 1M: bandwidth, not latency)")
    p.add_argument("--probe-iters", type=int, default=10, help="timed repetitions per probe (default 10)")
    p.add_argument("--probe-compute", metavar="S", type=float, default=0.0,
                   help="seconds of GEMMs per rank for the per-device-class compute check (default 0: off; on a CPU "
                   "machine whose devices are labels every rank computes on the same CPU: the times are printed, "
                   "not judged; real devices or `hetcomm emulate --compute` are judged)")
    p.add_argument("--health-only", action="store_true", help="stop after phase 1 (exit 1 if anything is slow)")
    p.add_argument("--warmup-from", metavar="METRICS.jsonl", default=None, help="seed calibrators and hot experts from a previous run")
    p.add_argument("--group-size", type=int, default=0, help="ranks per start wave (0: all at once)")
    p.add_argument("--group-delay", type=float, default=0.0, help="seconds between start waves")
    p.add_argument("--work-dir", default=None, help="where launch keeps its health report and job cluster files")
    p.add_argument("job", nargs=argparse.REMAINDER, help="-- then the hetcomm subcommand and its arguments (default: train)")
    return p


def _nnodes(spec: str) -> Tuple[int, int]:
    try:
        lo, _, hi = spec.partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"--nnodes {spec!r}: expected N or MIN:MAX, e.g. 2:3") from None
    if not 1 <= a <= b:
        raise UsageError(f"--nnodes {spec!r}: need 1 <= MIN <= MAX")
    return a, b


def _is_local(host: str) -> bool:
    from hetcomm.ops.health import is_local_address

    return is_local_address(host)


def torchrun_command(
    module_args: List[str], *, nproc: int, nnodes: Tuple[int, int], rdzv_endpoint: Optional[str],
    rdzv_id: str, max_restarts: int, local_addr: Optional[str] = None,
) -> List[str]:
    """The torchrun command line for one phase (``python -m torch.distributed.run ...``)."""
    # -P: the current directory is not on torchrun's sys.path; PYTHONSAFEPATH=1 in the job's
    # environment (run) does the same for the workers torchrun starts as `python -m ...`.
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.5"]
    if rdzv_endpoint is None:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        lo, hi = nnodes
        # last_call_timeout: once MIN nodes are in, wait this long for the rest (an ejected node
        # never comes; the default 30 s would be dead time). is_host: the node whose address is
        # the endpoint hosts the rendezvous store (torch guesses it from the hostname, which
        # namespaces or multi-homed hosts share or do not resolve).
        host = "1" if _is_local(rdzv_endpoint.rsplit(":", 1)[0]) else "0"
        cmd += [f"--nnodes={lo}:{hi}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}", f"--rdzv-conf=last_call_timeout=2,join_timeout=300,is_host={host}"]
        if local_addr:
            cmd.append(f"--local-addr={local_addr}")
    return cmd + ["-m"] + module_args


def eject_plan(report: dict, verdict) -> Tuple[List[str], List[str]]:
    """``(ejected, kept)``: the slow nodes ``--eject`` leaves out, and those it must keep because
    they host the rendezvous store (ejecting that node leaves the others with no store:
    torchrun's RendezvousConnectionError after ~100 s and no step). Decided from
    the health report, which is the same on every node, so every node's launch agrees."""
    hosts = {r["node"] for r in report["ranks"] if r.get("hosts_rendezvous")}
    kept = [n for n in verdict.slow_nodes if n in hosts]
    return [n for n in verdict.slow_nodes if n not in hosts], kept


def _judge_by_class(report: dict, cluster, work: str):
    """Print and record (``health-records.jsonl``) the per-device-class verdict (hetcomm.ops.health_class)."""
    from hetcomm.ops.health_class import judge_by_class, records
    from hetcomm.topo.compute import rank_speeds

    world = report["world_size"]
    names = [r["node"] for r in report["ranks"]]
    # Ranks follow the job's node order; the declared speed is that of each rank's own node.
    by_node = {n.name: n.first_rank for n in cluster.nodes}
    speeds = [rank_speeds(cluster, [by_node[names[r]]])[0] if names[r] in by_node else 1.0 for r in range(world)]
    gemms = {r["rank"]: r["gemm_s"] for r in report["ranks"] if r.get("gemm_s")}
    if gemms and any(r.get("label_only") for r in report["ranks"]) and not settings.EMULATE_COMPUTE.get():
        # The device kinds are labels: every rank's GEMM ran on this machine's CPU, so the datasheet
        # ratios call the fastest label (an H800) slow for computing like the others, and the
        # ranks' differences are the CPU's noise (other processes), not a device's health. Not
        # judged, said so, and not a failure; `hetcomm emulate --compute` or real devices are.
        print("per device class: compute not judged: the device kinds are labels on this CPU machine (every rank's "
              "GEMM ran on the same CPU; measured ms per GEMM: "
              f"{', '.join(f'{r}:{g * 1e3:.2f}' for r, g in sorted(gemms.items()))})", flush=True)
        report = dict(report, ranks=[dict(r, gemm_s=None) for r in report["ranks"]])
    # Network: the best-peer verdict above (judge) already scores every rank by its own best link.
    verdict = judge_by_class(report, speeds)
    for s in verdict.slow:
        print(f"slow in its class: {s.line()}", flush=True)
    if not verdict.slow and verdict.compute_factor:
        print(f"per device class: no rank slower than its class (compute factors "
              f"{', '.join(f'{r}:{f:.2f}' for r, f in sorted(verdict.compute_factor.items()))})", flush=True)
    from hetcomm.ops.safe_fs import write_private

    write_private(os.path.join(work, "health-records.jsonl"), "".join(json.dumps(rec) + "\n" for rec in records(verdict)))
    return verdict


#: Longest wait, after a failure mark first names a stopped rank, for the attempt's other ranks
#: to end before the launcher kills it (they end within the heartbeat interval, about a second).
_CULPRIT_GRACE_S = 5.0


def _kill_stopped_culprits(work: str, world: int) -> Callable[[], None]:
    """A watch for the job phase: SIGKILL a worker that is stopped (SIGSTOP, a debugger: state T)
    while the survivors of its attempt failed naming it (their end marks' ``peer``).

    Why: the survivors raise and exit within a second, but torchrun's agent then stops the attempt
    with SIGTERM, which a stopped process does not act on, and only SIGKILLs it after its 30 s
    grace; the restart waits for that. Only a rank both stopped and named is killed (torchrun
    would kill it anyway), and only once every other rank of the attempt has ended, or
    :data:`_CULPRIT_GRACE_S` after the first naming: the stopped rank hosts the attempt's store,
    and a survivor still naming it when it dies meets a reset connection instead; the line names
    it (rank, pid, attempt)."""
    from hetcomm.ops.rank_marks import read_marks
    from hetcomm.ops.supervise import descendants

    killed: set = set()
    named_at: dict = {}  # attempt -> when its marks first named a culprit

    def watch() -> None:
        try:
            attempts = [int(n.split("-")[1]) for n in os.listdir(work) if n.startswith("job-") and n.endswith(".started")]
        except (OSError, ValueError):
            return
        if not attempts:
            return
        attempt = max(attempts)
        marks = read_marks(work, "job", attempt, world)
        named = {m.peer for m in marks.values() if m.status == "failed" and m.peer is not None}
        suspects = {r for r in named if marks.get(r) is None or marks[r].status == "started"}
        if not suspects:
            return
        first = named_at.setdefault(attempt, time.monotonic())
        pending = [r for r in range(world) if r not in suspects and (marks.get(r) is None or marks[r].status == "started")]
        if pending and time.monotonic() - first < _CULPRIT_GRACE_S:
            return  # the other survivors are still failing: let them name it first
        for pid in descendants(os.getpid()):
            if pid in killed:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue
            if state not in (b"T", b"t") or environ.get(b"HETCOMM_LAUNCH_DIR") != work.encode():
                continue
            try:
                rank = int(environ.get(b"RANK", b"-1"))
                restart = int(environ.get(b"TORCHELASTIC_RESTART_COUNT", b"-1"))
            except ValueError:
                continue
            if rank in suspects and restart == attempt:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                print(f"hetcomm launch: rank {rank} (pid {pid}) is stopped (state T) and attempt {attempt}'s other "
                      "ranks failed naming it: SIGKILLed so that torchrun restarts now (its SIGTERM would wait "
                      "30 s)", file=sys.stderr, flush=True)

    return watch


def _phase(cmd: List[str], env: dict, what: str, watch: Optional[Callable[[], None]] = None) -> int:
    """Run one torchrun phase supervised; a signal to the launcher stops it and ends the launch."""
    from hetcomm.ops.supervise import run_supervised

    done = run_supervised(cmd, env, watch=watch)
    if done.signum is not None:
        name = signal.Signals(done.signum).name
        extra = f"; SIGKILLed after the grace: pids {', '.join(map(str, done.killed))}" if done.killed else ""
        print(f"hetcomm launch: {name} received during the {what}; stopped torchrun and every worker{extra}",
              file=sys.stderr, flush=True)
        raise SystemExit(done.exit_code)
    return done.returncode


def run(args: argparse.Namespace) -> int:
    from hetcomm.ops.safe_fs import remove_tree

    made: List[str] = []  # the default work directory: removed when the launch ends (--work-dir is kept)
    # (id, nonce): the job's in-memory snapshots on this node, removed whatever the outcome
    jobs: List[Tuple[str, str]] = []
    try:
        return _run(args, made, jobs)
    finally:
        from hetcomm.ops.snapshot import remove_job

        for job, nonce in jobs:
            remove_job(job, nonce)
        for path in made:
            remove_tree(path)


def _reclaim(work: Optional[str], rdzv_id: str, ident: dict) -> None:
    """Record this launch as the owner of its default work directory ``work`` (None: a kept
    ``--work-dir``), then remove what dead launches of this user left (their default work
    directories, their snapshot directories on this node): a killed launch never removes them
    itself. One line when anything went."""
    from hetcomm.ops import job_identity
    from hetcomm.ops.snapshot import job_dir

    removed: List[str] = []
    if work is not None:
        me = job_identity.Launch(rdzv_id, ident[settings.LAUNCH_NONCE.name], [ident[settings.LAUNCH_OWNER.name]])
        job_identity.write_record(work, me)
        removed += job_identity.sweep(os.path.dirname(work), "", keep=work)
    shm = job_dir(rdzv_id)
    removed += job_identity.sweep(os.path.dirname(shm), f"hetcomm-{os.getuid()}-", keep=shm)
    line = job_identity.sweep_line(removed)
    if line:
        print(line, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, made: List[str], jobs: List[Tuple[str, str]]) -> int:
    from hetcomm.cli._launch_checks import check_job, check_options, check_rdzv_endpoint, job_cluster
    from hetcomm.ops.health import judge, render_report
    from hetcomm.ops.safe_fs import launch_work_dir, read_nofollow, write_private
    from hetcomm.ops.rank_marks import clear_marks, describe, give_up_line, read_marks
    from hetcomm.topo.cluster import CLUSTER_ENV, load_cluster

    # Everything is checked here, before torchrun starts: a bad value is exit 2 in a second,
    # not a worker failure restarted --max-restarts times.
    probe_bytes = check_options(args)
    job = list(args.job)
    if job and job[0] == "--":
        job = job[1:]
    job = job or ["train"]
    from hetcomm.cli import _launch_inplace

    job = _launch_inplace.check(args, job)
    cluster_path = job_cluster(args.cluster or settings.CLUSTER.get(), job, "configs/clusters/mixed-mini.yaml")
    cluster = load_cluster(cluster_path)
    if args.warmup_from:
        if job[0] != "train":
            raise UsageError("--warmup-from applies to `train` jobs")
        if "--warmup-from" in job:
            raise UsageError("--warmup-from given to launch and to the job: give it once")
        job += ["--warmup-from", os.path.abspath(args.warmup_from)]
    job = check_job(job, cluster_path)
    in_place_cfg = _launch_inplace.check_config(job) if args.shrink_in_place else None
    names = [n.name for n in cluster.nodes]
    if args.rdzv_endpoint is not None:
        check_rdzv_endpoint(args.rdzv_endpoint)
    if args.node is not None:
        if args.node not in names:
            raise UsageError(f"--node {args.node!r} is not a node of cluster '{cluster.name}' (nodes: {', '.join(names)})")
        if args.rdzv_endpoint is None:
            raise UsageError("--node needs --rdzv-endpoint HOST:PORT (the c10d rendezvous every node's launch uses)")
        expected = next(n for n in cluster.nodes if n.name == args.node).num_devices
        what = f"node {args.node} of cluster '{cluster.name}' has {expected} devices"
        lo, hi = _nnodes(args.nnodes or str(len(names)))
        if hi > len(names):
            raise UsageError(f"--nnodes {args.nnodes}: cluster '{cluster.name}' has {len(names)} nodes")
    else:
        if args.rdzv_endpoint is not None:
            raise UsageError("--rdzv-endpoint without --node: give every node's launch its --node name")
        if args.nnodes is not None and _nnodes(args.nnodes) != (1, 1):
            raise UsageError(f"--nnodes {args.nnodes} without --node: a one-machine job is one node; "
                             "run one launch per node with --node and --rdzv-endpoint")
        expected = cluster.num_ranks
        what = f"cluster '{cluster.name}' has {expected} ranks"
        lo, hi = 1, 1
    if args.nproc_per_node is not None and args.nproc_per_node != expected:
        raise UsageError(f"--nproc-per-node {args.nproc_per_node}: {what}; the ranks follow the cluster YAML "
                         f"(omit the flag, or give a cluster with {args.nproc_per_node})")
    nproc = expected
    rdzv_id = args.rdzv_id or uuid.uuid4().hex[:8]
    work = launch_work_dir(args.work_dir, rdzv_id)  # private, never reused from someone else
    from hetcomm.ops.job_identity import new_launch_env

    ident = new_launch_env()  # which launch the snapshots are: restored by its restarts only
    if args.work_dir is None:
        made.append(work)
    _reclaim(work if args.work_dir is None else None, rdzv_id, ident)
    env = dict(os.environ)
    env[CLUSTER_ENV] = cluster_path
    env["HETCOMM_LAUNCH_DIR"] = work
    env[settings.JOB_ID.name] = rdzv_id  # names the job's snapshot segments in /dev/shm (hetcomm.ops.snapshot)
    env.update(ident)
    from hetcomm.ops.snapshot import check_job_dir

    check_job_dir(rdzv_id)  # another user's directory at that name: exit 2 now, never used or removed
    jobs.append((rdzv_id, ident[settings.LAUNCH_NONCE.name]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONSAFEPATH"] = "1"  # torchrun's `python -m hetcomm.cli.launch_worker` must not import ./hetcomm
    if args.node:
        env["HETCOMM_NODE"] = args.node
    if args.rdzv_endpoint is not None:
        # torch 2.13's c10d rendezvous shares its TCPStore with the workers and builds that
        # store's address once per agent (DynamicRendezvousHandler._bootstrap_store_info): a node
        # that joins a later round (a lost node back, growing the job) waits for a MASTER_ADDR key
        # the cached rank 0 never writes, and the round times out after 60 s on every node
        # (benchmarks/README.md, "Elastic shrink ..."). torch's own opt-out builds it every round;
        # the workers then host their store on rank 0 (hetcomm.ops.worker.fresh_store's case).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    where = f"node {args.node}" if args.node else "this machine"

    # -- phase 1: health check ------------------------------------------------------------
    if args.health:
        out = os.path.join(work, f"health-{args.node or 'local'}.json")
        probe = ["hetcomm.ops.health", "--out", out, "--size", str(probe_bytes), "--iters", str(args.probe_iters),
                 "--marks", work, "--compute-s", str(args.probe_compute)]
        if args.rdzv_endpoint is not None:
            probe += ["--rdzv-host", args.rdzv_endpoint.rsplit(":", 1)[0]]
        cmd = torchrun_command(
            probe, nproc=nproc, nnodes=(hi, hi), rdzv_endpoint=args.rdzv_endpoint, rdzv_id=f"{rdzv_id}-health", max_restarts=0,
            local_addr=args.local_addr,
        )
        print(f"hetcomm launch: phase 1, health check on {where}", file=sys.stderr, flush=True)
        clear_marks(work, "health")
        code = _phase(cmd, env, "health check")
        if code != 0:
            world = nproc if args.node is None else None  # multi-node: only this node's marks are here
            why = describe(read_marks(work, "health", 0, cluster.num_ranks), world)
            print(f"hetcomm launch: the health check failed (torchrun exit {code}): {why}; not starting the job",
                  file=sys.stderr)
            return 1
        report = json.loads(read_nofollow(out, limit=64 << 20, what="health report"))
        verdict = judge(report, args.threshold)
        print(render_report(report, verdict), flush=True)
        by_class = _judge_by_class(report, cluster, work)
        write_private(os.path.join(work, "verdict.json"),
                      json.dumps({"slow_nodes": verdict.slow_nodes, "slow_ranks": verdict.slow_ranks,
                                  "slow_in_class": [s.rank for s in by_class.slow]}))
        if args.health_only:
            return 1 if (verdict.slow_nodes or verdict.slow_ranks or by_class.slow) else 0
        if args.eject and verdict.slow_nodes:
            ejected, kept = eject_plan(report, verdict)
            if kept:
                print(f"hetcomm launch: node {', '.join(kept)} is slow but hosts the rendezvous store "
                      f"(--rdzv-endpoint {args.rdzv_endpoint}): not ejected; put the endpoint on a fast node "
                      "to eject it", file=sys.stderr, flush=True)
            if args.node is None:
                print("hetcomm launch: --eject needs one launch per node (--node); one-machine jobs only report",
                      file=sys.stderr)
            elif args.node in ejected:
                print(f"hetcomm launch: node {args.node} is slow and ejected (--eject); the job starts without it",
                      flush=True)
                return 0
            elif ejected:
                hi_left = hi - len(ejected)
                lo = hi_left  # start as soon as every remaining node is in; MAX stays (torchrun's elasticity)
                print(f"hetcomm launch: ejected {', '.join(ejected)}; starting on {hi_left} node(s)", flush=True)

    # -- phase 2: warm-up (in the job's arguments); phase 3: grouped start ------------------
    if args.group_size:
        env["HETCOMM_GROUP_SIZE"] = str(args.group_size)
        env["HETCOMM_GROUP_DELAY"] = str(args.group_delay)
    if in_place_cfg is not None:
        clear_marks(work, "job")
        return _launch_inplace.run_job(job, in_place_cfg, nproc, env)
    cmd = torchrun_command(
        ["hetcomm.cli.launch_worker"] + job, nproc=nproc, nnodes=(lo, hi), rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=rdzv_id, max_restarts=args.max_restarts, local_addr=args.local_addr,
    )
    print(f"hetcomm launch: starting the job on {where}: {' '.join(job)}", file=sys.stderr, flush=True)
    exit_file = os.path.join(work, "job-exit")
    if os.path.exists(exit_file):
        os.unlink(exit_file)
    clear_marks(work, "job")
    code = _phase(cmd, env, "job", _kill_stopped_culprits(work, cluster.num_ranks))
    if code != 0:
        # torchrun gave up: a worker kept failing after this node's agent spent its restarts.
        world = nproc if args.node is None else None
        print(f"hetcomm launch: {give_up_line(work, args.max_restarts, code, cluster.num_ranks, world)}",
              file=sys.stderr, flush=True)
        return 1
    try:
        return int(read_nofollow(exit_file, limit=64, what="job exit file").strip() or 0)
    except FileNotFoundError:
        return 0  # rank 0 ran on another node: its launch reports the job's own exit code
