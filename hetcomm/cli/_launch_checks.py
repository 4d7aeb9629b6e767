"""Checks of ``hetcomm launch``'s options and of the job after ``--``, before torchrun starts.

Anything found only inside torchrun's workers is counted as a worker failure and restarted
``--max-restarts`` times before an exit 1. Every check here raises
:class:`~hetcomm.errors.UsageError` (exit 2, one line) in the launcher, within a second.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import socket
from typing import List, Optional, Tuple

from hetcomm import settings
from hetcomm.errors import UsageError

__all__ = ["check_options", "check_rdzv_endpoint", "check_job", "job_cluster", "MAX_PROBE_BYTES"]

#: Largest health-probe message: every rank holds four buffers of it (send, receive, all-to-all
#: in and out); 256 MiB is already a bandwidth test, not a health check.
MAX_PROBE_BYTES = 256 << 20
MAX_PROBE_ITERS = 10_000
#: The workers read the delay as HETCOMM_GROUP_DELAY: one bound for the flag and the variable.
MAX_GROUP_DELAY_S: float = settings.GROUP_DELAY.maximum or 0.0


def check_options(args: argparse.Namespace) -> int:
    """Bounds of the numeric options; returns ``--probe-size`` in bytes."""
    from hetcomm.cli._args import check_nprocs
    from hetcomm.units import parse_size

    check_nprocs(args.nproc_per_node, "--nproc-per-node")
    # Without --group-size the workers read the grouped start from this environment: a bad value
    # (HETCOMM_GROUP_DELAY=1e308 overflowed time.sleep in every staggered worker) is exit 2 here.
    settings.GROUP_SIZE.get()
    settings.GROUP_DELAY.get()
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: need 0 or more (0: no restart)")
    if not 1 <= args.probe_iters <= MAX_PROBE_ITERS:
        raise UsageError(f"--probe-iters {args.probe_iters}: need 1 to {MAX_PROBE_ITERS} timed repetitions")
    probe_bytes = parse_size(args.probe_size, what="--probe-size", minimum=4, maximum=MAX_PROBE_BYTES)
    if not (math.isfinite(args.threshold) and args.threshold > 1.0):
        raise UsageError(f"--threshold {args.threshold}: need a finite factor above 1 (slow = above this x the median)")
    if not (math.isfinite(args.probe_compute) and 0.0 <= args.probe_compute <= 60.0):
        raise UsageError(f"--probe-compute {args.probe_compute}: need 0 to 60 seconds of GEMMs per rank")
    if args.group_size < 0:
        raise UsageError(f"--group-size {args.group_size}: need 0 (all at once) or more ranks per wave")
    if not (math.isfinite(args.group_delay) and 0.0 <= args.group_delay <= MAX_GROUP_DELAY_S):
        raise UsageError(f"--group-delay {args.group_delay}: need 0 to {MAX_GROUP_DELAY_S:g} seconds between waves")
    return probe_bytes


def check_rdzv_endpoint(endpoint: str) -> Tuple[str, int]:
    """``(host, port)`` of ``--rdzv-endpoint HOST:PORT``; the host must resolve."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UsageError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT with a port 1-65535, e.g. node0:29400")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port_text), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--rdzv-endpoint {endpoint!r}: host {host!r} does not resolve ({e}); "
                         "give an address every node reaches") from None
    return host, int(port_text)


def _parse_job(job: List[str], shown: List[str]) -> argparse.Namespace:
    """The job's argv parsed by hetcomm's own parser; argparse's complaint becomes one UsageError."""
    from hetcomm.cli.main import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = build_parser().parse_args(job)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        why = lines[-1] if lines else "not a hetcomm command"
        raise UsageError(f"the job after '--' ({' '.join(shown)}): {why.replace('hetcomm: error: ', '')}") from None
    if not getattr(ns, "command", None):
        raise UsageError("the job after '--' names no hetcomm subcommand (e.g. -- train --steps 100)")
    return ns


def job_cluster(launch_cluster: Optional[str], job: List[str], default: str) -> str:
    """The one cluster YAML of the job: launch's ``--cluster``, the job's
    ``--cluster``, the train config's ``cluster:``, or ``default``; two that differ are an error."""
    from hetcomm.cli.train import repo_path

    job_value = None
    if "--cluster" in job[:-1]:
        job_value = job[job.index("--cluster") + 1]
    if job_value == "detect":
        raise UsageError("the job's --cluster detect: `hetcomm launch` places ranks from a cluster YAML; "
                         "run `hetcomm discover` first and give its YAML as --cluster")
    if launch_cluster and job_value:
        a, b = os.path.realpath(repo_path(launch_cluster)), os.path.realpath(repo_path(job_value))
        if a != b:
            raise UsageError(f"launch --cluster {launch_cluster} but the job says --cluster {job_value}: "
                             "one cluster per job; give it once (to launch)")
    chosen = launch_cluster or job_value
    if chosen is None and job and job[0] == "train" and "--config" in job[:-1]:
        from hetcomm.train.loop import load_train_config

        try:
            chosen = load_train_config(repo_path(job[job.index("--config") + 1])).cluster
        except OSError as e:
            raise UsageError(f"the job's --config: {e}") from None
    return os.path.abspath(repo_path(chosen or default))


def check_job(job: List[str], cluster_path: str) -> List[str]:
    """Validate the job part (subcommand, flags, a train job's config and files) as its workers
    would; returns the job argv with ``--cluster`` set to the job's cluster."""
    args = list(job)
    if "--cluster" in args[:-1]:
        args[args.index("--cluster") + 1] = cluster_path
    else:
        args += ["--cluster", cluster_path]
    ns = _parse_job(args, job)
    if ns.command == "launch":
        raise UsageError("the job after '--' is `launch` again; give the job itself (e.g. -- train ...)")
    if ns.command == "train":
        from hetcomm.cli.train import train_config

        if ns.nprocs is not None:
            raise UsageError("the job's --nprocs: under launch the ranks are torchrun's (--nproc-per-node)")
        if ns.warmup_from is not None:
            try:
                with open(ns.warmup_from, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise UsageError(f"--warmup-from {ns.warmup_from}: cannot be read ({e.strerror or e})") from None
        train_config(ns)  # the config file and every override, checked as `hetcomm train` does
    return args
