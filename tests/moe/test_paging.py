"""Expert paging: bit-identical weights through evict/reload cycles, and the three degradation
levels (L1 wait / stale, L2 pin, L3 stand-in), on real tensors and real copy workers."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from torch import nn

from hetcomm.errors import ConfigError
from hetcomm.moe.degrade import DegradeConfig
from hetcomm.moe.paging import ExpertPager, PagingConfig, PagingError, pages_for

D, F = 16, 32


@pytest.fixture(autouse=True)
def _short_switch_interval():
    """Hand-offs to the copy workers at 0.1 ms instead of Python's 5 ms (as the benchmark)."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(old)


def make_experts(n: int, seed: int = 0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(D, F), nn.GELU(), nn.Linear(F, D)) for _ in range(n)]


def snapshot(mods, opt):
    out = []
    for m in mods:
        for p in m.parameters():
            out.append(p.detach().clone())
            for k in sorted(opt.state.get(p, {})):
                v = opt.state[p][k]
                out.append(v.detach().clone() if torch.is_tensor(v) else torch.tensor(v))
    return out


def assert_bit_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y)


def test_bit_identical_after_1000_evict_reload_cycles():
    """Train paged experts and an unpaged twin on the same data; random evictions, prefetches
    and reloads between steps; weights and Adam state stay equal bit for bit."""
    E = 8
    paged = make_experts(E)
    twin = copy.deepcopy(paged)
    opt_p = torch.optim.AdamW([p for m in paged for p in m.parameters()], lr=1e-2)
    opt_t = torch.optim.AdamW([p for m in twin for p in m.parameters()], lr=1e-2)
    pager = ExpertPager(paged, PagingConfig(budget_fraction=0.5), optimizer=opt_p)
    assert pager.num_slots == 4
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(1)
    try:
        step = 0
        while pager.stats()["evictions"] < 1000:
            step += 1
            used = rng.sample(range(E), rng.randint(1, 4))
            counts = torch.zeros(E, dtype=torch.int64)
            for e in used:
                counts[e] = rng.randint(1, 6)
            xs = {e: torch.randn(int(counts[e]), D, generator=gen) for e in used}
            loss_p = torch.zeros(())
            for g in pager.grants(pager.begin_step(counts)):
                assert g.kind in ("hit", "waited") and g.expert == g.requested
                assert pager.resident(g.expert)
                loss_p = loss_p + (paged[g.expert](xs[g.expert]) ** 2).mean()
                pager.release(g.requested)
            loss_t = torch.zeros(())
            for e in sorted(used):
                loss_t = loss_t + (twin[e](xs[e]) ** 2).mean()
            loss_p.backward()
            loss_t.backward()
            opt_p.step()
            opt_t.step()
            opt_p.zero_grad(set_to_none=True)
            opt_t.zero_grad(set_to_none=True)
            pager.end_step()
            # Between steps: random forced evictions and prefetches (reloads).
            for e in rng.sample(range(E), 5):
                if pager.slot_of[e] is not None and e not in pager.l2_pinned:
                    pager.evict(e)
                elif rng.random() < 0.7:
                    pager.prefetch(e)
            if step % 61 == 0:
                pager.sync()
                assert_bit_identical(snapshot(paged, opt_p), snapshot(twin, opt_t))
        pager.sync()
        assert_bit_identical(snapshot(paged, opt_p), snapshot(twin, opt_t))
        st = pager.stats()
        assert st["evictions"] >= 1000 and st["loads"] >= 1000 and st["writebacks"] >= 1000
    finally:
        pager.close()


def test_sum_order_does_not_matter_for_the_twin():
    """The twin above sums per-expert losses in another order than the pager grants; each
    expert's gradient depends only on its own term, so that order cannot change any weight."""
    a = make_experts(2)
    x = torch.randn(3, D)
    l1 = (a[0](x) ** 2).mean() + (a[1](x) ** 2).mean()
    g1 = torch.autograd.grad(l1, list(a[0].parameters()))
    l2 = (a[1](x) ** 2).mean() + (a[0](x) ** 2).mean()
    g2 = torch.autograd.grad(l2, list(a[0].parameters()))
    assert all(torch.equal(p, q) for p, q in zip(g1, g2))


def slow_pager(E: int = 4, **degrade):
    """A pager whose every transfer takes ~0.15 s, so a load started at gate time surely has
    not landed when its expert's turn comes (faults are certain, not timing luck)."""
    experts = make_experts(E, seed=3)
    probe = ExpertPager(experts[:1], PagingConfig(budget_fraction=1.0))
    slot_bytes = probe.slot_bytes
    probe.close()
    cfg = PagingConfig(budget_fraction=0.5, transfer_bytes_per_s=slot_bytes / 0.15, degrade=DegradeConfig(**degrade))
    return experts, ExpertPager(experts, cfg)


def one_step(pager, counts, compute=None):
    grants = []
    for g in pager.grants(pager.begin_step(torch.tensor(counts))):
        grants.append(g)
        if compute is not None:
            compute(g)
        pager.release(g.requested)
    pager.end_step()
    return grants


