"""A rank that comes later than the group timeout (issue 21.17) and timeout wording (issue 23.2).

The peer that waited raises a PeerTimeout naming the late rank and leaves; the late rank, when
it finally arrives, must be told that the group stopped waiting for *it*
(:class:`~hetcomm.errors.GroupStoppedWaiting`, ``peer`` = the rank that gave up), not "connection
closed by peer 0". Timeout messages say "timed out" (torch's own tests match
``Timed out|closed|timeout``) and keep their typed fields.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from hetcomm.backends.liveness import pid_alive
from tests.backends.ranks import mark, read_mark, run_ranks, wait_until

PG_TIMEOUT = 4.0


def late_rank(rank: int, n: int, op: str, gave_up: str) -> dict:
    import torch.distributed as dist

    if rank == 1:
        # Arrive only once rank 0 has stopped waiting (it leaves its pid in ``gave_up``) and left.
        pid = int(wait_until(lambda: read_mark(gave_up), "rank 0 to finish its collective"))
        wait_until(lambda: not pid_alive(pid), f"rank 0 (pid {pid}) to exit")
    try:
        if op == "all_to_all_single":
            dist.all_to_all_single(torch.empty(n), torch.ones(n))
        else:
            dist.all_reduce(torch.ones(4))
    except Exception as e:
        return {"type": type(e).__name__, "peer": getattr(e, "peer", None), "message": str(e)}
    finally:
        if rank == 0:
            mark(gave_up, str(os.getpid()))
    return {"type": None}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("env", [{}, {"HETCOMM_RAILS": "gloo"}], ids=["shm", "gloo"])
@pytest.mark.parametrize("op", ["all_reduce", "all_to_all_single"])
def test_the_late_rank_hears_that_the_group_stopped_waiting_for_it(op, env, tmp_path):
    waited, late = run_ranks(
        late_rank, world_size=2, args=(op, str(tmp_path / "gave-up")), env=env, timeout=90,
        pg_timeout=PG_TIMEOUT,
    )
    assert waited["type"] == "PeerTimeout" and waited["peer"] == 1, waited
    assert re.search("Timed out|closed|timeout", waited["message"]) and "timed out" in waited["message"]
    assert late["type"] == "GroupStoppedWaiting", late
    assert late["peer"] == 0
    assert "stopped waiting for this rank" in late["message"] and "closed by peer" not in late["message"].lower()
