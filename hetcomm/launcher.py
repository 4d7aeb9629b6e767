"""The one rank launcher: start N local rank processes, watch them, collect what they did.

``hetcomm bench --nprocs N``, ``hetcomm train``, ``hetcomm emulate run`` and the multi-rank tests
(``tests/backends/ranks.py``) all start their ranks through :func:`launch`::

    outcome = launch(fn, 4, args=(cfg,), store=True, timeout_s=600, grace_s=0)
    if not outcome.ok:
        print(outcome.message())            # names the failing rank and its error, or the silent ones
    results = outcome.results               # fn's return value per rank, in rank order

What a launch does:

* **Ranks.** ``target`` is a Python callable (run as ``target(*args)`` in each rank; module level,
  pickled by reference) or a command line (``["hetcomm", "bench", ...]``: emulate's ranks).
  A callable runs in a fresh interpreter (``start="exec"``: like torchrun, each rank imports torch
  itself and owns its threads) or in a child of a forkserver that imported torch and hetcomm once
  (``start="forkserver"``: a group of 4 starts in well under a second; the tests' default).
* **Environment.** Every rank gets torchrun's variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE`` (= rank and world size: all ranks are local), ``OMP_NUM_THREADS=1`` unless
  set; then ``env`` (for all ranks) and ``rank_env(rank)`` (per rank) on top; a ``None`` value
  unsets a variable.
* **Rendezvous.** ``store=True``: the launcher hosts a ``TCPStore`` on a free port (no port race,
  and it outlives any rank, which fault tests need) and sets ``MASTER_ADDR``/``MASTER_PORT`` and
  ``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's contract for "the agent hosts the store": a
  plain ``init_process_group(backend)`` (``env://``) connects every rank as a client of it.
* **Wrappers.** ``prefix(rank)`` is put before the rank's command line (emulate runs each rank as
  ``ip netns exec <ns> sh -c '...' CMD``); with a callable and ``start="exec"`` it wraps the
  Python interpreter the same way.
* **Results and errors.** A callable's return value comes back pickled; an exception comes back
  as its type name, message, traceback, and whether it is a timeout *by type*
  (:func:`is_timeout`). A command's result is its exit code. Output goes where ``logs[rank]``
  says (a path or a file descriptor; stdout and stderr both) or is inherited.
* **Failure.** A rank fails when it raises, exits non-zero or (callable) exits without reporting.
  After the first failure the others get ``grace_s`` seconds to end on their own (they usually
  see the broken connection and report their side of it), then they are stopped: SIGTERM, and
  SIGKILL after ``kill_grace_s``. ``grace_s=None`` never stops them early (fault tests read what
  the survivors saw). With ``rejoin`` a rank killed by a signal is started once more in its slot
  (``hetcomm train --grow-back``), and is a failure only if that process fails.
* **Timeout.** ``timeout_s`` bounds the whole run; ranks still running then are stopped and
  named in :attr:`LaunchOutcome.timed_out` and in the message.
* **Signals.** While the ranks run, SIGTERM and SIGINT are recorded and acted on at the
  launcher's own safe points (every 50 ms): the signal is forwarded to the ranks (SIGKILL
  follows after ``kill_grace_s``), then the handler the caller had installed runs, and the launcher raises ``SystemExit(128 + signal)`` (SIGTERM) or
  ``KeyboardInterrupt`` (SIGINT), so every caller's ``finally`` blocks run. (Raised from inside
  the handler, the exception could land in code that swallows it, e.g. logging's at-fork hook
  during ``Popen``, and the run would go on.)
* **Clean-up.** Each exec'd rank runs in its own session, so stopping it stops everything it
  started; each rank dies with the launcher (``PR_SET_PDEATHSIG``, Linux), even when the launcher
  is SIGKILLed (unless ``die_with_launcher=False``); the run's scratch directory
  (``$TMPDIR/hetcomm-<name>-*``) is removed; with ``clean_shm=True`` the
  ``/dev/shm/hetcomm-<pid>-*`` segments and doorbells of ranks that died before unlinking them
  are removed and listed in :attr:`LaunchOutcome.shm_removed`.

Why this is written here and not taken from torch: ``torch.distributed.elastic.multiprocessing.
start_processes`` (torchrun's process layer) and ``torch.multiprocessing.start_processes`` were
the first choice and do most of this, but their policy does not fit the callers: both close every
other worker the moment one fails (no grace, so bench could not report a peer's own error and the
fault tests could not read what the survivors saw), keep only the first failure, return no results
unless every worker succeeded, name no rank when ``wait(timeout)`` expires, install SIGTERM/SIGINT
handlers that raise from inside the handler, take one entrypoint for all ranks (no per-rank
wrapper command such as ``ip netns exec``), and neither sets a parent-death signal. What is
reused: torch's own rendezvous contract (the agent-hosted ``TCPStore`` and
``TORCHELASTIC_USE_AGENT_STORE``), Python's ``multiprocessing`` forkserver and ``subprocess``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback as traceback_mod
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from hetcomm.errors import UsageError
from hetcomm.launch_options import LaunchOptions, LogTarget

__all__ = ["launch", "LaunchOptions", "LaunchOutcome", "RankOutcome", "is_timeout", "forkserver_context", "PRELOAD"]

Target = Union[Callable[..., Any], Sequence[str]]

_POLL_S = 0.05
_EXEC_CHILD = "from hetcomm.launcher import _exec_main; _exec_main()"
#: How an exec'd rank's interpreter starts: ``-P`` (safe path, Python >= 3.11) keeps the current
#: directory off ``sys.path``, so a ``./hetcomm`` or ``./torch`` planted where a root user runs
#: ``hetcomm train`` (``/tmp``) is never imported; ``PYTHONSAFEPATH=1`` in the rank's environment
#: does the same for any interpreter the rank starts in turn (SECURITY.md).
SAFE_PYTHON = (sys.executable, "-P", "-c")

#: Modules the forkserver imports once, so that forked ranks start with them loaded.
#: torch._dynamo: the first functional collective imports it (~800 modules, 5-10 s per rank).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed._functional_collectives",
    "hetcomm",
    "hetcomm.backends.process_group",
    "hetcomm.launcher",
)


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended.

    Attributes:
        rank: the rank.
        ok: it finished: a callable returned (its result was reported), a command exited 0.
        result: the callable's return value (None for a command or when not ok).
        error_type: class name of the exception the callable raised (None: it raised none).
        error: str() of that exception.
        traceback: its formatted traceback.
        timeout_error: the exception is a timeout by type (:func:`is_timeout`).
        exitcode: process exit status (negative: killed by that signal); None only if the
            process could not be reaped.
        stopped: why the launcher stopped it: ``"failure"`` (another rank failed),
            ``"timeout"``, or None (it ended on its own). (On SIGTERM/SIGINT the launcher
            raises instead of returning an outcome.)
        pid: its process id.
        seconds: wall time from the launch to its end.
        log: where its output went (a path), or None.
        python: it ran a Python target (False: a command, which reports no result).
        replaced: ``(pid, exit status)`` of the process this one was started to replace
            (``LaunchOptions.rejoin``; None: the rank's first process).
    """

    rank: int
    ok: bool
    result: Any = None
    error_type: Optional[str] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    timeout_error: bool = False
    exitcode: Optional[int] = None
    stopped: Optional[str] = None
    pid: Optional[int] = None
    seconds: Optional[float] = None
    log: Optional[str] = None
    python: bool = True
    replaced: Optional[Tuple[int, int]] = None

    @property
    def exit_warning(self) -> bool:
        """It finished its work, then died while exiting (a teardown crash): the result stands,
        the crash must still be reported."""
        return self.ok and self.exitcode not in (0, None)

    def describe(self) -> str:
        """One line: what happened to this rank (``rank 2 was killed by SIGKILL (out of memory?)``)."""
        return f"rank {self.rank} {self.how_it_ended()}"

    def how_it_ended(self) -> str:
        """:meth:`describe` without the rank: ``killed by SIGABRT``, ``still running after another
        rank failed; stopped``, ``raised ValueError: ...``."""
        if self.error_type is not None:
            return f"raised {self.error_type}: {self.error}"
        if self.stopped == "timeout":
            return "still running at the timeout; stopped"
        if self.stopped == "failure":
            return "still running after another rank failed; stopped"
        code = self.exitcode
        if code is None:
            return "could not be reaped"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = " (out of memory?)" if name == "SIGKILL" else ""
            return f"killed by {name}{hint}"
        if not self.python:
            return f"exited with status {code}"
        if code == 0 and not self.ok:
            return "exited with status 0 without reporting a result"
        return f"exited with status {code}" + ("" if self.ok else " without a Python error")


