"""Issue #21 item 19: `hetcomm discover` on captures that contradict, lack a model, or are huge."""

from __future__ import annotations

import os
import shutil

import pytest

from hetcomm.errors import ConfigError
from hetcomm.topo.discover import assemble_cluster, host_record, probe_host, probe_host_name, topology_from_record

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _dir(tmp_path, *names):
    d = tmp_path / "host"
    d.mkdir()
    for n in names:
        shutil.copy(os.path.join(FIXTURES, n), d / n)
    return str(d)


def test_two_contradictory_captures_of_one_host_are_refused(tmp_path):
    # an 8x H800 matrix and a 4x H100 matrix in one host's directory: two machines, not one
    d = _dir(tmp_path, "nvsmi_topo_h800_nv8_mlx5_bond.txt", "nvsmi_topo_h100_x4_nv6_mesh_4numa.txt")
    with pytest.raises(ConfigError, match="contradict") as e:
        probe_host(d)
    assert "nvsmi_topo_h800_nv8_mlx5_bond.txt" in str(e.value) and e.value.key == "HETCOMM_PROBE_DIR"


def test_captures_without_a_device_model_are_refused_before_a_yaml_is_written(tmp_path):
    d = _dir(tmp_path, "nvsmi_topo_h800_nv8_mlx5_bond.txt")  # topo -m names no model
    topo = topology_from_record(host_record(probe_host(d), "h800"))
    ranks = [{"host": "h800"}] * 8
    with pytest.raises(ConfigError, match="not their model.*nvidia-smi"):
        assemble_cluster(ranks, {"h800": topo})


def test_a_huge_hostname_file_is_not_read_whole(tmp_path):
    d = _dir(tmp_path, "nvsmi_topo_h800_nv8_mlx5_bond.txt")
    with open(os.path.join(d, "hostname"), "wb") as f:
        f.truncate(200 << 20)  # 200 MB (sparse): the old code read it all into memory
    with pytest.raises(ConfigError, match="hostname file"):
        probe_host_name(d)
    with open(os.path.join(d, "hostname"), "w") as f:
        f.write("node7\n")
    assert probe_host_name(d) == "node7"
