"""The balancer's decisions (capacity-aware packing, replicas, gain vs cost, cooldown, drift),
the CSR map and its broadcast, and asynchronous migration between real rank processes."""

from __future__ import annotations

import torch
from torch import nn

import pytest

from hetcomm.errors import ConfigError
from hetcomm.moe.placement.balancer import (
    BalancerConfig,
    ExpertBalancer,
    ExpertMap,
    Move,
    broadcast_map,
    diff_maps,
    fast_signal,
    pack_capacity_aware,
    rank_loads,
    replica_counts,
)
from tests.backends.ranks import run_ranks


def zipf_counts(E, perm, n, gen):
    p = torch.empty(E, dtype=torch.float64)
    p[perm] = torch.arange(1, E + 1, dtype=torch.float64) ** -1.2
    return torch.bincount(torch.multinomial(p, n, replacement=True, generator=gen), minlength=E).double()


def test_capacity_aware_packing_follows_speed():
    load = [10.0] * 12
    m = pack_capacity_aware(load, [1] * 12, speeds=[3.0, 1.0, 1.0, 1.0], slots=[12] * 4)
    per_rank = [len(m.experts_on(r)) for r in range(4)]
    assert per_rank == [6, 2, 2, 2]  # finish times equal: 60/3 = 20/1
    eq = pack_capacity_aware(load, [1] * 12, speeds=[1.0] * 4, slots=[12] * 4)
    assert [len(eq.experts_on(r)) for r in range(4)] == [3, 3, 3, 3]
    with pytest.raises(ConfigError) as info:
        pack_capacity_aware(load, [1] * 12, speeds=[1.0] * 4, slots=[2] * 4)
    assert info.value.key == "balance.slots"


def test_replicas_go_to_the_hottest_per_copy_load():
    assert replica_counts([100.0, 30.0, 10.0], total_copies=6, max_copies=4) == [4, 1, 1]
    assert replica_counts([100.0, 60.0, 10.0], total_copies=5, max_copies=4) == [2, 2, 1]
    m = pack_capacity_aware([100.0, 10.0, 10.0, 10.0], [3, 1, 1, 1], [1.0] * 4, [4] * 4)
    assert len(set(m.ranks_of(0))) == 3  # copies on distinct ranks
    assert max(rank_loads(m, [100.0, 10.0, 10.0, 10.0])) < 100.0


def test_csr_map_round_trip_and_size():
    m = ExpertMap.from_lists([[e % 80] + ([(e + 1) % 80] if e < 16 else []) for e in range(64)], 80)
    assert len(m.indices) == 80 and m.nbytes() == 4 * (3 + 64 + 80) == 588
    assert ExpertMap.from_tensor(m.to_tensor(), 80) == m
    with pytest.raises(ConfigError):
        ExpertMap.from_lists([[0, 0]], 2)
    old = ExpertMap.from_lists([[0], [1], [2, 3]], 4)
    new = ExpertMap.from_lists([[1], [1, 2], [2]], 4)
    assert diff_maps(old, new) == [Move(0, 0, 1, 0), Move(1, None, 2, 1), Move(2, 3, None, 3)]


def test_fast_signal_is_confidence_weighted_topk_share():
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    f = fast_signal(logits, topk=2)
    assert abs(float(f.sum()) - 1) < 1e-9
    # The confident token (top-1 prob ~0.98) outweighs the flat one (0.25): expert 0 leads.
    assert int(torch.argmax(f)) == 0 and float(f[0]) > 0.6


def run_balancer(speeds, steps, cfg, seed=0, E=32):
    gen = torch.Generator().manual_seed(seed)
    bal = ExpertBalancer(E, speeds, cfg, bytes_per_expert=1 << 20)
    perm = torch.randperm(E, generator=gen)
    imb, static_imb = [], []
    static = bal.map
    for t in range(steps):
        if t % 200 == 0:
            perm = torch.randperm(E, generator=gen)
        counts = zipf_counts(E, perm, 4096, gen)
        bal.observe(counts, fast=counts / counts.sum())
        bal.maybe_rebalance()
        L = rank_loads(bal.map, counts.tolist())
        tt = [L[r] / speeds[r] for r in range(len(speeds))]
        imb.append(max(tt) / (sum(tt) / len(tt)))
        L = rank_loads(static, counts.tolist())
        tt = [L[r] / speeds[r] for r in range(len(speeds))]
        static_imb.append(max(tt) / (sum(tt) / len(tt)))
    return bal, imb, static_imb


def test_balancer_balances_and_never_breaks_the_cooldown():
    cfg = BalancerConfig(window=50, every=25, cooldown=300, redundant=4, seconds_per_unit=1e-4)
    bal, imb, static_imb = run_balancer([2.0, 1.0, 1.0, 1.0], 1000, cfg)
    assert bal.migrations, "a drifting hot set must make the balancer move experts"
    assert bal.cooldown_violations() == []
    steps_of = {}
    for step, mv in bal.migrations:
        steps_of.setdefault(mv.expert, set()).add(step)
    for e, s in steps_of.items():
        s = sorted(s)
        assert all(b - a >= 300 for a, b in zip(s, s[1:])), (e, s)
    # Over the run (the cooldown may hold a hot expert in place for a while) it beats static.
    assert sum(imb) / len(imb) < 0.8 * sum(static_imb) / len(static_imb)


def test_moves_only_when_gain_exceeds_cost():
    cheap = BalancerConfig(window=50, every=25, seconds_per_unit=1e-4)
    bal, _, _ = run_balancer([1.0] * 4, 200, cheap)
    assert bal.migrations
    dear = BalancerConfig(window=50, every=25, seconds_per_unit=1e-4, link_bytes_per_s=1.0)  # 1 B/s
    bal2, _, _ = run_balancer([1.0] * 4, 200, dear)
    assert bal2.migrations == [] and bal2.plans and all(not p.adopted and p.cost_s > p.predicted_gain_s for p in bal2.plans)


