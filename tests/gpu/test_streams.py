"""The stream contract on a real GPU (marker ``gpu``; see hetcomm/backends/devices.py).

Two ranks on one host with ``nvidia-ascend-2.yaml``: rank 0 on the CUDA device, rank 1 a CPU
process standing for an Ascend rank, so the pair crosses the bridge (NCCL, which refuses two
ranks on one GPU, is not involved). Rank 0 writes its input on a *side stream* behind a slow
kernel (``torch.cuda._sleep``) and calls the collective without synchronising, inside
``with torch.cuda.stream(side)``; then it uses the outputs on that stream right after
``wait()`` (or the future's ``wait()``), again without a host synchronisation.

What each check would catch:

- rank 1 receiving rank 0's *old* values: the bridge's device->host copies not ordered after the
  caller's stream (the defect of the first version: its start event was recorded on the
  executor thread's stream);
- rank 0's own rows old: the executor's local copy not ordered after the caller's stream;
- rank 0 reading -1 (the prefill) from the output on the side stream: ``wait()`` not ordering
  the caller's stream after the host->device copies.

CPU-only machines skip it (tests/backends/test_devices.py checks the same order of steps there).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from tests.backends.ranks import run_ranks
from tests.gpu import DEVICE_START

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvidia-ascend-2.yaml")
pytestmark = pytest.mark.gpu

#: GPU clock cycles the side stream spins before writing the input: ~0.1-0.5 s (H200, 0.3-2 GHz),
#: far longer than the host needs to reach the collective and start its copies.
SLEEP_CYCLES = 200_000_000
ROWS, DIM = 2048, 256  # 2 MiB per rank; 256 KiB pieces -> several bridge rounds


def _pattern(rank: int) -> torch.Tensor:
    return (torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM) % 997) + 1000.0 * (rank + 1)


class _Side:
    """Rank 0's device, a side stream on it and a slow kernel there; ``kind="cpu"`` runs the
    same bodies without streams (how the expected values were checked on the CPU machine)."""

    def __init__(self, kind: str):
        self.dev = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
        self.cuda = kind == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.dev)
            self.side = torch.cuda.Stream(self.dev)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def behind_a_slow_kernel(self):
        """The side stream is current, and a kernel of ~0.1-0.5 s is queued on it first."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(SLEEP_CYCLES)
            yield


def _side_stream_body(rank, world_size, kind="cuda"):
    import torch.distributed as dist

    half = [ROWS // 2, ROWS // 2]
    res = {}
    if rank == 1:  # the CPU ("Ascend") rank: plain host tensors, three calls like rank 0's
        for name in ("async", "blocking", "future"):
            y = torch.full((ROWS, DIM), -1.0)
            dist.all_to_all_single(y, _pattern(1), half, half)
            res[name] = y
        return res
    d = _Side(kind)
    ref = _pattern(0).to(d.dev)
    for name in ("async", "blocking", "future"):
        x = torch.zeros(ROWS, DIM, device=d.dev)
        y = torch.full((ROWS, DIM), -1.0, device=d.dev)
        d.sync()
        with d.behind_a_slow_kernel():
            x.copy_(ref)  # queued behind the sleep: the collective must read these values
            if name == "async":
                work = dist.all_to_all_single(y, x, half, half, async_op=True)
                work.wait()
                out = y
            elif name == "blocking":
                dist.all_to_all_single(y, x, half, half)
                out = y
            else:
                work = dist.all_to_all_single(y, x, half, half, async_op=True)
                out = work.get_future().wait()[0]
            used = out * 1.0  # on the side stream, right after the wait: no host sync between
            res[name] = used.cpu()  # .cpu() runs on the side stream too, after `used`
    return res


@pytest.mark.timeout(240)
def test_side_stream_work_is_ordered_before_the_bridge_and_results_are_ready_on_it():
    from hetcomm.backends.options import HetcommOptions

    res = run_ranks(_side_stream_body, world_size=2, cluster=CLUSTER, timeout=220,
                    pg_options=HetcommOptions(chunk_bytes=256 << 10), start_method=DEVICE_START)
    h = ROWS // 2
    for name in ("async", "blocking", "future"):
        # rank r's output: rows [0, h) from rank 0 (its first half), rows [h, 2h) from rank 1 (its second half)
        for rank in range(2):
            y = res[rank][name]
            assert torch.equal(y[:h], _pattern(0)[h * rank : h * (rank + 1)]), (name, rank, "rows from rank 0")
            assert torch.equal(y[h:], _pattern(1)[h * rank : h * (rank + 1)]), (name, rank, "rows from rank 1")


def _dispatch_body(rank, world_size, kind="cuda"):
    from hetcomm.backends.tokens import GroupComm, combine, dispatch

    T, D, E, k = 512, 128, 8, 2
    g = torch.Generator().manual_seed(rank)
    x_ref = torch.randn(T, D, generator=g)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].contiguous()
    w = torch.rand(T, k, generator=g) + 0.1
    expect = 2.0 * x_ref * w.sum(1, keepdim=True)  # identity experts, doubled
    owner = [e * world_size // E for e in range(E)]
    comm = GroupComm.of(None)
    if rank == 1:
        recv_x, counts, h, work = dispatch(comm, x_ref, idx, w, expert_to_rank=owner, async_op=True, num_chunks=2)
        work.wait()
        out, cw = combine(comm, recv_x * 2.0, h, async_op=True)
        cw.wait()
        return {"ok": bool(torch.allclose(out, expect, atol=1e-4)), "err": float((out - expect).abs().max())}
    d = _Side(kind)
    xg, idxg, wg = x_ref.to(d.dev), idx.to(d.dev), w.to(d.dev)
    d.sync()
    with d.behind_a_slow_kernel():
        x = xg * 1.0  # made on the side stream, behind the sleep
        recv_x, counts, h, work = dispatch(comm, x, idxg, wg, expert_to_rank=owner, async_op=True, num_chunks=2)
        y = torch.empty_like(recv_x)
        off = 0
        for c, n in enumerate(h.chunk_rows):  # experts start on a chunk as soon as it is in
            work.wait_chunk(c)
            torch.mul(recv_x[off : off + n], 2.0, out=y[off : off + n])
            off += n
        out, cw = combine(comm, y, h, async_op=True)
        cw.wait()
        got = (out * 1.0).cpu()  # used on the side stream right after the wait
    return {"ok": bool(torch.allclose(got, expect, atol=1e-4)), "err": float((got - expect).abs().max()),
            "chunks": len(h.chunk_rows)}


@pytest.mark.timeout(240)
def test_async_dispatch_chunks_and_combine_on_a_side_stream():
    res = run_ranks(_dispatch_body, world_size=2, cluster=CLUSTER, timeout=220, start_method=DEVICE_START)
    assert all(r["ok"] for r in res) and res[0]["chunks"] == 2, res
