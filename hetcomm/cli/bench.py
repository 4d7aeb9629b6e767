"""``hetcomm bench alltoall|allreduce``: nccl-tests' command line and table over torch.distributed.

Runs the collective over a real process group (``--backend hetcomm`` or ``gloo``) for a range of
message sizes and prints nccl-tests' table: ``size count type redop root`` then ``time algbw
busbw #wrong`` for out-of-place and in-place, and the ``# Out of bounds values`` / ``# Avg bus
bandwidth`` footer. ``docs/BENCH.md`` defines every number.

Two ways to start the ranks:

* ``hetcomm bench alltoall --nprocs 4`` starts 4 local processes itself (default 4, or the
  cluster YAML's rank count with ``--cluster``);
* under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) every process runs one rank and rank 0 prints.

Exit codes: 0 ok, 1 wrong results or a rank failed, 2 bad flags, 3 a rank timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Any, Dict, Optional, Tuple

from hetcomm import settings
from hetcomm.cli import _benchlib as lib
from hetcomm.cli._args import RANK_BASELINE_BYTES, check_nprocs
from hetcomm.cli._bench_output import discard_output, open_output, write_output
from hetcomm.errors import UsageError

__all__ = ["add_parser", "run", "config_from_args"]

_DEFAULT_NPROCS = 4
# Bytes each rank holds per byte of message: src, dst and scratch buffers, plus the int64
# index tensors the check builds (up to 8 bytes per element of a 1-byte type: counted as 3).
_MEMORY_FACTOR = 6
# nccl-tests has no limit, but a typo such as "-i 1" with "-e 1G" would run for days.
_MAX_ROWS = 1000


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hetcomm bench`` and its nccl-tests flags."""
    p = subparsers.add_parser(
        "bench",
        help="measure alltoall/allreduce like nccl-tests (table, busbw, #wrong)",
        description=(
            "Measure a collective over real processes and print nccl-tests' table. Sizes are "
            "bytes per rank; time is the max over ranks of each rank's mean time per "
            "iteration; busbw = algbw*(n-1)/n (alltoall) or algbw*2(n-1)/n (allreduce). "
            "See docs/BENCH.md."
        ),
    )
    p.add_argument(
        "collective",
        choices=lib.COLLECTIVES + ("compute", "dispatch", "moe"),
        help="the collective to measure, or 'compute': a GEMM and the expert FFN on this process's "
        "device (hetcomm.cli.bench_compute; -n/-w/-J/--json apply), or 'dispatch': dispatch/combine "
        "forward and backward over the communicator, per-rank percentiles and logical bandwidth "
        "(hetcomm.cli.bench_dispatch), or 'moe': the skew workloads W0-W7 under the per-rank time "
        "model (hetcomm.cli.bench_moe, --workload)",
    )
    g = p.add_argument_group("nccl-tests flags")
    g.add_argument(
        "-b",
        "--minbytes",
        default="32M",
        help="first size, bytes per rank (8, 1K, 128M, 1G; default 32M)",
    )
    g.add_argument(
        "-e", "--maxbytes", default="32M", help="last size, bytes per rank (default 32M)"
    )
    g.add_argument(
        "-f",
        "--stepfactor",
        type=int,
        default=None,
        help="multiply the size by this between rows (default 2)",
    )
    g.add_argument(
        "-i",
        "--stepbytes",
        default=None,
        help="add this many bytes between rows instead of multiplying (conflicts with -f > 1)",
    )
    g.add_argument(
        "-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)"
    )
    g.add_argument(
        "-w",
        "--warmup_iters",
        type=int,
        default=1,
        help="untimed iterations before each size's timed ones (default 1)",
    )
    g.add_argument(
        "-c",
        "--check",
        type=int,
        default=1,
        help="1: verify one extra call per size and fill #wrong; 0: skip (default 1)",
    )
    g.add_argument(
        "-d",
        "--datatype",
        default="float",
        help="int8, uint8, int32, int64, half, float, double, bfloat16 (default float)",
    )
    g.add_argument(
        "-o",
        "--op",
        default=None,
        help="allreduce reduction: sum, max, min (default sum; not for alltoall)",
    )
    g.add_argument(
        "-J",
        "--output_file",
        default=None,
        metavar="PATH",
        help="also write the result as one JSON document to PATH",
    )
    g.add_argument(
        "-T",
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="collective and rendezvous timeout in seconds (default 300)",
    )
    h = p.add_argument_group("hetcomm flags")
    h.add_argument(
        "--nprocs",
        type=int,
        default=None,
        help="start N local ranks (default: torchrun's when RANK/WORLD_SIZE are set, "
        "else the cluster's rank count with --cluster, else 4)",
    )
    h.add_argument(
        "--backend",
        choices=("hetcomm", "gloo"),
        default="hetcomm",
        help="torch.distributed backend (default hetcomm)",
    )
    h.add_argument(
        "--rails",
        default=None,
        metavar="LIST",
        help="force hetcomm rails, e.g. shm,gloo (default: chosen per peer)",
    )
    h.add_argument(
        "--cluster",
        default=None,
        metavar="YAML",
        help="cluster YAML the ranks stand for (sets HETCOMM_CLUSTER)",
    )
    h.add_argument(
        "--plan", default=None, help="hetcomm all-to-all plan (adaptive = the default, direct, auto, flat, hier, multirail)"
    )
    h.add_argument(
        "--json", action="store_true", help="print one JSON document instead of the table"
    )
    from hetcomm.cli.bench_compute import add_compute_args

    add_compute_args(p)
    from hetcomm.cli.bench_dispatch import add_dispatch_args

    add_dispatch_args(p)
    from hetcomm.cli.bench_moe import add_moe_args

    add_moe_args(p)
    return p


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _rail_and_plan_names() -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    return settings.RAIL_NAMES, settings.PLAN_NAMES


