"""One rank of the p2p-mode test: plain TCP (no torch), timed over two emulated links.

``python rank_socket.py OUT_DIR NUM_BYTES ADDR_OF_RANK2 ADDR_OF_RANK3``: rank 0 sends NUM_BYTES
to rank 3 (cross-vendor) and then to rank 2 (same vendor); each receiver writes
``<seconds> <bytes>`` to ``OUT_DIR/rank<r>.txt``. Rank 1 exits at once.
"""

from __future__ import annotations

import os
import socket
import sys
import time

PORT = 29611


def main() -> int:
    out_dir, num_bytes, addr2, addr3 = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rank = int(os.environ["RANK"])
    if rank in (2, 3):
        srv = socket.create_server((os.environ["HETCOMM_EMULATE_ADDRS"].split(",")[0], PORT))
        srv.settimeout(30)
        conn, _ = srv.accept()
        got, t0 = 0, None
        while got < num_bytes:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            if t0 is None:
                t0 = time.perf_counter()
            got += len(chunk)
        conn.sendall(b"k")
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{time.perf_counter() - t0:.4f} {got}\n")
        return 0 if got == num_bytes else 1
    if rank == 0:
        payload = b"x" * num_bytes
        for addr in (addr3, addr2):
            deadline = time.monotonic() + 30
            while True:
                try:
                    conn = socket.create_connection((addr, PORT), timeout=30)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            conn.sendall(payload)
            conn.recv(1)
            conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
