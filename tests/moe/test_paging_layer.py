"""The paged MoELayer (``page_budget > 0``): forward, backward and AdamW training equal the
unpaged layer's, on 1 and 2 real ranks, with a budget small enough that steps both fit it
(experts held until the optimizer step) and overflow it (waves: experts stream through the
slots, backward pages them in again); plus the paging step stats and ``apply_placement``."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from hetcomm.errors import ConfigError
from hetcomm.moe import MoELayer
from hetcomm.moe.paging import PagingConfig
from hetcomm.moe.placement import ExpertPlacement
from tests.backends.ranks import run_ranks

D, E = 16, 8
TOL = 1e-6


def _layers(budget: float, seed: int = 0, num_chunks: int = 1, device: str = "cpu"):
    """An unpaged layer and its paged twin (same weights), each with its own AdamW."""
    kw = dict(k=2, dropless=True, calibrate=False, wire_dtype="fp32", seed=seed, num_chunks=num_chunks)
    plain = MoELayer(D, E, **kw).to(device)
    paged = MoELayer(D, E, page_budget=budget, **kw).to(device)  # the pager is built on it at the first forward
    paged.load_state_dict(plain.state_dict())
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_paged = torch.optim.AdamW(paged.parameters(), lr=1e-2)
    paged.attach_optimizer(opt_paged)
    return plain, paged, opt_plain, opt_paged


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() if x.numel() else 0.0 for x, y in zip(a, b))


def train_twins(rank: int, world_size: int, budget: float, steps: int, seed: int, max_tokens: int = 12,
                num_chunks: int = 1, device: str = "cpu"):
    """Train an unpaged and a paged layer side by side on the same tokens; return the largest
    differences seen (outputs, input grads, parameter grads, weights, Adam state) and the
    paging counters. Token counts vary per step so some steps fit the budget and some do not."""
    sys.setswitchinterval(1e-4)  # hand-offs to the copy workers at 0.1 ms (as tests/moe/test_paging.py)
    plain, paged, opt_plain, opt_paged = _layers(budget, seed, num_chunks, device)
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    worst = {"out": 0.0, "x_grad": 0.0, "param_grad": 0.0, "weights": 0.0, "adam": 0.0}
    totals = {"page_hits": 0, "page_faults": 0, "page_loads": 0, "page_evictions": 0, "page_reacquires": 0}
    waves = held = 0
    for step in range(steps):
        T = int(torch.randint(1, max_tokens, (1,), generator=gen))
        x = torch.randn(T, D, generator=gen).to(device)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = plain(xa), paged(xb)
        (ya.pow(2).mean() + 0.01 * plain.l_aux).backward()
        (yb.pow(2).mean() + 0.01 * paged.l_aux).backward()
        worst["out"] = max(worst["out"], (ya - yb).abs().max().item())
        worst["x_grad"] = max(worst["x_grad"], (xa.grad - xb.grad).abs().max().item())
        ga = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plain.parameters()]
        gb = [p.grad if p.grad is not None else torch.zeros_like(p) for p in paged.parameters()]
        worst["param_grad"] = max(worst["param_grad"], _max_diff(ga, gb))
        opt_plain.step()
        opt_paged.step()
        opt_plain.zero_grad(set_to_none=True)
        opt_paged.zero_grad(set_to_none=True)
        paged.end_page_step()
        st = paged.step_stats()
        for k in totals:
            totals[k] += st[k]
        if st["page_experts_used"] > st["page_slots"]:
            waves += 1
            assert st["page_waves"]
        else:
            held += 1
    # A forward without autograd streams whatever it routes (never over budget).
    with torch.no_grad():
        x = torch.randn(24, D, generator=gen).to(device)
        worst["out"] = max(worst["out"], (plain(x) - paged(x)).abs().max().item())
    paged.end_page_step()
    paged.sync_pages()
    worst["weights"] = _max_diff(list(plain.parameters()), list(paged.parameters()))
    sa = [opt_plain.state[p][k] for p in plain.parameters() for k in ("exp_avg", "exp_avg_sq") if p in opt_plain.state]
    sb = [opt_paged.state[p][k] for p in paged.parameters() for k in ("exp_avg", "exp_avg_sq") if p in opt_paged.state]
    assert len(sa) == len(sb)
    worst["adam"] = _max_diff(sa, sb)
    slots = paged.pager.num_slots
    local = len(paged.local_expert_ids)
    paged.pager.close()
    return {"worst": worst, "totals": totals, "waves": waves, "held": held, "slots": slots, "local": local}


def assert_trains_like_unpaged(res, tol: float = TOL) -> None:
    """Every difference within `tol`, and the budget really forced paging (asserts)."""
    for key, v in res["worst"].items():
        assert v <= tol, (key, res)
    t = res["totals"]
    # The budget really forced paging: evictions and reloads, steps in both modes.
    assert res["slots"] < res["local"], res
    assert t["page_evictions"] > 0 and t["page_loads"] > 0, res
    assert res["waves"] > 0 and res["held"] > 0, res
    assert t["page_reacquires"] > 0, res
    assert t["page_hits"] + t["page_faults"] > 0, res


def test_paged_layer_trains_exactly_like_the_unpaged_one_on_one_rank():
    res = train_twins(0, 1, 0.5, 40, 0)
    assert res["slots"] == 4 and res["local"] == 8
    assert_trains_like_unpaged(res)


@pytest.mark.timeout(180)
def test_paged_layer_trains_exactly_like_the_unpaged_one_on_two_ranks():
    # 4 local experts per rank, a budget of 2: steps of 1-4 tokens per rank use 1-4 of them;
    # two dispatch chunks (the pager grants each chunk's experts as the chunk arrives).
    res = run_ranks(train_twins, world_size=2, cluster=None, timeout=150, args=(0.5, 30, 1, 5, 2))
    for r in res:
        assert r["local"] == 4 and r["slots"] == 2
        assert_trains_like_unpaged(r)


def test_page_budget_errors_name_the_key_and_the_minimum():
    with pytest.raises(ConfigError) as info:
        MoELayer(D, E, page_budget=1.5)
    assert info.value.key == "moe.page_budget"
    with pytest.raises(ConfigError) as info:
        MoELayer(D, E, page_budget=0.1)  # 0.1 x 8 local experts: no slot
    assert info.value.key == "moe.page_budget" and "0.125" in str(info.value)
    with pytest.raises(ConfigError) as info:
        MoELayer(D, E, paging="fast")
    assert info.value.key == "moe.paging"


def test_step_stats_without_paging_have_no_page_keys():
    layer = MoELayer(D, E)
    layer(torch.randn(4, D))
    assert not any(k.startswith("page_") for k in layer.step_stats())
    assert "migrations" not in layer.step_stats()


def test_apply_placement_validates_and_names_the_expert():
    layer = MoELayer(D, E, page_budget=0.5, calibrate=False)
    layer(torch.randn(6, D))
    mods = {e: layer.experts.experts[i] for i, e in enumerate(layer.local_expert_ids)}
    cases = [
        ([0] * (E - 1), mods, "names 7 experts"),
        ([0] * (E - 1) + [1], mods, "expert 7 is mapped to rank 1"),
        ([0] * E, {e: m for e, m in mods.items() if e != 5}, "expert 5 is mapped to rank 0 but no module"),
        ([0] * E, {**mods, 9: nn.Linear(1, 1)}, "expert 9 has a module"),
        ([0] * E, {**mods, 2: nn.Linear(D, D)}, "expert 2's module has parameters"),
    ]
    for owner, ms, text in cases:
        with pytest.raises(ConfigError, match=text) as info:
            layer.apply_placement(owner, ms)
        assert info.value.key == "moe.placement"
    # A valid map: expert 3 gets a fresh module (as a migration would bring it); the layer
    # computes with it and the pager is rebuilt over the new modules.
    fresh = layer.make_expert(3)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(2.0)
    arrived = layer.apply_placement(ExpertPlacement(tuple([0] * E), 1), {**mods, 3: fresh})
    assert arrived == []  # expert 3 was already on rank 0
    assert layer.experts.experts[layer.local_expert_ids.index(3)] is fresh
    x = torch.randn(32, D)
    y = layer(x)
    assert layer.pager is not None and layer.pager.experts[3] is fresh
    assert layer.step_stats()["migrations"] == 0
    ref = MoELayer(D, E, calibrate=False)
    ref.load_state_dict(layer.state_dict())
    assert torch.allclose(ref(x), y, atol=TOL)
    layer.pager.close()


def test_metrics_records_carry_the_paging_counters(tmp_path):
    """``hetcomm train --metrics``: a paged layer's counters reach the step record (one rank),
    an unpaged layer's stay null; ``hetcomm report`` prints them."""
    from hetcomm.ops.metrics import MetricsCollector, RunHeader, read_metrics
    from hetcomm.ops.plots import summarize

    recs = {}
    for budget in (0.0, 0.5):
        layer = MoELayer(D, E, k=2, calibrate=False, page_budget=budget)
        path = str(tmp_path / f"m{budget}.jsonl")
        mc = MetricsCollector(path, 0, 1, None, [layer], RunHeader(1, "none", [], {}))
        for step in (1, 2, 3):
            mc.start_step()
            layer(torch.randn(16, D)).sum().backward()
            mc.mark("forward")
            layer.end_page_step()
            mc.end_step(step, 1.0, 16)
        mc.close()
        if layer.pager is not None:
            layer.pager.close()
        recs[budget] = read_metrics(path)
    off, on = recs[0.0].steps, recs[0.5].steps
    assert all(s.page_hits is None and s.page_faults is None and s.page_stall_s is None for s in off)
    assert all(isinstance(s.page_hits, int) and isinstance(s.page_stall_s, float) for s in on)
    # 16 tokens x 2 copies over 8 experts: every step uses more experts than the 4 slots.
    assert sum(s.page_hits + s.page_faults for s in on) >= 3 * 5
    text = summarize(recs[0.5])
    assert "of expert computations started without waiting" in text and "stalled on page loads" in text


