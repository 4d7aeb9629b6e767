"""Plan, ChunkTable and Plan.check: the exactly-once contract the executor relies on."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm.sched.plan import ChunkTable, Plan, Transfer, traffic_from_splits
from hetcomm.topo.model import LinkClass

NV = LinkClass.NVLINK


def _t(index, src, dst, origin, final, off, size, stage=0, deps=(), rail=None):
    return Transfer(index, src, dst, origin, final, off, size, NV, stage, tuple(deps), rail)


T3 = ((0, 10, 4), (6, 0, 0), (0, 3, 0))


def good_transfers():
    return [
        _t(0, 0, 1, 0, 1, 0, 10),
        _t(1, 0, 1, 0, 2, 0, 4),  # 0 -> 2 forwarded through 1
        _t(2, 1, 2, 0, 2, 0, 4, stage=1, deps=[1], rail="nic0"),
        _t(3, 1, 0, 1, 0, 0, 6),
        _t(4, 2, 1, 2, 1, 0, 1),
        _t(5, 2, 1, 2, 1, 1, 2),
    ]


def test_a_correct_forwarding_plan_passes_and_round_trips_through_the_table():
    plan = Plan("hier", T3, good_transfers())
    plan.check()
    assert plan.num_ranks == 3 and plan.num_stages == 2 and plan.num_transfers == 6
    again = Plan("hier", T3, table=plan.table)
    assert again.transfers == plan.transfers
    assert again.traffic == T3
    assert [t.index for t in plan.stage(1)] == [2]
    assert plan.bytes_by_class() == {"NVLINK": 27}


def test_messages_group_chunks_by_stage_sender_receiver_and_rail():
    msgs = Plan("hier", T3, good_transfers()).messages
    got = sorted(zip(msgs.stage.tolist(), msgs.src.tolist(), msgs.dst.tolist(), msgs.num_bytes.tolist()))
    assert got == [(0, 0, 1, 14), (0, 1, 0, 6), (0, 2, 1, 3), (1, 1, 2, 4)]
    k = msgs.chunk_message
    assert k[0] == k[1] and k[4] == k[5]
    assert msgs.forwarded[k[2]] and not msgs.forwarded[k[0]]
    assert list(zip(msgs.dep_msg.tolist(), msgs.dep_on.tolist())) == [(k[2], k[1])]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ts: ts.__setitem__(0, _t(0, 0, 1, 0, 1, 0, 9)), "delivered 9 of 10"),
        (lambda ts: ts.__setitem__(5, _t(5, 2, 1, 2, 1, 0, 2)), "gap or overlap"),
        (lambda ts: ts.__setitem__(2, _t(2, 1, 2, 0, 2, 0, 4, stage=1)), "never received"),
        (lambda ts: ts.__setitem__(2, _t(2, 1, 2, 0, 2, 0, 4, stage=0, deps=[1])), "not earlier"),
        (lambda ts: ts.__setitem__(2, _t(2, 1, 2, 0, 2, 0, 4, stage=1, deps=[7])), "unknown dependency"),
        (lambda ts: ts.__setitem__(3, _t(3, 1, 1, 1, 0, 0, 6)), "src == dst"),
        (lambda ts: ts.__setitem__(3, _t(3, 1, 0, 1, 0, 0, 0)), "empty chunk"),
        (lambda ts: ts.__setitem__(3, _t(3, 1, 5, 1, 0, 0, 6)), "out of range"),
        (lambda ts: ts.append(_t(6, 0, 1, 0, 1, 0, 10)), "overlap"),
        (lambda ts: ts.pop(), "delivered 1 of 3"),
        # forwarding a wider range than was received
        (lambda ts: ts.__setitem__(1, _t(1, 0, 1, 0, 2, 0, 3)), "never received"),
    ],
)
def test_check_names_the_first_broken_property(mutate, message):
    ts = good_transfers()
    mutate(ts)
    with pytest.raises(AssertionError, match=message):
        Plan("hier", T3, ts).check()


def test_table_build_matches_explicit_transfers():
    ts = good_transfers()
    tb = ChunkTable.build(
        src=[t.src for t in ts],
        dst=[t.dst for t in ts],
        origin=[t.origin for t in ts],
        final_dst=[t.final_dst for t in ts],
        offset_bytes=[t.offset_bytes for t in ts],
        num_bytes=[t.num_bytes for t in ts],
        link_class=[int(t.link_class) for t in ts],
        stage=[t.stage for t in ts],
        rail=[0 if t.rail else -1 for t in ts],
        dep=[t.deps[0] if t.deps else -1 for t in ts],
        rail_names=("nic0",),
    )
    assert Plan("hier", T3, table=tb).transfers == tuple(ts)


def test_plan_needs_exactly_one_of_transfers_and_table():
    with pytest.raises(TypeError):
        Plan("flat", T3)
    assert traffic_from_splits([[1, 2], [3, 4]]) == ((1, 2), (3, 4))
    assert Plan("flat", np.zeros((2, 2), int), []).num_stages == 0
