"""``hetcomm audit``: the Done-when checks, JSON, exit codes 0/1/2 and ``--plot``.

In-process through ``hetcomm.cli.main.main`` for speed, plus one run of the installed
``hetcomm`` entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from hetcomm.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")
TOP_KEYS = {"devices", "nics", "links", "findings", "measurements"}


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_audit_of_this_cpu_only_machine_is_clean(capsys):
    code, out, err = run_cli(capsys, "audit")
    assert code == 0 and err == ""
    assert "Findings\n  none" in out
    assert "(a) Expected all-to-all time" in out and "local copy" in out
    assert "No cross-vendor pair in this topology." in out
    assert "(c) Measured all-to-all" in out
    assert "CPU-only host" in out


def test_audit_h800_names_nvlink_peers_and_pix_rails(capsys, fixture_path):
    code, out, _ = run_cli(capsys, "audit", "-i", fixture_path("nvsmi_topo_h800_nv8_mlx5_bond.txt"))
    assert code == 0
    assert (
        "NVLINK group of 8 (NV8 on all 28 pairs): GPU0, GPU1, GPU2, GPU3, GPU4, GPU5, GPU6, GPU7"
        in out
    )
    rails = {
        "GPU0": "mlx5_0",
        "GPU1": "mlx5_3",
        "GPU2": "mlx5_4",
        "GPU3": "mlx5_5",
        "GPU4": "mlx5_6",
        "GPU5": "mlx5_7",
        "GPU6": "mlx5_8",
        "GPU7": "mlx5_9",
    }
    rail_lines = [
        ln.split()
        for ln in out.splitlines()
        if ln.strip().startswith("GPU") and ln.rstrip().endswith("PIX")
    ]
    assert {parts[0]: parts[1] for parts in rail_lines} == rails
    assert "Findings\n  none" in out
    # Answer (a) at the default 64 MiB: 7 NVLink peers at 200 GB/s each side.
    assert re.search(r"NVLINK\s+28\s+7\s+56 MiB\s+1600 Gb/s \(200 GB/s\)\s+3 us\s+296\.6 us", out)
    assert "bounded by NVLINK" in out


def test_audit_l40s_reports_nic_numa_mismatch(capsys, fixture_path):
    code, out, _ = run_cli(
        capsys, "audit", "-i", fixture_path("nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt")
    )
    assert code == 0  # warnings only
    assert "[WARNING] nic-numa-mismatch: GPU0" in out and "[WARNING] nic-numa-mismatch: GPU1" in out
    assert "nic-numa-mismatch: GPU2" not in out
    assert "fix:" in out and "means:" in out


def test_audit_socket_nccl_log_reports_ib_disabled_and_exits_1(capsys, fixture_path):
    code, out, _ = run_cli(
        capsys, "audit", "-i", fixture_path("nccl_log_p4d_ib_disabled_net_socket.txt")
    )
    assert code == 1
    assert "[ERROR] nccl-ib-disabled" in out


def test_audit_pcie_a100_against_sxm_cluster(capsys, fixture_path):
    code, out, _ = run_cli(
        capsys,
        "audit",
        "-i",
        fixture_path("nvsmi_a100_pcie_x2_nvlink_inactive.txt"),
        "--cluster",
        MINI,
    )
    assert code == 1
    assert "[ERROR] pcie-not-sxm: GPU0" in out and "A100-PCIE-40GB" in out
    assert "Staged through host memory" in out


def test_audit_combined_inputs_no_gdr(capsys, fixture_path):
    code, out, _ = run_cli(
        capsys,
        "audit",
        "-i",
        fixture_path("lsmod_nvidia_peermem_bound_vs_unbound.txt"),
        "-i",
        fixture_path("ibstat_cx7_roce200_cx6dx_down_truncated.txt"),
    )
    assert code == 1
    assert "[ERROR] no-gdr" in out and "[WARNING] rdma-port-down: mlx5_10" in out


def test_audit_json_has_the_schema_and_answers(capsys, fixture_path):
    code, out, _ = run_cli(
        capsys,
        "audit",
        "--json",
        "--size",
        "1G",
        "-i",
        fixture_path("nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt"),
    )
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == TOP_KEYS | {"answers"}
    assert {f["code"] for f in doc["findings"]} == {"nic-numa-mismatch"}
    for f in doc["findings"]:
        assert {"code", "severity", "subject", "message", "fix"} <= set(f)
    est = doc["answers"]["alltoall_estimate"]
    assert est["size_bytes"] == 1 << 30 and est["num_ranks"] == 4
    assert doc["answers"]["cross_vendor"]["verdict"] == "none"


def test_audit_json_of_the_mini_cluster(capsys):
    code, out, _ = run_cli(capsys, "audit", "--json", "--cluster", MINI)
    assert code == 0
    answers = json.loads(out)["answers"]
    assert answers["cross_vendor"]["verdict"] == "host-staged"
    assert answers["alltoall_estimate"]["bottleneck"] == "HOST_BRIDGE"


def test_audit_bad_size_and_bad_input_exit_2(capsys, tmp_path):
    code, out, err = run_cli(capsys, "audit", "--size", "lots")
    assert code == 2 and "bad size 'lots'" in err and out == ""
    empty = tmp_path / "e.txt"
    empty.write_text("")
    code, out, err = run_cli(capsys, "audit", "-i", str(empty))
    assert code == 2 and f"{empty}:1:" in err and "Traceback" not in err


def test_plot_without_matplotlib_exits_2_with_the_install_hint(
    capsys, monkeypatch, fixture_path, tmp_path
):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = run_cli(
        capsys,
        "audit",
        "--plot",
        str(tmp_path / "x.png"),
        "-i",
        fixture_path("nvsmi_topo_h800_nv8_mlx5_bond.txt"),
    )
    assert code == 2 and "pip install 'hetcomm[plot]'" in err
    assert not (tmp_path / "x.png").exists()


def test_plot_writes_a_png(capsys, fixture_path, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "links.png"
    code, _, err = run_cli(
        capsys,
        "audit",
        "--plot",
        str(png),
        "-i",
        fixture_path("nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt"),
    )
    assert code == 0 and "heat map" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_ENTRY_POINT = shutil.which("hetcomm") or os.path.join(os.path.dirname(sys.executable), "hetcomm")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.exists(_ENTRY_POINT), reason="the hetcomm entry point is not installed (pip install -e .)")
def test_installed_entry_point_runs_the_demo_audit():
    exe = _ENTRY_POINT
    done = subprocess.run([exe, "audit"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Findings" in done.stdout and "(b) Cross-vendor path" in done.stdout
    assert done.stderr == ""
