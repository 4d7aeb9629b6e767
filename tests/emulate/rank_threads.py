"""Rank program for the host-share test: where the training thread and a helper thread run.

Usage: rank_threads.py OUT_DIR SECONDS. The main thread starts a helper thread that spins, then
spins itself for SECONDS of wall time, while it records each thread's cpu cgroup (from
``/proc/self/task/<tid>/cgroup``) until the helper has left the ``device`` cgroup (the run moves
it out) or the time is up. Writes OUT_DIR/rank<N>.json: both threads' cgroups as last seen, the
main thread's wall and CPU seconds, and the cores it may run on.
"""

import json
import os
import sys
import threading
import time


def _cpu_cgroup(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/cgroup") as f:
        # v1 "N:cpu,cpuacct:/path"
        lines = [x.split(":", 2) for x in f.read().splitlines()]
    return next(x[2] for x in lines if "cpu" in x[1].split(","))


def main() -> int:
    out_dir, seconds = sys.argv[1], float(sys.argv[2])
    rank = int(os.environ["RANK"])
    stop = threading.Event()
    helper_tid = []

    def spin() -> None:
        helper_tid.append(threading.get_native_id())
        while not stop.is_set():
            pass

    helper = threading.Thread(target=spin, daemon=True)
    helper.start()
    while not helper_tid:
        time.sleep(0.001)
    t0, c0 = time.perf_counter(), time.thread_time()
    seen = {}
    while time.perf_counter() - t0 < seconds:
        seen = {"main": _cpu_cgroup(threading.get_native_id()), "helper": _cpu_cgroup(helper_tid[0])}
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    stop.set()
    result = {"rank": rank, "cgroups": seen, "wall_s": wall, "cpu_s": cpu,
              "cores": sorted(os.sched_getaffinity(0))}
    tmp = os.path.join(out_dir, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
