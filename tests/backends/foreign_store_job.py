"""One rank of a job for tests/backends/test_foreign_store.py (run as a script).

``foreign_store_job.py RANK WORLD PORT HOLD_S``: joins the TCPStore at 127.0.0.1:PORT as a
client, creates the hetcomm group (10 s timeout), all_reduces, holds until the test sets the
store key ``test/release`` (at most HOLD_S seconds), all_reduces again, prints ``READY`` after the first, then ``OK <sum> <sum>`` or ``ERROR <type> <key> <seconds since init_process_group> <message>`` and exits 0 / 3.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import hetcomm  # noqa: F401


def main() -> int:
    rank, world, port, hold = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=20))
    t0 = time.monotonic()
    try:
        dist.init_process_group("hetcomm", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=10))
        t = torch.ones(2)
        dist.all_reduce(t)
        print("READY", flush=True)
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline and not store.check(["test/release"]):
            time.sleep(0.1)
        u = torch.ones(2)
        dist.all_reduce(u)
        print(f"OK {t.sum().item()} {u.sum().item()}", flush=True)
        dist.destroy_process_group()
        return 0
    except Exception as e:
        print(f"ERROR {type(e).__name__} {getattr(e, 'key', None)} {time.monotonic() - t0:.1f} {e}", flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
