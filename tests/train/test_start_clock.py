"""``hetcomm train`` starts its clocks (the summary's tokens/s, the metrics' times, the progress
line) only when every rank is ready to train. Four real ranks; rank 1 builds its model a second and
a half slower, as a slower device does: without the start barrier rank 0 would start timing at
once and charge rank 1's build to its first step."""

from __future__ import annotations

import os
import time
from typing import Dict

import pytest

from tests.backends.ranks import run_ranks
from tests.ops.jobs import _free_port

SLOW_BUILD_S = 1.5


def _train_rank(rank: int, world_size: int, cfg, port: int) -> Dict[str, float]:
    import torch.distributed as dist

    from hetcomm.train import loop

    marks: Dict[str, float] = {}
    build, start = loop._build, loop._start

    def slow_build(r, *args, **kwargs):  # a slower device's rank finishes its model later
        job = build(r, *args, **kwargs)
        if r == 1:
            time.sleep(SLOW_BUILD_S)
        marks["built"] = time.time()
        return job

    def timed_start(*args, **kwargs):  # where the loop's clocks start
        marks["clocks"] = time.time()
        return start(*args, **kwargs)

    loop._build, loop._start = slow_build, timed_start
    dist.destroy_process_group()  # train_worker makes its own group, as under torchrun
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    loop.train_worker(rank, world_size, cfg)
    return marks


@pytest.mark.timeout(200)
def test_the_clocks_start_after_the_slowest_rank_built_its_model():
    from hetcomm.train.loop import TrainConfig

    cfg = TrainConfig(steps=2, experts=4, layers=1, model_dim=16, hidden_dim=32, batch_size=4, seq_len=8,
                      snapshot_every=0, probe_every=0, log_every=100, timeout_s=60.0, backend="gloo")
    marks = run_ranks(_train_rank, 4, backend="gloo", args=(cfg, _free_port()), timeout=150)
    # Ordered by the barrier, not by timing: rank 0 reaches its clocks only after rank 1 is built.
    assert marks[0]["clocks"] >= marks[1]["built"], marks