def test_state_dict_round_trip():
    cfg = BalancerConfig(window=20, every=10)
    bal, _, _ = run_balancer([1.0] * 4, 60, cfg)
    other = ExpertBalancer(32, [1.0] * 4, cfg)
    other.load_state_dict(bal.state_dict())
    assert other.map == bal.map and other.predicted_load() == bal.predicted_load()
    assert other.cooldown_violations() == bal.cooldown_violations()


# -- real processes -----------------------------------------------------------------------------

D = 8


def _expert():
    return nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D))


def _batch(step, e):
    g = torch.Generator().manual_seed(1000 * step + e)
    return torch.randn(5, D, generator=g)


def _rank_migration(rank, world_size):
    import torch.distributed as dist

    from hetcomm.moe.placement.migration import ExpertMigrator, ExpertSlots

    E = 8
    torch.manual_seed(0)
    twin = [_expert() for _ in range(E)]  # every rank trains all experts: the reference
    slots_mods = [_expert() for _ in range(4)]
    with torch.no_grad():
        for i, e in enumerate([2 * rank, 2 * rank + 1]):
            for p, q in zip(slots_mods[i].parameters(), twin[e].parameters()):
                p.copy_(q)
    slots = ExpertSlots(slots_mods, [2 * rank, 2 * rank + 1, None, None])
    opt = torch.optim.AdamW([p for m in slots_mods for p in m.parameters()], lr=1e-2)
    opt_t = torch.optim.AdamW([p for m in twin for p in m.parameters()], lr=1e-2)
    old = ExpertMap.from_lists([[e // 2] for e in range(E)], world_size)
    new = ExpertMap.from_lists([[1], [0], [2], [0], [3], [2], [1], [3]], world_size)  # 0<->1, 2->..., swaps
    moves = diff_maps(old, new)
    mig = ExpertMigrator()
    for step in range(1, 7):
        for e in slots.experts():
            (slots.module(e)(_batch(step, e)) ** 2).mean().backward()
        for e in range(E):
            (twin[e](_batch(step, e)) ** 2).mean().backward()
        if step == 4:
            done = mig.finish(slots, opt)
            assert done == [m for m in moves if m.dst is not None]
        opt.step()
        opt_t.step()
        opt.zero_grad(set_to_none=True)
        opt_t.zero_grad(set_to_none=True)
        if step == 3:
            mig.start(moves, slots, opt)  # the copy overlaps step 4's forward/backward
    assert sorted(slots.experts()) == sorted(new.experts_on(rank))
    for e in slots.experts():
        for p, q in zip(slots.module(e).parameters(), twin[e].parameters()):
            assert torch.equal(p, q), (rank, e)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][k], opt_t.state[q][k]), (rank, e, k)
    # The map goes out in CSR form from rank 0.
    got = broadcast_map(new if rank == 0 else None, src=0, num_experts=E, world_size=world_size, max_nnz=2 * E)
    assert got == new
    dist.barrier()
    return mig.stats["copies"]


def test_migration_between_real_ranks_is_exact():
    out = run_ranks(_rank_migration, world_size=4, backend="gloo", timeout=120)
    assert len(out) == 4


def test_a_pagers_migration_request_makes_the_balancer_plan_at_once():
    E = 8
    bal = ExpertBalancer(E, [1.0] * 4, BalancerConfig(window=10, every=50, cooldown=0), slots=[4] * 4)
    load = torch.zeros(E, dtype=torch.float64)
    load[0] = 100.0  # expert 0 (on rank 0) carries the step
    load[1] = 100.0  # and so does expert 1, on rank 0 too
    for _ in range(3):
        bal.observe(load)
        assert bal.maybe_rebalance() is None  # step 3 of 50: no plan is evaluated
    assert bal.plans == []
    bal.request_migration([1])
    bal.observe(load)
    plan = bal.maybe_rebalance()
    assert len(bal.plans) == 1 and bal.num_requests == 1  # evaluated at once
    assert plan is not None and any(mv.expert in (0, 1) for mv in plan.moves), bal.plans
    bal.observe(load)
    assert bal.maybe_rebalance() is None and len(bal.plans) == 1  # the request was used up


def test_measured_speeds_replace_the_prior_and_cold_experts_go_to_the_slow_rank():
    # Prior: equal ranks (a datasheet that is wrong); measured: rank 3 at half speed.
    load = [20.0, 50.0, 16.7, 33.3, 100.0, 25.0, 12.5, 14.3]  # coldest: experts 6 and 7, by load not by id
    init = ExpertMap.from_lists([[e * 4 // 8] for e in range(8)], 4)
    bal = ExpertBalancer(8, [1.0] * 4, BalancerConfig(every=1, window=1, cooldown=1, min_gain=0.0),
                         slots=[4] * 4, initial=init)
    bal.set_speeds([2.0, 2.0, 2.0, 1.0], seconds_per_unit=3.0)
    assert bal.speeds == [2.0, 2.0, 2.0, 1.0] and bal.cfg.seconds_per_unit == 3.0
    bal.observe(torch.tensor(load, dtype=torch.float64))
    plan = bal.propose()
    assert plan.adopted and plan.imbalance_after < plan.imbalance_before
    on_slow = plan.new_map.experts_on(3)
    assert on_slow and set(on_slow) <= {6, 7, 2}  # only the coldest experts stay on the slowest rank
    with pytest.raises(ConfigError):
        bal.set_speeds([1.0, 0.0, 1.0, 1.0])
