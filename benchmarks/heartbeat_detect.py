"""Detection time of a lost peer by hetcomm's heartbeat (issue 20, item 3: <= 1 s p99).

    .venv/bin/python benchmarks/heartbeat_detect.py --trials 100

Per trial: three survivor processes and one victim each run a
:class:`hetcomm.backends.heartbeat.Heartbeat` of a 4-rank group (a fresh key prefix per trial, one
TCPStore hosted by this script, so the store outlives every victim); once every survivor has seen
the victim beat, the victim is

* ``kill``: SIGKILLed; the survivors know its pid (a same-host peer: ``/proc``);
* ``hang``: SIGSTOPped; the survivors do **not** know its pid, as for a peer on another host,
  so only its missing beats tell (the slow path: at least ``miss_s`` = 0.6 s, more when the
  victim's beats arrived irregularly: the threshold adapts, see hetcomm.backends.heartbeat);
* ``hang-mate``: SIGSTOPped; survivor 0 knows its pid (it shares the victim's host) and says
  "stopped" in its own beat; survivors 1 and 2 do not (another host) and are the ones measured:
  they learn it from survivor 0's beat (two beat intervals) instead of from the silence.

Each trial lets the victim beat for 1.5 s first, as a rank of a running job has.

Detection time = the survivor's ``PeerLoss.detected_at`` - the time of the signal. Every
survivor must name the victim in every trial; the table gives p50/p99/max over all survivors
and trials, how many of the trials had every survivor within 1 s, and the causes the survivors
gave (hang-mate: "stopped" when the verdict came through the beat). At the end: no process of
the run is left, and no ``/dev/shm/hetcomm-*`` entry appeared.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from datetime import timedelta


def _survivor(port: int, rank: int, conn) -> None:
    import torch.distributed as dist

    from hetcomm.backends.heartbeat import Heartbeat

    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        trial, victim_pid, mode = msg
        store = dist.PrefixStore(f"t{trial}", base)
        sees_pid = mode == "kill" or (mode == "hang-mate" and rank == 0)
        hb = Heartbeat(store, rank, 4, local_pids={3: victim_pid} if sees_pid else {}).start()
        # Seen the victim beat for 1.5 s (15 beats: the silence threshold has its history), then ready.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60 and not store.check(["hetcomm/hb/3"]):
            time.sleep(0.05)
        time.sleep(1.5)
        conn.send("ready")
        t_sig = conn.recv()
        while 3 not in hb.lost and time.time() - t_sig < 30:
            time.sleep(0.01)
        loss = hb.lost.get(3)
        measured = not (mode == "hang-mate" and sees_pid)
        conn.send(((loss.detected_at - t_sig) if loss else None, loss.cause if loss else None, measured))
        conn.recv()  # keep beating until every survivor is done (hang-mate: the others read this beat)
        hb.stop()


def _victim(port: int, trial: int) -> None:
    import torch.distributed as dist

    from hetcomm.backends.heartbeat import Heartbeat

    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    Heartbeat(dist.PrefixStore(f"t{trial}", base), 3, 4).start()
    time.sleep(600)


def _shm() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("hetcomm")}
    except OSError:
        return set()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--modes", default="kill,hang,hang-mate")
    args = p.parse_args()
    import torch.distributed as dist

    shm_before = _shm()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    ctx = mp.get_context("fork")  # torch imported once here; no thread of ours runs yet at fork
    pipes, procs = [], []
    for r in range(3):
        a, b = ctx.Pipe()
        pr = ctx.Process(target=_survivor, args=(store.port, r, b), daemon=True)
        pr.start()
        pipes.append(a)
        procs.append(pr)
    results = {}
    victims = []
    trial = 0
    for mode in args.modes.split(","):
        times, named_all, within, causes = [], 0, 0, {}
        for _ in range(args.trials):
            trial += 1
            v = ctx.Process(target=_victim, args=(store.port, trial), daemon=True)
            v.start()
            victims.append(v)
            for c in pipes:
                c.send((trial, v.pid, mode))
            for c in pipes:
                assert c.recv() == "ready"
            t_sig = time.time()
            os.kill(v.pid, signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            for c in pipes:
                c.send(t_sig)
            got = [g[:2] for g in [c.recv() for c in pipes] if g[2]]
            for c in pipes:
                c.send("stop")
            if mode != "kill":
                os.kill(v.pid, signal.SIGKILL)
            v.join(10)
            ok = [g for g in got if g[0] is not None]
            for g in ok:
                causes[g[1]] = causes.get(g[1], 0) + 1
            times += [g[0] for g in ok]
            named_all += len(ok) == len(got)
            within += len(ok) == len(got) and all(g[0] <= 1.0 for g in ok)
        times.sort()
        results[mode] = (named_all, within, statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))], times[-1],
                         ", ".join(f"{c} {k}" for c, k in sorted(causes.items())))
    for c in pipes:
        c.send(None)
    for pr in procs:
        pr.join(10)
    left = [x.pid for x in procs + victims if x.is_alive()]
    new_shm = sorted(_shm() - shm_before)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load {os.getloadavg()[0]:.1f}; "
          f"{args.trials} trials per mode; 3 survivors each (hang-mate: the 2 without a pid view measured)")
    print("| mode | trials every survivor named it | ... within 1 s | p50 s | p99 s | max s | causes named |")
    print("|---|---|---|---|---|---|---|")
    for mode, (named_all, within, p50, p99, mx, named) in results.items():
        print(f"| {mode} | {named_all}/{args.trials} | {within}/{args.trials} | {p50:.3f} | {p99:.3f} | {mx:.3f} | {named} |")
    print(f"left behind: processes {left or 'none'}; /dev/shm entries {new_shm or 'none'}")
    return 0 if not left and not new_shm else 1


if __name__ == "__main__":
    sys.exit(main())
