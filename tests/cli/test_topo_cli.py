"""``hetcomm topo``: text, JSON, cluster labels and the errors for bad input (in-process)."""

from __future__ import annotations

import json
import os

import pytest

from hetcomm.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")
TOP_KEYS = {"devices", "nics", "links", "findings", "measurements"}
# The per-item keys issue 2 item 6 names; Topology.to_dict() may add more (index, host, ...).
ITEM_KEYS = {
    "devices": {"name", "vendor", "model", "numa"},
    "nics": {"name", "link_layer", "rate_gbps", "state"},
    "links": {"a", "b", "class", "raw", "gbps"},
    "findings": {"code", "severity", "subject", "message"},
    "measurements": {"op", "size_bytes", "time_us", "algbw_gbps", "busbw_gbps"},
}


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def check_schema(doc):
    assert TOP_KEYS <= set(doc)
    for key, required in ITEM_KEYS.items():
        for item in doc[key]:
            assert required <= set(item), (key, item)


def test_topo_probes_this_machine(capsys):
    code, out, err = run_cli(capsys, "topo")
    assert code == 0 and err == ""
    assert "Devices (" in out and "host:" in out and "Probe notes" in out


def test_topo_json_is_one_document_with_the_schema(capsys):
    code, out, _ = run_cli(capsys, "topo", "--json")
    assert code == 0
    doc = json.loads(out)  # the whole of stdout is one document
    assert set(doc) == TOP_KEYS
    check_schema(doc)
    assert doc["devices"]


def test_topo_of_the_h800_capture(capsys, fixture_path):
    code, out, _ = run_cli(capsys, "topo", "-i", fixture_path("nvsmi_topo_h800_nv8_mlx5_bond.txt"))
    assert code == 0
    assert (
        "NVLINK group of 8 (NV8 on all 28 pairs): GPU0, GPU1, GPU2, GPU3, GPU4, GPU5, GPU6, GPU7"
        in out
    )
    assert "NV8" in out and "mlx5_bond_0" in out and "Legend" in out


def test_topo_json_of_merged_inputs(capsys, fixture_path):
    code, out, _ = run_cli(
        capsys,
        "topo",
        "--json",
        "-i",
        fixture_path("nvsmi_topo_h800_nv8_mlx5_bond.txt"),
        "-i",
        fixture_path("lsmod_nvidia_peermem_bound_vs_unbound.txt"),
    )
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == TOP_KEYS
    check_schema(doc)
    assert [d["name"] for d in doc["devices"]] == [f"GPU{i}" for i in range(8)]
    assert len(doc["nics"]) == 9
    assert len(doc["links"]) == 17 * 16 // 2  # each unordered pair once
    assert len({tuple(sorted((ln["a"], ln["b"]))) for ln in doc["links"]}) == len(doc["links"])
    nv = [ln for ln in doc["links"] if ln["class"] == "NVLINK"]
    assert len(nv) == 28 and all(ln["raw"] == "NV8" for ln in nv)


def test_topo_cluster_says_which_kinds_are_labels(capsys):
    code, out, _ = run_cli(capsys, "topo", "--cluster", MINI)
    assert code == 0
    assert "device kinds that are labels on this machine" in out
    assert "A100-SXM4-80GB x2" in out and "910B x1" in out
    code, out, _ = run_cli(capsys, "topo", "--cluster", MINI, "--json")
    doc = json.loads(out)
    ranks = [d for d in doc["devices"] if d["name"].startswith("rank")]
    assert len(ranks) == 4 and all(d["label_only"] for d in ranks)
    assert {ln["class"] for ln in doc["links"]} == {"NVLINK", "NET_ROCE_GDR", "HOST_BRIDGE"}


def test_topo_nccl_log_ranks_and_cluster_ranks_clash_is_reported(capsys, fixture_path):
    code, out, _ = run_cli(
        capsys, "topo", "-i", fixture_path("nccl_log_g6e_l40s_shm.txt"), "--cluster", MINI
    )
    assert code == 0
    assert "4 rank(s) (rank0..rank3) are both in the inputs" in out


def test_topo_stdin(capsys, monkeypatch, fixture_path):
    import io
    import sys

    data = open(fixture_path("nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt"), "rb").read()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code, out, _ = run_cli(capsys, "topo", "-i", "-")
    assert code == 0 and "GPU3" in out and "<stdin>" in out


# -- bad input: exit 2, file and line named, no traceback ---------------------------------------


def test_missing_file(capsys, tmp_path):
    code, out, err = run_cli(capsys, "topo", "-i", str(tmp_path / "nope.txt"))
    assert code == 2 and out == ""
    assert "nope.txt: no such file" in err and "Traceback" not in err


def test_empty_file_names_file_and_line(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = run_cli(capsys, "topo", "-i", str(empty))
    assert code == 2 and f"{empty}:1: file is empty" in err


def test_unknown_content_names_file_and_line(capsys, tmp_path):
    junk = tmp_path / "junk.txt"
    junk.write_text("\nhello world\nnothing topological here\n")
    code, _, err = run_cli(capsys, "topo", "-i", str(junk))
    assert code == 2 and f"{junk}:2: could not recognise the format" in err


def test_truncated_matrix_is_an_error_or_a_warning_never_a_traceback(
    capsys, tmp_path, fixture_path
):
    lines = open(fixture_path("nvsmi_topo_h800_nv8_mlx5_bond.txt")).read().splitlines()
    cut = tmp_path / "cut.txt"
    cut.write_text("\n".join(lines[:6]) + "\nGPU4    NV8     NV")  # cut mid-row
    code, out, err = run_cli(capsys, "topo", "-i", str(cut))
    assert "Traceback" not in err
    if code == 2:
        assert str(cut) in err
    else:
        assert code == 0 and "Parse warnings" in out


def test_binary_file(capsys, tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\x7fELF\x00\x01\x02")
    code, _, err = run_cli(capsys, "topo", "-i", str(blob))
    assert code == 2 and str(blob) in err


def test_directory_and_bad_format(capsys, tmp_path, fixture_path):
    code, _, err = run_cli(capsys, "topo", "-i", str(tmp_path))
    assert code == 2 and "is a directory" in err
    code, _, err = run_cli(
        capsys,
        "topo",
        "-i",
        fixture_path("lsmod_nvidia_peermem_bound_vs_unbound.txt"),
        "--format",
        "nvsmi-topoo",
    )
    assert code == 2 and "unknown input format 'nvsmi-topoo'" in err
    code, _, err = run_cli(capsys, "topo", "--format", "lsmod")
    assert code == 2 and "--format applies to --input" in err


def test_bad_cluster_file(capsys, tmp_path):
    code, _, err = run_cli(capsys, "topo", "--cluster", str(tmp_path / "none.yaml"))
    assert code == 2 and "no such cluster file" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnode_groups:\n  - name: a\n    devcie: {model: H800, count: 1}\n")
    code, _, err = run_cli(capsys, "topo", "--cluster", str(bad))
    assert code == 2 and "bad.yaml" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["topo", "--bogus"], ["audit", "--size"]])
def test_argparse_usage_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
