"""PowerSGD on cross-node pairs only, over real rank processes (gloo)."""

from __future__ import annotations

import sys

import torch

from tests.backends.ranks import run_ranks

SHAPES = [(64, 64), (256, 64), (64,), (8, 64)]


def _grads(rank, step):
    g = torch.Generator().manual_seed(100 * rank + 7)  # constant per rank: error feedback must converge
    return [torch.randn(s, generator=g) * (1 + rank) for s in SHAPES]


def _rank_powersgd(rank, world_size, node_ids):
    import torch.distributed as dist

    from hetcomm.moe.powersgd import SlowLinkPowerSGD

    comp = SlowLinkPowerSGD(node_ids, matrix_approximation_rank=4, start_iter=3)
    exact = [sum(_grads(r, 0)[i] for r in range(world_size)) / world_size for i in range(len(SHAPES))]
    flat_exact = torch.cat([e.reshape(-1) for e in exact])
    cum = torch.zeros_like(flat_exact)
    first_errs = []
    steps = 12
    num_refs = sys.getrefcount(comp.state)
    held_after = []  # references to the state still held elsewhere (gloo's worker) after each call
    for step in range(steps):
        gs = _grads(rank, step)
        comp.all_reduce_mean(gs)
        if comp.state is not None:  # leaders only (None's count moves with everything else)
            held_after.append(sys.getrefcount(comp.state) - num_refs)
        flat = torch.cat([g.reshape(-1) for g in gs])
        if step < 2:  # plain averaging before start_iter
            first_errs.append(float((flat - flat_exact).abs().max()))
        cum += flat
    # Error feedback (torch's): what compression left out so far sits in the leaders' error
    # buffers, so sum(outputs) - sum(exact means) = -(1/W) * sum over leaders of their errors.
    err = comp.state.error_dict[0].clone() if comp.state is not None else torch.zeros_like(cum)
    dist.all_reduce(err)
    identity = float((cum - steps * flat_exact + err / world_size).abs().max()) / float(flat_exact.abs().max())
    missing = float((cum / steps - flat_exact).norm() / flat_exact.norm())
    return {"first": max(first_errs), "identity": identity, "missing": missing, "stats": comp.stats(),
            "leader": comp.is_leader, "cum0": cum[:4].tolist(), "held_after": held_after}


def test_powersgd_compresses_only_between_nodes_with_torch_error_feedback():
    node_ids = [0, 0, 1, 2]  # mixed-mini: two A100 ranks share a node; H800 and 910B alone
    out = run_ranks(_rank_powersgd, world_size=4, backend="gloo", timeout=180, args=(node_ids,))
    assert all(o["first"] < 1e-5 for o in out)
    assert out[0]["cum0"] == out[1]["cum0"] == out[2]["cum0"] == out[3]["cum0"]  # same result everywhere
    assert [o["leader"] for o in out] == [True, False, True, True]
    for o in (out[0], out[2], out[3]):
        assert o["stats"]["reduction"] >= 8.0, o["stats"]
    assert out[1]["stats"]["compressed_bytes"] == 0  # rank 1 talks only inside its node
    assert out[0]["missing"] > 1e-3  # it did compress (random full-rank gradients lose a lot)...
    assert all(o["identity"] < 1e-4 for o in out), [o["identity"] for o in out]  # ...and nothing is lost
    # The hook's callbacks (on gloo's worker thread) have let go of the state, and with it of the
    # leader group, when a call returns: a group freed on its own worker thread aborts the process.
    assert [o["held_after"] for o in out] == [[0] * 12, [], [0] * 12, [0] * 12]


def _rank_one_node(rank, world_size):
    from hetcomm.moe.powersgd import SlowLinkPowerSGD

    comp = SlowLinkPowerSGD([0] * world_size, start_iter=2)
    gs = _grads(rank, 0)
    comp.all_reduce_mean(gs)
    exact = [sum(_grads(r, 0)[i] for r in range(world_size)) / world_size for i in range(len(SHAPES))]
    return max(float((a - b).abs().max()) for a, b in zip(gs, exact))


def test_one_node_is_exact():
    assert max(run_ranks(_rank_one_node, world_size=2, backend="gloo", timeout=60)) < 1e-5


def _rank_powersgd_bytes(rank, world_size, node_ids):
    """SlowLinkPowerSGD over the default group's backend (hetcomm here: no side gloo groups), with
    this rank's hetcomm.stats() bytes per averaging before and after compression starts."""
    import torch.distributed as dist

    import hetcomm
    from hetcomm.backends import hetcomm_group
    from hetcomm.moe.powersgd import SlowLinkPowerSGD

    comp = SlowLinkPowerSGD(node_ids, matrix_approximation_rank=4, start_iter=3)
    groups = [g for g in (comp.node_group, comp.leader_group) if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER]
    backends = sorted({dist.get_backend(g) for g in groups})
    if dist.get_backend() == "hetcomm":
        for g in groups:
            hetcomm_group(g)  # raises unless the group is a hetcomm group
    per_step = []
    outs = []
    for step in range(6):
        gs = _grads(rank, step)
        hetcomm.reset_stats()
        comp.all_reduce_mean(gs)
        s = hetcomm.stats()
        per_step.append(sum(int(v.get("bytes_sent", 0)) for v in s.values() if isinstance(v, dict)))
        outs.append(torch.cat([g.reshape(-1) for g in gs]))
    return {"backends": backends, "bytes": per_step, "out": outs[-1], "stats": comp.stats()}


def test_powersgd_over_hetcomm_groups_counts_its_compressed_bytes_on_the_rails():
    from tests.backends.ranks import MIXED_MINI

    node_ids = [0, 0, 1, 2]
    ref = run_ranks(_rank_powersgd_bytes, world_size=4, backend="gloo", timeout=180, args=(node_ids,))
    got = run_ranks(_rank_powersgd_bytes, world_size=4, cluster=MIXED_MINI, timeout=240, args=(node_ids,))
    for o in got:
        assert o["backends"] == ["hetcomm"], o["backends"]  # no side gloo group
    for r in range(4):  # the same compressed averages as over gloo, bit for bit
        assert torch.equal(got[r]["out"], ref[r]["out"]), r
    for r in (2, 3):  # alone on their node: every byte they send is the leader group's
        plain, compressed = got[r]["bytes"][0], got[r]["bytes"][-1]
        assert plain > 0 and compressed > 0
        assert plain / compressed >= 4.0, got[r]["bytes"]
        assert got[r]["stats"]["reduction"] >= 8.0
    assert ref[0]["stats"]["reduction"] == got[0]["stats"]["reduction"]