def _resolve_nprocs(args: argparse.Namespace, cluster) -> Tuple[int, bool]:
    """``(num_ranks, spawn)``: how many ranks, and whether this process starts them."""
    if _under_torchrun():
        if args.nprocs is not None:
            raise UsageError(
                "--nprocs: RANK/WORLD_SIZE are set, so this process is already one rank of a "
                "torchrun launch; drop --nprocs (torchrun's --nproc_per_node decides) or run "
                "outside torchrun"
            )
        try:
            return int(os.environ["WORLD_SIZE"]), False
        except ValueError:
            raise UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None
    if args.nprocs is not None:
        return check_nprocs(args.nprocs), True
    if cluster is not None:
        return check_nprocs(cluster.num_ranks, f"cluster '{cluster.name}' has"), True
    return _DEFAULT_NPROCS, True


def config_from_args(args: argparse.Namespace) -> Tuple[lib.BenchConfig, int, bool]:
    """Validate every flag before any process starts.

    Returns:
        ``(config, num_ranks, spawn)``: the run, the group size, and whether this process
        starts the ranks itself (False under torchrun).

    Raises:
        UsageError: a flag is invalid or conflicts with another (exit code 2).
        ConfigError: the cluster YAML is invalid (exit code 2).
    """
    minbytes = lib.parse_bytes(args.minbytes, "-b/--minbytes")
    maxbytes = lib.parse_bytes(args.maxbytes, "-e/--maxbytes")
    if minbytes > maxbytes:
        raise UsageError(
            f"-b/--minbytes {args.minbytes} ({minbytes} B) is larger than -e/--maxbytes "
            f"{args.maxbytes} ({maxbytes} B); give -e >= -b (both default to 32M)"
        )
    if args.stepbytes is not None and args.stepfactor is not None and args.stepfactor > 1:
        raise UsageError(
            f"-i/--stepbytes {args.stepbytes} and -f/--stepfactor {args.stepfactor} conflict: "
            f"sizes either grow by a factor or by a fixed step; give one of them"
        )
    stepbytes = (
        lib.parse_bytes(args.stepbytes, "-i/--stepbytes") if args.stepbytes is not None else 1 << 20
    )
    if args.stepbytes is not None and stepbytes < 1:
        raise UsageError("-i/--stepbytes must be at least 1 byte")
    if args.stepfactor is not None:
        stepfactor = args.stepfactor
        if stepfactor < 1:
            raise UsageError(f"-f/--stepfactor {stepfactor}: must be >= 2 (or 1 together with -i)")
    else:
        stepfactor = 1 if args.stepbytes is not None else 2
    if args.iters < 1:
        raise UsageError(f"-n/--iters {args.iters}: need at least 1 timed iteration")
    if args.warmup_iters < 0:
        raise UsageError(f"-w/--warmup_iters {args.warmup_iters}: must be >= 0")
    if args.check not in (0, 1):
        raise UsageError(f"-c/--check {args.check}: must be 0 (no check) or 1 (check results)")
    datatype = lib.DATATYPES.get(args.datatype.lower())
    if datatype is None:
        raise UsageError(
            f"-d/--datatype {args.datatype!r} is not supported; choose one of "
            f"int8, uint8, int32, int64, half, float, double, bfloat16"
        )
    if args.collective == "alltoall":
        if args.op is not None:
            raise UsageError(
                f"-o/--op {args.op}: alltoall does not reduce (its redop is 'none'); drop -o or "
                f"bench allreduce"
            )
        redop = "none"
    else:
        redop = (args.op or "sum").lower()
        if redop not in lib.REDOPS:
            raise UsageError(f"-o/--op {args.op!r}: choose one of {', '.join(lib.REDOPS)}")
    if not args.timeout > 0:
        raise UsageError(f"-T/--timeout {args.timeout}: must be a positive number of seconds")

    rail_names, plan_names = _rail_and_plan_names()
    rails: Optional[Tuple[str, ...]] = None
    if args.rails is not None:
        if args.backend != "hetcomm":
            raise UsageError(
                f"--rails applies to --backend hetcomm only, not {args.backend}; "
                f"drop --rails or use --backend hetcomm"
            )
        rails = tuple(r.strip() for r in args.rails.split(",") if r.strip())
        unknown = [r for r in rails if r not in rail_names]
        if not rails or unknown:
            raise UsageError(
                f"--rails {args.rails!r}: unknown rail(s) {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(rail_names)}, e.g. --rails shm,gloo"
            )
    if args.plan is not None:
        if args.backend != "hetcomm":
            raise UsageError(f"--plan applies to --backend hetcomm only, not {args.backend}")
        if args.plan not in plan_names:
            raise UsageError(f"--plan {args.plan!r}: choose one of {', '.join(plan_names)}")
        if args.collective != "alltoall":
            raise UsageError("--plan: plans apply to alltoall only")

    cluster_path = args.cluster or settings.CLUSTER.get()
    cluster = None
    if cluster_path:
        if not os.path.isfile(cluster_path):
            flag = "--cluster" if args.cluster else "HETCOMM_CLUSTER"
            raise UsageError(f"{flag} {cluster_path}: no such file")
        from hetcomm.topo.cluster import load_cluster

        cluster_path = os.path.abspath(cluster_path)
        cluster = load_cluster(cluster_path)
    num_ranks, spawn = _resolve_nprocs(args, cluster)
    if cluster is not None and cluster.num_ranks != num_ranks:
        raise UsageError(
            f"cluster '{cluster.name}' ({cluster_path}) has {cluster.num_ranks} ranks but the "
            f"run has {num_ranks}; use --nprocs {cluster.num_ranks} or another cluster file"
        )

    config = lib.BenchConfig(
        collective=args.collective,
        minbytes=minbytes,
        maxbytes=maxbytes,
        stepfactor=stepfactor,
        stepbytes=stepbytes,
        iters=args.iters,
        warmup_iters=args.warmup_iters,
        check=bool(args.check),
        datatype=datatype,
        redop=redop,
        backend=args.backend,
        rails=rails,
        cluster=cluster_path,
        plan=args.plan,
        timeout_s=float(args.timeout),
    )
    if stepfactor == 1 and (maxbytes - minbytes) // stepbytes + 1 > _MAX_ROWS:
        raise UsageError(
            f"-i/--stepbytes {args.stepbytes}: {(maxbytes - minbytes) // stepbytes + 1} sizes "
            f"between -b and -e, more than {_MAX_ROWS}; use a larger -i or -f 2"
        )
    sizes = lib.message_sizes(config, num_ranks)
    if not sizes:
        minimum = config.itemsize * (num_ranks if args.collective == "alltoall" else 1)
        raise UsageError(
            f"no size between -b {args.minbytes} and -e {args.maxbytes} holds one {datatype} "
            f"element{' per peer' if args.collective == 'alltoall' else ''}; raise -e to at "
            f"least {minimum} bytes"
        )
    if spawn:
        _check_memory(sizes[-1][0], num_ranks)
    return config, num_ranks, spawn