def test_train_page_budget_is_checked():
    from hetcomm.train.loop import TrainConfig

    with pytest.raises(ConfigError) as info:
        TrainConfig(page_budget=2.0)
    assert info.value.key == "train.page_budget"
    assert TrainConfig(page_budget=0.4, balance=True).page_budget == 0.4


def test_warm_pages_loads_the_hottest_local_experts():
    layer = MoELayer(D, E, calibrate=False, page_budget=0.5)
    share = torch.tensor([0.0, 0.05, 0.4, 0.0, 0.3, 0.05, 0.2, 0.0])
    warmed = layer.warm_pages(share)
    assert warmed == [2, 4, 6, 1]  # 4 slots; hottest first (1 before 5: the stable order of equal shares)
    assert sorted(layer.pager.resident_experts()) == [1, 2, 4, 6]
    with pytest.raises(ConfigError) as info:
        layer.warm_pages(torch.ones(3))
    assert info.value.key == "moe.page_budget"
    assert MoELayer(D, E).warm_pages(share) == []  # paging off: nothing to do
    layer.pager.close()


@pytest.mark.timeout(300)
def test_train_with_paging_and_balance_follows_the_unpaged_run(tmp_path):
    """``hetcomm train --balance --page-budget 0.5`` on the 4 real ranks of mixed-mini (the demo
    model's sizes, one layer, 8 steps): the loss of every step equals the unpaged run's while
    experts migrate between paged layers, and the records carry migrations and paging counters.
    Replication is off in both: a rank that pages its experts has no room for copies, so the
    copies would sit elsewhere and the rows' partition (and their last bits) would differ."""
    from hetcomm.ops.metrics import read_metrics
    from hetcomm.train.loop import load_train_config
    from tests.ops.jobs import TINY, train_ranks

    logs = {}
    for budget in (0.0, 0.5):
        path = str(tmp_path / f"m{budget}.jsonl")
        cfg = load_train_config(TINY, steps=8, experts=16, layers=1, model_dim=64, hidden_dim=128, batch_size=16,
                                seq_len=32, balance=True, speed="datasheet", balance_every=3,
                                balance_cooldown=3, page_budget=budget, replicate=False, metrics=path)
        assert all(code in (0, 1) for code in train_ranks(cfg))  # 8 steps: no loss verdict
        logs[budget] = read_metrics(path).steps
    plain, paged = logs[0.0], logs[0.5]
    assert [s.loss for s in plain] == [s.loss for s in paged]
    assert sum(s.migrations or 0 for s in paged) > 0
    assert [s.migrations for s in plain] == [s.migrations for s in paged]
    assert all(s.page_hits is not None and s.page_stall_s is not None for s in paged)
    assert all(s.page_hits is None for s in plain)


