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


def _mismatch(rank: int, world: int):
    import hetcomm

    found = hetcomm.communicator().placement.discovered
    return [f.code for f in found.findings if f.code == "cluster-mismatch"]


def test_a_file_that_contradicts_the_probe_is_reported(tmp_path):
    """mixed-mini says A100-SXM4 with NVLink; the ranks read a captured PCIe A100 box."""
    from tests.topo.test_discover import make_probe_dirs

    template = make_probe_dirs(tmp_path)
    from tests.backends.ranks import MIXED_MINI

    res = run_ranks(_mismatch, world_size=4, cluster=MIXED_MINI, env={"HETCOMM_PROBE_DIR": template})
    assert all(r == res[0] and "cluster-mismatch" in r for r in res)
