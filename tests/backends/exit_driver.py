"""Run fault scenarios whose ranks exit through the interpreter's own finalisation, and report
every rank's exit status: ``python -m tests.backends.exit_driver kill --runs 20``.

Why not :mod:`tests.backends.ranks`: its ranks are multiprocessing children, which end with
``os._exit`` and so never finalise the interpreter. The defect this checks for lives exactly
there: a daemon thread still blocked in a gloo wait when ``Py_FinalizeEx`` starts returns from
C++ while the interpreter is going away, CPython then ends that thread with ``pthread_exit``,
whose forced unwind through pybind11's GIL guard (a ``noexcept`` destructor) calls
``std::terminate`` ("terminate called without an active exception", exit -6).

Each run forks its ranks from this process (torch is imported once, here); a forked rank runs its
scenario, then raises ``SystemExit`` out of the driver's stack, so it finalises like any script.
The store lives in a separate forked process that ends with ``os._exit`` (a forked copy of a
TCPStore server must not be finalised: its server thread does not exist in the copy).

Output: one JSON line per run, ``{"run": i, "codes": [exit code per rank], "stderr": {rank:
tail}}`` for ranks that did not exit 0, then a summary line ``{"survivor_codes": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Dict, List

import torch
import torch.distributed as dist

import hetcomm  # noqa: F401  (registers the backend)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _store_process(port: int, world: int) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            store = dist.TCPStore("127.0.0.1", port, world + 1, True, timeout=timedelta(seconds=120), wait_for_workers=False)
            store.set("ready", "1")
            while True:
                time.sleep(3600)
        finally:
            os._exit(0)
    return pid


def _scenario_kill(rank: int, n: int, victim: int) -> str:
    """Every rank streams all-to-alls; ``victim`` kills itself (SIGKILL) mid-stream."""
    rows = 1 << 12
    x = torch.full((rows * n, 16), float(rank))
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    if rank == victim:
        threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        for _ in range(100_000):
            dist.all_to_all_single(y, x)
    except Exception as e:
        return type(e).__name__
    return "no error"


def _scenario_mismatch(rank: int, n: int, victim: int) -> str:
    """``victim`` sends one row too many to rank 0 and one too few to the last rank; then every
    rank makes a correct all-to-all and an all_reduce (the group stays usable)."""
    in_s = [2] * n
    if rank == victim:
        in_s = [3] + [2] * (n - 2) + [1]
    x = torch.zeros(sum(in_s), 4)
    y = torch.empty(2 * n, 4)
    got = "no error"
    try:
        dist.all_to_all_single(y, x, [2] * n, in_s)
    except ValueError as e:
        got = type(e).__name__
    dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n))
    t = torch.ones(3)
    dist.all_reduce(t)
    return got if torch.equal(t, torch.full((3,), float(n))) else "wrong all_reduce"


def _scenario_dispatch(rank: int, n: int, victim: int) -> str:
    """Clean use of ``Communicator.dispatch``/``combine`` (sync, async, chunked, forward and
    backward), then a clean exit: every rank must exit 0 (#21 item 12)."""
    comm = hetcomm.communicator()
    E, D, T = 4 * n, 16, 64
    owner = [e * n // E for e in range(E)]
    g = torch.Generator().manual_seed(rank)
    total = 0.0
    for step in range(6):
        x = torch.randn(T, D, generator=g, requires_grad=True)
        idx = torch.randint(0, E, (T, 2), generator=g)
        w = torch.rand(T, 2, generator=g, requires_grad=True)
        res = comm.dispatch(x, idx, w, expert_to_rank=owner, async_op=step % 2 == 1, num_chunks=1 + step % 3)
        res.work.wait()
        out = comm.combine(res.recv_x * 2.0, res.handle)
        out.sum().backward()
        total += float(out.detach().sum())
    return "ok" if total == total else "nan"


SCENARIOS = {"kill": _scenario_kill, "mismatch": _scenario_mismatch, "dispatch": _scenario_dispatch}


class _Linger:
    """Kept in a module global: its finaliser runs inside ``Py_FinalizeEx`` and sleeps there, like
    a program whose exit does some cleanup. It widens the window in which a peer's exit (its
    sockets closing) wakes a thread of this process that is still blocked in gloo."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __del__(self):
        time.sleep(self.seconds)


def _rank_main(rank: int, n: int, port: int, args, out_fd: int, err_path: str) -> None:
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(err, 2)
    os.close(err)
    torch.set_num_threads(1)
    ti = time.monotonic()
    store = dist.TCPStore("127.0.0.1", port, n + 1, False, timeout=timedelta(seconds=60))
    dist.init_process_group("hetcomm", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=args.pg_timeout))
    t0 = time.monotonic()
    init_s = round(t0 - ti, 2)
    outcome = SCENARIOS[args.scenario](rank, n, args.victim)
    t1 = time.monotonic()
    if not args.no_destroy:
        dist.destroy_process_group()
    t2 = time.monotonic()
    rec = {"rank": rank, "outcome": outcome, "scenario_s": round(t1 - t0, 2), "destroy_s": round(t2 - t1, 2), "init_s": init_s, "end": time.time()}
    os.write(out_fd, (json.dumps(rec) + "\n").encode())
    if args.linger > 0:
        globals()["_linger"] = _Linger(args.linger)
    os.close(out_fd)


def _one_run(i: int, args, tmp: str) -> Dict:
    n = args.world
    port = _free_port()
    store_pid = _store_process(port, n)
    r, w = os.pipe()
    pids: List[int] = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _rank_main(rank, n, port, args, w, os.path.join(tmp, f"err-{i}-{rank}"))
            # Leave through the interpreter's own finalisation, like any script (see the module
            # docstring): SystemExit unwinds the driver's frames, which hold no finally blocks.
            raise SystemExit(0)
        pids.append(pid)
    os.close(w)
    deadline = time.monotonic() + args.run_timeout
    codes: List = [None] * n
    reaped: Dict[int, float] = {}
    t_fork = time.time()
    while None in codes and time.monotonic() < deadline:
        for k, pid in enumerate(pids):
            if codes[k] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[k] = os.waitstatus_to_exitcode(status)
                    reaped[k] = time.time()
        time.sleep(0.05)
    for k, pid in enumerate(pids):
        if codes[k] is None:  # still running at the deadline: a hang, reported as such
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[k] = "hung"
    outcomes = {}
    f = os.fdopen(r)
    for line in f:
        rec = json.loads(line)
        outcomes[rec.pop("rank")] = rec
    f.close()
    os.kill(store_pid, signal.SIGKILL)
    os.waitpid(store_pid, 0)
    stderr = {}
    for k in range(n):
        path = os.path.join(tmp, f"err-{i}-{k}")
        if codes[k] != 0 and not (args.scenario == "kill" and k == args.victim):
            f = open(path, errors="replace")
            stderr[k] = f.read()[-1500:]
            f.close()
        os.unlink(path)
    for k, rec in outcomes.items():
        rec["exit_after_s"] = round(reaped.get(k, 0) - rec.pop("end"), 2)
    return {"run": i, "wall_s": round(time.time() - t_fork, 1), "codes": codes, "outcomes": outcomes, "stderr": stderr}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=8.0)
    p.add_argument("--run-timeout", type=float, default=60.0)
    p.add_argument("--linger", type=float, default=0.0, help="seconds each rank spends in its exit cleanup")
    p.add_argument("--no-destroy", action="store_true",
                   help="leave without destroy_process_group(), as many scripts do (the group dies at exit)")
    args = p.parse_args(argv)
    survivor_codes: Dict[str, int] = {}
    # No `with`/`finally` here: a forked rank unwinds these frames on its way out (SystemExit)
    # and must not run the parent's cleanup.
    tmp = tempfile.mkdtemp(prefix="hetcomm-exit-")
    for i in range(args.runs):
        rec = _one_run(i, args, tmp)
        print(json.dumps(rec), flush=True)
        for k, c in enumerate(rec["codes"]):
            if args.scenario == "kill" and k == args.victim:
                continue
            survivor_codes[str(c)] = survivor_codes.get(str(c), 0) + 1
    os.rmdir(tmp)
    print(json.dumps({"survivor_codes": survivor_codes}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
