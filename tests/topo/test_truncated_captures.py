"""Captures cut short (issue 14 item 11): an error that says so, never a misconfiguration that
is not there. Each test cuts a real capture at every line (or byte) and checks the property."""

from __future__ import annotations

import os

import pytest

from hetcomm.cli.main import main
from hetcomm.errors import TruncatedCaptureError
from hetcomm.topo.audit import audit
from hetcomm.topo.parse import parse_text
from hetcomm.topo.parse.lspci import parse_lspci

from tests.conftest import FIXTURES

NVLINK = os.path.join(FIXTURES, "nvsmi_nvlink_status_a100_sxm4_8gpu.txt")
LSPCI = os.path.join(FIXTURES, "lspci_nn_a100_nvswitch_vm.txt")
TOPO = os.path.join(FIXTURES, "nvsmi_topo_h800_nv8_mlx5_bond.txt")


def head_n(path: str, n: int) -> str:
    with open(path, encoding="utf-8") as f:
        return "".join(f.readlines()[:n])


def test_head_44_of_nvlink_status_is_an_error_not_a_degraded_gpu(tmp_path, capsys):
    # Before: GPU3 "nvlink-degraded" (3 of 12 links) with exit 0.
    path = tmp_path / "nvlink44.txt"
    path.write_text(head_n(NVLINK, 44))
    assert main(["audit", "-i", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "nvlink-degraded" not in out
    assert f"{path}:44: the `nvidia-smi nvlink -s` output ends inside GPU3's block" in err


def test_no_cut_of_nvlink_status_reports_a_degraded_link():
    lines = open(NVLINK, encoding="utf-8").read().splitlines(keepends=True)
    errors = 0
    for n in range(2, len(lines) + 1):
        text = "".join(lines[:n])
        try:
            topo = parse_text(text, f"head-{n}")
        except TruncatedCaptureError as e:
            assert e.line == n
            errors += 1
            continue
        codes = {f.code for f in audit(topo)}
        assert "nvlink-degraded" not in codes, n
    # Cut inside each of the 8 blocks (12 Link lines + the next title), plus the complete file.
    assert errors > 80


def test_every_byte_cut_of_lspci_counts_only_complete_records():
    text = open(LSPCI, encoding="utf-8").read()
    assert len(parse_lspci(text).nics) == 9
    for cut in range(text.index("\n0101:"), len(text), 3):
        part = text[:cut]
        try:
            topo = parse_lspci(part, "cut")
        except TruncatedCaptureError as e:
            assert "ends mid-record" in str(e)
            continue
        complete = [ln for ln in part.splitlines() if "Mellanox" in ln and ln.rstrip().endswith(("]", ")"))]
        assert len(topo.nics) == len(complete), (cut, part.splitlines()[-1])


def test_truncated_lspci_through_the_cli(tmp_path, capsys):
    text = open(LSPCI, encoding="utf-8").read()
    path = tmp_path / "lspci.txt"
    path.write_text(text[: text.index("0102:") + 30])  # cut inside the second NIC's line
    assert main(["topo", "-i", str(path)]) == 2
    assert "lspci line ends mid-record" in capsys.readouterr().err


def test_truncated_matrix_followed_by_another_tool_is_an_error(tmp_path, capsys):
    # Before: a parse warning, exit 0, and GPUs without links.
    path = tmp_path / "mixed.txt"
    path.write_text(head_n(TOPO, 7) + "mlx5_0 port 1 ==> ibs1 (Up)\nmlx5_1 port 1 ==> ibs2 (Up)\n")
    assert main(["audit", "-i", str(path)]) == 2
    assert "has no row for GPU4" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    [
        "nvsmi_nvlink_status_a100_sxm4_8gpu.txt",
        "nvsmi_a100_pcie_x2_nvlink_inactive.txt",
        "lspci_nn_a100_nvswitch_vm.txt",
        "npusmi_board_lspci_hccn_910a_x8.txt",
    ],
)
def test_complete_captures_are_not_called_truncated(name):
    parse_text(open(os.path.join(FIXTURES, name), encoding="utf-8").read(), name)
