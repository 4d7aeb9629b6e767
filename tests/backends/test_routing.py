"""Rail choice, forced rails, stats, logging, subgroups, and plan execution (multi-stage)."""

from __future__ import annotations

import logging

import pytest
import torch

from hetcomm.sched.plan import Plan, Transfer
from hetcomm.topo.model import LinkClass
from tests.backends.ranks import MIXED_MINI, run_ranks


def _rows(src: int, dst: int, num_rows: int, width: int = 5) -> torch.Tensor:
    return torch.arange(num_rows * width, dtype=torch.float32).reshape(num_rows, width) + 1000 * src + 100 * dst


def _relay_plan(splits, row_bytes: int) -> Plan:
    """Hand-built 2-stage plan: each segment i->j is cut in two; the first half goes direct in
    stage 0, the second half goes i -> r -> j through relay r = the rank after j that is not i."""
    n = len(splits)
    traffic = tuple(tuple(splits[i][j] * row_bytes for j in range(n)) for i in range(n))
    transfers = []

    def add(**kw):
        transfers.append(Transfer(index=len(transfers), link_class=LinkClass.NET_SOCKET, **kw))
        return len(transfers) - 1

    for i in range(n):
        for j in range(n):
            size = traffic[i][j]
            if i == j or size == 0:
                continue
            first = (size // 2) // row_bytes * row_bytes or size
            add(src=i, dst=j, origin=i, final_dst=j, offset_bytes=0, num_bytes=first, stage=0)
            rest = size - first
            if rest:
                r = next(k for k in range(j + 1, j + n) if k % n not in (i, j)) % n
                d = add(src=i, dst=r, origin=i, final_dst=j, offset_bytes=first, num_bytes=rest, stage=0)
                add(src=r, dst=j, origin=i, final_dst=j, offset_bytes=first, num_bytes=rest, stage=1, deps=(d,))
    plan = Plan(strategy="hand-relay", traffic=traffic, transfers=tuple(transfers))
    plan.check()
    return plan


ALL_RAILS = ("shm", "gloo", "bridge")  # explicit: HETCOMM_RAILS (set for the job) only fills defaults
SPLITS = [[2, 3, 0, 5], [1, 0, 4, 2], [6, 2, 2, 0], [0, 7, 1, 3]]


def routing(rank: int, n: int) -> dict:
    import torch.distributed as dist

    import hetcomm
    from hetcomm.backends import HetcommOptions, hetcomm_group

    out = {}
    pg = hetcomm_group()
    out["rails_forced"] = pg.rail_names("cpu")  # HETCOMM_RAILS=shm,gloo is set for this job
    # stats: bytes per rail equal what this rank sends to the peers on that rail
    hetcomm.reset_stats()
    in_s, out_s = [SPLITS[rank][j] for j in range(n)], [SPLITS[j][rank] for j in range(n)]
    x = torch.cat([_rows(rank, j, in_s[j]) for j in range(n)])
    y = torch.empty(sum(out_s), 5)
    dist.all_to_all_single(y, x, out_s, in_s)
    out["a2a_ok"] = torch.equal(y, torch.cat([_rows(j, rank, out_s[j]) for j in range(n)]))
    out["stats"] = hetcomm.stats()
    hetcomm.reset_stats()
    out["stats_after_reset"] = hetcomm.stats()
    # a subgroup of global ranks 1..3, with its own log line
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hetcomm.backends").addHandler(handler)
    logging.getLogger("hetcomm.backends").setLevel(logging.INFO)
    sub = dist.new_group([1, 2, 3], backend="hetcomm", pg_options=HetcommOptions(rails=ALL_RAILS))
    logging.getLogger("hetcomm.backends").removeHandler(handler)
    out["log"] = [r.getMessage() for r in records]
    if rank != 0:
        sp = hetcomm_group(sub)
        out["sub_rails"] = sp.rail_names("cpu")
        xs = torch.arange(3 * 2, dtype=torch.float32) + 10 * rank
        ys = torch.empty(6)
        dist.all_to_all_single(ys, xs, group=sub)
        out["sub_a2a"] = ys
    # a subgroup whose ranks are a prefix of the cluster (global 0, 1 = the two A100s)
    pair = dist.new_group([0, 1], backend="hetcomm", pg_options=HetcommOptions(rails=ALL_RAILS))
    if rank < 2:
        out["pair_rails"] = hetcomm_group(pair).rail_names("cpu")
    # plans: planner strategies through the options, and a hand-made 2-stage relay plan
    ref_group = dist.new_group(backend="gloo")
    for strategy in ("hier", "multirail", "flat"):
        g = dist.new_group(backend="hetcomm", pg_options=HetcommOptions(plan=strategy, rails=ALL_RAILS))
        y1, y2 = torch.full((sum(out_s), 5), -1.0), torch.full((sum(out_s), 5), -2.0)
        dist.all_to_all_single(y1, x, out_s, in_s, group=g)
        dist.all_to_all_single(y2, x, out_s, in_s, group=ref_group)
        out[f"plan_{strategy}_equal"] = torch.equal(y1, y2)
    plan = _relay_plan(SPLITS, 5 * 4)
    y3 = torch.full((sum(out_s), 5), -3.0)
    hetcomm_group().run_plan(plan, y3, x).wait()
    out["relay_plan_equal"] = torch.equal(y3, torch.cat([_rows(j, rank, out_s[j]) for j in range(n)]))
    return out


@pytest.mark.timeout(180)
def test_rails_stats_logging_subgroups_and_plans():
    outs = run_ranks(routing, world_size=4, cluster=MIXED_MINI, timeout=150, env={"HETCOMM_RAILS": "shm,gloo"})
    assert outs[0]["rails_forced"] == ["self", "shm", "gloo", "gloo"]
    assert outs[3]["rails_forced"] == ["gloo", "gloo", "gloo", "self"]  # bridge not allowed -> gloo
    for rank, o in enumerate(outs):
        assert o["a2a_ok"], rank
        rails = o["rails_forced"]
        for rail in ("shm", "gloo"):  # data only: the split-check messages are not counted
            peers = [j for j in range(4) if rails[j] == rail]
            sent = sum(SPLITS[rank][j] * 5 * 4 for j in peers)
            recv = sum(SPLITS[j][rank] * 5 * 4 for j in peers)
            s = o["stats"].get(rail, {"bytes_sent": 0, "bytes_received": 0})
            assert (s["bytes_sent"], s["bytes_received"]) == (sent, recv), (rank, rail, o["stats"])
        assert o["stats_after_reset"] == {}
        for strategy in ("hier", "multirail", "flat"):
            assert o[f"plan_{strategy}_equal"], (rank, strategy)
        assert o["relay_plan_equal"], rank
    # the subgroup maps group ranks to global ranks: global 1 (A100) -> 2 (H800) gloo, -> 3 bridge
    assert outs[1]["sub_rails"] == ["self", "gloo", "bridge"]
    assert outs[3]["sub_rails"] == ["bridge", "bridge", "self"]
    assert outs[0]["pair_rails"] == ["self", "shm"] and outs[1]["pair_rails"] == ["shm", "self"]
    assert torch.equal(outs[2]["sub_a2a"], torch.tensor([12.0, 13.0, 22.0, 23.0, 32.0, 33.0]))
    # one log record per group creation, naming rails, link classes and labels
    log = "\n".join(outs[1]["log"])
    assert "rail bridge" in log and "HOST_BRIDGE" in log and "910B" in log, log
    assert "labels only" in log, log