@dataclass(frozen=True)
class LaunchOutcome:
    """What :func:`launch` saw.

    Attributes:
        ranks: one :class:`RankOutcome` per rank, in rank order.
        first_failure: the rank whose failure the launcher saw first, or None.
        timed_out: ranks still running at the timeout (empty when none).
        end_order: ranks in the order the launcher saw them end.
        wall_s: seconds from the first start to the end.
        timeout_s: the run's time limit (None: none).
        shm_removed: ``/dev/shm`` entries of dead ranks the launcher removed (``clean_shm``).
    """

    ranks: Tuple[RankOutcome, ...]
    first_failure: Optional[int]
    timed_out: Tuple[int, ...]
    end_order: Tuple[int, ...]
    wall_s: float
    timeout_s: Optional[float] = None
    shm_removed: Tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Every rank finished (exit warnings do not count against it)."""
        return all(r.ok for r in self.ranks)

    @property
    def results(self) -> List[Any]:
        """Each rank's return value, in rank order."""
        return [r.result for r in self.ranks]

    @property
    def failures(self) -> List[RankOutcome]:
        """Ranks that did not finish, the first seen failure first, then in end order, ranks
        the launcher had to stop last."""
        order = {r: i for i, r in enumerate(self.end_order)}
        bad = [r for r in self.ranks if not r.ok]
        return sorted(
            bad,
            key=lambda r: (r.rank != self.first_failure, r.stopped is not None, order.get(r.rank, len(order))),
        )

    def message(self) -> str:
        """One paragraph for the user: all ranks finished, the silent ranks at the timeout, or
        the first failure and what the other failing ranks did."""
        if self.ok:
            return f"all {len(self.ranks)} ranks finished in {self.wall_s:.1f} s"
        lines = []
        if self.timed_out:
            lines.append(
                f"ranks {list(self.timed_out)} did not finish within {self.timeout_s:g} s; they were stopped"
            )
        lines.extend(r.describe() for r in self.failures if r.stopped != "timeout")
        return "\n".join(lines)


