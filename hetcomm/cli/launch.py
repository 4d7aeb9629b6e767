"""``hetcomm launch``: a job in three phases on top of torchrun (its rendezvous and restarts).

    hetcomm launch [--cluster YAML] [--node NAME --nnodes MIN:MAX --rdzv-endpoint HOST:PORT]
                   [--nproc-per-node N] [--max-restarts R]
                   [--no-health] [--threshold 3] [--eject] [--probe-size 64K] [--probe-iters 10]
                   [--warmup-from METRICS.jsonl] [--group-size N --group-delay S]
                   [-- train ARGS...]

Run it once per node (like torchrun). Without ``--node`` it is a one-machine job: one
``torchrun --standalone`` with the cluster's ranks.

1. **Health check** (``hetcomm.ops.health`` under torchrun, rendezvous id ``<id>-health``):
   all-reduce, all-to-all and pairwise probes, P50/P99 per rank and link class printed; ranks and
   nodes whose best-peer time exceeds ``--threshold`` x the median are reported. With
   ``--eject`` a slow node's launch stops here (exit 0, saying so) and the others start the job
   with ``--nnodes <remaining>:<all>``, so torchrun's rendezvous completes without it.
2. **Warm-up**: ``--warmup-from`` a previous run's metrics file seeds every MoE layer's
   calibrator history and replicates (pages in) its hottest experts before the first step
   (passed to ``hetcomm train --warmup-from``).
3. **Grouped start**: ranks start in waves of ``--group-size`` every ``--group-delay`` seconds
   (``hetcomm.cli.worker``), so a large job does not hit the store and the NICs all at once.

The job runs under torchrun with ``--max-restarts``: a rank that dies makes the survivors raise
(naming it), torchrun restarts every worker, and ``hetcomm train --resume`` continues from the
last checkpoint. Exit code: torchrun's (0 ok, 1 a worker failed for good), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from typing import List, Optional, Tuple

from hetcomm import settings
from hetcomm.errors import UsageError

__all__ = ["add_parser", "run", "torchrun_command"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "launch",
        help="start a job under torchrun: health check, warm-up, grouped start, restarts",
        description="Launch a hetcomm job on top of torchrun in three phases (health check with "
        "optional ejection of slow nodes, warm-up, grouped start) with elastic restarts.",
    )
    p.add_argument("--cluster", default=None, help="cluster YAML (default: $HETCOMM_CLUSTER or the demo's)")
    p.add_argument("--node", default=None, help="this node's name in the cluster YAML (multi-node jobs)")
    p.add_argument("--nnodes", default=None, help="nodes, N or MIN:MAX (default: all the cluster's nodes with --node, else 1)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks on this node (default: from the cluster)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (multi-node jobs)")
    p.add_argument("--rdzv-id", default=None, help="job id shared by every node's launch (default: random)")
    p.add_argument("--local-addr", default=None, help="this node's address other nodes reach it by (torchrun --local-addr)")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts after a worker failure (default 3)")
    p.add_argument("--no-health", dest="health", action="store_false", help="skip phase 1")
    p.add_argument("--threshold", type=float, default=3.0, help="slow = best-peer probe time above this x the median (default 3)")
    p.add_argument("--eject", action="store_true", help="leave slow nodes out of the job")
    p.add_argument("--probe-size", default="1M", help="bytes per probe message (default 1M: bandwidth, not latency)")
    p.add_argument("--probe-iters", type=int, default=10, help="timed repetitions per probe (default 10)")
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
    """Whether ``host`` is an address of this machine (or network namespace): it can be bound."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


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


def run(args: argparse.Namespace) -> int:
    from hetcomm.ops.safe_fs import remove_tree

    made: List[str] = []  # the default work directory: removed when the launch ends (--work-dir is kept)
    try:
        return _run(args, made)
    finally:
        for path in made:
            remove_tree(path)


