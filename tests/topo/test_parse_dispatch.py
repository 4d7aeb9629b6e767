"""The format dispatcher: detection on every fixture, merging of concatenated outputs, errors.

Formats of the NVIDIA-side modules (nvsmi, lspci, nccl_xml, nccl_tests) are checked by module,
so that their authors can rename or split formats; the Ascend/RDMA/NCCL-log formats by name.
"""

from __future__ import annotations

import importlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetcomm.topo.parse as P
from hetcomm.errors import TopologyParseError, TruncatedCaptureError, UsageError
from hetcomm.topo.model import LinkClass
from tests.conftest import FIXTURES

# fixture -> (module of the primary format, modules of all formats, exact names of ours)
EXPECTED = {
    "envreport_sglang_h800_nv8_11nic_kvm.txt": ("nvsmi", {"nvsmi", "envreport"}, set()),
    "envreport_sglang_a100_sxm4_x2_nv12_5nic.txt": ("nvsmi", {"nvsmi", "envreport"}, set()),
    "nvsmi_topo_p100_x8_pix_phb_jenkins.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_nvlink_status_v100_sxm2_2_inactive.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_topo_p2p_rtx5090_x2_phb_gns.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_topo_h100_x4_nv6_mesh_4numa.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_topo_a100_x2_nv12_mlx5_named_columns.txt": ("nvsmi", {"nvsmi"}, set()),
    "nccl_log_efa_ofi_1.3_hmem_unsupported.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_log_p5en_h200_efa_16nic_libfabric.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_topo_xml_aws_p4d_24xl_efa_static.xml": ("nccl_xml", {"nccl_xml"}, set()),
    "nccl_topo_xml_aws_g5_48xl_cpu_roots_only.xml": ("nccl_xml", {"nccl_xml"}, set()),
    "nccl_topo_xml_azure_ndv4_a100_ib_4numa.xml": ("nccl_xml", {"nccl_xml"}, set()),
    "nccl_topo_xml_azure_ndv5_h100_ib_2numa.xml": ("nccl_xml", {"nccl_xml"}, set()),
    "nccl_topo_xml_azure_ndv2_v100_ib.xml": ("nccl_xml", {"nccl_xml"}, set()),
    "fabricmanager_log_nvls_multicast.txt": ("lspci", {"lspci"}, set()),
    "hccn_tool_910b_status_lldp_ip_route_ping.txt": ("hccn", {"hccn"}, {"hccn_tool"}),
    "hccn_tool_ascend_8npu_env_check.txt": ("hccn", {"hccn"}, {"hccn_tool"}),
    "ibstat_cx7_roce200_cx6dx_down_truncated.txt": ("rdma", {"rdma"}, {"ibstat"}),
    "ibstat_ib_hdr200_partial_ibpanic.txt": ("rdma", {"rdma"}, {"ibstat"}),
    "ibv_devinfo_show_gids_cx7_roce.txt": ("rdma", {"rdma"}, {"ibv_devinfo", "show_gids"}),
    "lsmod_nvidia_peermem_bound_vs_unbound.txt": ("lsmod", {"lsmod"}, {"lsmod"}),
    "lspci_nn_a100_nvswitch_vm.txt": ("lspci", {"lspci"}, set()),
    "nccl_log_g6e_l40s_shm.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_log_h100_2node_roce_gdrdma_p2pipc.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_log_p4d_ib_disabled_net_socket.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_topo_xml_oci_h100_8gpu_cx7.xml": ("nccl_xml", {"nccl_xml"}, set()),
    "nccltests_alltoall_perf_b300_1node_2node.txt": ("nccl_tests", {"nccl_tests"}, set()),
    "npusmi_board_lspci_hccn_910a_x8.txt": (
        "npusmi",
        {"npusmi", "hccn"},
        {"npu-smi-board", "lspci-ascend", "hccn_tool"},
    ),
    "npusmi_info_910b3_x8.txt": ("npusmi", {"npusmi"}, {"npu-smi-info"}),
    "npusmi_topo_910b3_x8_hccs.txt": ("npusmi", {"npusmi"}, {"npu-smi-topo"}),
    "nvsmi_a100_pcie_x2_nvlink_inactive.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_nvlink_status_a100_sxm4_8gpu.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_topo_dgx_a100_mlx5x12.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_topo_h100_nv18_12nic_ibdev2netdev.txt": ("nvsmi", {"nvsmi", "rdma"}, {"ibdev2netdev"}),
    "nvsmi_topo_h800_nv8_mlx5_bond.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_topo_mp_dgx1_v100_pcie_only.txt": ("nvsmi", {"nvsmi"}, set()),
    "nvsmi_topo_pcie8_pix_pxb_sys_numa_na.txt": ("nvsmi", {"nvsmi"}, set()),
    "sys_class_infiniband_h100_ndr_ib_plus_roce_bond.txt": ("rdma", {"rdma"}, {"ib-sysfs"}),
    # issue #22's captures
    "npusmi_info_a3_910c_8card_16chip_cann_8.2rc1.txt": ("npusmi", {"npusmi"}, {"npu-smi-info"}),
    "nccltests_alltoall_rtx2080ti_x2_pix_p2p_ns.txt": ("nccl_tests", {"nccl_tests", "nvsmi"}, set()),
    "nccltests_allreduce_h100_1node_and_2node_srun_l.txt": ("nccl_tests", {"nccl_tests"}, set()),
    "nccltests_allreduce_h100_2node_srun_l_only.txt": ("nccl_tests", {"nccl_tests"}, set()),
    "nccl_log_ofi_efa_disabling_gdr_proto_simple.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_log_h100_ibext_sharp_collnet_4nic.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_log_ompi_tag_horovod_efa_aws_libfabric.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_log_hosttag_rdma_train_worker_ibext_sharp.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nccl_log_k8s_pytorchjob_ibext_roce_vf.txt": ("nccl_log", {"nccl_log"}, {"nccl-log"}),
    "nvsmi_470.82.01_tesla_m60_azure_nv12s_v3_srun_pyxis.txt": ("nvsmi", {"nvsmi"}, set()),
}
OURS = ("npusmi", "rdma", "lsmod", "nccl_log", "hccn")
#: Real captures a parser claims but must refuse with an error (nothing in them to model).
REFUSED = {"nccl_topo_xml_aws_g5_48xl_cpu_roots_only.xml"}