def is_timeout(e: BaseException) -> bool:
    """Whether ``e`` is a timeout, by type: hetcomm's :class:`PeerTimeout`, the store's
    ``DistStoreError`` (a rank that never arrived), Python's ``TimeoutError``.

    One exception: plain gloo (``--backend gloo``, the comparison) raises a bare ``RuntimeError``
    for a timeout as for a broken connection, with nothing but its text to tell them apart; only
    for such a foreign error is gloo's own marker read. hetcomm's errors are never parsed.
    """
    from hetcomm.errors import HetcommError, PeerTimeout

    if isinstance(e, (PeerTimeout, TimeoutError)):
        return True
    if "torch.distributed" in sys.modules:  # a rank that never imported torch raised no store error
        import torch.distributed as dist

        if isinstance(e, dist.DistStoreError):
            return True
    return type(e) is RuntimeError and not isinstance(e, HetcommError) and "Timed out" in str(e)


# -- the launcher ---------------------------------------------------------------------------------


_FORKSERVER: Any = None


def forkserver_context(preload: Sequence[str] = PRELOAD) -> Any:
    """The multiprocessing forkserver context ranks are forked from (``start="forkserver"``).

    The server imports ``preload`` once (the first call's list wins: there is one server per
    process) and every rank is a fork of it, so a rank starts without importing torch again.
    """
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        _FORKSERVER = ctx
    return _FORKSERVER


