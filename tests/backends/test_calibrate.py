"""Ways chosen by measurement (issue 10.5): same-host pairs calibrated once per host and size
class, cached on disk, refreshed on demand, the same choice on every rank, and each call routed
by its size class."""

from __future__ import annotations

import json
import os

import torch

from hetcomm.backends.calibrate import CAL_SIZES, SameHostRails
from tests.backends.ranks import run_ranks


def _routes(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import hetcomm

    comm = hetcomm.communicator()
    x = torch.arange(4.0 * world_size) + 100 * rank
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    expect = torch.cat([torch.arange(4.0 * rank, 4.0 * rank + 4) + 100 * j for j in range(world_size)])
    return {"choice": {k: str(v) for k, v in comm.same_host_rail.items()},
            "classes": [v.classes for v in comm.same_host_rail.values()],
            "rails": hetcomm.backends.hetcomm_group().rail_names("cpu"), "ok": bool(torch.equal(y, expect)), "stats": hetcomm.stats()}


def test_size_classes_route_by_the_nearest_measured_size():
    c = SameHostRails(((1 << 20, "gloo"), (4 << 20, "shm"), (16 << 20, "cma")))
    assert [c.rail_for(b) for b in (0, 1 << 20, (2 << 20) + 1, 4 << 20, (8 << 20) - 1, 8 << 20, 1 << 30)] == \
        ["gloo", "gloo", "shm", "shm", "shm", "cma", "cma"]
    assert c.pair_rail == "shm" and c.per_call and str(c) == "gloo at 1 MiB, shm at 4 MiB, cma at 16 MiB"
    assert SameHostRails.single("gloo").pair_rail == "gloo" and not SameHostRails.single("shm").per_call
    assert c.without_cma().ways == ("gloo", "shm", "shm")
    assert SameHostRails.from_json(c.to_json()) == c


def test_calibration_measures_once_caches_and_agrees(tmp_path):
    # The suite pins same-host pairs to shm (tests/conftest.py); this test measures.
    env = {"HETCOMM_CACHE_DIR": str(tmp_path), "HETCOMM_RECALIBRATE": None, "HETCOMM_SAME_HOST_RAIL": None}
    first = run_ranks(_routes, world_size=2, timeout=120, env=env)
    cache = json.loads((tmp_path / "calibration.json").read_text())
    (key, entry), = cache.items()
    assert key.startswith("v=2|") and "unit=2" in key and "group=2" in key
    assert [b for b, _ in entry["classes"]] == list(CAL_SIZES), entry
    assert [r["bytes_per_rank"] for r in entry["measured"]] == list(CAL_SIZES)
    for row in entry["measured"]:
        assert row["shm_s"] > 0 and row["gloo_s"] > 0 and row["rail"] in ("shm", "gloo", "cma"), row
        assert ("cma_s" in row) == entry["cma_possible"]
    measured = SameHostRails(tuple((b, w) for b, w in entry["classes"]))
    # Every rank routes every call and pair the same way: the measured classes, for the one host.
    assert all(o["classes"] == [measured.classes] for o in first), first
    for r, o in enumerate(first):
        assert o["ok"] and o["rails"] == [("self" if p == r else measured.pair_rail) for p in range(2)], o
        # The calibration's own transfers are not the user's traffic.
        assert sum(v["bytes_sent"] for v in o["stats"].values()) < 1 << 20, o["stats"]
    # A planted cache entry is used as is (no new measurement): every size on gloo, or on shm.
    flipped = "shm" if measured.pair_rail == "gloo" else "gloo"
    planted = dict(entry, classes=[[b, flipped] for b in CAL_SIZES], measured=[])
    (tmp_path / "calibration.json").write_text(json.dumps({key: planted}))
    second = run_ranks(_routes, world_size=2, timeout=120, env=env)
    assert all(o["ok"] and list(o["choice"].values()) == [flipped] for o in second), second
    # HETCOMM_RECALIBRATE=1 measures again and overwrites the entry.
    third = run_ranks(_routes, world_size=2, timeout=120, env=dict(env, HETCOMM_RECALIBRATE="1"))
    again = json.loads((tmp_path / "calibration.json").read_text())[key]
    assert len(again["measured"]) == len(CAL_SIZES) and all(o["ok"] for o in third)


def test_explicit_rails_are_not_calibrated(tmp_path):
    from hetcomm.backends import HetcommOptions

    out = run_ranks(_routes, world_size=2, timeout=60, env={"HETCOMM_CACHE_DIR": str(tmp_path)},
                    pg_options=HetcommOptions(rails=("shm", "gloo")))
    assert all(o["choice"] == {} and o["ok"] for o in out)
    assert out[0]["rails"] == ["self", "shm"] and not os.path.exists(tmp_path / "calibration.json")


def test_pinned_way_skips_measurement_and_cache(tmp_path):
    for way, rail in (("gloo", "gloo"), ("shm", "shm"), ("cma", "shm")):
        out = run_ranks(_routes, world_size=2, timeout=60,
                        env={"HETCOMM_CACHE_DIR": str(tmp_path), "HETCOMM_SAME_HOST_RAIL": way})
        assert all(o["ok"] and list(o["choice"].values()) == [way] for o in out), out
        assert out[0]["rails"] == ["self", rail]
    assert not os.path.exists(tmp_path / "calibration.json")


def _by_size(rank: int, world_size: int) -> dict:
    """One call per size class; which way moved it shows in the counters (the rings cut a
    peer's 2 MiB into 1 MiB chunks, the single-copy path reads it in one piece, gloo counts
    under gloo)."""
    import torch.distributed as dist

    import hetcomm

    seen = {}
    for name, per_rank in (("small", 64 << 10), ("middle", 4 << 20), ("large", 16 << 20)):
        n = per_rank // 4
        x = torch.arange(n, dtype=torch.float32) + rank * n
        y = torch.empty_like(x)
        hetcomm.reset_stats()
        dist.all_to_all_single(y, x)
        share = n // world_size
        expect = torch.cat([torch.arange(share, dtype=torch.float32) + j * n + rank * share for j in range(world_size)])
        s = hetcomm.stats()
        seen[name] = {"ok": bool(torch.equal(y, expect)),
                      "gloo": s.get("gloo", {}).get("bytes_sent", 0), "shm_chunks": s.get("shm", {}).get("chunks_sent", 0)}
    return seen


def test_each_call_takes_its_size_class(tmp_path):
    from hetcomm.backends.calibrate import unit_key
    from hetcomm.backends.options import HetcommOptions

    key = unit_key(2, 2, HetcommOptions(ring_bytes=4 << 20))
    planted = {"classes": [[1 << 20, "gloo"], [4 << 20, "shm"], [16 << 20, "cma"]]}
    (tmp_path / "calibration.json").write_text(json.dumps({key: planted}))
    env = {"HETCOMM_CACHE_DIR": str(tmp_path), "HETCOMM_SAME_HOST_RAIL": None, "HETCOMM_RECALIBRATE": None,
           "HETCOMM_CHUNK_BYTES": "1M", "HETCOMM_SHM_RING_BYTES": None}
    out = run_ranks(_by_size, world_size=2, timeout=120, env=env)
    for o in out:
        assert all(v["ok"] for v in o.values()), o
        assert o["small"]["gloo"] > 0 and o["small"]["shm_chunks"] == 0, o      # gloo's all-to-all
        assert o["middle"]["gloo"] == 0 and o["middle"]["shm_chunks"] == 2, o   # rings: 2 MiB in 1 MiB chunks
        assert o["large"]["gloo"] == 0 and o["large"]["shm_chunks"] == 1, o    # single copy: one read per peer

