"""Issue #22 parsers on real captures: A3 two-chip cards, launcher prefixes on every format."""

from __future__ import annotations

import glob
import os

import pytest

from hetcomm.topo.bandwidth import canonical_model
from hetcomm.topo.parse import detect_formats, parse_file, parse_text
from hetcomm.topo.parse.prefixes import strip_prefixes

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def read(name: str) -> str:
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return f.read()


def test_a3_two_chip_cards_give_sixteen_chips_named_by_card_and_chip():
    topo = parse_file(os.path.join(FIXTURES, "npusmi_info_a3_910c_8card_16chip_cann_8.2rc1.txt"))
    names = [d.name for d in topo.devices]
    assert names == [f"NPU{card}-{chip}" for card in range(8) for chip in range(2)]
    assert {d.model for d in topo.devices} == {"Ascend910 (910C)"}  # not "910"
    assert {canonical_model(d.model) for d in topo.devices} == {"910C"}
    assert topo.device("NPU0-1").pci_bus_id == "0000:9f:00.0"
    assert topo.facts["npu_phy_ids"]["NPU7-1"] == 15


def test_910_910b_910c_are_told_apart():
    b3 = parse_file(os.path.join(FIXTURES, "npusmi_info_910b3_x8.txt"))
    assert {canonical_model(d.model) for d in b3.devices} == {"910B"}
    board = parse_file(os.path.join(FIXTURES, "npusmi_board_lspci_hccn_910a_x8.txt"))
    assert {canonical_model(d.model) for d in board.devices} == {"910A"}
    assert canonical_model("Ascend910") == "910A"  # a one-chip card: the first generation