def test_l1_fault_waits_for_its_load_and_resident_experts_go_first():
    _, pager = slow_pager()
    try:
        pager.prefetch(1)
        pager.sync()
        grants = one_step(pager, [3, 5, 0, 0])  # expert 1 resident, expert 0 cold
        assert [(g.requested, g.kind) for g in grants] == [(1, "hit"), (0, "waited")]
        assert grants[1].waited_s > 0
        st = pager.stats()
        assert st["l1_waits"] == 1 and st["waits"] == 1 and st["hits"] == 1 and st["stall_s"] > 0
        assert st["hit_rate"] == 0.5
    finally:
        pager.close()


def test_l1_stale_reuses_previous_output_instead_of_waiting():
    experts, pager = slow_pager(reuse_stale=True)
    try:
        x = torch.randn(4, D)
        pager.prefetch(2)
        pager.sync()
        with torch.no_grad():
            y = experts[2](x)
        pager.record_output(2, y)
        pager.end_step()
        pager.evict(2)
        grants = one_step(pager, [0, 0, 4, 0])
        assert [(g.requested, g.kind) for g in grants] == [(2, "stale")]
        out = pager.stale_output(2, 3, like=x)
        assert out.shape == (3, D) and torch.allclose(out, y.mean(0).expand(3, D))
        assert pager.stats()["l1_stale"] == 1 and pager.stats()["l1_waits"] == 0
    finally:
        pager.close()


def test_l2_three_consecutive_faults_pin_the_expert():
    _, pager = slow_pager()
    try:
        for _ in range(3):
            grants = one_step(pager, [2, 0, 0, 0])
            assert grants[0].kind == "waited"
            pager.sync()
            pager.evict(0) if 0 not in pager.l2_pinned else None
        assert pager.l2_pinned == {0}
        st = pager.stats()
        assert st["l2_pins"] == 1 and st["l1_waits"] == 3
        with pytest.raises(PagingError) as info:
            pager.evict(0)
        assert info.value.expert == 0
        # Pinned: other experts stream through the remaining slot, 0 stays.
        for e in (1, 2, 3, 1, 2):
            counts = [0, 0, 0, 0]
            counts[e] = 1
            one_step(pager, counts)
            assert pager.slot_of[0] is not None
    finally:
        pager.close()


def test_l3_stands_in_the_most_similar_resident_expert(caplog):
    experts = make_experts(6, seed=3)
    with torch.no_grad():  # expert 3 = expert 1 plus a little noise: the most similar to 1
        for p, q in zip(experts[3].parameters(), experts[1].parameters()):
            p.copy_(q + 1e-3 * torch.randn_like(q))
    probe = ExpertPager(experts[:1], PagingConfig(budget_fraction=1.0))
    slot_bytes = probe.slot_bytes
    probe.close()
    cfg = PagingConfig(budget_fraction=0.5, transfer_bytes_per_s=slot_bytes / 0.15,
                       degrade=DegradeConfig(substitute=True))
    pager = ExpertPager(experts, cfg)
    try:
        pager.prefetch(3)
        pager.prefetch(0)
        pager.sync()
        pager.end_step()
        with caplog.at_level(logging.WARNING, logger="hetcomm.moe.degrade"):
            grants = one_step(pager, [1, 1, 0, 1, 0, 0])
        kinds = {g.requested: (g.kind, g.expert) for g in grants}
        assert kinds[1] == ("substitute", 3)
        assert kinds[0] == ("hit", 0) and kinds[3] == ("hit", 3)
        assert pager.stats()["l3_substitutions"] == 1
        assert any("expert 3" in r.getMessage() and "stood in" in r.getMessage() for r in caplog.records)
    finally:
        pager.close()


def test_training_step_over_budget_is_a_clear_error():
    experts = make_experts(5)
    with ExpertPager(experts, PagingConfig(budget_fraction=0.4)) as pager:
        with pytest.raises(PagingError, match="routes tokens to 3 experts but the budget holds 2"):
            pager.begin_step(torch.tensor([1, 1, 1, 0, 0]))


def test_forward_only_streams_more_experts_than_slots():
    experts = make_experts(10)
    x = torch.randn(2, D)
    ref = [e(x) for e in experts]
    with ExpertPager(experts, PagingConfig(budget_fraction=0.3, training=False)) as pager:
        for _ in range(3):
            seen = []
            for g in pager.grants(pager.begin_step(torch.ones(10, dtype=torch.int64))):
                with torch.no_grad():
                    assert torch.equal(experts[g.expert](x), ref[g.expert])
                seen.append(g.requested)
                pager.release(g.requested)
            pager.end_step()
            assert sorted(seen) == list(range(10))


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError) as info:
        PagingConfig(budget_fraction=1.5)
    assert info.value.key == "paging.budget_fraction"
    with pytest.raises(ConfigError) as info:
        ExpertPager(make_experts(4), PagingConfig(budget_fraction=0.1))
    assert info.value.key == "paging.budget_fraction"
    assert pages_for(17 * 2**20, PagingConfig()) == (8 * 2**20, 3)
    assert pages_for(200 * 2**20, PagingConfig()) == (64 * 2**20, 4)


def test_state_dict_round_trip():
    experts = make_experts(4)
    with ExpertPager(experts, PagingConfig(budget_fraction=0.5)) as a:
        one_step(a, [1, 2, 0, 0])
        one_step(a, [0, 2, 0, 0])
        sd = a.state_dict()
    with ExpertPager(make_experts(4), PagingConfig(budget_fraction=0.5)) as b:
        b.load_state_dict(sd)
        assert b.state_dict()["last_used"] == sd["last_used"] and torch.equal(b.state_dict()["ema"], sd["ema"])
