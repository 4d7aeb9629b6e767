"""Device paths (nccl, bridge with CUDA tensors, hccl) and the stream contract
(:mod:`hetcomm.backends.devices`).

The device tests run only where the devices exist (markers ``gpu`` / ``npu``); on the CPU-only
development machine the CPU tests exercise the same executor, checks and bridge staging with
CPU tensors. The contract's *logic* is checked here on CPU through the helper's trace: the
event is taken on the caller's thread at the call (not when the executor gets to the job), the
rail side waits for it on the executor's thread, the done event follows, and the join happens
on the thread that waits. tests/gpu/test_streams.py checks the same on a real GPU with a side
stream and a slow kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from tests.backends.ranks import REPO_ROOT, run_ranks
from tests.gpu import DEVICE_START

PAIR = os.path.join(REPO_ROOT, "tests", "gpu", "nvidia-ascend-2.yaml")  # NVIDIA + Ascend: the bridge


def test_importing_hetcomm_touches_no_device_runtime():
    code = (
        "import sys, torch, hetcomm, hetcomm.backends.process_group, hetcomm.backends.devices, "
        "hetcomm.backends.tokens, hetcomm.moe; "
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported'; "
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_the_contract_steps_on_cpu_happen_in_order_and_log_their_thread():
    from hetcomm.backends import devices

    rails = devices.RailStreams()
    with devices.tracing() as log:
        order = devices.capture([torch.zeros(3), torch.ones(3)], tag=7)
        with rails.scope(order):
            pass
        devices.join(order)
    assert order.device.type == "cpu" and order.ready is None and order.done is None
    assert [(e.step, e.thread, e.tag) for e in log] == [
        ("capture", "MainThread", 7), ("rail-wait", "MainThread", 7), ("rail-done", "MainThread", 7), ("join", "MainThread", 7),
    ]
    assert devices.completed(order) and devices.completed(None)
    assert devices.device_module(torch.device("cpu")) is None


def cuda_all_to_all(rank: int, n: int) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import hetcomm_group

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    in_s = [(rank + j) % 3 + 1 for j in range(n)]
    out_s = [(j + rank) % 3 + 1 for j in range(n)]
    x = torch.cat([torch.full((in_s[j], 4), float(100 * rank + j), device=dev) for j in range(n)])
    y = torch.empty(sum(out_s), 4, device=dev)
    dist.all_to_all_single(y, x, out_s, in_s)
    expect = torch.cat([torch.full((out_s[j], 4), float(100 * j + rank), device=dev) for j in range(n)])
    return {"ok": bool(torch.equal(y, expect)), "rails": hetcomm_group().rail_names("cuda"), "stats": __import__("hetcomm").stats()}


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU; needs 2 GPUs")
def test_cuda_all_to_all_over_nccl():
    # Without a cluster YAML, CUDA ranks are real NVIDIA ranks: peers go over nccl.
    n = max(2, min(4, torch.cuda.device_count()))
    outs = run_ranks(cuda_all_to_all, world_size=n, timeout=150, start_method=DEVICE_START)
    for o in outs:
        assert o["ok"]
        assert set(o["rails"]) - {"self"} == {"nccl"}
        assert o["stats"]["nccl"]["bytes_sent"] > 0


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_cuda_all_to_all_over_bridge_when_nccl_is_not_allowed():
    outs = run_ranks(cuda_all_to_all, world_size=2, timeout=150, env={"HETCOMM_RAILS": "bridge,gloo"},
                     start_method=DEVICE_START)
    for o in outs:
        assert o["ok"]
        assert set(o["rails"]) - {"self"} == {"bridge"}
        assert o["stats"]["bridge"]["bytes_sent"] > 0


def npu_all_to_all(rank: int, n: int) -> bool:
    import torch.distributed as dist
    import torch_npu  # noqa: F401

    dev = torch.device("npu", rank % torch.npu.device_count())
    torch.npu.set_device(dev)
    x = torch.arange(2 * n, dtype=torch.float32, device=dev) + 10 * rank
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 10 * j for j in range(n)])
    return bool(torch.equal(y.cpu(), expect))


@pytest.mark.npu
@pytest.mark.timeout(180)
def test_npu_all_to_all_over_hccl():
    assert all(run_ranks(npu_all_to_all, world_size=2, timeout=150))


# -- the stream contract's order of steps, on CPU, through the bridge ------------------------------


def _contract_body(rank, world_size):
    import hetcomm
    import torch.distributed as dist

    from hetcomm.backends import devices, hetcomm_group
    from hetcomm.backends.tokens import GroupComm, dispatch

    hetcomm.reset_stats()
    marks = {}
    # The tag of each collective in the log is its sequence number in the group (on torch 2.14
    # dist.* hands back c10d's own Work, not hetcomm's, so it is read from the group).
    face = hetcomm_group()
    with devices.tracing() as log:
        x1, y1 = torch.arange(8.0) + 100 * rank, torch.empty(8)
        w1 = dist.all_to_all_single(y1, x1, async_op=True)  # async: the executor thread runs it
        w1_tag = face._get_sequence_number_for_group()
        box = {}

        def other_caller():
            x2, y2 = torch.arange(6.0) - rank, torch.empty(6)
            box["work"] = dist.all_to_all_single(y2, x2, async_op=True)
            box["tag"] = face._get_sequence_number_for_group()
            box["ok"] = (x2, y2)

        t = threading.Thread(target=other_caller, name="second-caller")
        t.start()
        t.join()
        marks["before_waits"] = len(log)
        w1.wait()
        box["work"].wait()
        dist.all_to_all_single(torch.empty(4), torch.zeros(4))  # blocking: may run inline
        # dispatch with two async chunks: each chunk's exchange is captured at the dispatch call
        T, D, E = 12, 4, 4
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, D, generator=g)
        idx = torch.randint(0, E, (T, 1), generator=g)
        w = torch.ones(T, 1)
        marks["dispatch"] = len(log)
        recv_x, counts, handle, work = dispatch(
            GroupComm.of(None), x, idx, w, expert_to_rank=[0, 0, 1, 1], async_op=True, num_chunks=2
        )
        marks["dispatched"] = len(log)
        work.wait_chunk(0)
        marks["chunk0"] = len(log)
        work.wait_chunk(1)
    return {
        "log": [tuple(e) for e in log],
        "marks": marks,
        "rails": hetcomm_group().rail_names("cpu"),
        "bridge": dict(hetcomm.stats().get("bridge", {})),
        "w1_tag": w1_tag,
        "w2_tag": box["tag"],
    }


def _steps(log, tag):
    """``{step: (index in the log, thread)}`` of one collective (each step happens once)."""
    out = {}
    for i, (step, thread, device, t) in enumerate(log):
        if t == tag:
            assert step not in out, (step, tag, log)
            out[step] = (i, thread)
    return out


@pytest.mark.timeout(120)
def test_stream_order_is_captured_on_the_callers_thread_and_joined_by_the_waiter():
    res = run_ranks(_contract_body, world_size=2, cluster=PAIR, timeout=100)
    for rank, r in enumerate(res):
        log, marks = r["log"], r["marks"]
        assert r["rails"][1 - rank] == "bridge", r["rails"]  # the pair crosses vendors
        assert r["bridge"].get("bytes_sent", 0) > 0, r["bridge"]
        for tag, caller in ((r["w1_tag"], "MainThread"), (r["w2_tag"], "second-caller")):
            s = _steps(log, tag)
            assert set(s) == {"capture", "rail-wait", "rail-done", "join"}, (tag, log)
            # at the call, on the calling thread: not later, on the executor's
            assert s["capture"][1] == caller and s["capture"][0] < marks["before_waits"], (tag, s)
            assert s["rail-wait"][1].startswith("hetcomm-exec"), s
            assert s["rail-done"][1] == s["rail-wait"][1], s
            assert s["join"][1] == "MainThread", s  # the thread that called wait()
            assert s["capture"][0] < s["rail-wait"][0] < s["rail-done"][0] < s["join"][0], s
        # dispatch: its blocking exchanges (counts, metadata) are joined inside the call; the
        # two chunk exchanges are captured during the call and joined only by their wait_chunk.
        tags = sorted({t for (step, thread, dev, t) in log[marks["dispatch"] :]})
        chunks = []
        for tag in tags:
            s = _steps(log, tag)
            assert s["capture"][1] == "MainThread" and s["capture"][0] < marks["dispatched"], s
            assert s["join"][1] == "MainThread", s
            if s["join"][0] >= marks["dispatched"]:
                chunks.append(s)
        assert len(chunks) == 2 and len(tags) > 2, (tags, log[marks["dispatch"] :])
        assert chunks[0]["join"][0] < marks["chunk0"] <= chunks[1]["join"][0], (chunks, marks)
