"""The token engine's shared parts (``hetcomm.backends.tokens``): one wire rule, and two faces
that make the same exchanges.

The wire rule is a pure function, checked in one process; that the communicator, ``GroupComm``
and the engine's per-peer wires all answer with it is checked on real ranks. The faces are
counted on real ranks: a ``TokenSwitch`` step (``create_routing``, ``dispatch``, ``combine``)
makes exactly the collectives of a ``Communicator.dispatch``/``combine`` step, no more.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.distributed as dist

from hetcomm.backends.tokens.wire import link_wire_dtype, segment_bytes
from tests.backends.ranks import run_ranks

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    "dtype, policy, link, expect",
    [
        (F32, "exact", "fp16", None),
        (F32, "fp16", None, F16),
        (F32, "cluster", "fp16", F16),
        (F32, "auto", "bf16", BF16),
        (F32, "cluster", None, None),  # a link without a wire dtype of its own
        (F32, "cluster", F16, F16),  # GroupComm's link: a torch dtype
        (F16, "fp32", None, None),  # never widens
        (F16, "fp16", None, None),
        (BF16, "fp16", None, None),  # same width: no byte saved, range lost
        (F16, "bf16", None, None),
        (torch.float64, "bf16", None, BF16),
        (torch.int64, "fp16", None, None),  # only floating-point rows are cast
    ],
)
def test_wire_rule(dtype, policy, link, expect):
    assert link_wire_dtype(dtype, policy, lambda: link) == expect


def test_segments_are_padded_to_eight_bytes():
    assert segment_bytes(0, 5, F32) == 0
    assert segment_bytes(1, 5, F32) == 24  # 20 bytes -> 24
    assert segment_bytes(3, 4, F16) == 24
    assert segment_bytes(1, 3, F16) == 8


def _wire_answers(rank: int, world_size: int) -> Dict[str, str]:
    import hetcomm
    from hetcomm.backends.tokens import GroupComm
    from hetcomm.backends.tokens.wire import row_wires

    comm = hetcomm.communicator()
    peer = 1 - rank
    group = GroupComm.of(None, wire=F16)
    out = {}
    for dt in (F32, BF16, F16):
        out[str(dt)] = (
            str(comm.wire_dtype(peer, dt)), str(group.wire_dtype(peer, dt)), str(row_wires(comm, dt)[peer])
        )
    return out


@pytest.mark.timeout(120)
def test_communicator_group_comm_and_engine_follow_one_rule():
    """Under an fp16 policy: fp32 rows cross as fp16, bf16 and fp16 rows as they are, alike for
    the communicator (the bridge rail's answer), GroupComm and the engine's per-peer wires."""
    from hetcomm.backends import HetcommOptions

    res = run_ranks(_wire_answers, world_size=2, backend="hetcomm", timeout=100, pg_options=HetcommOptions(wire_dtype="fp16"))
    for r in res:
        assert r[str(F32)] == (str(F16), str(F16), str(F16)), r
        assert r[str(BF16)] == ("None", "None", str(BF16)), r
        assert r[str(F16)] == ("None", "None", str(F16)), r


def _count_collectives(rank: int, world_size: int) -> Dict[str, Dict[str, int]]:
    import hetcomm

    counts: Dict[str, int] = {}
    real = {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce", "all_gather", "broadcast", "barrier")}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real[name](*args, **kwargs)

        return call

    E, T, H = 4 * world_size, 16, 8
    g = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    x = torch.randn(T, H, generator=g)
    comm = hetcomm.communicator()
    ts = hetcomm.TokenSwitch(None, E, T, T * world_size, H * 4)
    owners = [e // 4 for e in range(E)]
    out = {}
    for face in ("communicator", "tokenswitch"):
        dist.barrier()
        counts.clear()
        for name in real:
            setattr(dist, name, counted(name))
        try:
            if face == "communicator":
                res = comm.dispatch(x, idx, w, expert_to_rank=owners)
                comm.combine(res.recv_x, res.handle)
            else:
                routing = ts.create_routing(idx)
                slots, _, _ = ts.dispatch(routing, x, w, routing.num_recv_tokens)
                ts.combine(routing, slots)
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        out[face] = dict(counts)
    return out


@pytest.mark.timeout(120)
def test_token_switch_makes_the_communicators_exchanges_and_no_more():
    res = run_ranks(_count_collectives, world_size=2, backend="hetcomm", timeout=100)
    for r in res:
        # counts, metadata, rows; the return of the rows
        assert r["communicator"] == {"all_to_all_single": 4}, r
        assert r["tokenswitch"] == r["communicator"], r