def module_of(fmt: str) -> str:
    for name in P.MODULES:
        module = importlib.import_module(f"hetcomm.topo.parse.{name}")
        if fmt in [f[0] for f in module.FORMATS]:
            return name
    raise AssertionError(f"format {fmt} belongs to no module")


def read(name: str) -> str:
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return f.read()


def test_every_fixture_is_in_the_table():
    assert sorted(os.listdir(FIXTURES)) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_fixture_detects_and_parses(name):
    primary_module, modules, ours = EXPECTED[name]
    text = read(name)
    found = P.detect_formats(text, name)
    assert module_of(P.detect_format(text, name)) == primary_module
    assert {module_of(f) for f in found} == modules
    assert {f for f in found if module_of(f) in OURS} == ours
    if name in REFUSED:
        with pytest.raises(TopologyParseError):
            P.parse_file(os.path.join(FIXTURES, name))
        return
    topo = P.parse_file(os.path.join(FIXTURES, name))
    assert topo.facts["formats"] == found  # every detected format parsed, in priority order
    assert topo.facts["sources"] == [os.path.join(FIXTURES, name)]
    failed = [w for w in topo.facts.get("parse_warnings", []) if "could not parse it" in w]
    assert failed == []
    assert topo.devices or topo.nics or topo.links or topo.measurements or len(topo.facts) > 2


def test_all_format_modules_load():
    assert P.load_errors() == {}
    names = P.FORMAT_NAMES
    assert len(names) == len(set(names))
    for fmt in (
        "npu-smi-topo",
        "npu-smi-info",
        "npu-smi-board",
        "lspci-ascend",
        "ibstat",
        "ibv_devinfo",
        "show_gids",
        "ib-sysfs",
        "ibdev2netdev",
        "lsmod",
        "nccl-log",
        "hccn_tool",
    ):
        assert fmt in names
    assert set(P.format_tools()) == set(names)


def test_a_missing_module_of_our_own_is_an_error_not_silence(monkeypatch):
    # issue #18: the guard that turned a missing parser module into "format unknown" is gone.
    monkeypatch.setattr(P, "MODULES", ("not_written_yet",) + P.MODULES)
    monkeypatch.setattr(P, "_registry", None)
    with pytest.raises(ModuleNotFoundError, match="not_written_yet"):
        P.detect_format(read("npusmi_topo_910b3_x8_hccs.txt"))
    monkeypatch.setattr(P, "MODULES", P.MODULES[1:])
    monkeypatch.setattr(P, "_registry", None)
    assert P.detect_format(read("npusmi_topo_910b3_x8_hccs.txt")) == "npu-smi-topo"