def test_a3_topo_matrix_joins_the_info_table_by_phy_id():
    # No public `npu-smi info -t topo` of an A3 box was found (docs/INPUT_FORMATS.md): this
    # matrix is hand-made in the 910B capture's layout, with SIO between the chips of a card.
    info = read("npusmi_info_a3_910c_8card_16chip_cann_8.2rc1.txt")
    header = "\t   " + "".join(f"NPU{i:<10d}" for i in range(4)) + "CPU Affinity\n"
    rows = ""
    for i in range(4):
        cells = ["X" if i == j else ("SIO" if i // 2 == j // 2 else "HCCS") for j in range(4)]
        rows += f"NPU{i}\t   " + "".join(f"{c:<11s}" for c in cells) + "0-39\n"
    topo = parse_text(info + "\n" + header + rows, fmt="npu-smi-info,npu-smi-topo")
    link = topo.link("NPU0-0", "NPU0-1")
    assert link is not None and link.raw == "SIO"
    assert topo.link("NPU0-1", "NPU1-0").raw == "HCCS"
    assert topo.device("NPU0") is None  # renamed, not duplicated


PREFIXED = [
    ("slurm-task", lambda ln: f" 3: {ln}"),
    ("openmpi-tag", lambda ln: f"[1,3]<stdout>:{ln}"),
    ("torchrun-rank", lambda ln: f"[rank3]:{ln}"),
    ("rfc3339", lambda ln: f"2025-03-04T09:13:02.123456789Z {ln}"),
    ("host-tag", lambda ln: f"node-007: {ln}"),
]


def _fixtures():
    return sorted(
        os.path.basename(p)
        for p in glob.glob(os.path.join(FIXTURES, "*"))
        if not p.endswith(".xml")  # XML: one document, never line-prefixed
    )


@pytest.mark.parametrize("family,prefix", PREFIXED, ids=[f for f, _ in PREFIXED])
@pytest.mark.parametrize("name", _fixtures())
def test_every_format_reads_through_every_prefix(name, family, prefix):
    text = read(name)
    header, *body = text.split("\n")
    prefixed = "\n".join([header] + [prefix(ln) if ln.strip() else ln for ln in body])
    stripped, found = strip_prefixes(prefixed)
    assert found[:1] == [family]
    assert detect_formats(prefixed) == detect_formats(text)
    try:
        plain = parse_text(text, path=name)
    except Exception as e:  # refused captures are refused the same way when prefixed
        with pytest.raises(type(e)):
            parse_text(prefixed, path=name)
        return
    topo = parse_text(prefixed, path=name)
    assert [d.name for d in topo.devices] == [d.name for d in plain.devices]
    assert [n.name for n in topo.nics] == [n.name for n in plain.nics]
    assert [(ln.a, ln.b, ln.link_class) for ln in topo.links] == [
        (ln.a, ln.b, ln.link_class) for ln in plain.links
    ]
    assert len(topo.measurements) == len(plain.measurements)
    assert family in topo.facts["line_prefixes"]


def test_real_srun_l_capture_is_recognised():
    # nccl-tests issue 290: a Slurm `srun -l` run was "an unrecognised format" before issue 22
    topo = parse_file(os.path.join(FIXTURES, "nccltests_allreduce_h100_2node_srun_l_only.txt"))
    assert topo.facts["line_prefixes"] == ["slurm-task"]
    assert max(m.size_bytes for m in topo.measurements) == 8589934592
    assert {d.host for d in topo.devices} == {"node005", "node007"}


def test_plain_key_value_lines_are_not_mistaken_for_host_tags():
    text = read("ibstat_cx7_roce200_cx6dx_down_truncated.txt")
    assert strip_prefixes(text)[1] == []


def test_ofi_plugin_disabling_gdr_fires_no_gdr_and_lists_its_nic():
    from hetcomm.topo.audit import audit

    topo = parse_file(os.path.join(FIXTURES, "nccl_log_ofi_efa_disabling_gdr_proto_simple.txt"))
    assert [(n.name, n.link_layer, n.gdr) for n in topo.nics] == [("ofi0", "EFA", False)]
    codes = {f.code: f for f in audit(topo)}
    assert "no-gdr" in codes and "disabling GDR" in codes["no-gdr"].message


def test_p5en_efa_nic_groups_are_listed():
    topo = parse_file(os.path.join(FIXTURES, "nccl_log_p5en_h200_efa_16nic_libfabric.txt"))
    assert any(n.name.startswith("ofi7.0") and n.pci_bus_id == "0000:a3:00.0" for n in topo.nics)


def test_ibext_sharp_plugin_and_its_hcas():
    topo = parse_file(os.path.join(FIXTURES, "nccl_log_h100_ibext_sharp_collnet_4nic.txt"))
    assert topo.facts["nccl_plugins"] == {"net": "NCCL RDMA Plugin v6", "collnet": "SHARP"}
    assert topo.facts["nccl_network"] == "IBext"
    assert {n.name.split("@")[0] for n in topo.nics} == {"mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5"}


def test_openmpi_tagged_nccl_log_reads_its_channels():
    topo = parse_file(os.path.join(FIXTURES, "nccl_log_ompi_tag_horovod_efa_aws_libfabric.txt"))
    assert topo.facts["line_prefixes"] == ["openmpi-tag"]
    # (NCCL 2.4's "Ring 00 : a[d] -> b[d] via ..." lines are not channel records the parser models)
    assert topo.facts["nccl_warnings"] == ["NET/OFI Couldn't open AV. RC: -22, ERROR: Invalid argument"]


def test_host_tagged_ibext_log_and_roce_vf_log():
    tagged = parse_file(os.path.join(FIXTURES, "nccl_log_hosttag_rdma_train_worker_ibext_sharp.txt"))
    assert tagged.facts["line_prefixes"] == ["host-tag"]
    assert [n.name for n in tagged.nics] == ["mlx5_9"] and tagged.facts["nccl_network"] == "IBext"
    vf = parse_file(os.path.join(FIXTURES, "nccl_log_k8s_pytorchjob_ibext_roce_vf.txt"))
    assert "line_prefixes" not in vf.facts  # pod names are NCCL's own host field, not a tag
    assert [(n.name, n.link_layer) for n in vf.nics] == [("rocep204s0f0v6", "Ethernet")]
