"""What the stream contract (hetcomm/backends/devices.py) adds to one collective, on the host.

Every routed collective takes three steps of it: ``capture`` on the caller's thread, the
executor's ``RailStreams.scope`` around the job, ``join`` in ``Work.wait()``. This times the
three together, without the collective, side by side in one run:

- ``empty``: a Python call doing nothing (the timer's floor);
- ``host tensors``: the steps for a CPU collective (4 tensors, as ``all_to_all_single`` passes);
- ``host tensors, tracing``: the same while ``devices.tracing()`` logs (what the tests run);
- ``device tensors`` (with ``--device cuda``): event on the current stream, the rail stream
  waits on it, ``record_stream`` x4, the stream context, the done event, the join.

Medians of ``--repeats`` runs of ``--number`` calls each, in microseconds of this thread's CPU
time per collective (``time.thread_time``: on a shared, loaded machine wall time mostly measures
the other processes).

    .venv/bin/python benchmarks/stream_overhead.py
    .venv/bin/python benchmarks/stream_overhead.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetcomm.backends import devices  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="also time device tensors on this device (cuda, npu)")
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rails = devices.RailStreams()

    def steps(tensors):
        def one():
            order = devices.capture(tensors, 1)
            with rails.scope(order):
                pass
            devices.join(order)
        return one

    host = [torch.zeros(4, device="cpu") for _ in range(4)]
    variants = {"empty": lambda: None, "host tensors": steps(host)}

    def traced():
        with devices.tracing() as log:
            for _ in range(a.number):
                steps(host)()
            log.clear()

    if a.device != "cpu":
        dev = [torch.zeros(4, device=a.device) for _ in range(4)]
        variants["device tensors"] = steps(dev)
    print(f"stream contract per collective (thread CPU time), median of {a.repeats} x {a.number} calls; "
          f"load {os.getloadavg()[0]:.1f}")
    print("| variant | CPU us per collective |")
    print("|---|---|")
    for name, fn in variants.items():
        runs = timeit.repeat(fn, number=a.number, repeat=a.repeats, timer=time.thread_time)
        print(f"| {name} | {1e6 * statistics.median(runs) / a.number:.2f} |")
    runs = timeit.repeat(traced, number=1, repeat=a.repeats, timer=time.thread_time)
    print(f"| host tensors, tracing | {1e6 * statistics.median(runs) / a.number:.2f} |")
    if a.device != "cpu":
        torch.get_device_module(a.device).synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