def launch(
    target: Target,
    world_size: int,
    options: Optional[LaunchOptions] = None,
    **overrides: Any,
) -> LaunchOutcome:
    """Run ``target`` as ``world_size`` rank processes and wait for them (see the module doc).

    Args:
        target: a module-level callable, run as ``target(*args)`` in every rank (it reads its
            rank from ``RANK``), or a command line (a sequence of strings).
        world_size: number of ranks (>= 1).
        options: how to run them (:class:`~hetcomm.launch_options.LaunchOptions`; default: its
            defaults).
        **overrides: fields of ``options`` changed for this call: ``launch(fn, 4, store=True,
            timeout_s=600)`` reads as it always did (every keyword is a ``LaunchOptions`` field).

    Returns:
        The :class:`LaunchOutcome`.

    Raises:
        UsageError: bad arguments (no ranks, an empty command, forkserver with a command, an
            unknown ``start``, a negative time).
        TypeError: a keyword that is not a ``LaunchOptions`` field.
        SystemExit: SIGTERM arrived while the ranks ran (after they were stopped).
        KeyboardInterrupt: SIGINT arrived likewise.
    """
    opts = options if options is not None else LaunchOptions()
    if overrides:
        opts = replace(opts, **overrides)
    args, start, env, rank_env, prefix, logs = opts.args, opts.start, opts.env, opts.rank_env, opts.prefix, opts.logs
    store, store_timeout_s, timeout_s, grace_s = opts.store, opts.store_timeout_s, opts.timeout_s, opts.grace_s
    kill_grace_s, clean_shm, die_with_launcher = opts.kill_grace_s, opts.clean_shm, opts.die_with_launcher
    name, on_start = opts.name, opts.on_start
    is_command = not callable(target)
    if world_size < 1:
        raise UsageError(f"launch: world_size must be >= 1, not {world_size}")
    if is_command and (isinstance(target, str) or not list(target)):
        raise UsageError(f"launch: the command must be a non-empty list of strings, not {target!r}")
    if start == "forkserver" and (is_command or prefix is not None):
        raise UsageError("launch: start='forkserver' runs Python callables only, without a prefix")
    tcp_store = None
    if store:
        import datetime

        import torch.distributed as dist

        tcp_store = dist.TCPStore(
            "127.0.0.1", 0, world_size + 1, True,
            timeout=datetime.timedelta(seconds=store_timeout_s), wait_for_workers=False,
        )
    handles: List[_Proc] = []
    run_dir = tempfile.mkdtemp(prefix=f"hetcomm-{name}-")
    t0 = time.monotonic()
    try:
        with _signals_as_requests() as signals:
            envs = [
                _rank_environment(r, world_size, env, rank_env, tcp_store.port if tcp_store is not None else None)
                for r in range(world_size)
            ]
            spec_path = None
            if not is_command and start == "exec":
                from multiprocessing import spawn as mp_spawn

                spec_path = os.path.join(run_dir, "target.pickle")
                with open(spec_path, "wb") as f:
                    # What multiprocessing's spawn hands its children (import path, the main
                    # module to re-import as __mp_main__), so a target defined in a script's
                    # __main__ unpickles in the rank too.
                    prep = mp_spawn.get_preparation_data(f"hetcomm-{name}")
                    prep.pop("authkey", None)  # not picklable outside multiprocessing; unused here
                    pickle.dump(prep, f)
                    pickle.dump((target, tuple(args)), f)

            def start_rank(r: int, env_r: Dict[str, str]) -> _Proc:
                log = (logs or {}).get(r)
                if start == "forkserver":
                    return _start_forked(target, tuple(args), r, env_r, run_dir, log)  # type: ignore[arg-type]
                argv = list(target) if is_command else [*SAFE_PYTHON, _EXEC_CHILD, spec_path, str(r), run_dir]  # type: ignore[arg-type]
                if prefix is not None:
                    argv = [*prefix(r), *argv]
                return _start_exec(argv, env_r, log, die_with_launcher)

            for r in range(world_size):
                handles.append(start_rank(r, envs[r]))
                if on_start is not None:
                    on_start(r, handles[-1].pid)
                signals.check(lambda sig: _stop(handles, range(len(handles)), kill_grace_s, sig))

            def respawn(r: int) -> _Proc:  # a killed rank's slot started once more (opts.rejoin)
                return start_rank(r, {**envs[r], **(opts.rejoin or {})})

            outcome = _watch(handles, run_dir, not is_command, t0, timeout_s, grace_s, kill_grace_s, signals,
                             respawn if opts.rejoin is not None else None)
    finally:
        _stop(handles, range(len(handles)), kill_grace_s)
        for h in handles:
            h.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        del tcp_store
    if clean_shm:
        outcome = _with_shm_removed(outcome)
    return outcome


