"""Placement, wire policy and metrics: the pure parts, in one process."""

from __future__ import annotations

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe import ExpertPlacement, place_experts, routing_metrics
from hetcomm.moe.routing import ChunkLayout, route_tokens
from hetcomm.moe.placement import split_by_weight
from hetcomm.topo.cluster import load_cluster
from tests.backends.ranks import MIXED_MINI


def test_experts_need_not_divide_ranks_and_strong_ranks_hold_more():
    assert split_by_weight(7, [2, 2, 2, 1]) == [2, 2, 2, 1]
    assert split_by_weight(32, [2, 2, 2, 1]) == [9, 9, 9, 5]
    assert split_by_weight(3, [1, 1, 1, 1]) == [1, 1, 1, 0]
    p = place_experts(7, 4, rank_weights=[2, 2, 2, 1])
    assert p.num_local_experts_per_rank == (2, 2, 2, 1)
    assert [p.slots[e] for e in range(7)] == list(range(7))


def test_cold_experts_go_to_weak_ranks_when_the_load_is_known():
    load = [100, 90, 80, 70, 60, 50, 3, 2, 1]
    p = place_experts(9, 4, rank_weights=[2, 2, 2, 1], strong_ranks=[0, 1, 2], expert_load=load)
    weak = p.experts_of(3)
    assert set(weak) <= {6, 7, 8}, p.describe()
    # The hottest three land on three different strong ranks.
    assert len({p.owner[0], p.owner[1], p.owner[2]}) == 3


def test_placement_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"moe.placement.owner\[1\]"):
        ExpertPlacement((0, 5), 2)
    with pytest.raises(ConfigError, match="rank_weights"):
        place_experts(4, 2, rank_weights=[1.0])


def test_wire_rule_from_mixed_mini_is_fp16_to_and_from_the_910b_only():
    # The one wire rule (Communicator.wire_dtype reads Placement.wire_dtype for "auto").
    from hetcomm.backends.rank_placement import Placement, RankPlace

    cluster = load_cluster(MIXED_MINI)
    ranks = tuple(
        RankPlace(r, r, cluster.rank(r).node.name, "host", 100 + r, cluster.rank(r).vendor, cluster.rank(r).model, True)
        for r in range(4)
    )
    placement = Placement(ranks, cluster)
    got = {f"{a}-{b}": placement.wire_dtype(a, b) for a in range(4) for b in range(a + 1, 4)}
    assert got == {"0-1": "fp32", "0-2": "fp32", "0-3": "fp16", "1-2": "fp32", "1-3": "fp16", "2-3": "fp16"}
    assert all(placement.wire_dtype(a, b) == placement.wire_dtype(b, a) for a in range(4) for b in range(4) if a != b)


def test_route_keeps_capacity_by_choice_then_token_and_sets_replica_copies_aside():
    # 4 tokens, k=2, 3 experts; expert 0 is everyone's first choice.
    topk = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 2]])
    key = torch.tensor([0, 1, 2])
    r = route_tokens(topk, key, capacity=2)
    # First choices of tokens 0 and 1 are kept, of tokens 2 and 3 dropped (GShard's order).
    assert r.num_dropped == 2 and r.num_assign == 8
    assert r.send_idx.tolist() == [[0, 1], [0, 2], [-1, 1], [-1, 2]]
    assert r.send_counts.tolist() == [2, 2, 2]
    assert r.picks.tolist() == [4, 2, 2]
    assert r.local_assign.numel() == 0
    # Expert 1 on a local replica: its copies (assignments j*T+t = 4 and 6) stay here.
    rep = route_tokens(topk, key, capacity=None, replica_here=torch.tensor([False, True, False]))
    assert rep.local_expert.tolist() == [1, 1] and rep.local_assign.tolist() == [4, 6]
    assert rep.send_idx.tolist() == [[0, -1], [0, 2], [0, -1], [0, 2]]
    assert rep.send_counts.tolist() == [4, 0, 2]


def test_chunk_layout_groups_local_experts():
    p = place_experts(7, 4, rank_weights=[2, 2, 2, 1])
    lay = ChunkLayout.build(p, 2)
    assert lay.experts_in[0][0] == (0,) and lay.experts_in[1][0] == (1,)
    assert lay.experts_in[0][3] == () and lay.experts_in[1][3] == (6,)
    # Send order is chunk-major.
    order = sorted(range(7), key=lambda e: int(lay.key_of_expert[e]))
    assert order == [0, 2, 4, 1, 3, 5, 6]


def test_routing_metrics():
    picks = torch.tensor([50, 20, 10, 10, 5, 4, 1, 0])
    m = routing_metrics(picks, num_dropped=10, num_local=45)
    assert m.top5_share == pytest.approx(95 / 100)
    assert m.min_expert_rate == 0.0
    assert m.overflow_rate == pytest.approx(0.1)
    assert m.local_fraction == pytest.approx(45 / 90)
