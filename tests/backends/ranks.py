"""Spawn real rank processes for multi-rank tests: ``run_ranks(fn, world_size=4, ...)``.

Usable by every package's tests (``from tests.backends.ranks import run_ranks``). Each rank is a
real process started from a forkserver that has imported torch and hetcomm once (so a group of 4
starts in well under a second instead of 4 torch imports); the ranks rendezvous through a
TCPStore hosted by the test process itself, so the store outlives any rank (fault tests kill
ranks). ``fn(rank, world_size, *args)`` runs after ``init_process_group`` and must be a
module-level function; its return value comes back (pickled) per rank.

Failures propagate: a rank that raises or dies makes :func:`run_ranks` raise :class:`RanksFailed`
with every rank's traceback or exit code; a rank still running at ``timeout`` is killed and
reported. :func:`run_ranks_outcomes` returns the per-rank outcomes instead, for tests that expect
failures.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["run_ranks", "run_ranks_outcomes", "RankOutcome", "RanksFailed", "MIXED_MINI"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIXED_MINI = os.path.join(REPO_ROOT, "configs", "clusters", "mixed-mini.yaml")

_CTX: Optional[mp.context.BaseContext] = None


def _context(start_method: str = "forkserver") -> mp.context.BaseContext:
    if start_method == "spawn":
        return mp.get_context("spawn")
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # torch._dynamo: the first functional collective imports it (~800 modules, 5-10 s per rank).
        ctx.set_forkserver_preload(
            ["torch", "torch.distributed", "torch._dynamo", "torch.distributed._functional_collectives",
             "hetcomm", "hetcomm.backends.process_group"]
        )
        _CTX = ctx
    return _CTX


@dataclass
class RankOutcome:
    """What one rank did.

    Attributes:
        rank: the rank.
        ok: fn returned normally.
        result: fn's return value (when ok).
        error_type: class name of the exception fn raised (``None`` if ok or the process died).
        error: str() of that exception.
        traceback: its formatted traceback.
        exitcode: the process exit code (negative = killed by that signal), None if it was
            still running at the timeout.
        seconds: wall time from start to the rank's report (None if it never reported).
    """

    rank: int
    ok: bool = False
    result: Any = None
    error_type: Optional[str] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    exitcode: Optional[int] = None
    seconds: Optional[float] = None


class RanksFailed(AssertionError):
    """At least one rank raised, died or hung; the message has every rank's story."""


def _child(fn, rank, world_size, args, backend, port, env, pg_timeout_s, pg_options, q, t0):
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native crash (SIGABRT/SIGSEGV) prints every thread's stack
    import torch
    import torch.distributed as dist

    import hetcomm  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=pg_timeout_s + 30))
        kwargs = {"pg_options": pg_options} if pg_options is not None else {}
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s), **kwargs
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
        # Plain pickle copies tensors by value; the Queue's own pickler would share their memory
        # with a process that is about to exit.
        q.put((rank, True, pickle.dumps(result), None, None, None, time.time() - t0))
    except BaseException as e:  # reported to the parent, which decides
        q.put((rank, False, None, type(e).__name__, str(e), traceback.format_exc(), time.time() - t0))


def run_ranks_outcomes(
    fn: Callable[..., Any],
    world_size: int = 4,
    backend: str = "hetcomm",
    cluster: Optional[str] = None,
    timeout: float = 120.0,
    args: Sequence[Any] = (),
    env: Optional[Dict[str, Optional[str]]] = None,
    pg_timeout: float = 60.0,
    pg_options: Any = None,
    start_method: str = "forkserver",
) -> List[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh rank processes.

    Args:
        fn: module-level function (it is pickled by reference).
        backend: ``"hetcomm"`` or ``"gloo"`` (for reference results).
        cluster: cluster YAML for ``HETCOMM_CLUSTER`` (None = unset).
        timeout: seconds for the whole run; ranks still running then are killed (SIGKILL).
        env: extra environment variables for the ranks (None values unset a variable).
        pg_timeout: the process group timeout.
        pg_options: passed to ``init_process_group(pg_options=...)``.
        start_method: ``forkserver`` (default: fast, torch imported once) or ``spawn`` (fresh
            interpreters, for tests that must not inherit the server's state).

    Returns:
        One :class:`RankOutcome` per rank, in rank order.
    """
    import torch.distributed as dist

    ctx = _context(start_method)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    child_env: Dict[str, Optional[str]] = {"HETCOMM_CLUSTER": cluster}
    child_env.update(env or {})
    q = ctx.Queue()
    t0 = time.time()
    procs = []
    for r in range(world_size):
        p = ctx.Process(
            target=_child,
            args=(fn, r, world_size, tuple(args), backend, store.port, child_env, pg_timeout, pg_options, q, t0),
            daemon=True,
        )
        p.start()
        procs.append(p)
    outcomes = {r: RankOutcome(rank=r) for r in range(world_size)}
    reported = set()
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, result, etype, emsg, tb, secs = q.get(timeout=0.2)
            except queue_mod.Empty:
                # A rank that died without reporting will never report: stop waiting for it.
                dead = {i for i, p in enumerate(procs) if p.exitcode is not None and i not in reported}
                if dead and all(procs[i].exitcode is not None or i in reported for i in range(world_size)):
                    # Everyone is gone; drain what is left in the queue.
                    time.sleep(0.2)
                    try:
                        while True:
                            rank, ok, result, etype, emsg, tb, secs = q.get_nowait()
                            outcomes[rank] = RankOutcome(rank, ok, pickle.loads(result) if ok else None, etype, emsg, tb, None, secs)
                            reported.add(rank)
                    except queue_mod.Empty:
                        break
                continue
            outcomes[rank] = RankOutcome(rank, ok, pickle.loads(result) if ok else None, etype, emsg, tb, None, secs)
            reported.add(rank)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
        for r, p in enumerate(procs):
            outcomes[r].exitcode = p.exitcode if p.exitcode is not None else None
        q.close()
        del store
    return [outcomes[r] for r in range(world_size)]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 4,
    backend: str = "hetcomm",
    cluster: Optional[str] = None,
    timeout: float = 120.0,
    args: Sequence[Any] = (),
    env: Optional[Dict[str, Optional[str]]] = None,
    pg_timeout: float = 60.0,
    pg_options: Any = None,
    start_method: str = "forkserver",
) -> List[Any]:
    """Like :func:`run_ranks_outcomes`, but return the per-rank results and raise
    :class:`RanksFailed` if any rank raised, died or hung."""
    outs = run_ranks_outcomes(fn, world_size, backend, cluster, timeout, args, env, pg_timeout, pg_options, start_method)
    bad = [o for o in outs if not o.ok]
    if bad:
        parts = []
        for o in bad:
            if o.error_type:
                parts.append(f"rank {o.rank} raised {o.error_type}: {o.error}\n{o.traceback}")
            elif o.exitcode is None:
                parts.append(f"rank {o.rank} still running after {timeout} s (killed)")
            else:
                parts.append(f"rank {o.rank} died with exit code {o.exitcode} without reporting")
        raise RanksFailed("\n".join(parts))
    return [o.result for o in outs]
