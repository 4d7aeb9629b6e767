"""Single-process tests: options, rail selection, chunking, split checks, placement, liveness."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hetcomm.backends.checks import check_meta, encode_meta
from hetcomm.backends.executor import chunk_rows, execute_plan, tag_for
from hetcomm.backends.options import HetcommOptions, options_from_env
from hetcomm.backends.rank_placement import Placement, RankPlace
from hetcomm.backends.rails.shm import pid_alive
from hetcomm.backends.select import choose_rail
from hetcomm.errors import ConfigError
from hetcomm.sched.plan import Plan
from hetcomm.topo.cluster import load_cluster
from tests.backends.ranks import MIXED_MINI


def test_options_from_env_fill_defaults_only():
    env = {"HETCOMM_RAILS": "shm, gloo", "HETCOMM_CHUNK_BYTES": "1M", "HETCOMM_PLAN": "hier", "HETCOMM_CHECK": "0"}
    o = options_from_env(None, env)
    assert o.rails == ("shm", "gloo") and o.chunk_bytes == 1 << 20 and o.plan == "hier" and not o.check_splits
    o = options_from_env(HetcommOptions(rails=("gloo",), chunk_bytes=4096), env)
    assert o.rails == ("gloo",) and o.chunk_bytes == 4096  # explicit options win


@pytest.mark.parametrize(
    "kwargs, key",
    [({"rails": ("shm", "tcp")}, "rails"), ({"chunk_bytes": 0}, "chunk_bytes"), ({"plan": "best"}, "plan"),
     ({"wire_dtype": "fp8"}, "wire_dtype"), ({"ring_bytes": 100}, "ring_bytes")],
)
def test_bad_options_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        HetcommOptions(**kwargs)


def test_bad_env_names_the_variable():
    with pytest.raises(ConfigError, match="HETCOMM_RAILS"):
        options_from_env(None, {"HETCOMM_RAILS": "shm,carrier-pigeon"})
    with pytest.raises(ConfigError, match="HETCOMM_CHUNK_BYTES"):
        options_from_env(None, {"HETCOMM_CHUNK_BYTES": "lots"})


def _mini_placement(hosts=("h", "h", "h", "h")) -> Placement:
    c = load_cluster(MIXED_MINI)
    ranks = tuple(
        RankPlace(r, r, c.rank(r).node.name, hosts[r], 100 + r, c.rank(r).vendor, c.rank(r).model, True) for r in range(4)
    )
    return Placement(ranks, c)


def test_rail_choice_on_mixed_mini_follows_the_yaml_not_the_host():
    p = _mini_placement()
    assert [choose_rail(p, 0, q, "cpu") for q in (1, 2, 3)] == ["shm", "gloo", "bridge"]
    assert [choose_rail(p, 2, q, "cpu") for q in (0, 1, 3)] == ["gloo", "gloo", "bridge"]
    # forced rail sets
    assert [choose_rail(p, 0, q, "cpu", allowed=("shm", "gloo")) for q in (1, 2, 3)] == ["shm", "gloo", "gloo"]
    assert [choose_rail(p, 0, q, "cpu", allowed=("gloo",)) for q in (1, 2, 3)] == ["gloo", "gloo", "gloo"]
    # same YAML node but different real hosts: no shared memory
    p2 = _mini_placement(hosts=("h0", "h1", "h2", "h3"))
    assert choose_rail(p2, 0, 1, "cpu") == "gloo"
    # device tensors: label-only ranks cannot use NCCL; the bridge stages through host memory
    assert choose_rail(p, 0, 1, "cuda", nccl_ok=True) == "bridge"


def test_rail_choice_for_real_devices():
    c = load_cluster(MIXED_MINI)
    ranks = tuple(RankPlace(r, r, c.rank(r).node.name, "h", r, c.rank(r).vendor, c.rank(r).model, False) for r in range(4))
    p = Placement(ranks, c)
    assert choose_rail(p, 0, 2, "cuda", nccl_ok=True) == "nccl"
    assert choose_rail(p, 0, 2, "cuda", nccl_ok=False) == "bridge"
    assert choose_rail(p, 0, 3, "cuda", nccl_ok=True) == "bridge"


def test_chunk_rows_cover_every_row_once():
    assert chunk_rows(0, 8, 64) == []
    assert chunk_rows(10, 8, 32) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_rows(3, 1000, 10) == [(0, 1), (1, 1), (2, 1)]  # at least one row per chunk
    assert len({tag_for(s, i) for s in range(3) for i in range(100)}) == 300
    assert all(0 <= tag_for(s, i) < 2**31 for s in (0, 1 << 20) for i in (0, 1 << 20))


def test_check_meta_names_every_bad_pair_and_passes_good_ones():
    n = 3
    good = [[1, 2, 0], [0, 1, 4], [3, 0, 0]]
    metas = [encode_meta("all_to_all_single", 5, torch.float32, 8, (2,), good[r], [good[j][r] for j in range(n)]) for r in range(n)]
    m = check_meta("all_to_all_single", 0, metas)
    assert m.sends(1) == [0, 1, 4] and m.recvs(2) == [0, 4, 0]
    bad = [encode_meta("all_to_all_single", 5, torch.float32, 8, (2,), good[r], [good[j][r] for j in range(n)]) for r in range(n)]
    bad[2] = encode_meta("all_to_all_single", 5, torch.float32, 8, (2,), [3, 0, 0], [0, 9, 0])
    with pytest.raises(ValueError, match=r"rank 1 sends 4 rows to rank 2, but rank 2 expects 9"):
        check_meta("all_to_all_single", 2, bad)
    wrong_dtype = list(metas)
    wrong_dtype[1] = encode_meta("all_to_all_single", 5, torch.float16, 4, (2,), good[1], [good[j][1] for j in range(n)])
    with pytest.raises(ValueError, match="rank 1 has dtype torch.float16"):
        check_meta("all_to_all_single", 0, wrong_dtype)
    out_of_order = list(metas)
    out_of_order[2] = encode_meta("all_to_all", 6, torch.float32, 8, (2,), good[2], [good[j][2] for j in range(n)])
    with pytest.raises(ValueError, match="different orders"):
        check_meta("all_to_all_single", 0, out_of_order)


def test_execute_plan_rejects_tensors_that_do_not_fit_the_plan():
    plan = Plan(strategy="flat", traffic=((4, 8), (8, 4)), transfers=())
    with pytest.raises(ValueError, match="need 12 and 12"):
        execute_plan(plan, torch.empty(3, dtype=torch.uint8), torch.empty(12, dtype=torch.uint8), 0, lambda p, h: None)


def test_pid_alive_sees_exit_and_zombies():
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    while proc.poll() is None:
        pass
    assert not pid_alive(proc.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited but not reaped yet: a zombie
    assert not pid_alive(zombie.pid)
    zombie.wait()


def test_registered_with_a_device_list():
    import torch.distributed as dist

    import hetcomm  # noqa: F401

    assert "hetcomm" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["hetcomm"][0] == "cpu"
    assert isinstance(dist.Backend.backend_capability["hetcomm"], list)