def _run(args: argparse.Namespace, made: List[str]) -> int:
    from hetcomm.cli.train import repo_path
    from hetcomm.ops.safe_fs import launch_work_dir, read_nofollow, write_private
    from hetcomm.ops.health import judge, render_report
    from hetcomm.topo.cluster import CLUSTER_ENV, load_cluster
    from hetcomm.units import parse_size

    cluster_path = os.path.abspath(repo_path(args.cluster or settings.CLUSTER.get() or "configs/clusters/mixed-mini.yaml"))
    cluster = load_cluster(cluster_path)
    job = list(args.job)
    if job and job[0] == "--":
        job = job[1:]
    job = job or ["train"]
    names = [n.name for n in cluster.nodes]
    if args.node is not None:
        if args.node not in names:
            raise UsageError(f"--node {args.node!r} is not a node of cluster '{cluster.name}' (nodes: {', '.join(names)})")
        if args.rdzv_endpoint is None:
            raise UsageError("--node needs --rdzv-endpoint HOST:PORT (the c10d rendezvous every node's launch uses)")
        nproc = args.nproc_per_node or next(n for n in cluster.nodes if n.name == args.node).num_devices
        lo, hi = _nnodes(args.nnodes or str(len(names)))
    else:
        if args.rdzv_endpoint is not None:
            raise UsageError("--rdzv-endpoint without --node: give every node's launch its --node name")
        nproc = args.nproc_per_node or cluster.num_ranks
        lo, hi = 1, 1
    rdzv_id = args.rdzv_id or uuid.uuid4().hex[:8]
    work = launch_work_dir(args.work_dir, rdzv_id)  # private, never reused from someone else
    if args.work_dir is None:
        made.append(work)
    env = dict(os.environ)
    env[CLUSTER_ENV] = cluster_path
    env["HETCOMM_LAUNCH_DIR"] = work
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONSAFEPATH"] = "1"  # torchrun's `python -m hetcomm.ops.worker` must not import ./hetcomm
    if args.node:
        env["HETCOMM_NODE"] = args.node
    where = f"node {args.node}" if args.node else "this machine"

    # -- phase 1: health check ------------------------------------------------------------
    if args.health:
        out = os.path.join(work, f"health-{args.node or 'local'}.json")
        cmd = torchrun_command(
            ["hetcomm.ops.health", "--out", out, "--size", str(parse_size(args.probe_size)), "--iters", str(args.probe_iters)],
            nproc=nproc, nnodes=(hi, hi), rdzv_endpoint=args.rdzv_endpoint, rdzv_id=f"{rdzv_id}-health", max_restarts=0,
            local_addr=args.local_addr,
        )
        print(f"hetcomm launch: phase 1, health check on {where}", file=sys.stderr, flush=True)
        code = subprocess.call(cmd, env=env)
        if code != 0:
            print(f"hetcomm launch: the health check failed (torchrun exit {code}); not starting the job", file=sys.stderr)
            return 1
        report = json.loads(read_nofollow(out, limit=64 << 20, what="health report"))
        verdict = judge(report, args.threshold)
        print(render_report(report, verdict), flush=True)
        write_private(os.path.join(work, "verdict.json"),
                      json.dumps({"slow_nodes": verdict.slow_nodes, "slow_ranks": verdict.slow_ranks}))
        if args.health_only:
            return 1 if (verdict.slow_nodes or verdict.slow_ranks) else 0
        if args.eject and verdict.slow_nodes:
            if args.node in verdict.slow_nodes:
                print(f"hetcomm launch: node {args.node} is slow and ejected (--eject); the job starts without it",
                      flush=True)
                return 0
            if args.node is None:
                print("hetcomm launch: --eject needs one launch per node (--node); one-machine jobs only report",
                      file=sys.stderr)
            else:
                hi_left = hi - len(verdict.slow_nodes)
                lo = hi_left  # start as soon as every remaining node is in; MAX stays (torchrun's elasticity)
                print(f"hetcomm launch: ejected {', '.join(verdict.slow_nodes)}; starting on {hi_left} node(s)",
                      flush=True)

    # -- phase 2: warm-up; phase 3: grouped start -----------------------------------------
    if args.warmup_from:
        if job[0] != "train":
            raise UsageError("--warmup-from applies to `train` jobs")
        job += ["--warmup-from", os.path.abspath(args.warmup_from)]
    if args.group_size:
        env["HETCOMM_GROUP_SIZE"] = str(args.group_size)
        env["HETCOMM_GROUP_DELAY"] = str(args.group_delay)
    cmd = torchrun_command(
        ["hetcomm.cli.worker"] + job, nproc=nproc, nnodes=(lo, hi), rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=rdzv_id, max_restarts=args.max_restarts, local_addr=args.local_addr,
    )
    print(f"hetcomm launch: starting the job on {where}: {' '.join(job)}", file=sys.stderr, flush=True)
    exit_file = os.path.join(work, "job-exit")
    if os.path.exists(exit_file):
        os.unlink(exit_file)
    code = subprocess.call(cmd, env=env)
    if code != 0:
        return 1  # torchrun gave up: a worker kept failing after --max-restarts restarts
    try:
        return int(read_nofollow(exit_file, limit=64, what="job exit file").strip() or 0)
    except FileNotFoundError:
        return 0  # rank 0 ran on another node: its launch reports the job's own exit code
