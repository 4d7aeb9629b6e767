"""Without a cluster file the default group detects its cluster (hetcomm.topo.discover)."""

from __future__ import annotations

from tests.backends.ranks import run_ranks


def _placement(rank: int, world: int):
    import torch
    import torch.distributed as dist

    import hetcomm

    comm = hetcomm.communicator()
    x = torch.arange(8, dtype=torch.float32) + 10 * rank
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    found = comm.placement.discovered
    return {
        "name": comm.cluster.name if comm.cluster is not None else None,
        "nodes": [p.node for p in comm.placement.ranks],
        "classes": [comm.placement.link_class(0, b).name for b in range(1, world)],
        "probes": dict(found.probes) if found is not None else None,
        "out": out.tolist(),
    }


def test_default_group_runs_on_a_detected_cluster():
    res = run_ranks(_placement, world_size=4, env={"HETCOMM_CLUSTER": None, "HETCOMM_PROBE_DIR": None})
    for r, got in enumerate(res):
        assert got["name"] == "detected"
        assert len(set(got["nodes"])) == 1  # one host, one node
        assert got["classes"] == ["SHM", "SHM", "SHM"]
        assert sum(got["probes"].values()) == 1  # the host was probed by one rank only
        assert got["out"] == [float(10 * s + 2 * r + i) for s in range(4) for i in range(2)]


def test_detection_can_be_turned_off():
    res = run_ranks(_placement, world_size=2, env={"HETCOMM_CLUSTER": None, "HETCOMM_DETECT": "0"})
    assert [got["name"] for got in res] == [None, None]
