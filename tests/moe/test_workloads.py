"""The eight skew workloads (hetcomm.moe.workloads): deterministic, k distinct experts per row,
each with the skew it is named for; the oracle against scipy's LP and the fallback."""

from __future__ import annotations

import builtins

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe.token_split import plan_split
from hetcomm.moe.workloads import WORKLOADS, WorkloadSpec, global_counts, oracle_makespan, resolve_workload, workload_routing

SPEC = WorkloadSpec(num_experts=16, world_size=4, num_tokens=256, k=2)


def _share(counts, experts):
    tot = [sum(c[e] for c in counts) for e in range(SPEC.num_experts)]
    return sum(tot[e] for e in experts) / sum(tot)


@pytest.mark.parametrize("w", WORKLOADS)
def test_deterministic_and_k_distinct(w):
    a = workload_routing(w, SPEC, 3, 5, 1)
    b = workload_routing(w, SPEC, 3, 5, 1)
    assert torch.equal(a, b)
    assert a.dtype == torch.int64 and a.size(1) == 2
    assert bool((a[:, 0] != a[:, 1]).all())
    assert int(a.min()) >= 0 and int(a.max()) < SPEC.num_experts
    if w not in ("W0_balanced", "W7_burst"):  # W7 is W0 except every 8th step
        assert not torch.equal(a, workload_routing(w, SPEC, 4, 5, 1))


def test_each_workload_has_its_skew():
    bal = global_counts("W0", SPEC, 0, 0)
    tot = [sum(c[e] for c in bal) for e in range(16)]
    assert max(tot) == min(tot)  # exactly balanced
    hot = global_counts("W1", SPEC, 0, 0)
    tot = sorted((sum(c[e] for c in hot) for e in range(16)), reverse=True)
    assert sum(tot[:2]) / sum(tot) > 0.35  # 2 hot experts take about half the picks
    assert _share(global_counts("W2", SPEC, 0, 0), range(16)) == 1.0
    ragged = [sum(c) for c in global_counts("W4", SPEC, 0, 0)]
    assert ragged[0] < ragged[-1] and ragged[0] == 2 * 64 and ragged[-1] == 2 * 448
    zero = global_counts("W5", SPEC, 0, 0)
    assert any(all(sum(c[e] for c in zero) == 0 for e in SPEC.block(r)) for r in range(4))
    rot = [global_counts("W6", SPEC, 0, s) for s in (0, 4)]
    top = [max(range(16), key=lambda e: sum(c[e] for c in r)) for r in rot]
    assert top[0] != top[1]  # the hotspot moved
    assert max(sum(c[e] for c in global_counts("W7", SPEC, 0, 7)) for e in range(16)) > 3 * 128
    assert resolve_workload("w3") == "W3_spread" and resolve_workload("burst") == "W7_burst"
    with pytest.raises(ConfigError):
        resolve_workload("W9")


def _case():
    counts = global_counts("W2", SPEC, 1, 2)
    total = [sum(c[e] for c in counts) for e in range(16)]
    owner = [e * 4 // 16 for e in range(16)]
    holders = {e: (0, 1, 2, 3) for e in (0, 1, 2, 3)}
    return counts, total, owner, holders, [100.0, 100.0, 100.0, 50.0]


def _without_scipy(fn):
    real = builtins.__import__

    def no_scipy(name, *a, **k):
        if name.startswith("scipy"):
            raise ImportError(name)
        return real(name, *a, **k)

    builtins.__import__ = no_scipy
    try:
        return fn()
    finally:
        builtins.__import__ = real


def test_fallback_oracle_bounds_the_integer_split():
    counts, total, owner, holders, speeds = _case()
    fb, solver = _without_scipy(lambda: oracle_makespan(total, holders, owner, speeds))
    assert solver == "bisection-maxflow"
    plan = plan_split(counts, owner, holders, speeds)
    assert fb <= plan.makespan * (1 + 1e-9) <= fb * 1.01  # integer rows: within a row of the LP
    # Without copies the oracle is the owners' time.
    alone, _ = _without_scipy(lambda: oracle_makespan(total, {}, owner, speeds))
    assert alone == pytest.approx(max(sum(total[e] for e in range(16) if owner[e] == r) / speeds[r] for r in range(4)), rel=1e-8)


def test_scipy_lp_agrees_with_the_fallback():
    counts, total, owner, holders, speeds = _case()
    lp, solver = oracle_makespan(total, holders, owner, speeds)
    assert solver == "scipy-highs"
    fb, _ = _without_scipy(lambda: oracle_makespan(total, holders, owner, speeds))
    assert fb == pytest.approx(lp, rel=1e-6)
