"""Spawn real rank processes for multi-rank tests: ``run_ranks(fn, world_size=4, ...)``.

Usable by every package's tests (``from tests.backends.ranks import run_ranks``). A thin layer
over :func:`hetcomm.launcher.launch` (the launcher bench, train and emulate use too): each rank
is a real process forked from a forkserver that has imported torch and hetcomm once (so a group
of 4 starts in well under a second instead of 4 torch imports); the ranks rendezvous through a
TCPStore hosted by the test process itself, so the store outlives any rank (fault tests kill
ranks). ``fn(rank, world_size, *args)`` runs after ``init_process_group`` and must be a
module-level function; its return value comes back (pickled) per rank.

Failures propagate: a rank that raises or dies makes :func:`run_ranks` raise :class:`RanksFailed`
with every rank's traceback or exit code; a rank still running at ``timeout`` is killed and
reported. :func:`run_ranks_outcomes` returns the per-rank outcomes instead, for tests that expect
failures; the other ranks are never stopped early, so a fault test reads what the survivors saw.

Fault tests order their ranks by events, never by fixed sleeps: :func:`wait_until` polls for
one (a marker file from :func:`mark`, a process that exited), and a rank that must stay silent
while its peers time out waits for their :func:`mark_done` with :func:`wait_done`.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

from hetcomm.launcher import RankOutcome, launch

__all__ = [
    "run_ranks", "run_ranks_outcomes", "RankOutcome", "RanksFailed", "MIXED_MINI",
    "wait_until", "mark", "read_mark", "mark_done", "wait_done", "recv_from_any",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIXED_MINI = os.path.join(REPO_ROOT, "configs", "clusters", "mixed-mini.yaml")


class RanksFailed(AssertionError):
    """At least one rank raised, died or hung; the message has every rank's story."""


def _rank_body(fn, world_size, args, backend, pg_timeout_s, pg_options, store_timeout_s):
    """The launcher's target: join the group through the test's store, run ``fn``, leave."""
    import torch
    import torch.distributed as dist

    import hetcomm  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False,
        timeout=timedelta(seconds=store_timeout_s),
    )
    kwargs = {"pg_options": pg_options} if pg_options is not None else {}
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s), **kwargs
    )
    try:
        return fn(rank, world_size, *args)
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


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
        timeout: seconds for the whole run; ranks still running then are killed.
        env: extra environment variables for the ranks (None values unset a variable).
        pg_timeout: the process group timeout.
        pg_options: passed to ``init_process_group(pg_options=...)``.
        start_method: ``forkserver`` (default: fast, torch imported once) or ``spawn`` (a fresh
            interpreter per rank, for tests that must not inherit the server's state).

    Returns:
        One :class:`hetcomm.launcher.RankOutcome` per rank, in rank order (``ok``, ``result``,
        ``error_type``, ``error``, ``traceback``, ``exitcode``, ``stopped == "timeout"``, ...).
    """
    # The ranks join the test's store as clients by hand (below); fns that build their own env://
    # group at another MASTER_PORT (tests/ops/jobs.py) need rank 0 to host it, as before.
    child_env: Dict[str, Optional[str]] = {"HETCOMM_CLUSTER": cluster, "TORCHELASTIC_USE_AGENT_STORE": None}
    child_env.update(env or {})
    out = launch(
        _rank_body,
        world_size,
        args=(fn, world_size, tuple(args), backend, pg_timeout, pg_options, pg_timeout + 30),
        start="exec" if start_method == "spawn" else "forkserver",
        env=child_env,
        store=True,
        store_timeout_s=timeout,
        timeout_s=timeout,
        grace_s=None,
        kill_grace_s=1.0,
        name="test-ranks",
    )
    return list(out.ranks)


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
        raise RanksFailed("\n".join(o.describe() + (f"\n{o.traceback}" if o.traceback else "") for o in bad))
    return [o.result for o in outs]


def wait_until(cond: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """Poll ``cond`` until it returns something truthy, and return that.

    Tests (and the ranks they start) wait on an event they can observe -- a marker file a rank
    wrote, a process that exited -- instead of sleeping a fixed time: a fixed sleep is too long
    on an idle machine and may still be too short on a loaded one. ``timeout_s`` is generous;
    when it passes, the error names the event that did not happen.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}, and it did not happen")
        time.sleep(0.02)


def mark(path: str, text: str = "") -> None:
    """Write the marker file ``path`` atomically (a reader never sees it half written)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def read_mark(path: str) -> Optional[str]:
    """The text of the marker file ``path`` (see :func:`mark`), or None while it is absent."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def mark_done(marks: str, rank: int) -> None:
    """Say that ``rank`` is through (its collective returned or raised): ``marks/done-<rank>``."""
    mark(os.path.join(marks, f"done-{rank}"), "1")


def wait_done(marks: str, ranks: Sequence[int], timeout_s: float = 45.0) -> None:
    """Wait until every rank in ``ranks`` has called :func:`mark_done`: a silent rank in a fault
    test stays alive (and silent) exactly as long as its peers still diagnose it, no fixed sleep."""
    wait_until(
        lambda: all(os.path.exists(os.path.join(marks, f"done-{r}")) for r in ranks),
        f"ranks {list(ranks)} to be done (marks in {marks})",
        timeout_s,
    )



def recv_from_any(buf, tag: int = 0) -> int:
    """``dist.recv(buf, tag=tag)`` from any source where c10d can serve it (torch 2.13's
    ProcessGroup face), ``hetcomm.backends.recv_any`` where it cannot (2.14's Backend face, see
    tests/backends/test_c10d_backend.py); returns the sender's rank."""
    import torch.distributed as dist

    from hetcomm.backends import recv_any
    from hetcomm.backends.process_group import backend_subclassable

    return recv_any(buf, tag=tag) if backend_subclassable() else dist.recv(buf, tag=tag)