def _rank_environment(
    rank: int,
    world_size: int,
    env: Optional[Mapping[str, Optional[str]]],
    rank_env: Optional[Callable[[int], Mapping[str, Optional[str]]]],
    store_port: Optional[int],
) -> Dict[str, str]:
    full = dict(os.environ)
    # torchrun's default: one intra-op thread per rank, or N ranks fight over the cores.
    full.setdefault("OMP_NUM_THREADS", "1")
    full.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        PYTHONSAFEPATH="1",  # interpreters the rank starts keep the current directory off sys.path too
    )
    if store_port is not None:
        full.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port), TORCHELASTIC_USE_AGENT_STORE="True")
    for overrides in (env or {}, rank_env(rank) if rank_env is not None else {}):
        for k, v in overrides.items():
            if v is None:
                full.pop(k, None)
            else:
                full[k] = v
    return full


# -- one rank process, whichever way it was started ---------------------------------------------


class _Proc:
    """A started rank: a ``subprocess.Popen`` in its own session, or a forked
    ``multiprocessing.Process``. One face for polling and signalling both."""

    def __init__(self, popen: Any = None, process: Any = None, log: Optional[str] = None) -> None:
        self._popen = popen
        self._process = process
        self.log = log
        self.pid: int = popen.pid if popen is not None else process.pid
        # Readable once the process has ended: the watcher sleeps on these instead of a fixed
        # poll, so a finished launch returns at once (a pidfd for Popen, Linux >= 5.3).
        self._pidfd: Optional[int] = None
        if popen is not None and hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(popen.pid)
        self.sentinel: Optional[int] = process.sentinel if process is not None else self._pidfd

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = self.sentinel = None

    def poll(self) -> Optional[int]:
        if self._popen is not None:
            return self._popen.poll()
        return self._process.exitcode

    def signal(self, sig: int) -> None:
        try:
            if self._popen is not None:
                os.killpg(self.pid, sig)  # the rank and everything it started (its own session)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> None:
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=timeout)
        else:
            self._process.join(timeout)


def libc_prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl`` (Linux), or None where there is none; loaded in the parent, so that a
    child between fork and exec only makes the call."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _parent_death_signal() -> Optional[Callable[[], None]]:
    """A function that makes the calling process die with its parent (Linux), or None.

    If the launcher dies (even by SIGKILL) the kernel kills its ranks too, so no stray process
    is left holding shared memory or ports. libc is loaded here, in the parent: between fork and
    exec the child only makes the one call (no imports, no locks).
    """
    prctl = libc_prctl()
    if prctl is None:
        return None
    sigkill = int(signal.SIGKILL)

    def set_pdeathsig() -> None:  # pragma: no cover - runs in the child
        prctl(1, sigkill)  # 1 = PR_SET_PDEATHSIG

    return set_pdeathsig


