"""Measurement code behind ``hetcomm bench``: sizes, data patterns, timing loop, table, JSON.

Split along its seams: :mod:`._bench_config` (flags -> :class:`BenchConfig`,
sizes), :mod:`._bench_workload` (data patterns, timed calls, #wrong), :mod:`._bench_measure`
(one rank's run, the merge), :mod:`._bench_table` (the table); this module launches local ranks
and re-exports the public names, so ``from hetcomm.cli import _benchlib as lib`` keeps working.

The metrics follow nccl-tests (``doc/PERFORMANCE.md``); ``docs/BENCH.md`` defines every printed
number. Notation used below::

    n      number of ranks in the group
    size   bytes per rank: what one rank sends (alltoall) or reduces (allreduce)
    count  elements per rank, ``size // itemsize`` (alltoall: rounded down to a multiple of n)
    time   seconds per iteration: each rank times ``iters`` back-to-back calls and divides by
           ``iters``; the table shows the maximum of that mean over the ranks
    algbw  size / time
    busbw  algbw * (n-1)/n (alltoall) or algbw * 2(n-1)/n (allreduce)

A run is one process per rank. ``run_rank`` is the body of a rank, whether the rank was started
by ``hetcomm bench --nprocs N`` (see ``hetcomm.cli.bench``) or by torchrun; rank 0 returns the
merged result, which :func:`format_table` renders as the nccl-tests table.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from hetcomm import launcher as _launcher
from hetcomm import settings
from hetcomm.cli._bench_config import *  # noqa: F401,F403
from hetcomm.cli._bench_config import (  # noqa: F401  (private names the CLI and tests use)
    _ITEMSIZE, _TORCH_DTYPE, BenchConfig, COLLECTIVES, DATATYPES, KNOWN_RAILS, REDOPS, bus_factor, format_bytes,
    message_sizes, parse_bytes,
)
from hetcomm.cli._bench_measure import _merge, machine_description, run_rank  # noqa: F401
from hetcomm.cli._bench_table import format_table  # noqa: F401
from hetcomm.cli._bench_workload import (  # noqa: F401
    allreduce_expected, allreduce_input, alltoall_expected, alltoall_input, count_wrong,
)
from hetcomm.errors import UsageError

__all__ = [
    "COLLECTIVES",
    "DATATYPES",
    "KNOWN_RAILS",
    "REDOPS",
    "BenchConfig",
    "parse_bytes",
    "format_bytes",
    "message_sizes",
    "bus_factor",
    "machine_description",
    "run_rank",
    "format_table",
    "alltoall_input",
    "alltoall_expected",
    "allreduce_input",
    "allreduce_expected",
    "count_wrong",
    "launch_ranks",
    "run_local",
    "LaunchResult",
    "RankFailure",
]

# -- launching local ranks ----------------------------------------------------------------------
# Ranks are started by the one launcher (hetcomm.launcher, start="exec"): separate Python processes
# like torchrun's, not forks, so each one imports torch itself and owns its threads. The launcher
# hosts the TCPStore (no free-port race); every rank connects to it as a client. This layer keeps
# bench's view of a launch: rank 0's result, the failures root cause first, exit warnings.

is_timeout = _launcher.is_timeout


@dataclass(frozen=True)
class RankFailure:
    """One rank that did not finish.

    Attributes:
        rank: its global rank.
        exit_code: process exit status (negative: killed by that signal).
        error_type: class name of the exception it raised, or None when it died without one.
        message: the exception message or a description of the death.
        is_timeout: the failure is a timeout (exit code 3 for the command).
        killed_by_launcher: it was still running after another rank failed and was stopped.
    """

    rank: int
    exit_code: int
    error_type: Optional[str]
    message: str
    is_timeout: bool
    killed_by_launcher: bool = False


@dataclass(frozen=True)
class LaunchResult:
    """Outcome of :func:`launch_ranks`: rank 0's return value or the failures.

    Attributes:
        result: rank 0's return value (None when a rank failed).
        failures: ranks that did not finish, the first failure first.
        exit_warnings: ranks that finished their work (result reported, group destroyed) and then
            died while the interpreter shut down, e.g. a C++ thread aborting in a destructor. The
            result stands; the crash is reported, never hidden.
    """

    result: Any
    failures: Tuple[RankFailure, ...]
    exit_warnings: Tuple[RankFailure, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures


def launch_ranks(
    target: str,
    payload: str,
    num_ranks: int,
    *,
    timeout_s: float,
    env: Optional[Dict[str, str]] = None,
    grace_s: float = 10.0,
) -> LaunchResult:
    """Run ``target(payload, rank, world_size, store)`` in ``num_ranks`` fresh processes.

    Args:
        target: ``"module:function"``; the function must be importable in the child (set
            ``PYTHONPATH`` through ``env`` for modules outside the package). Rank 0's return
            value becomes :attr:`LaunchResult.result`.
        payload: a string handed to every rank unchanged (a JSON config).
        num_ranks: number of processes; ranks 0..num_ranks-1 with ``LOCAL_RANK`` = rank.
        timeout_s: store timeout; a rank that cannot rendezvous fails after this long.
        env: extra environment for the ranks (e.g. ``HETCOMM_CLUSTER``).
        grace_s: after the first rank fails, how long the others get to fail on their own (they
            usually see the broken connection at once) before they are stopped.

    Returns:
        The result of rank 0, or the failures, the first failure first.

    Raises:
        SystemExit: SIGTERM while the ranks ran (exit status 143, after they were stopped and the
            ``hetcomm-bench-*`` scratch directory was removed).
    """
    outcome = _launcher.launch(
        _bench_child,
        num_ranks,
        args=(target, payload, timeout_s),
        start="exec",
        env=env,
        store=True,
        store_timeout_s=timeout_s,
        grace_s=grace_s,
        kill_grace_s=5.0,
        clean_shm=True,
        name="bench",
    )
    failures, exit_warnings = [], []
    ended = list(outcome.end_order)
    for r in ended + [r for r in range(num_ranks) if r not in ended]:
        rank = outcome.ranks[r]
        if rank.exit_warning:
            exit_warnings.append(_failure(rank))
        elif not rank.ok:
            failures.append(_failure(rank))
    # Root causes first: a rank's own error beats "connection closed by peer" on the others,
    # and those beat ranks the launcher had to stop.
    failures.sort(key=lambda f: (f.killed_by_launcher, _is_secondary(f.message)))
    result = outcome.ranks[0].result if not failures else None
    return LaunchResult(result=result, failures=tuple(failures), exit_warnings=tuple(exit_warnings))


def _is_secondary(message: str) -> bool:
    lowered = message.lower()
    return any(
        s in lowered for s in ("connection closed by peer", "connection reset", "broken pipe")
    )


def _failure(rank: "_launcher.RankOutcome") -> RankFailure:
    return RankFailure(
        rank.rank,
        rank.exitcode if rank.exitcode is not None else -9,
        rank.error_type,
        (rank.error or "") if rank.error_type is not None else rank.how_it_ended(),
        is_timeout=rank.timeout_error,
        killed_by_launcher=rank.stopped is not None,
    )


def _bench_child(target: str, payload: str, timeout_s: float) -> Any:
    """The launcher's target in every bench rank: connect to the launcher's store, run
    ``target(payload, rank, world_size, store)``; rank 0's return value is the result."""
    import importlib

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        import torch.distributed as dist

        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size + 1,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # A prefix per launch keeps the keys of this run apart from anything else on the store.
        store = dist.PrefixStore("hetcomm-bench/", store)
        result = func(payload, rank, world_size, store)
    except BaseException:
        if settings.BENCH_TRACEBACK.get():
            import traceback

            traceback.print_exc()
        raise
    return result if rank == 0 else None