def test_page_stats_survive_a_placement_change():
    layer = MoELayer(D, E, calibrate=False, page_budget=0.5)
    assert MoELayer(D, E).page_stats() == {}
    layer(torch.randn(16, D))
    before = layer.page_stats()
    assert before["slots"] == 4 and before["experts"] == 8 and before["hits"] + before["waits"] > 0
    mods = {e: layer.experts.experts[i] for i, e in enumerate(layer.local_expert_ids)}
    layer.apply_placement([0] * E, mods)  # the pager is rebuilt at the next forward
    assert layer.pager is None and layer.page_stats()["loads"] == before["loads"]
    layer(torch.randn(16, D))
    assert layer.page_stats()["hits"] + layer.page_stats()["waits"] > before["hits"] + before["waits"]
    layer.pager.close()


def test_doctor_counts_paging_as_prefetch(tmp_path):
    """An out-of-memory log beside a run with --page-budget is the oom-prefetch finding."""
    import os

    from hetcomm.ops.doctor import diagnose, load_record
    from tests.ops.traces import make_traces

    def paged(o):
        if o["kind"] == "run":
            o["config"]["page_budget"] = 0.4

    make_traces._write(str(tmp_path), "paged.jsonl", make_traces._records(paged))
    oom = os.path.join(make_traces.HERE, "oom_prefetch.log")
    (f,) = [x for x in diagnose(load_record([str(tmp_path / "paged.jsonl"), oom])) if x.code.startswith("oom")]
    assert f.code == "oom-prefetch" and "page_budget=0.4" in f.message
    make_traces._write(str(tmp_path), "plain.jsonl", make_traces._records(lambda o: None))
    (f,) = [x for x in diagnose(load_record([str(tmp_path / "plain.jsonl"), oom])) if x.code.startswith("oom")]
    assert f.code == "oom"