def _start_exec(argv: List[str], env: Dict[str, str], log: Optional[LogTarget], die_with_launcher: bool) -> _Proc:
    out: Any = None
    path = None
    if isinstance(log, str):
        path = log
        out = open(log, "wb")
    elif isinstance(log, int):
        out = log
    try:
        popen = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,  # ranks read no input (multiprocessing's children neither)
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,  # stopping a rank stops everything it started
            preexec_fn=_parent_death_signal() if die_with_launcher else None,
        )
    finally:
        if path is not None:
            out.close()
    return _Proc(popen=popen, log=path)


def _start_forked(target: Callable[..., Any], args: Tuple[Any, ...], rank: int, env: Dict[str, str],
                  run_dir: str, log: Optional[LogTarget]) -> _Proc:
    ctx = forkserver_context()
    if isinstance(log, int):
        raise UsageError("launch: start='forkserver' takes log paths, not file descriptors")
    process = ctx.Process(target=_forked_main, args=(target, args, rank, env, run_dir, log), daemon=True)
    process.start()
    return _Proc(process=process, log=log)


def _forked_main(target, args, rank, env, run_dir, log) -> None:  # pragma: no cover - in the rank
    # The forkserver exits with the launcher but does not stop its children: they die with it.
    set_pdeathsig = _parent_death_signal()
    if set_pdeathsig is not None:
        set_pdeathsig()
    # The forkserver's environment is the one it started with: the launch's replaces it.
    os.environ.clear()
    os.environ.update(env)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _run_rank(target, args, rank, run_dir)


def _exec_main() -> None:  # pragma: no cover - in the rank
    """Entry point of an exec'd rank: argv = spec path, rank, run dir."""
    spec_path, rank, run_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from multiprocessing import spawn as mp_spawn

    with open(spec_path, "rb") as f:
        try:
            own_path = list(sys.path)
            # The launcher's import path and main module, as a spawned child gets them; then the
            # rank's own entries ($PYTHONPATH of its environment) after them.
            mp_spawn.prepare(pickle.load(f))
            sys.path.extend(p for p in own_path if p not in sys.path)
            target, args = pickle.load(f)
        except BaseException as e:  # noqa: BLE001 - a target that cannot be imported is this rank's error
            _report(run_dir, rank, "error", _error_record(e))
            sys.exit(1)
    _run_rank(target, args, rank, run_dir)


def _run_rank(target, args, rank: int, run_dir: str) -> None:  # pragma: no cover - in the rank
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native crash prints every thread's stack
    try:
        result = target(*args)
        data = pickle.dumps(result)  # plain pickle copies tensors by value
    except BaseException as e:  # noqa: BLE001 - every failure goes to the launcher
        _report(run_dir, rank, "error", _error_record(e))
        sys.stderr.flush()
        # SystemExit, not os._exit: atexit handlers (the shm rail's segment cleanup) must run.
        raise SystemExit(1)
    _report(run_dir, rank, "result", data, raw=True)
    sys.stdout.flush()
    sys.stderr.flush()


def _error_record(e: BaseException) -> Dict[str, Any]:
    try:
        timeout = is_timeout(e)
    except Exception:  # noqa: BLE001 - classification must never hide the error itself
        timeout = False
    return {
        "type": type(e).__name__,
        "message": str(e) or repr(e),
        "traceback": traceback_mod.format_exc(),
        "timeout": timeout,
    }


def _report(run_dir: str, rank: int, kind: str, value: Any, raw: bool = False) -> None:
    path = os.path.join(run_dir, f"rank{rank}.{kind}")
    with open(path + ".tmp", "wb") as f:
        f.write(value if raw else pickle.dumps(value))
    os.replace(path + ".tmp", path)  # the launcher never reads half a file