def bench_rank_entry(payload: str, rank: int, world_size: int, store) -> Optional[Dict[str, Any]]:
    """:func:`launch_ranks` target of ``hetcomm bench``: one rank of :func:`run_rank`."""
    config = BenchConfig.from_json(payload)
    return run_rank(config, rank, world_size, local_rank=rank, store=store)


def run_local(
    config: BenchConfig, num_ranks: int, env: Optional[Dict[str, str]] = None
) -> Dict[str, Any]:
    """Start ``num_ranks`` local ranks, run the benchmark, return the result document.

    The programmatic form of ``hetcomm bench ... --nprocs N`` (``hetcomm audit --bench`` can
    use it): the same JSON document ``--json`` prints; :func:`format_table` renders it.

    Raises:
        PeerTimeout: the first failing rank timed out.
        CollectiveError: a rank failed otherwise (its rank and error in the message).
    """
    from hetcomm.errors import CollectiveError, PeerTimeout

    extra = dict(env or {})
    if config.cluster:
        extra.setdefault("HETCOMM_CLUSTER", config.cluster)
    outcome = launch_ranks(
        "hetcomm.cli._benchlib:bench_rank_entry",
        config.to_json(),
        num_ranks,
        timeout_s=config.timeout_s,
        env=extra,
    )
    if not outcome.ok:
        first = outcome.failures[0]
        others = "; ".join(f"rank {f.rank}: {f.message}" for f in outcome.failures[1:])
        cls = PeerTimeout if first.is_timeout else CollectiveError
        raise cls(
            f"{first.error_type or 'died'}: {first.message}"
            + (f" (then {others})" if others else ""),
            op=f"bench {config.collective}",
            rank=first.rank,
            rail=None,
        )
    return outcome.result

