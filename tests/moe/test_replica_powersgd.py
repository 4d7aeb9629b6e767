"""Compressed replica-gradient sums (``MoEConfig.replicate_powersgd``) over real hetcomm ranks,
and ``hetcomm train --powersgd`` keeping every byte on hetcomm groups.

The replicator runs on the 4-rank mixed-mini cluster (ranks 0, 1 on one node; 2 and 3 alone):
hot experts 0, 1, 2 owned by the strong ranks 0, 1, 2 reduce over the holders ``{0, 1, 2}``,
whose cross-node pair is the leaders 0 and 2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetcomm.errors import ConfigError
from tests.backends.ranks import MIXED_MINI, run_ranks

D, F = 64, 128  # the demo's expert: two [128, 64]-class matrices (PowerSGD rank 4: 10.7x each)
START = 3
STEPS = 8
CHANGE = 6  # the hot set drops expert 2 from this step on


def _make(e):
    return nn.Sequential(nn.Linear(D, F), nn.Linear(F, D))


def _grad(rank, e, p_index, shape):
    g = torch.Generator().manual_seed(1000 * rank + 10 * e + p_index)  # constant per step: error feedback converges
    return torch.randn(shape, generator=g) * (1 + rank)


def _replicator(rank, node_ids, powersgd_rank):
    from hetcomm.moe.placement import ExpertPlacement
    from hetcomm.moe.placement.replicate import HotExpertReplicator

    placement = ExpertPlacement(owner=(0, 1, 2, 3), world_size=4)
    torch.manual_seed(0)
    owned = {rank: _make(rank)}
    return HotExpertReplicator(placement, rank, (0, 1, 2), _make, owned, None, num_hot=3, every=1,
                               powersgd_rank=powersgd_rank, powersgd_start=START, node_ids=node_ids)


def _step(rep, rank, hot):
    """One backward's replica-gradient sum: every replica gets its fixed gradient; returns the
    owner's summed gradient (flat) and this reduction's rail bytes sent."""
    rep.set_hot(hot)
    for e, m in rep.replicas.items():
        for i, p in enumerate(m.parameters()):
            p.grad = _grad(rank, e, i, p.shape)
    for p in rep.owned[rank].parameters():
        p.grad = None
    before = sum(rep.grad_rail_bytes.values())
    rep.reduce_grads()
    out = [p.grad for p in rep.owned[rank].parameters()]
    flat = torch.cat([g.reshape(-1) for g in out]) if all(g is not None for g in out) else None
    return flat, sum(rep.grad_rail_bytes.values()) - before


def _exact(e, shapes):
    """The exact sum for expert e: every holder but its owner contributes a replica gradient."""
    return torch.cat([sum(_grad(h, e, i, s) for h in (0, 1, 2) if h != e).reshape(-1) for i, s in enumerate(shapes)])


def _rank_replicas(rank, world_size):
    import torch.distributed as dist

    from hetcomm.backends import hetcomm_group

    plain = _replicator(rank, None, 0)
    comp = _replicator(rank, [0, 0, 1, 2], 4)
    one_node = _replicator(rank, [0, 0, 0, 1], 4)  # the holders share a node; rank 3 does not
    for c in comp.powersgd.values():
        for g in (c.node_group, c.leader_group):
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                hetcomm_group(g)  # raises unless a hetcomm group: no side gloo group
    out = {"keys": sorted(comp.powersgd), "one_node_keys": sorted(one_node.powersgd), "steps": []}
    shapes = [p.shape for p in _make(0).parameters()]
    cum = None
    for step in range(STEPS):
        hot = (0, 1, 2) if step < CHANGE else (0, 1)
        p_out, p_bytes = _step(plain, rank, hot)
        c_out, c_bytes = _step(comp, rank, hot)
        o_out, _ = _step(one_node, rank, hot)
        rec = {"plain_bytes": p_bytes, "comp_bytes": c_bytes,
               "one_node_equal": (p_out is None and o_out is None) or bool(torch.equal(p_out, o_out))}
        if rank in (0, 1) and c_out is not None:
            if step < START:
                rec["warmup_err"] = float((c_out - _exact(rank, shapes)).abs().max())
            cum = c_out.clone() if cum is None else cum + c_out
        out["steps"].append(rec)
    holders = comp.powersgd.get("holders")
    if holders is not None and holders.state is not None:  # a leader: 0 (node {0, 1}) or 2
        err = holders.state.error_dict[0]
        out["err_rows"] = [float(r.norm()) for r in err.view(len(comp._powersgd_hot["holders"]), -1)]
    # Error feedback: what compression left out so far sits in the leaders' error rows, so for
    # an expert hot all along, sum(outputs) + sum over leaders of its error row = steps x exact.
    P = sum(s.numel() for s in shapes)
    row = torch.zeros(2 * P)
    if holders is not None and holders.state is not None:
        row = holders.state.error_dict[0][: 2 * P].clone()  # experts 0 and 1 (rows 0, 1 of the hot set)
    dist.all_reduce(row)
    if rank in (0, 1):
        mine = row[rank * P : (rank + 1) * P]
        exact = _exact(rank, shapes)
        out["identity"] = float((cum + mine - STEPS * exact).abs().max() / exact.abs().max())
        out["missing"] = float((cum / STEPS - exact).norm() / exact.norm())
    return out


def test_replica_gradients_compressed_on_cross_node_pairs_with_error_feedback():
    out = run_ranks(_rank_replicas, world_size=4, cluster=MIXED_MINI, timeout=240)
    assert out[0]["keys"] == ["all", "holders"]  # both reduction groups span nodes
    assert out[0]["one_node_keys"] == ["all"]  # holders on one node: their sums stay exact
    for o in out:  # no cross-node pair: bit for bit the uncompressed sums
        assert all(s["one_node_equal"] for s in o["steps"]), o["steps"]
    for r in (0, 1):
        assert all(s["warmup_err"] < 1e-4 for s in out[r]["steps"][:START]), out[r]["steps"]
        assert out[r]["missing"] > 1e-3  # it did compress (random full-rank gradients lose a lot)...
        assert out[r]["identity"] < 1e-4, out[r]["identity"]  # ...and the error feedback keeps the rest
    # The error rows persist across steps and follow the hot set: experts 0, 1 kept theirs.
    for r in (0, 2):
        assert len(out[r]["err_rows"]) == 2 and min(out[r]["err_rows"]) > 0, out[r]["err_rows"]
    # Rank 2 is alone on its node: each byte it sends crosses a node. Compressed >= 4x fewer.
    s2 = out[2]["steps"]
    for s in s2[START:]:
        assert s["plain_bytes"] > 0 and s["plain_bytes"] / s["comp_bytes"] >= 4.0, s2
    assert all(s["plain_bytes"] == s["comp_bytes"] == 0 for s in out[3]["steps"])  # not a holder


def test_replica_powersgd_config_names_the_key():
    from hetcomm.moe import MoEConfig
    from hetcomm.train.loop import TrainConfig

    with pytest.raises(ConfigError) as info:
        MoEConfig(model_dim=8, num_experts=4, replicate_powersgd=2)
    assert info.value.key == "moe.replicate_powersgd"
    with pytest.raises(ConfigError) as info:
        MoEConfig(model_dim=8, num_experts=4, replicate=True, replicate_powersgd=2, replicate_powersgd_start=1)
    assert info.value.key == "moe.replicate_powersgd_start"
    for bad in (dict(powersgd_experts=-1), dict(powersgd_experts=4, replicate=False)):
        with pytest.raises(ConfigError) as info:
            TrainConfig(**bad)
        assert info.value.key == "train.powersgd_experts"


def test_one_rank_layer_is_unchanged_by_the_option():
    from hetcomm.moe import MoELayer

    outs = []
    for rp in (0, 4):
        torch.manual_seed(0)
        layer = MoELayer(16, 4, k=2, replicate=True, replicate_powersgd=rp, calibrate=False, seed=3)
        x = torch.randn(32, 16, requires_grad=True)
        layer(x).sum().backward()
        outs.append(torch.cat([x.grad.reshape(-1)] + [p.grad.reshape(-1) for p in layer.parameters() if p.grad is not None]))
    assert torch.equal(outs[0], outs[1])


def _rank_train(rank, world_size, cfg, port):
    from hetcomm.train.loop import last_summary
    from tests.ops.jobs import _train_rank

    code = _train_rank(rank, world_size, cfg, port)
    s = last_summary()
    return {"code": code, "groups": s["process_groups"], "dense": s["powersgd_ranks"][rank],
            "experts": s["replica_grad_ranks"][rank], "text": s["text"] if rank == 0 else ""}


def test_train_powersgd_sends_every_byte_on_hetcomm_groups():
    """``hetcomm train --powersgd 4 --powersgd-experts 4``: every process group is a hetcomm
    group, and the compressed bytes are counted on hetcomm's rails."""
    from hetcomm.train.loop import load_train_config
    from tests.ops.jobs import TINY, _free_port

    # tiny's sizes with the demo's widths (its dense gradients compress 8x at rank 4) and 12 steps:
    # compression starts at step 11 (max(10, steps // 10) plain ones)
    cfg = load_train_config(TINY, steps=12, powersgd_rank=4, powersgd_experts=4, model_dim=64, hidden_dim=128)
    out = run_ranks(_rank_train, 4, cluster=MIXED_MINI, args=(cfg, _free_port()), timeout=180)
    assert all(o["code"] in (0, 1) for o in out)
    for o in out:
        assert o["groups"] and set(o["groups"]) == {"hetcomm"}, o["groups"]
    assert "all hetcomm" in out[0]["text"]
    for r in (2, 3):  # alone on their nodes: each byte they send in a compressed averaging crosses a node
        d = out[r]["dense"]
        assert d["compressed_calls"] == 2 and d["compressed_bytes"] > 0
        assert 0 < d["rail_bytes"] <= d["uncompressed_bytes"] / 4, d  # on hetcomm rails, >= 4x fewer
    # the hot set forms at step 10 (replicate_every): its sums ran, exact before their own start
    assert out[2]["experts"]["calls"] > 0 and out[2]["experts"]["compressed_calls"] == 0
