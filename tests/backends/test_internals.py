"""The backend's insides (issue 10.8): statistics of delegated collectives, threads joined at
shutdown, rail hooks declared on RailOp (no probing), one composite poll loop."""

from __future__ import annotations

import ast
import pathlib
from typing import List

import torch

from hetcomm.backends.rails.base import CompositeOp, RailOp, Xfer
from tests.backends.ranks import run_ranks

BACKENDS = pathlib.Path(__file__).resolve().parents[2] / "hetcomm" / "backends"


def _delegated_stats(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import hetcomm

    hetcomm.reset_stats()
    t = torch.ones(1 << 20)  # 4 MiB of float32
    dist.all_reduce(t)
    before = hetcomm.stats()
    dist.broadcast(t, src=0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out = [torch.empty(4) for _ in range(world_size)]
    dist.all_gather(out, torch.ones(4))
    dist.barrier()
    return {"after_all_reduce": before, "all": hetcomm.stats(), "value": float(t[0])}


def test_stats_count_delegated_collectives():
    out = run_ranks(_delegated_stats, world_size=2, timeout=90)
    for o in out:
        g = o["after_all_reduce"]["gloo"]
        # A 4 MiB all_reduce on 2 ranks moves 2(n-1)/n * 4 MiB = 4 MiB each way (bus bytes).
        assert g["ops"] == 1 and g["bytes_sent"] == 4 << 20 and g["bytes_received"] == 4 << 20, g
        assert o["all"]["gloo"]["ops"] == 5 and o["value"] == 2.0, o


def _threads_after_shutdown(rank: int, world_size: int) -> List[str]:
    import threading

    import torch.distributed as dist

    from hetcomm.backends import HetcommOptions

    g = dist.new_group(list(range(world_size)), backend="hetcomm", pg_options=HetcommOptions(rails=("gloo",)))
    x = torch.arange(8.0 * world_size)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, None, None, group=g)
    dist.destroy_process_group(g)
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("hetcomm-gloo-wait", "hetcomm-exec")) and t.is_alive())


def test_waiter_and_executor_threads_are_joined_at_shutdown():
    out = run_ranks(_threads_after_shutdown, world_size=3, timeout=90)
    # Only the default group's threads remain (its executor); the subgroup's are gone.
    for names in out:
        assert all(not n.startswith("hetcomm-gloo-wait") for n in names), names


def test_no_attribute_probing_between_executor_and_rails():
    """Every hook is declared on RailOp: no getattr/hasattr/setattr in the executor or the rails."""
    files = [BACKENDS / "executor.py", BACKENDS / "routed.py", *sorted((BACKENDS / "rails").glob("*.py"))]
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr"):
                # hccl.py probes torch_npu (an optional third-party module), not a rail.
                if not (f.name == "hccl.py"):
                    found.append(f"{f.name}:{node.lineno} {node.func.id}")
    assert not found, found


class _Steps(RailOp):
    """A minimal op: declares only what RailOp requires; done after ``n`` polls."""

    def __init__(self, n: int, peer: int, recv: Xfer):
        self.n = n
        self.peer = peer
        self.recv = recv
        self.finished = False

    def poll(self) -> bool:
        self.n -= 1
        self.progressed = True
        if self.n <= 0:
            self.arrived_xfers = [self.recv]
        return self.n <= 0

    def pending_peers(self) -> List[int]:
        return [self.peer] if self.n > 0 else []

    def finish(self) -> None:
        self.finished = True


def test_composite_op_polls_finishes_and_reports_arrivals():
    a = _Steps(1, 1, Xfer(1, torch.zeros(1)))
    b = _Steps(3, 2, Xfer(2, torch.zeros(1)))
    comp = CompositeOp([a, b], rail="x")
    assert not comp.can_block and not comp.needs_polling
    assert not comp.poll() and a.finished and comp.pending_peers() == [2]
    assert [x.peer for x in comp.take_arrivals()] == [1] and comp.take_arrivals() == []
    assert not comp.poll() and comp.poll() and b.finished
    assert [x.peer for x in comp.take_arrivals()] == [2]
