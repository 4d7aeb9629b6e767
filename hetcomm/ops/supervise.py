"""Run one phase of ``hetcomm launch`` (a torchrun) so that nothing outlives the launcher.

``subprocess.call`` handled no signal: SIGTERM (what a scheduler, systemd or ``kill PID`` sends)
or SIGINT to the launcher's pid killed the launcher alone, and torchrun's agent with every
worker kept running. :func:`run_supervised` instead:

* starts the command in a session of its own (a terminal's Ctrl-C reaches the launcher only;
  the launcher decides what the job gets) and with a parent-death signal (SIGTERM: if the
  launcher is SIGKILLed, torchrun still closes its workers);
* makes the launcher a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): torchrun starts each
  worker in a session of its own, and a worker whose agent died is re-parented to the launcher,
  not to init, so it can still be found as a descendant;
* on SIGTERM or SIGINT forwards the same signal to torchrun's process group (torchrun's agent
  then stops its workers), waits ``kill_grace_s`` for every descendant to exit, then SIGKILLs
  the ones left (each recorded with its start time, so a recycled pid is never hit), and reports
  ``128 + signal`` (143, 130);
* after a normal exit of torchrun, stops any descendant still running (an orphan) the same way.

torch's own ``torch.distributed.elastic`` handles signals inside the agent only; nothing in it
supervises the agent from outside, which is what a launcher that runs torchrun needs; hence
this small module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

from hetcomm.launcher import libc_prctl

__all__ = ["SupervisedExit", "run_supervised", "descendants", "die_with_parent"]

_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class SupervisedExit:
    """How a supervised command ended.

    Attributes:
        returncode: the command's exit status (negative: killed by that signal).
        signum: the signal the launcher received and forwarded, or None.
        killed: pids SIGKILLed after the grace (they ignored the forwarded signal).
    """

    returncode: int
    signum: Optional[int] = None
    killed: Tuple[int, ...] = ()

    @property
    def exit_code(self) -> int:
        """What the launcher should exit with: ``128 + signal`` after a signal, else the status."""
        return 128 + self.signum if self.signum is not None else self.returncode


def die_with_parent() -> None:
    """Make this process (a torchrun worker) die by SIGKILL when its parent (torchrun's agent)
    dies, whatever kills the agent: torchrun sets no parent-death signal on its workers, so a
    SIGKILLed agent (or node launcher) left its workers training on, orphaned. Called first
    thing in the worker; if the agent is already gone, exits at once."""
    prctl = libc_prctl()
    if prctl is None:
        return
    parent = os.getppid()
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the agent died before the call: nobody would signal us
        os._exit(128 + int(signal.SIGKILL))


def _stat(pid: int) -> Optional[Tuple[int, int]]:
    """``(ppid, start time in clock ticks)`` of ``pid`` from ``/proc``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] == "Z":
        return None  # a zombie has exited: nothing to stop
    return int(fields[1]), int(fields[19])


def descendants(root: int, skip: Optional[Mapping[int, int]] = None) -> Dict[int, int]:
    """Every live descendant of ``root``: ``{pid: start time}`` (from one scan of ``/proc``).

    ``skip``: processes (``{pid: start time}``) left out with everything below them: the
    children the caller had before it started torchrun (a test runner's fork server, another
    job's ranks) are not torchrun's to stop.
    """
    children: Dict[int, List[int]] = {}
    start: Dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is None:
            continue
        children.setdefault(st[0], []).append(int(name))
        start[int(name)] = st[1]
    out: Dict[int, int] = {}
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out and not (skip and skip.get(c) == start[c]):
                out[c] = start[c]
                todo.append(c)
    return out


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start


def _reap_orphans(known: Set[int]) -> None:
    """Collect the exit status of re-parented descendants (we are their subreaper), not torchrun's."""
    for pid in list(known):
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _stop_tree(seen: Dict[int, int], first: Optional[int], kill_grace_s: float,
               skip: Optional[Mapping[int, int]] = None) -> Tuple[int, ...]:
    """Send ``first`` (None: nothing, they were already told) to every recorded process, wait up
    to ``kill_grace_s`` for all of them (and any they start meanwhile) to exit, SIGKILL the rest."""
    me = os.getpid()
    if first is not None:
        for pid, start in seen.items():
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, first)
    deadline = time.monotonic() + kill_grace_s
    while time.monotonic() < deadline:
        seen.update(descendants(me, skip))
        _reap_orphans(set(seen))
        if not any(_alive(p, s) for p, s in seen.items()):
            return ()
        time.sleep(_POLL_S)
    killed = []
    for pid, start in seen.items():
        if _alive(pid, start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(_alive(p, s) for p, s in seen.items()):
        _reap_orphans(set(seen))
        time.sleep(_POLL_S)
    _reap_orphans(set(seen))
    return tuple(sorted(killed))


def run_supervised(cmd: List[str], env: Mapping[str, str], *, kill_grace_s: float = 15.0,
                   watch: Optional[Callable[[], None]] = None, watch_every_s: float = 0.5) -> SupervisedExit:
    """Run ``cmd`` (a torchrun) to its end, forwarding SIGTERM/SIGINT; see the module docstring.

    Args:
        cmd: the command line.
        env: its environment.
        kill_grace_s: seconds between the forwarded signal and SIGKILL of what is left
            (torchrun's agent gives its workers 30 s by default; ours is the bound).
        watch: called every ``watch_every_s`` while torchrun runs (``hetcomm launch``: a
            stopped worker the survivors named is SIGKILLed there); it must not raise.
    """
    prctl = libc_prctl()
    main_thread = threading.current_thread() is threading.main_thread()
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1)

    def in_child() -> None:  # pragma: no cover - runs between fork and exec
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))

    received: List[int] = []
    previous: Dict[int, object] = {}
    if main_thread:  # handlers can only be set from the main thread
        for s in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(s) is not signal.SIG_IGN:
                previous[s] = signal.signal(s, lambda signum, frame: received.append(signum))
    # Children this process already had are not part of the job (in-process callers: a test
    # runner's multiprocessing fork server); they and their subtrees are never stopped or reaped.
    before = descendants(os.getpid())
    try:
        proc = subprocess.Popen(cmd, env=dict(env), start_new_session=True, preexec_fn=in_child)
        seen: Dict[int, int] = {}
        watched_at = time.monotonic()
        while True:
            code = proc.poll()
            if watch is not None and code is None and not received and time.monotonic() - watched_at >= watch_every_s:
                watched_at = time.monotonic()
                watch()
            if received:
                sig = received[0]
                seen.update(descendants(os.getpid(), before))
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)  # torchrun's agent stops its workers on either signal
                killed = _stop_tree(seen, None, kill_grace_s, before)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)
                return SupervisedExit(proc.returncode if proc.returncode is not None else -signal.SIGKILL, sig, killed)
            if code is not None:
                # torchrun is done; a worker it left behind (an agent that died) is stopped here.
                seen.update(descendants(os.getpid(), before))
                killed = _stop_tree(seen, signal.SIGTERM, kill_grace_s, before) if seen else ()
                return SupervisedExit(code, None, killed)
            time.sleep(0.1)  # no /proc scans meanwhile: as subreaper, nothing can escape the tree
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if prctl is not None:
            prctl(_PR_SET_CHILD_SUBREAPER, 0)
