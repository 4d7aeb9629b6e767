"""Emulated compute speed (issue 11 item 4): a cpu cgroup per node, real ranks in it.

Marked ``emulate`` (root, iproute2, a cgroup cpu controller). The timing check asserts only
what the kernel guarantees on any load: no rank uses more CPU per wall second than its cgroup's
quota. A neighbour's load can only push a rank below its quota, so the wall-time ratio between
the nodes is reported, not asserted: measured on 2 shared cores it was 1.96-2.29 for a
configured 2.0 at load average 15, and 2.84 once under a full CI run.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from hetcomm.cli.main import main as hetcomm_main
from hetcomm.emulate.cgroup import SHARES_V1, WEIGHT_V2, find_cpu_hierarchy, period_us_for, read_cpu_limit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# mixed-mini's links, every device at 100 TFLOPS except the 910B at 50 (device.tflops).
HALF = os.path.join(REPO, "configs", "clusters", "mixed-mini-halfspeed.yaml")
HERE = os.path.join(REPO, "tests", "emulate")

pytestmark = [
    pytest.mark.emulate,
    pytest.mark.skipif(find_cpu_hierarchy() is None, reason="no cgroup cpu controller"),
]


def _no_cgroups(rid: str) -> bool:
    h = find_cpu_hierarchy()
    return not [n for n in os.listdir(h.root) if n.startswith(f"hc{rid}-")]


@pytest.mark.timeout(60)
def test_up_makes_a_cgroup_per_rank_with_its_quota(tmp_path, capfd):
    sd = str(tmp_path / "sd")
    argv = [
        "emulate",
        "up",
        "--cluster",
        HALF,
        "--state-dir",
        sd,
        "--compute",
        "--cpu-per-rank",
        "0.2",
    ]
    assert hetcomm_main(argv + ["--json"]) == 0
    state = json.loads(capfd.readouterr().out)
    rid = state["run_id"]
    h = find_cpu_hierarchy()
    try:
        # Recorded before creation, one per rank, named with the run's prefix.
        names = ["a100-0-r0", "a100-0-r1", "h800-0-r2", "ascend-0-r3"]
        assert state["cgroups"] == [os.path.join(h.root, f"hc{rid}-{n}") for n in names]
        quotas = {}
        for path in state["cgroups"]:
            quota, period = read_cpu_limit(h, path)
            quotas[os.path.basename(path)[9:]] = quota / period
            weight = "cpu.weight" if h.version == 2 else "cpu.shares"
            with open(os.path.join(path, weight)) as f:
                assert int(f.read()) == (WEIGHT_V2 if h.version == 2 else SHARES_V1)
        # 0.2 CPU per rank at full speed; the 910B at half speed: 0.1.
        assert quotas == pytest.approx(
            {"a100-0-r0": 0.2, "a100-0-r1": 0.2, "h800-0-r2": 0.2, "ascend-0-r3": 0.1}
        )
        assert hetcomm_main(["emulate", "status", "--state-dir", sd]) == 0
        assert "ascend-0     x0.5: 0.1 CPUs per rank" in capfd.readouterr().out
    finally:
        assert hetcomm_main(["emulate", "down", "--state-dir", sd]) == 0
    assert _no_cgroups(rid)


@pytest.mark.timeout(120)
def test_the_same_gemm_is_held_to_each_nodes_quota(tmp_path, capfd, monkeypatch):
    """The same GEMM loop on the H800 node (0.2 CPU) and then on the 910B node (x0.5: 0.1 CPU):
    neither gets more CPU than its quota. Unthrottled, the loop runs at a whole core, so a
    missing quota fails this; a loaded machine cannot."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    code = hetcomm_main(
        [
            "emulate", "run", "--cluster", HALF, "--state-dir", str(tmp_path / "sd"),
            "--compute", "--cpu-per-rank", "0.2", "--timeout", "100", "--",
            sys.executable, os.path.join(HERE, "rank_gemm.py"), str(out), "2,3", "4", "250",
        ]
    )  # fmt: skip
    err = capfd.readouterr().err
    assert code == 0, err
    h800 = json.loads((out / "rank2.json").read_text())
    ascend = json.loads((out / "rank3.json").read_text())
    rid = os.path.basename(h800["cgroup"]).split("-")[0][2:]
    assert h800["cgroup"].endswith(f"hc{rid}-h800-0-r2") and ascend["cgroup"].endswith(
        f"hc{rid}-ascend-0-r3"
    )
    assert (h800["compute"], ascend["compute"]) == ("1/0.2", "0.5/0.1")
    from hetcomm.emulate.ranks import rank_core

    # Each rank on one core of this machine's (two ranks a core on two cores).
    assert (h800["cores"], ascend["cores"]) == ([rank_core(2)], [rank_core(3)])
    cores = sorted(os.sched_getaffinity(0))
    assert rank_core(2) == cores[2 % len(cores)] and rank_core(3) == cores[3 % len(cores)]
    # CFS enforces the quota every period; a round may begin with one period's quota unspent.
    # Unthrottled, the CPU seconds would equal the wall seconds, 4-8x over this bound.
    for rec, quota in ((h800, 0.2), (ascend, 0.1)):
        walls, cpus = rec["wall_s"], rec["cpu_s"]
        bound = quota * (sum(walls) + len(walls) * period_us_for(quota) / 1e6)
        assert sum(cpus) <= 1.05 * bound, (sum(cpus), bound, rec)
    ratio = sum(ascend["wall_s"]) / sum(h800["wall_s"])
    print(f"910B/H800 wall-time ratio {ratio:.2f} (configured 2.0)")
    assert _no_cgroups(rid)


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    find_cpu_hierarchy() is None or find_cpu_hierarchy().version != 1,
    reason="emulation.host_share places single threads through cgroup v1",
)
def test_host_share_holds_only_the_training_thread(tmp_path, capfd):
    """With ``emulation.host_share`` a rank's cgroup gets ``cpu_per_rank`` and its main thread a
    ``device`` child at the node's speed; a thread the main thread starts is moved out of it.
    Asserted: where each thread ends up, both quotas, and the kernel's guarantee that the main
    thread gets no more CPU than its device quota, which on the slow node is a quarter of the
    rank's: without the device cgroup its main thread would take about half the rank's."""
    cluster = tmp_path / "half-host.yaml"
    text = open(HALF).read()
    assert "\nemulation:\n" in text
    cluster.write_text(text.replace("\nemulation:\n", "\nemulation:\n  host_share: 0.5\n"))
    out = tmp_path / "out"
    out.mkdir()
    code = hetcomm_main(
        [
            "emulate", "run", "--cluster", str(cluster), "--state-dir", str(tmp_path / "sd"),
            "--compute", "--cpu-per-rank", "0.4", "--timeout", "100", "--",
            sys.executable, os.path.join(HERE, "rank_threads.py"), str(out), "3",
        ]
    )  # fmt: skip
    err = capfd.readouterr().err
    assert code == 0, err
    for rank, device_cpus in ((2, 0.4 * 0.5), (3, 0.5 * 0.4 * 0.5)):
        rec = json.loads((out / f"rank{rank}.json").read_text())
        main, helper = rec["cgroups"]["main"], rec["cgroups"]["helper"]
        assert main.endswith("/device") and helper == main[: -len("/device")], rec
        bound = device_cpus * (rec["wall_s"] + period_us_for(device_cpus) / 1e6)
        assert rec["cpu_s"] <= 1.05 * bound, (rec, bound)
    from hetcomm.emulate.cgroup import CpuHierarchy, KernelError, create_cgroup

    with pytest.raises(KernelError, match="host_share needs the cgroup v1"):
        create_cgroup(CpuHierarchy(2, str(tmp_path)), str(tmp_path / "hcx-n-r0"), 0.4, 0.2)
