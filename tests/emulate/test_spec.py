"""The emulation layout, computed without touching the kernel (no root needed)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import textwrap

import pytest

from hetcomm.emulate.fabric import _tc_lines
from hetcomm.emulate.ranks import rank_env
from hetcomm.emulate.spec import plan_network, settings_from_cluster
from hetcomm.emulate.state import EmulationState
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import load_cluster, load_cluster_text

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")
FOUR = os.path.join(REPO, "configs", "clusters", "emulated-4node.yaml")


def _mini_text(emulation: str) -> str:
    with open(MINI) as f:
        text = f.read()
    head = text.split("emulation:")[0]
    return head + "emulation:\n" + textwrap.indent(textwrap.dedent(emulation), "  ")


def test_mixed_mini_bridge_layout():
    c = load_cluster(MINI)
    plan = plan_network(c, settings_from_cluster(c), "0a1b2c")
    assert plan.fabric_ns == "hc0a1b2c-fabric"
    assert [n.ns for n in plan.nodes] == ["hc0a1b2c-a100-0", "hc0a1b2c-h800-0", "hc0a1b2c-ascend-0"]
    assert [n.ranks for n in plan.nodes] == [(0, 1), (2,), (3,)]
    # Every name created carries the run's prefix.
    assert all(ns.startswith(plan.prefix) for ns in plan.namespaces)
    # 200 Gb/s ports at scale 1e-3 -> 200 Mbit/s, on both ends of each veth.
    assert {s.rate_bps for s in plan.shapers} == {200_000_000}
    assert len(plan.shapers) == 2 * len(plan.veths) == 6
    addrs = [str(n.ifaces[0].address) for n in plan.nodes]
    assert addrs == ["10.213.0.1/24", "10.213.0.2/24", "10.213.0.3/24"]
    assert all(
        ipaddress.ip_address(a.split("/")[0]) in ipaddress.ip_network("10.213.0.0/16")
        for a in addrs
    )
    # Cross-vendor: the 100 Gb/s host bridge caps NVIDIA <-> Ascend traffic at 100 Mbit/s.
    a100 = [s for s in plan.shapers if s.ns == "hc0a1b2c-a100-0"][0]
    assert a100.bridge_rate_bps == 100_000_000
    assert a100.bridge_match == ("dst", ("10.213.0.3/32",))
    fabric_to_ascend = [s for s in plan.shapers if s.dev == "n2r0"][0]
    assert fabric_to_ascend.bridge_match == ("src", ("10.213.0.1/32", "10.213.0.2/32"))


def test_tc_commands_shape_with_tbf_and_bridge_class():
    c = load_cluster(MINI)
    plan = plan_network(c, settings_from_cluster(c, scale=1e-2), "0a1b2c")
    lines = _tc_lines(plan.shapers[0], plan.settings.queue_ms)
    assert lines[0].startswith("qdisc add dev nic0 root handle 1: tbf rate 2000000000bit burst ")
    assert "latency 200ms" in lines[0]
    assert any("htb rate 1000000000bit ceil 1000000000bit" in x for x in lines)
    assert lines[-1].endswith("u32 match ip dst 10.213.0.3/32 flowid 10:20")


def test_multirail_rails_get_their_own_subnets_and_bridges():
    c = load_cluster(FOUR)
    plan = plan_network(c, settings_from_cluster(c), "abcdef")
    assert plan.bridges == ("br0", "br1")
    for n in plan.nodes:
        assert [i.name for i in n.ifaces] == ["nic0", "nic1"]
        assert str(n.ifaces[0].address).startswith("10.214.0.")
        assert str(n.ifaces[1].address).startswith("10.214.1.")
    # 100 Gb/s of bridge per node split over two 100 Gb/s ports: 50 Mbit/s each at 1e-3.
    assert {s.bridge_rate_bps for s in plan.shapers} == {50_000_000}
    assert sorted(v.name_b for v in plan.veths)[:2] == ["n0r0", "n0r1"]


def test_p2p_uses_pair_rates():
    c = load_cluster(MINI)
    plan = plan_network(c, settings_from_cluster(c, mode="p2p"), "abcdef")
    assert plan.fabric_ns is None and len(plan.veths) == 3
    rates = {
        (v.ns_a.split("-")[1], v.ns_b.split("-")[1]): s.rate_bps
        for v, s in zip(plan.veths, plan.shapers[::2])
    }
    assert rates == {
        ("a100", "h800"): 200_000_000,
        ("a100", "ascend"): 100_000_000,
        ("h800", "ascend"): 100_000_000,
    }
    # One address per node, on every one of its veths, and a host route per peer.
    assert {str(i.address) for i in plan.nodes[0].ifaces} == {"10.213.0.1/32"}
    assert ("hcabcdef-a100-0", "10.213.0.3/32", "p2", "10.213.0.1") in plan.routes


def test_rank_env_points_at_the_emulated_network():
    c = load_cluster(MINI)
    plan = plan_network(c, settings_from_cluster(c), "abcdef")
    state = EmulationState(
        run_id="abcdef",
        cluster_name=c.name,
        cluster_path=MINI,
        status="up",
        nodes=[
            {
                "ns": n.ns,
                "node": n.node,
                "index": n.index,
                "vendor": n.vendor,
                "ranks": list(n.ranks),
                "ifaces": [{"name": i.name, "address": str(i.address)} for i in n.ifaces],
            }
            for n in plan.nodes
        ],
    )
    env = rank_env(state, 1, base={"PATH": "/usr/bin"})
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.213.0.1" and env["GLOO_SOCKET_IFNAME"] == "nic0"
    assert env["HETCOMM_CLUSTER"] == MINI and env["HETCOMM_EMULATE"] == "hcabcdef"
    env3 = rank_env(state, 3, base={})
    assert env3["LOCAL_RANK"] == "0" and env3["NODE_RANK"] == "2"
    assert env3["HETCOMM_EMULATE_ADDRS"] == "10.213.0.3" and env3["MASTER_ADDR"] == "10.213.0.1"


def test_rank_env_matches_ranks_to_rails():
    """Local rank k binds gloo to port k of a multi-NIC node (rail matching)."""
    c = load_cluster(FOUR)
    plan = plan_network(c, settings_from_cluster(c), "abcdef")
    state = EmulationState(
        run_id="abcdef",
        cluster_name=c.name,
        cluster_path=FOUR,
        status="up",
        nodes=[
            {
                "ns": n.ns,
                "node": n.node,
                "index": n.index,
                "vendor": n.vendor,
                "ranks": list(n.ranks),
                "ifaces": [{"name": i.name, "address": str(i.address)} for i in n.ifaces],
            }
            for n in plan.nodes
        ],
    )
    ifnames = [rank_env(state, r, base={})["GLOO_SOCKET_IFNAME"] for r in range(8)]
    assert ifnames == ["nic0", "nic1"] * 4
    env5 = rank_env(state, 5, base={})
    assert env5["HETCOMM_EMULATE_IFNAMES"] == "nic0,nic1"
    assert env5["HETCOMM_EMULATE_ADDRS"] == "10.214.0.3,10.214.1.3"
    assert env5["MASTER_ADDR"] == "10.214.0.1"


@pytest.mark.parametrize(
    "emulation, key, needle",
    [
        ("subnet: 8.8.0.0/16\n", "emulation.subnet", "not a private range"),
        ("subnet: 10.213.0.0/33\n", "emulation.subnet", "not an IPv4 network"),
        ("subnet: 10.213.0.0/31\n", "emulation.subnet", "too small"),
        ("mode: star\n", "emulation.mode", "unknown mode 'star'"),
        ("scale: 2\n", "emulation.scale", "in (0, 1]"),
        ("sclae: 0.001\n", "emulation.sclae", "unknown key 'sclae'"),
        ("compute_scale: {ascend: 0}\n", "emulation.compute_scale.ascend", "in [0.01, 1]"),
        ("compute_scale: {ascend: 1.5}\n", "emulation.compute_scale.ascend", "in [0.01, 1]"),
        ("compute_scale: {ascend: half}\n", "emulation.compute_scale.ascend", "in [0.01, 1]"),
        ("compute_scale: {ascend: .nan}\n", "emulation.compute_scale.ascend", "in [0.01, 1]"),
        ("compute_scale: {tpu: 0.5}\n", "emulation.compute_scale.tpu", "no node group or node"),
        ("compute_scale: [0.5]\n", "emulation.compute_scale", "expected a mapping"),
        ("compute: yes please\n", "emulation.compute", "expected true or false"),
        ("cpu_per_rank: 0\n", "emulation.cpu_per_rank", "CPUs per rank"),
        ("cpu_per_rank: 100000\n", "emulation.cpu_per_rank", "CPUs per rank"),
    ],
)
def test_bad_emulation_settings_name_key_and_line(tmp_path, emulation, key, needle):
    path = tmp_path / "c.yaml"
    path.write_text(_mini_text(emulation))
    c = load_cluster(str(path))
    with pytest.raises(ConfigError) as ei:
        plan_network(c, settings_from_cluster(c), "abcdef")
    msg = str(ei.value)
    assert needle in msg and f"key '{key}'" in msg
    line = path.read_text().splitlines().index("emulation:") + 2
    assert f"{path}:{line}" in msg


def test_bad_scale_from_command_line_is_refused():
    c = load_cluster_text(_mini_text("mode: bridge\n"))
    with pytest.raises(ConfigError, match="emulation.scale"):
        settings_from_cluster(c, scale=0.0)


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
    reason="needs root and setpriv to drop to an unprivileged user",
)
def test_cli_refuses_without_root(tmp_path):
    """A real unprivileged process (setpriv to nobody) gets exit 2 and the reason."""
    proc = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-m",
            "hetcomm",
            "emulate",
            "up",
            "--cluster",
            MINI,
            "--state-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr
    assert "missing root" in proc.stderr


def test_cli_run_without_command_is_usage_error(tmp_path, capsys):
    from hetcomm.cli.main import main

    assert main(["emulate", "run", "--cluster", MINI, "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing to run" in err or "missing root" in err
    assert main(["emulate"]) == 2
    assert "missing action" in capsys.readouterr().err


def test_bad_group_name_error_names_index_and_line(tmp_path):
    """Issue 14.15: the error names which node group (index, file, line), not just the key."""
    with open(MINI) as f:
        text = f.read().replace("name: ascend", "name: as--cend")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    c = load_cluster(str(path))
    with pytest.raises(ConfigError) as e:
        plan_network(c, settings_from_cluster(c), "abcdef")
    assert e.value.key == "node_groups[2].name"
    assert e.value.line == 19 and e.value.path == str(path)
    assert f"{path}:19" in str(e.value)


def test_compute_scale_gives_each_node_its_cpu_share():
    """Issue 11.4: each rank's CPU quota is its node's compute_scale x cpu_per_rank; naming a
    node group turns compute emulation on, a node name overrides its group."""
    c = load_cluster_text(_mini_text("compute_scale: {a100: 1, ascend: 0.5, h800-0: 0.75}\n"))
    settings = settings_from_cluster(c, num_cpus=2)
    assert settings.compute and settings.cpu_per_rank == 0.5  # 2 cores / 4 ranks
    plan = plan_network(c, settings, "abcdef")
    got = {n.node: (n.compute_scale, n.cpus) for n in plan.nodes}
    assert got == {"a100-0": (1.0, 0.5), "h800-0": (0.75, 0.375), "ascend-0": (0.5, 0.25)}
    assert any("ascend-0 x0.5 (0.25 CPUs per rank)" in note for note in plan.notes)
    # Off by default without compute_scale, and switchable from the command line.
    plain = load_cluster_text(_mini_text("mode: bridge\n"))
    assert all(
        n.cpus is None for n in plan_network(plain, settings_from_cluster(plain), "abcdef").nodes
    )
    # Switched on without overrides, the device table decides: H800 fastest, A100 and 910B
    # at about a third of it (312 and 320 against 990 dense FP16 TFLOPS).
    on = settings_from_cluster(plain, compute=True, cpu_per_rank=0.2)
    nodes = plan_network(plain, on, "abcdef").nodes
    assert [round(n.compute_scale, 2) for n in nodes] == [0.32, 1.0, 0.32]
    assert [n.cpus for n in nodes] == pytest.approx([0.2 * 0.3153, 0.2, 0.2 * 0.3234], rel=1e-3)
    # device.tflops in the YAML beats the table: the half-speed 910B cluster DETECT benchmarks.
    half = load_cluster(os.path.join(REPO, "configs", "clusters", "mixed-mini-halfspeed.yaml"))
    nodes = plan_network(
        half, settings_from_cluster(half, compute=True, num_cpus=2), "abcdef"
    ).nodes
    assert [(n.compute_scale, n.cpus) for n in nodes] == [(1.0, 0.5), (1.0, 0.5), (0.5, 0.25)]
    off = settings_from_cluster(c, compute=False)
    assert all(n.cpus is None for n in plan_network(c, off, "abcdef").nodes)


def test_host_share_holds_the_training_thread_to_the_node_speed():
    """``emulation.host_share``: the rank keeps ``cpu_per_rank`` (its host threads are not slowed
    with its device) and its training thread gets ``compute_scale x cpu_per_rank x (1 - share)``;
    a share outside [0, 0.9] is refused naming the key and its line."""
    c = load_cluster_text(_mini_text("compute_scale: {a100: 1, ascend: 0.5}\nhost_share: 0.25\n"))
    settings = settings_from_cluster(c, num_cpus=2)
    assert settings.host_share == 0.25
    got = {n.node: (n.cpus, n.device_cpus) for n in plan_network(c, settings, "abcdef").nodes}
    assert got == {"a100-0": (0.5, 0.375), "h800-0": (0.5, 0.375), "ascend-0": (0.5, 0.1875)}
    plain = load_cluster_text(_mini_text("compute_scale: {ascend: 0.5}\n"))
    assert all(n.device_cpus is None for n in plan_network(plain, settings_from_cluster(plain, num_cpus=2), "abcdef").nodes)
    for bad in ("0.95", "-0.1", "true", "half"):
        c = load_cluster_text(_mini_text(f"compute_scale: {{ascend: 0.5}}\nhost_share: {bad}\n"))
        with pytest.raises(ConfigError, match=r"host_share.*in \[0, 0.9\]") as e:
            settings_from_cluster(c, num_cpus=2)
        assert e.value.key == "emulation.host_share"


def test_cgroup_quota_and_hierarchy_detection(tmp_path):
    from hetcomm.emulate.cgroup import MIN_PERIOD_US, find_cpu_hierarchy, period_us_for, quota_us_for

    # The shortest period (at least 4 ms) whose quota is the kernel's 1 ms minimum or more: a
    # mixed-mini A100 rank (0.5 x 312/989.5 CPU) gets 6.35 ms, not a 1 ms quota of a 4 ms period.
    assert [period_us_for(c) for c in (1.0, 0.5, 0.25, 0.1)] == [MIN_PERIOD_US, 4000, 4000, 10000]
    assert period_us_for(0.5 * 312 / 989.5) == 6343
    assert quota_us_for(0.5 * 312 / 989.5) == 1000 and quota_us_for(0.5) == 2000
    assert quota_us_for(0.25, 20_000) == 5000
    # Below 1 ms per 1 s (the kernel's longest period) the quota is floored.
    assert period_us_for(0.0001) == 1_000_000 and quota_us_for(0.0001) == 1000
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
        f"cgroup2 {v2} cgroup2 rw,relatime 0 0\n"
    )
    h = find_cpu_hierarchy(str(mounts))
    assert (h.version, h.root) == (2, str(v2))
    (v2 / "cgroup.controllers").write_text("hugetlb\n")  # this machine: v2 without cpu
    h = find_cpu_hierarchy(str(mounts))
    assert (h.version, h.root) == (1, "/sys/fs/cgroup/cpu")


def test_cgroup_v2_files_written(tmp_path):
    """The v2 branch, on a directory standing in for the unified hierarchy (this machine's cpu
    controller is on v1, so the kernel path is exercised only there): the root delegates cpu
    to its children, the rank's cgroup gets cpu.max and cpu.weight."""
    from hetcomm.emulate.cgroup import (
        WEIGHT_V2,
        CpuHierarchy,
        cgroup_dir_for,
        create_cgroup,
        read_cpu_limit,
    )
    from hetcomm.emulate.kernel import KernelError

    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    h = CpuHierarchy(2, str(tmp_path))
    path = cgroup_dir_for(h, "abcdef", "ascend-0-r3")
    assert create_cgroup(h, path, 0.1) == (1000, 10000)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
    assert read_cpu_limit(h, path) == (1000, 10000)
    assert (tmp_path / "hcabcdef-ascend-0-r3" / "cpu.weight").read_text() == str(WEIGHT_V2)
    with pytest.raises(KernelError, match="exists already"):
        create_cgroup(h, path, 0.25)
