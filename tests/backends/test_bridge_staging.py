"""The bridge's chunked staging on CPU, forced with a small chunk_bytes (issue 10, item 4).

Real ranks on mixed-mini (rank 3 is the 910B: its pairs go over the bridge). With
``chunk_bytes=256`` a 4 KiB segment crosses in 16 pieces, round by round; the results must equal
the exact all-to-all and the bridge's counters must show the pieces.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hetcomm.backends.rails.bridge import pieces
from tests.backends.ranks import MIXED_MINI, run_ranks


def test_pieces_cover_the_tensor_once():
    assert pieces(10, 4, 16) == [(0, 4), (4, 4), (8, 2)]
    assert pieces(0, 4, 16) == [(0, 0)]  # an empty transfer still posts one (empty) piece
    assert pieces(3, 8, 1) == [(0, 1), (1, 1), (2, 1)]  # at least one element per piece


def _body(rank, world_size, numel):
    import hetcomm

    hetcomm.reset_stats()
    inp = torch.arange(world_size * numel, dtype=torch.float32) + 100_000 * rank
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    expected = torch.cat([torch.arange(numel, dtype=torch.float32) + rank * numel + 100_000 * s for s in range(world_size)])
    # A second, uneven call with an fp64 payload (pieces in 8-byte elements).
    splits = [(rank + d) % 3 * 37 for d in range(world_size)]
    recv = [(s + rank) % 3 * 37 for s in range(world_size)]
    x = torch.randn(sum(splits), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    y = torch.empty(sum(recv), 5, dtype=torch.float64)
    dist.all_to_all_single(y, x, recv, splits)
    ys = [torch.empty(n, 5, dtype=torch.float64) for n in splits]
    dist.all_to_all(ys, list(y.split(recv)))  # back again: must return x
    return {
        "exact": torch.equal(out, expected),
        "round_trip": torch.equal(torch.cat(ys), x),
        "bridge": dict(hetcomm.stats().get("bridge", {})),
    }


@pytest.mark.timeout(120)
def test_bridge_stages_in_pieces_and_delivers_exactly():
    from hetcomm.backends.options import HetcommOptions

    numel = 1024  # 4 KiB per peer
    res = run_ranks(_body, world_size=4, cluster=MIXED_MINI, timeout=100, args=(numel,),
                    pg_options=HetcommOptions(chunk_bytes=256))
    for rank, r in enumerate(res):
        assert r["exact"] and r["round_trip"], (rank, r)
    # Rank 3 sends 4 KiB to each of 3 peers over the bridge: 16 pieces each (first call alone).
    assert res[3]["bridge"].get("chunks_sent", 0) >= 3 * 16, res[3]["bridge"]
    assert res[0]["bridge"].get("chunks_received", 0) >= 16, res[0]["bridge"]


def _rail_body(rank, world_size):
    """The bridge rail alone over a real gloo group: one 1,000-element transfer per pair, cut
    into 64-byte pieces (fp16 on the wire: 32 elements each, 32 rounds)."""
    import time
    from datetime import timedelta

    from hetcomm.backends.rails.base import Xfer
    from hetcomm.backends.rails.bridge import BridgeRail
    from hetcomm.backends.rails.gloo import GlooRail

    gloo = GlooRail(dist.group.WORLD, rank, timeout=timedelta(seconds=30))
    bridge = BridgeRail(rank, lambda peer: gloo, lambda peer, d: torch.float16, chunk_bytes=64)
    peer = 1 - rank
    src = torch.linspace(-4, 4, 1000) + rank
    dst = torch.full((1000,), float("nan"))
    op = bridge.start([Xfer(peer, src, tag=7)], [Xfer(peer, dst, tag=7)], "test", 1)
    rounds = op.num_rounds
    deadline = time.monotonic() + 30
    while not op.poll():
        assert time.monotonic() < deadline, "bridge step did not finish"
        time.sleep(0.001)
    op.finish()
    gloo.close()
    expect = (torch.linspace(-4, 4, 1000) + peer).half().float()
    return {"rounds": rounds, "equal": torch.equal(dst, expect)}


@pytest.mark.timeout(90)
def test_bridge_rail_pipelines_pieces_with_the_wire_cast():
    res = run_ranks(_rail_body, world_size=2, backend="gloo", timeout=80)
    for r in res:
        assert r["rounds"] == 32 and r["equal"], r