@pytest.mark.parametrize("level,counter", [("reuse_stale", "l1_stale"), ("substitute", "l3_substitutions")])
def test_degraded_answers_in_the_layer(level, counter):
    """L1 stale / L3 stand-in inside the layer: with loads that take ~0.1 s, cold experts get the
    degraded answer instead of a wait; forward and backward still run (opt-in: approximate)."""
    from hetcomm.moe.degrade import DegradeConfig

    sys.setswitchinterval(1e-4)
    probe = MoELayer(D, E, page_budget=1.0)
    probe(torch.randn(2, D))
    slot_bytes = probe.pager.slot_bytes
    probe.pager.close()
    paging = PagingConfig(transfer_bytes_per_s=slot_bytes / 0.1, degrade=DegradeConfig(**{level: True}))
    layer = MoELayer(D, E, k=1, calibrate=False, page_budget=0.5, paging=paging)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(12, D, generator=gen, requires_grad=True)
        y = layer(x)
        y.sum().backward()
        assert torch.isfinite(y).all() and x.grad is not None
        layer.end_page_step()
        layer.pager.sync()
        for e in layer.pager.resident_experts():  # cold again next step, so it faults again
            if e not in layer.pager.l2_pinned:  # (L2 pins an expert after 3 faulting steps)
                layer.pager.evict(e)
    assert layer.pager.stats()[counter] > 0
    assert layer.page_stats()[counter] == layer.pager.stats()[counter]
    assert "page_" + counter in layer.step_stats()
    layer.pager.close()
