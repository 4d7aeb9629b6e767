"""Rails chosen by measurement (issue 10.5): same-host pairs calibrated once per host, cached on
disk, refreshed on demand, and the same choice on every rank."""

from __future__ import annotations

import json
import os

import torch

from tests.backends.ranks import run_ranks


def _routes(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import hetcomm

    comm = hetcomm.communicator()
    x = torch.arange(4.0 * world_size) + 100 * rank
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    expect = torch.cat([torch.arange(4.0 * rank, 4.0 * rank + 4) + 100 * j for j in range(world_size)])
    return {"choice": comm.same_host_rail, "rails": comm.group.rail_names("cpu"), "ok": bool(torch.equal(y, expect)),
            "stats": hetcomm.stats()}


def test_calibration_measures_once_caches_and_agrees(tmp_path):
    # The suite pins same-host pairs to shm (tests/conftest.py); this test measures.
    env = {"HETCOMM_CACHE_DIR": str(tmp_path), "HETCOMM_RECALIBRATE": None, "HETCOMM_SAME_HOST_RAIL": None}
    first = run_ranks(_routes, world_size=2, timeout=120, env=env)
    cache = json.loads((tmp_path / "calibration.json").read_text())
    (key, entry), = cache.items()
    assert entry["rail"] in ("shm", "gloo") and entry["shm_s"] > 0 and entry["gloo_s"] > 0, entry
    assert "unit=2" in key and "group=2" in key
    # Every rank routes every pair the same way: the measured choice, for the one host.
    choices = {json.dumps(o["choice"], sort_keys=True) for o in first}
    assert len(choices) == 1 and list(first[0]["choice"].values()) == [entry["rail"]]
    for r, o in enumerate(first):
        assert o["ok"] and o["rails"] == [("self" if p == r else entry["rail"]) for p in range(2)], o
        # The calibration's own transfers are not the user's traffic.
        assert sum(v["bytes_sent"] for v in o["stats"].values()) < 1 << 20, o["stats"]
    # A planted cache entry is used as is (no new measurement): flip the choice.
    flipped = "shm" if entry["rail"] == "gloo" else "gloo"
    entry_planted = dict(entry, rail=flipped, shm_s=-1.0)
    (tmp_path / "calibration.json").write_text(json.dumps({key: entry_planted}))
    second = run_ranks(_routes, world_size=2, timeout=120, env=env)
    assert all(o["ok"] and list(o["choice"].values()) == [flipped] for o in second), second
    # HETCOMM_RECALIBRATE=1 measures again and overwrites the entry.
    third = run_ranks(_routes, world_size=2, timeout=120, env=dict(env, HETCOMM_RECALIBRATE="1"))
    again = json.loads((tmp_path / "calibration.json").read_text())[key]
    assert again["shm_s"] > 0 and all(o["ok"] for o in third)


def test_explicit_rails_are_not_calibrated(tmp_path):
    from hetcomm.backends import HetcommOptions

    out = run_ranks(_routes, world_size=2, timeout=60, env={"HETCOMM_CACHE_DIR": str(tmp_path)},
                    pg_options=HetcommOptions(rails=("shm", "gloo")))
    assert all(o["choice"] == {} and o["ok"] for o in out)
    assert out[0]["rails"] == ["self", "shm"] and not os.path.exists(tmp_path / "calibration.json")


def test_pinned_rail_skips_measurement_and_cache(tmp_path):
    for rail in ("gloo", "shm"):
        out = run_ranks(_routes, world_size=2, timeout=60,
                        env={"HETCOMM_CACHE_DIR": str(tmp_path), "HETCOMM_SAME_HOST_RAIL": rail})
        assert all(o["ok"] and list(o["choice"].values()) == [rail] for o in out), out
        assert out[0]["rails"] == ["self", rail]
    assert not os.path.exists(tmp_path / "calibration.json")