def test_empty_and_header_only_files(tmp_path):
    for text in ("", "\n\n  \n", "# source: somewhere | hardware: none\n\n"):
        with pytest.raises(TopologyParseError, match="file is empty") as e:
            P.detect_format(text, "e.txt")
        assert e.value.line == 1
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TopologyParseError, match=f"{empty}:1: file is empty"):
        P.parse_file(str(empty))
    with pytest.raises(TopologyParseError, match="file is empty: expected the output of ibstat"):
        P.parse_text("", "e.txt", fmt="ibstat")


def test_random_text_is_not_recognised():
    text = "# source: synthetic\n\nLorem ipsum dolor sit amet\n42 is the answer\n"
    with pytest.raises(TopologyParseError) as e:
        P.parse_text(text, "junk.txt")
    msg = str(e.value)
    assert msg.startswith("junk.txt:3: could not recognise the format")
    for tool in (
        "nvidia-smi topo -m",
        "npu-smi info -t topo",
        "ibstat",
        "lsmod",
        "NCCL_DEBUG=INFO",
    ):
        assert tool in msg


def test_crlf_gives_the_same_result():
    for name in (
        "npusmi_topo_910b3_x8_hccs.txt",
        "ibstat_cx7_roce200_cx6dx_down_truncated.txt",
        "nccl_log_h100_2node_roce_gdrdma_p2pipc.txt",
        "npusmi_info_910b3_x8.txt",
    ):
        lf = read(name)
        a = P.parse_text(lf, name)
        b = P.parse_text(lf.replace("\n", "\r\n"), name)
        assert a.to_dict() == b.to_dict()
        assert P.detect_formats(lf) == P.detect_formats(lf.replace("\n", "\r\n"))


def test_two_formats_concatenated_are_merged():
    # Synthetic capture: `npu-smi info -t topo` then `npu-smi info` then `ibstat` in one file.
    text = "\n".join(
        [
            read("npusmi_topo_910b3_x8_hccs.txt"),
            read("npusmi_info_910b3_x8.txt"),
            read("ibstat_cx7_roce200_cx6dx_down_truncated.txt"),
        ]
    )
    assert P.detect_formats(text) == ["npu-smi-topo", "npu-smi-info", "ibstat"]
    topo = P.parse_text(text, "node.txt")
    npu0 = topo.device("NPU0")
    assert (npu0.model, npu0.cpu_affinity, npu0.pci_bus_id) == ("910B3", "144-167", "0000:c1:00.0")
    assert topo.link("NPU0", "NPU5").link_class == LinkClass.HCCS
    assert topo.nic("mlx5_1").rate_gbps == 200.0
    assert topo.facts["npu_health"]["NPU7"] == "OK"
    assert topo.facts["formats"] == ["npu-smi-topo", "npu-smi-info", "ibstat"]


def test_910a_capture_joins_lspci_ids_onto_npus():
    topo = P.parse_text(read("npusmi_board_lspci_hccn_910a_x8.txt"), "910a.txt")
    assert all(d.pci_device_id == "19e5:d801" and d.model == "910A" for d in topo.devices)
    assert topo.facts["hccn_health"] == {"npu0-roce": "Socket failed"}


def test_failing_format_becomes_a_warning_when_another_parses():
    # Synthetic: a matrix with a row its header does not name, followed by a good ibstat capture.
    bad = "\tNPU0\tNPU1\tCPU Affinity\nNPU0\tX\tHCCS\t0-23\nNPU2\tHCCS\tX\t0-23\n"
    text = bad + "\n" + read("ibstat_ib_hdr200_partial_ibpanic.txt")
    topo = P.parse_text(text, "mixed.txt")
    assert topo.facts["formats"] == ["ibstat"]
    assert topo.nic("mlx5_7").rate_gbps == 200.0
    (warning,) = [w for w in topo.facts["parse_warnings"] if "could not parse it" in w]
    assert warning.startswith("mixed.txt:3:") and "NPU2" in warning and "npu-smi-topo" in warning


def test_truncated_matrix_is_an_error_even_when_another_format_parses():
    # Issue 14.11: a matrix cut after its first row, followed by a good ibstat capture, used to
    # be a parse warning (exit 0, the NPUs silently without links); a cut record is an error.
    cut = "\tNPU0\tNPU1\tCPU Affinity\nNPU0\tX\tHCCS\t0-23\n"
    text = cut + "\n" + read("ibstat_ib_hdr200_partial_ibpanic.txt")
    with pytest.raises(TruncatedCaptureError, match="no row for NPU1") as e:
        P.parse_text(text, "mixed.txt")
    assert (e.value.path, e.value.line) == ("mixed.txt", 2)
    with pytest.raises(TruncatedCaptureError, match="no row for NPU1"):
        P.parse_text(cut, "cut.txt")


