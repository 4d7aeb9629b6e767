"""Planned all-to-all paths by default (``plan="adaptive"``, hetcomm/backends/planpick.py).

One 5-rank job on ``plan-5.yaml`` (2 A100 + 2 Ascend 910B + 1 H800 on three nodes, CPU processes
standing for them) covers: the default path picks ``hier`` where the cost model predicts a gain
(small messages) and the direct route where it does not (300 KiB per pair), on the whole group and
on a 4-rank subgroup (the A100 and Ascend nodes, as an expert-parallel group of a larger job
would be); ``pg_options`` pins ``direct``; every output is bit-equal to the pinned direct group's and to the
expected rows; and every rank took the same path in every call, with rank-dependent splits (a
divergent choice would also hang the job: the test would fail on its timeout). The decision
rules themselves (shape classes, purity, subclusters, the pin through ``HETCOMM_PLAN``) are
checked without processes (pinned named plans run in test_routing.py and tests/gpu).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hetcomm.backends.options import HetcommOptions, options_from_env
from hetcomm.backends.planpick import PlanChooser, group_cluster, representative, scaled_cluster, shape_class
from hetcomm.backends.rank_placement import Placement, RankPlace
from hetcomm.topo.cluster import load_cluster
from tests.backends.ranks import REPO_ROOT, run_ranks

PLAN5 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan-5.yaml")
ROW = 64  # float32 elements per row: 256 B


def _rows(src: int, dst: int, count: int) -> torch.Tensor:
    base = (src * 1000 + dst) * 10000.0
    return base + torch.arange(count * ROW, dtype=torch.float32).reshape(count, ROW)  # host: test data


def _exchange(group, members, rank_in_group, splits_of):
    """One all_to_all_single on ``group``; returns (output, expected)."""
    import torch.distributed as dist

    n = len(members)
    ins = [splits_of(rank_in_group, j) for j in range(n)]
    outs = [splits_of(j, rank_in_group) for j in range(n)]
    x = torch.cat([_rows(rank_in_group, j, c) for j, c in enumerate(ins)])
    y = torch.empty(sum(outs), ROW)  # host: test output
    dist.all_to_all_single(y, x, outs, ins, group=group)
    want = torch.cat([_rows(j, rank_in_group, c) for j, c in enumerate(outs)])
    return y, want


def _small(i: int, j: int) -> int:
    return 3 + (2 * i + j) % 4  # 0.75-1.5 KiB per pair, different on every rank


def _large(i: int, j: int) -> int:
    return 1200 + 16 * ((i + j) % 3)  # about 300 KiB per pair


def _body(rank: int, world: int):
    import torch.distributed as dist

    import hetcomm

    out = {}
    direct = dist.new_group(backend="hetcomm", pg_options=HetcommOptions(plan="direct"))
    sub = dist.new_group([0, 1, 2, 3], backend="hetcomm")
    ok = True
    for name, splits, calls in (("small", _small, 2), ("large", _large, 1)):
        for c in range(calls):  # the second call of a class hits the cache
            y, want = _exchange(None, range(world), rank, splits)
            yd, _ = _exchange(direct, range(world), rank, splits)
            ok &= torch.equal(y, want) and torch.equal(y, yd)
            if rank < 4:
                ys, want_s = _exchange(sub, range(4), rank, splits)
                ok &= torch.equal(ys, want_s)
        out[name] = {
            "world": dict(hetcomm.communicator().plan_paths["taken"]),
            "sub": dict(hetcomm.communicator(sub).plan_paths["taken"]) if rank < 4 else None,
        }
    out["equal"] = ok
    out["paths"] = {
        "world": hetcomm.communicator().plan_paths,
        "direct": hetcomm.communicator(direct).plan_paths["taken"],
        "sub": hetcomm.communicator(sub).plan_paths if rank < 4 else None,
    }
    return out


def test_default_path_plans_where_the_model_says_so_on_groups_and_subgroups():
    # HETCOMM_PLAN_STAGE_US=0: the simulator's model alone decides (the default charges each
    # extra stage 500 us, under which this small cluster never plans: test_conservative_default)
    res = run_ranks(_body, world_size=5, cluster=PLAN5, timeout=240.0, env={"HETCOMM_PLAN_STAGE_US": "0"})
    for r, o in enumerate(res):
        assert o["equal"], r
        # small: 2 planned calls; large: then a direct one (counts are cumulative)
        assert o["small"]["world"] == {"hier": 2}, (r, o["small"])
        assert o["large"]["world"] == {"hier": 2, "direct": 1}, (r, o["large"])
        assert o["paths"]["direct"] == {"direct": 3}, r
        if r < 4:
            assert o["small"]["sub"] == {"hier": 2} and o["large"]["sub"] == {"hier": 2, "direct": 1}, (r, o)
            assert o["paths"]["sub"]["cluster"] == "plan-5[4 ranks]"
        assert o["paths"]["world"]["strategy"] == "adaptive"
    # every rank decided alike, class by class (a rank-divergent choice would deadlock)
    for key in ("world", "sub"):
        seen = [o["paths"][key]["decisions"] for o in res if o["paths"][key] is not None]
        assert all(d == seen[0] for d in seen), (key, seen)
    assert len(res[0]["paths"]["world"]["decisions"]) >= 2  # at least one class each way


# -- without processes --------------------------------------------------------------------------


def _placement(cluster, ranks):
    return Placement(tuple(RankPlace(i, g, "n", "h", 0, "nvidia", "A100", True) for i, g in enumerate(ranks)), cluster)


def test_shape_classes_decide_once_and_alike_in_any_order(monkeypatch):
    monkeypatch.setenv("HETCOMM_PLAN_STAGE_US", "0")
    cluster = load_cluster(PLAN5)
    n = 5
    rng = np.random.default_rng(0)
    mats = [rng.integers(1, 1 << k, size=(n, n)) * 256 for k in (2, 6, 12, 14) for _ in range(3)]
    a = PlanChooser(_placement(cluster, range(n)), "adaptive")
    b = PlanChooser(_placement(cluster, range(n)), "adaptive")
    got_a = [a.choose(m) for m in mats]
    got_b = [b.choose(m) for m in reversed(mats)][::-1]
    assert got_a == got_b  # pure: the call order (what a rank saw before) does not matter
    assert "hier" in got_a and None in got_a
    assert len(a.decisions) == len({shape_class(m).tobytes() for m in mats})
    # a class's decision is that of its representative matrix, so two members agree
    m = np.full((n, n), 1000)
    m2 = m + 10  # same half octave
    assert shape_class(m).tobytes() == shape_class(m2).tobytes()
    assert a.choose(m) == a.choose(m2) == a._decide(representative(shape_class(m)))[0]
    # a plan covers the call's own bytes
    plan = a.plan("hier", m2)
    assert [list(r) for r in plan.traffic] == m2.tolist()


def test_group_clusters_and_pins(monkeypatch):
    monkeypatch.setenv("HETCOMM_PLAN_STAGE_US", "0")
    cluster = load_cluster(PLAN5)
    assert group_cluster(_placement(cluster, range(5))) is cluster
    sub = group_cluster(_placement(cluster, [1, 2, 3]))
    assert [(g.name, g.devices_per_node) for g in sub.groups] == [("a100-0", 1), ("ascend-0", 2)]
    assert sub.num_ranks == 3 and sub.link_class(0, 1) == cluster.link_class(1, 2)
    assert group_cluster(_placement(cluster, [0, 2, 1])) is None  # a node's ranks split in group order
    assert group_cluster(_placement(None, [0, 1])) is None
    # pins: direct never plans; a named plan always does; HETCOMM_PLAN pins too; pg_options wins
    assert HetcommOptions().plan == "adaptive"
    assert options_from_env(None, {"HETCOMM_PLAN": "direct"}).plan == "direct"
    assert options_from_env(HetcommOptions(plan="hier"), {"HETCOMM_PLAN": "direct"}).plan == "hier"
    assert PlanChooser(_placement(cluster, range(5)), "direct").choose(np.full((5, 5), 1024)) is None
    assert PlanChooser(_placement(cluster, range(5)), "multirail").choose(np.full((5, 5), 1 << 24)) == "multirail"
    # under emulation (rates x 1e-3) the shaped links dominate sooner: emulated-4node plans up to
    # 64 KiB per pair at nominal rates, only the smallest class (256 B) at the emulated ones
    emu = load_cluster(os.path.join(REPO_ROOT, "configs", "clusters", "emulated-4node.yaml"))
    ch = PlanChooser(_placement(emu, range(8)), "adaptive")
    assert ch.choose(np.full((8, 8), 1 << 16)) == "hier"
    ch = PlanChooser(_placement(emu, range(8)), "adaptive")
    ch.cluster = scaled_cluster(emu, 1e-3)
    assert ch.choose(np.full((8, 8), 256)) == "hier" and ch.choose(np.full((8, 8), 4096)) is None


def test_conservative_default():
    """With the default per-stage cost (500 us) the small clusters never plan (the emulated
    measurement: a staged plan lost to direct where the bare simulator predicted a gain), while
    the 80-rank preset still plans its small and mid-sized all-to-alls."""
    from hetcomm import settings
    from hetcomm.backends.planpick import plan_model

    assert settings.PLAN_STAGE_US.get({}) == 500.0
    assert plan_model().endswith(";stage_us=500.0") or os.environ.get("HETCOMM_PLAN_STAGE_US")
    small = load_cluster(PLAN5)
    assert not PlanChooser(_placement(small, range(5)), "adaptive").eligible
    big = load_cluster(os.path.join(REPO_ROOT, "configs", "clusters", "mixed-a100-h800-910b.yaml"))
    ch = PlanChooser(_placement(big, range(big.num_ranks)), "adaptive")
    n = big.num_ranks
    assert ch.choose(np.full((n, n), 1 << 20)) in ("hier", "multirail")
    assert ch.choose(np.full((n, n), 1 << 24)) is None
