"""Plans executed for real: 4 spawned ranks on the mixed-mini cluster, compared with gloo.

The backend's ``all_to_all_single`` runs the plan ``HETCOMM_PLAN`` names (every rank plans
locally from the exchanged split sizes); ``run_plan`` runs a plan built here. Outputs must equal
gloo's all-to-all bit for bit, and the bytes each rank sent must be what the plan says (so the
plan, with its forwarding hops, really ran rather than the direct route).
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import MIXED_MINI, run_ranks

WIDTH = 3  # float32 values per row: 12-byte rows, so lane cuts fall inside rows


def _split_rows(n: int):
    # uneven, with zeros and one large segment (rank 3 -> rank 0) so lanes cut segments
    S = [[(7 * i + 3 * j) % 11 for j in range(n)] for i in range(n)]
    S[1][2] = 0
    S[3][0] = 20011
    return S


def _rows(rank: int, num_rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(num_rows, WIDTH, generator=g)


def program(rank: int, n: int, strategy: str) -> dict:
    import torch.distributed as dist

    from hetcomm.backends.stats import reset_stats, stats
    from hetcomm.sched import plan_all_to_all
    from hetcomm.topo.cluster import load_cluster

    S = _split_rows(n)
    in_splits = S[rank]
    out_splits = [S[i][rank] for i in range(n)]
    inp = _rows(rank, sum(in_splits))
    traffic = [[x * WIDTH * 4 for x in row] for row in S]
    plan = plan_all_to_all(load_cluster(MIXED_MINI), traffic, strategy)
    plan.check()
    result = {
        "strategy": plan.strategy,
        "num_stages": plan.num_stages,
        "plan_sent": sum(t.num_bytes for t in plan.transfers if t.src == rank),
        "direct_sent": sum(traffic[rank]) - traffic[rank][rank],
    }
    # 1. through all_to_all_single with HETCOMM_PLAN=strategy
    out = torch.empty(sum(out_splits), WIDTH)
    reset_stats()
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    counters = stats()
    # Every data byte is counted once, under the rail that owns it (the bridge's staged bytes
    # under "bridge", not again under the host rail that carried them).
    result["sent"] = sum(c["bytes_sent"] for c in counters.values())
    result["a2a"] = out
    # 2. this rank's own plan object, through run_plan, on raw bytes
    from hetcomm.backends import hetcomm_group

    out2 = torch.empty(sum(out_splits), WIDTH)
    hetcomm_group(dist.group.WORLD).run_plan(plan, out2, inp).wait()
    result["run_plan"] = out2
    # 3. the reference
    gloo = dist.new_group(backend="gloo")
    ref = torch.empty(sum(out_splits), WIDTH)
    dist.all_to_all_single(ref, inp, out_splits, in_splits, group=gloo)
    result["gloo"] = ref
    return result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["hier", "multirail", "flat"])
def test_plans_through_the_backend_equal_gloo_exactly(strategy):
    got = run_ranks(program, world_size=4, cluster=MIXED_MINI, timeout=150, args=(strategy,),
                    env={"HETCOMM_PLAN": strategy})
    for rank, r in enumerate(got):
        assert r["strategy"] == strategy
        assert torch.equal(r["a2a"], r["gloo"]), f"rank {rank}: {strategy} all_to_all_single != gloo"
        assert torch.equal(r["run_plan"], r["gloo"]), f"rank {rank}: run_plan({strategy}) != gloo"
        assert r["sent"] == r["plan_sent"], f"rank {rank}: sent {r['sent']} bytes, the plan says {r['plan_sent']}"
    if strategy == "flat":
        assert all(r["plan_sent"] == r["direct_sent"] for r in got)
    else:
        # the A100 node's two ranks aggregate for each other: somebody forwards
        assert got[0]["num_stages"] == 4  # gather, exchange, network scatter, bridge scatter
        assert any(r["plan_sent"] != r["direct_sent"] for r in got)
