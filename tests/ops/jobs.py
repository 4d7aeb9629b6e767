"""Run ``hetcomm train``'s rank function on the test launcher's ranks (torch imported once)."""

from __future__ import annotations

import os
import socket
from typing import List

from tests.backends.ranks import MIXED_MINI, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny.yaml")
#: Steps of the shared tiny run (conftest.demo_run) and its checkpoint interval.
STEPS = 24
CHECKPOINT_EVERY = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rank(rank: int, world_size: int, cfg, port: int) -> int:
    # train_worker makes its own process group, as under torchrun: give it the launcher's place.
    import torch.distributed as dist

    from hetcomm.train.loop import train_worker

    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return train_worker(rank, world_size, cfg)


def train_ranks(cfg, world_size: int = 4, timeout: float = 150) -> List[int]:
    """``train_worker`` on ``world_size`` real ranks; every rank's exit code."""
    return run_ranks(_train_rank, world_size, cluster=MIXED_MINI, args=(cfg, _free_port()), timeout=timeout)