def _check_memory(max_size_bytes: int, num_ranks: int) -> None:
    """Refuse a run whose buffers cannot fit in this machine's available memory."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    need = (_MEMORY_FACTOR * max_size_bytes + RANK_BASELINE_BYTES) * num_ranks
    if need > available:
        raise UsageError(
            f"-e/--maxbytes: {num_ranks} ranks x {lib.format_bytes(max_size_bytes)} need about "
            f"{lib.format_bytes(need)} of memory ({_MEMORY_FACTOR} buffers and "
            f"{lib.format_bytes(RANK_BASELINE_BYTES)} of process each) but "
            f"{lib.format_bytes(available)} is available; lower -e or --nprocs"
        )


def _open_output(args: argparse.Namespace) -> Optional[IO[str]]:
    """Open ``-J PATH`` before any rank starts (:func:`hetcomm.cli._bench_output.open_output`)."""
    return open_output(args.output_file)


def _emit(result: Dict[str, Any], args: argparse.Namespace, out: Optional[IO[str]] = None) -> None:
    # The table first: a -J file that cannot be written (a full disk) must not cost the result.
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        sys.stdout.write(lib.format_table(result))
    sys.stdout.flush()
    if out is not None:
        write_output(out, result)


def _exit_code_for(result: Dict[str, Any]) -> int:
    from hetcomm.cli.main import EXIT_FINDINGS, EXIT_OK

    if result["out_of_bounds"]:
        print(
            f"hetcomm bench: {result['out_of_bounds']} wrong element(s): the collective delivered "
            f"data that differs from the known pattern (see the #wrong column)",
            file=sys.stderr,
        )
        return EXIT_FINDINGS
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Validate the flags, run the ranks, print the table (or JSON); returns the exit code."""
    if args.collective == "compute":
        from hetcomm.cli.bench_compute import run_compute

        return run_compute(args)
    if args.collective == "dispatch":
        from hetcomm.cli.bench_dispatch import run_dispatch

        if _under_torchrun():
            raise UsageError("bench dispatch starts its own ranks: run it outside torchrun, with --nprocs N")
        num_ranks, _ = _resolve_nprocs(args, None)
        return run_dispatch(args, num_ranks)
    if args.collective == "moe":
        from hetcomm.cli.bench_moe import run_moe

        return run_moe(args)
    config, num_ranks, spawn = config_from_args(args)
    if not spawn:
        return _run_under_torchrun(config, num_ranks, args)
    out = _open_output(args)
    try:
        code = _run_local(config, num_ranks, args, out)
    except BaseException:
        discard_output(out)
        raise
    if out is not None and not out.closed:
        discard_output(out)
    return code


