"""A second job on a running job's MASTER_PORT (issue 21.13): refused at once, first job unharmed.

Real processes: a TCPStore hosted by the test (the first job's store, as torchrun's agent hosts
it), two ranks of the first job that hold their group open; then a "second job" rank 1 joins the
same store, once with the same world size and once with another. Before: it completed
init_process_group on the first job's keys and failed ~38 s later with a PeerTimeout or gloo's
"Connect timeout"; now a ConfigError(key="MASTER_PORT") within the group timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "foreign_store_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank: int, world: int, port: int, hold: float) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.pop("HETCOMM_CLUSTER", None)
    return subprocess.Popen(
        [sys.executable, JOB, str(rank), str(world), str(port), str(hold)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("second_world", [2, 3], ids=["same-size", "other-size"])
def test_a_second_job_on_the_same_port_is_told_at_once(second_world):
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    first = [_start(r, 2, port, 15.0) for r in range(2)]
    try:
        # the first job's group works (both ranks did an all_reduce) before the second job starts
        for p in first:
            assert p.stdout.readline().strip() == "READY"
        second = _start(1, second_world, port, 0.0)
        out2, _ = second.communicate(timeout=90)
        store.set("test/release", "1")  # the first job may finish: the second one has been told
        outs = ["READY\n" + p.communicate(timeout=90)[0] for p in first]
    finally:
        for p in first:
            if p.poll() is None:
                p.kill()
    assert second.returncode == 3, out2
    line = out2.strip().splitlines()[-1]
    assert line.startswith("ERROR ConfigError MASTER_PORT"), out2
    assert "another job" in line
    took = float(line.split()[3])  # seconds from init_process_group to the error
    assert took < 10.0, f"the second job was told after {took:.1f} s, not within its 10 s group timeout"
    for r, out in enumerate(outs):
        assert first[r].returncode == 0 and out.strip().splitlines()[-1] == "OK 4.0 4.0", f"first job rank {r}: {out}"
