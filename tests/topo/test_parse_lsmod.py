"""lsmod parser: is nvidia_peermem (or nv_peer_mem) bound to ib_core?

The fixture holds the two inputs of gpud's peermem test (bound, then loaded but not bound);
inline texts are synthetic.
"""

from __future__ import annotations

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.parse import lsmod


def read(fixture_path, name: str) -> str:
    with open(fixture_path(name), encoding="utf-8") as f:
        return f.read()


def test_fixture_has_bound_and_unbound_listings(fixture_path):
    text = read(fixture_path, "lsmod_nvidia_peermem_bound_vs_unbound.txt")
    assert lsmod.sniff_lsmod(text)
    bound, unbound = lsmod.parse_lsmod_sections(text)
    assert (bound.first_line, bound.last_line) == (4, 6)
    assert bound.peermem is True
    assert unbound.peermem is False and unbound.peermem_loaded  # loaded, but not in ib_core's list
    size, count, used_by = bound.modules["ib_core"]
    assert size == 434176 and count == 9 and "nvidia_peermem" in used_by


def test_fixture_whole_file_is_worst_case(fixture_path):
    topo = lsmod.parse_lsmod(
        read(fixture_path, "lsmod_nvidia_peermem_bound_vs_unbound.txt"), "l.txt"
    )
    assert topo.facts["peermem"] is False
    assert topo.facts["lsmod_sections"] == [
        {"lines": "4-6", "peermem": True},
        {"lines": "16-18", "peermem": False},
    ]
    assert topo.facts["kernel_modules"] == ["ib_core", "nvidia", "nvidia_peermem"]
    assert any(w.startswith("l.txt:16:") for w in topo.facts["parse_warnings"])


# Synthetic: real `lsmod` shape with header, flags and a legacy nv_peer_mem.
SYNTH = """\
Module                  Size  Used by
nv_peer_mem            16384  0
ib_uverbs             147456  3 nv_peer_mem,rdma_ucm,mlx5_ib
ib_core               434176  9 rdma_cm,nv_peer_mem,ib_uverbs,mlx5_ib
nvidia              56717312  447 nvidia_uvm,nv_peer_mem,nvidia_modeset
zfs                  4218880  6 [permanent]
"""


def test_legacy_nv_peer_mem_bound():
    topo = lsmod.parse_lsmod(SYNTH)
    assert topo.facts["peermem"] is True
    assert "lsmod_sections" not in topo.facts and "parse_warnings" not in topo.facts
    assert "zfs" in topo.facts["kernel_modules"]


def test_ib_core_without_peermem_is_false():
    text = "Module Size Used by\nib_core 434176 2 mlx5_ib,ib_uverbs\nmlx5_ib 466944 0\n"
    assert lsmod.parse_lsmod(text).facts["peermem"] is False


def test_no_ib_core_means_no_verdict():
    text = (
        "Module                  Size  Used by\nnvidia              56717312  0\next4  1048576  2\n"
    )
    topo = lsmod.parse_lsmod(text)
    assert "peermem" not in topo.facts
    assert topo.facts["kernel_modules"] == ["ext4", "nvidia"]


def test_headerless_rows_need_a_known_module():
    # Two-number lines of another tool must not be taken for lsmod.
    text = "eth0 1500 0\nlo 65536 0\n"
    assert not lsmod.sniff_lsmod(text)
    assert lsmod.parse_lsmod_sections(text) == []
    with pytest.raises(TopologyParseError, match="no lsmod rows"):
        lsmod.parse_lsmod(text, "x.txt")


def test_crlf_and_dash_count():
    text = "Module Size Used by\r\nib_core 434176 - nvidia_peermem,\r\nnvidia_peermem 16384 0\r\n"
    (section,) = lsmod.parse_lsmod_sections(text)
    assert section.modules["ib_core"][1] is None
    assert section.peermem is True