def _run_local(config: lib.BenchConfig, num_ranks: int, args: argparse.Namespace, out: Optional[IO[str]]) -> int:
    from hetcomm.cli.main import EXIT_FINDINGS, EXIT_TIMEOUT

    env = {"HETCOMM_CLUSTER": config.cluster} if config.cluster else {}
    print(
        f"hetcomm bench: starting {num_ranks} local ranks ({config.backend}"
        + (f", rails {','.join(config.rails)}" if config.rails else "")
        + f"), {len(lib.message_sizes(config, num_ranks))} sizes",
        file=sys.stderr,
        flush=True,
    )
    outcome = lib.launch_ranks(
        "hetcomm.cli._benchlib:bench_rank_entry",
        config.to_json(),
        num_ranks,
        timeout_s=config.timeout_s,
        env=env,
    )
    if not outcome.ok:
        for failure in outcome.failures:
            kind = f"{failure.error_type}: " if failure.error_type else ""
            print(
                f"hetcomm bench: error: rank {failure.rank} failed: {kind}{failure.message}",
                file=sys.stderr,
            )
        print(
            "hetcomm bench: (set HETCOMM_BENCH_TRACEBACK=1 for the ranks' tracebacks)",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT if outcome.failures[0].is_timeout else EXIT_FINDINGS
    for warning in outcome.exit_warnings:
        print(
            f"hetcomm bench: warning: rank {warning.rank} finished its work, then died while "
            f"exiting ({warning.message}); the results above are complete, but this is a bug "
            f"in the backend's teardown",
            file=sys.stderr,
        )
    _emit(outcome.result, args, out)
    return _exit_code_for(outcome.result)


def _run_under_torchrun(config: lib.BenchConfig, num_ranks: int, args: argparse.Namespace) -> int:
    from hetcomm.cli.main import EXIT_FINDINGS, EXIT_TIMEOUT

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    out = _open_output(args) if rank == 0 else None
    try:
        result = lib.run_rank(config, rank, num_ranks, local_rank=local_rank)
    except UsageError:
        discard_output(out)
        raise
    except Exception as e:  # a failed collective: name this rank, keep the exit-code contract
        discard_output(out)
        print(f"hetcomm bench: error: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_TIMEOUT if lib.is_timeout(e) else EXIT_FINDINGS
    if rank == 0:
        _emit(result, args, out)
    return (
        _exit_code_for(result) if rank == 0 else (EXIT_FINDINGS if result["out_of_bounds"] else 0)
    )