def test_forced_format():
    text = read("ibstat_ib_hdr200_partial_ibpanic.txt")
    assert P.parse_text(text, fmt="ibstat").facts["formats"] == ["ibstat"]
    assert P.parse_text(text, fmt="auto").facts["formats"] == ["ibstat"]
    with pytest.raises(TopologyParseError, match="npu-smi info -t topo"):
        P.parse_text(text, "ib.txt", fmt="npu-smi-topo")
    with pytest.raises(UsageError, match="did you mean 'ibstat'"):
        P.parse_text(text, fmt="ibstatt")
    both = P.parse_text(read("ibv_devinfo_show_gids_cx7_roce.txt"), fmt="show_gids,ibv_devinfo")
    assert both.facts["formats"] == ["show_gids", "ibv_devinfo"]
    nic = both.nic("mlx5_0")
    assert (nic.netdev, nic.link_layer) == ("ens108np0", "Ethernet")


def test_unreadable_binary_and_undecodable_files(tmp_path):
    with pytest.raises(TopologyParseError, match="cannot read file") as e:
        P.parse_file(str(tmp_path / "nope.txt"))
    assert str(tmp_path / "nope.txt") in str(e.value)
    with pytest.raises(TopologyParseError, match="is a directory"):
        P.parse_file(str(tmp_path))
    binary = tmp_path / "core.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00")
    with pytest.raises(TopologyParseError, match="binary file"):
        P.parse_file(str(binary))
    gbk = tmp_path / "gbk.txt"
    gbk.write_bytes("npu-smi info\n".encode() + "网卡\n".encode("gbk"))
    with pytest.raises(TopologyParseError, match="not UTF-8") as e:
        P.parse_file(str(gbk))
    assert e.value.line == 2 and "iconv" in str(e.value)


def test_utf16_with_bom_is_read(tmp_path):
    # PowerShell's `npu-smi info -t topo > topo.txt` writes UTF-16 with a BOM.
    f = tmp_path / "topo16.txt"
    f.write_bytes(read("npusmi_topo_910b3_x8_hccs.txt").encode("utf-16"))
    assert len(P.parse_file(str(f)).links) == 28


def test_gzipped_log_is_read(tmp_path):
    import gzip

    f = tmp_path / "nccl.log.gz"
    f.write_bytes(gzip.compress(read("nccl_log_p4d_ib_disabled_net_socket.txt").encode()))
    assert P.parse_file(str(f)).facts["nccl_net_class"] == "NET_SOCKET"
    bad = tmp_path / "cut.log.gz"
    bad.write_bytes(f.read_bytes()[:40])
    with pytest.raises(TopologyParseError, match="corrupt gzip"):
        P.parse_file(str(bad))


def test_parse_files_merges_captures_of_one_node():
    paths = [
        os.path.join(FIXTURES, n)
        for n in ("npusmi_topo_910b3_x8_hccs.txt", "npusmi_info_910b3_x8.txt")
    ]
    topo = P.parse_files(paths)
    assert topo.facts["sources"] == paths
    assert topo.device("NPU3").model == "910B3" and topo.device("NPU3").cpu_affinity == "96-119"


_CACHE: dict = {}
OUR_FIXTURES = sorted(n for n, (primary, _, _) in EXPECTED.items() if primary in OURS)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(OUR_FIXTURES),
    cut=st.floats(min_value=0.0, max_value=1.0),
    drop=st.integers(min_value=0, max_value=200),
    junk=st.sampled_from(["", "X", "\t\t", "NPU9", "CA 'x'", "Port 3:", " -> ", "|", ": :"]),
)
def test_mangled_captures_never_crash(name, cut, drop, junk):
    # Truncated at a random point, one line replaced by junk: every parser of ours either
    # returns a Topology or raises TopologyParseError, never IndexError/ValueError/KeyError.
    full = _CACHE.setdefault(name, read(name))
    lines = full[: int(len(full) * cut)].splitlines()
    if lines:
        lines[drop % len(lines)] = junk
    text = "\n".join(lines)
    for module in OURS:
        for _fmt, _, parse in importlib.import_module(f"hetcomm.topo.parse.{module}").FORMATS:
            try:
                parse(text, name)
            except TopologyParseError:
                pass
    try:
        P.parse_text(text, name)
    except TopologyParseError:
        pass


def test_header_only_text_raises_parse_error_in_every_parser():
    # Found by fuzzing: a provenance header and nothing else must not index an empty line list.
    for module in OURS:
        for _fmt, _, parse in importlib.import_module(f"hetcomm.topo.parse.{module}").FORMATS:
            with pytest.raises(TopologyParseError):
                parse("# source: synthetic header only\n", "h.txt")
