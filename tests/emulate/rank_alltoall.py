"""One rank of the emulation test: an uneven all-to-all, then timed transfers over two links.

Run by ``hetcomm emulate run ... -- python rank_alltoall.py OUT.json BACKEND NUM_BYTES``: the
environment (RANK, WORLD_SIZE, MASTER_ADDR, GLOO_SOCKET_IFNAME, HETCOMM_CLUSTER) comes from the
emulator. Rank 0 writes what it measured to OUT.json; every rank checks its own all-to-all
output against a locally computed expectation and exits 1 on a mismatch.

Transfers timed (receiver side, after a barrier), on mixed-mini:
    rank 0 (a100-0) -> rank 3 (ascend-0): cross-vendor, the slow link
    rank 0 (a100-0) -> rank 2 (h800-0):   same vendor, a NIC-rate link
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _splits(world: int, src: int) -> list:
    # Uneven on purpose: rank s sends (s + d + 1) * 1000 elements to rank d.
    return [(src + d + 1) * 1000 for d in range(world)]


def main() -> int:
    out_path, backend, num_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if backend == "hetcomm":
        import hetcomm  # noqa: F401  (registers the backend)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    in_splits = _splits(world, rank)
    out_splits = [_splits(world, s)[rank] for s in range(world)]
    # Element i of the block for destination d is rank*1e6 + d*1e3 + (i % 1000): every value says
    # where it came from and where it was meant to go.
    inp = torch.cat(
        [
            rank * 1_000_000 + d * 1000 + torch.arange(n, dtype=torch.float32) % 1000
            for d, n in enumerate(in_splits)
        ]
    )
    out = torch.empty(sum(out_splits), dtype=torch.float32)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    expected = torch.cat(
        [
            s * 1_000_000 + rank * 1000 + torch.arange(n, dtype=torch.float32) % 1000
            for s, n in enumerate(out_splits)
        ]
    )
    ok = bool(torch.equal(out, expected))

    timings = {}
    buf = torch.zeros(num_bytes // 4, dtype=torch.float32)
    for name, (src, dst) in (("slow_0to3", (0, 3)), ("fast_0to2", (0, 2))):
        dist.barrier()
        if rank == src:
            dist.send(buf, dst)
        elif rank == dst:
            t0 = time.perf_counter()
            dist.recv(buf, src)
            timings[name] = time.perf_counter() - t0
    # Collect the receivers' timings on rank 0.
    gathered = [None] * world
    dist.all_gather_object(
        gathered,
        {
            "rank": rank,
            "ok": ok,
            "timings": timings,
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "node": os.environ.get("HETCOMM_EMULATE_NODE"),
        },
    )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"backend": backend, "num_bytes": num_bytes, "ranks": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