def _read(run_dir: str, rank: int, kind: str) -> Optional[bytes]:
    try:
        with open(os.path.join(run_dir, f"rank{rank}.{kind}"), "rb") as f:
            return f.read()
    except OSError:
        return None


# -- watching ---------------------------------------------------------------------------------------


class _SignalRequests:
    """SIGTERM/SIGINT recorded by the handler, acted on at the launcher's safe points."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.previous: Dict[int, Any] = {}

    def check(self, stop: Callable[[int], None]) -> None:
        if self.signum is None:
            return
        stop(self.signum)  # the ranks get the same signal: a Python rank unwinds on SIGINT
        # Then the signal is the caller's again: its own handler decides (emulate's raises
        # KeyboardInterrupt to tear down; SIGINT's default does too); by default, exit 128+sig.
        previous = self.previous.get(self.signum)
        if callable(previous):
            previous(self.signum, None)
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + self.signum)


@contextlib.contextmanager
def _signals_as_requests() -> Iterator[_SignalRequests]:
    requests = _SignalRequests()
    if threading.current_thread() is not threading.main_thread():
        yield requests  # handlers can only be set from the main thread; callers there unwind anyway
        return

    def on_signal(signum: int, frame: Any) -> None:
        requests.signum = signum

    for s in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(s) is not signal.SIG_IGN:  # an ignored signal stays ignored
            requests.previous[s] = signal.signal(s, on_signal)
    try:
        yield requests
    finally:
        for s, handler in requests.previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _watch(handles: List[_Proc], run_dir: str, reports: bool, t0: float, timeout_s: Optional[float],
           grace_s: Optional[float], kill_grace_s: float, signals: _SignalRequests,
           respawn: Optional[Callable[[int], _Proc]] = None) -> LaunchOutcome:
    n = len(handles)
    replaced: Dict[int, Tuple[int, int]] = {}  # rank -> (pid, exit status) of the process respawn replaced
    ended: Dict[int, float] = {}
    end_order: List[int] = []
    first: Optional[int] = None
    stop_at: Optional[float] = None
    stopped: Dict[int, str] = {}
    deadline = t0 + timeout_s if timeout_s is not None else None
    while True:
        signals.check(lambda sig: _stop(handles, [r for r in range(n) if r not in ended], kill_grace_s, sig))
        now = time.monotonic()
        for r, h in enumerate(handles):
            if r in ended:
                continue
            code = h.poll()
            if code is not None and code < 0 and respawn is not None and r not in replaced:
                replaced[r] = (h.pid, code)
                h.close()
                handles[r] = respawn(r)
                continue
            if code is not None:
                ended[r] = now - t0
                end_order.append(r)
            # A failure is a non-zero exit, an exit without a result, or a reported error (a rank
            # that reported its error but hangs while exiting is caught too).
            failed = (code is not None and (code != 0 or (reports and _read(run_dir, r, "result") is None))) or (
                reports and os.path.exists(os.path.join(run_dir, f"rank{r}.error"))
            )
            if failed and first is None:
                first = r
                if grace_s is not None:
                    stop_at = now + grace_s
        if len(ended) == n:
            break
        running = [r for r in range(n) if r not in ended]
        if stop_at is not None and now >= stop_at:
            # A rank that reported its error is on its way out (atexit handlers): let it end on its
            # own for up to kill_grace_s; only the others are "stopped".
            reported = [r for r in running if reports and _read(run_dir, r, "error") is not None]
            exit_by = now + kill_grace_s
            while reported and time.monotonic() < exit_by:
                time.sleep(_POLL_S)
                for r in [r for r in reported if handles[r].poll() is not None]:
                    reported.remove(r)
                    ended[r] = time.monotonic() - t0
                    end_order.append(r)
            stopped.update((r, "failure") for r in running if r not in ended and r not in reported)
            break
        if deadline is not None and now >= deadline:
            stopped.update((r, "timeout") for r in running)
            break
        _wait_any([handles[r] for r in running], _POLL_S)
    left = [r for r in range(n) if r not in ended]
    _stop(handles, left, kill_grace_s)
    wall = time.monotonic() - t0
    for r in left:
        if r not in ended:
            ended[r] = wall
            end_order.append(r)
    ranks = tuple(replace(_outcome(r, handles[r], run_dir, reports, stopped.get(r), ended.get(r)), replaced=replaced.get(r))
                  for r in range(n))
    return LaunchOutcome(
        ranks=ranks,
        first_failure=first,
        timed_out=tuple(r for r in range(n) if stopped.get(r) == "timeout"),
        end_order=tuple(end_order),
        wall_s=wall,
        timeout_s=timeout_s,
    )


def _wait_any(running: List[_Proc], timeout: float) -> None:
    """Sleep until one of ``running`` ends or ``timeout`` passes (the watcher's other duties:
    error reports, the deadline, signals, come at least that often)."""
    sentinels = [h.sentinel for h in running if h.sentinel is not None]
    if len(sentinels) < len(running):
        time.sleep(timeout)
        return
    from multiprocessing.connection import wait

    wait(sentinels, timeout)


def _outcome(rank: int, h: _Proc, run_dir: str, reports: bool, stopped: Optional[str],
             seconds: Optional[float]) -> RankOutcome:
    code = h.poll()
    common = dict(rank=rank, exitcode=code, stopped=stopped, pid=h.pid, seconds=seconds, log=h.log)
    if not reports:
        return RankOutcome(ok=code == 0 and stopped is None, python=False, **common)
    err = _read(run_dir, rank, "error")
    if err is not None:
        e = pickle.loads(err)
        return RankOutcome(ok=False, error_type=e["type"], error=e["message"], traceback=e["traceback"],
                           timeout_error=e["timeout"], **common)
    data = _read(run_dir, rank, "result")
    if data is not None:
        try:
            return RankOutcome(ok=True, result=pickle.loads(data), **common)
        except Exception as e:  # noqa: BLE001 - e.g. a class the launcher cannot import
            return RankOutcome(ok=False, error_type=type(e).__name__, error=f"its result could not be unpickled here: {e}",
                               traceback=traceback_mod.format_exc(), **common)
    return RankOutcome(ok=False, **common)


def _stop(handles: List[_Proc], ranks: Any, kill_grace_s: float, first: int = signal.SIGTERM) -> None:
    """``first`` (SIGTERM, or the signal the launcher got), then after ``kill_grace_s`` SIGKILL,
    to every given rank still running; reap."""
    live = [handles[r] for r in ranks if handles[r].poll() is None]
    for sig in (first, signal.SIGKILL):
        for h in live:
            h.signal(sig)
        deadline = time.monotonic() + (kill_grace_s if sig != signal.SIGKILL else 5.0)
        while live and time.monotonic() < deadline:
            live = [h for h in live if h.poll() is None]
            if live:
                time.sleep(_POLL_S)
        if not live:
            break
    for r in ranks:
        handles[r].wait(0.5)


def _with_shm_removed(outcome: LaunchOutcome) -> LaunchOutcome:
    """Remove the shared-memory segments and doorbell FIFOs of this launch's ranks (the backend
    names them ``hetcomm-<pid>-*`` / ``hetcomm-bell-<pid>-*``); a rank unlinks its own on a clean
    exit, so only those of ranks that died early are left."""
    from hetcomm.backends.rails.shm import SHM_DIR, SHM_PREFIX

    pids = {str(p) for r in outcome.ranks for p in (r.pid, r.replaced[0] if r.replaced else None) if p is not None}
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return outcome
    for entry in names:
        if not entry.startswith(SHM_PREFIX):
            continue
        rest = entry[len(SHM_PREFIX):]
        if rest.startswith("bell-"):
            rest = rest[len("bell-"):]
        if rest.split("-", 1)[0] in pids:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(os.path.join(SHM_DIR, entry))
    if not removed:
        return outcome
    return replace(outcome, shm_removed=tuple(sorted(removed)))
