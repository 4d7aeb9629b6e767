"""The emulation in the kernel: real namespaces, veths, tbf shapers and rank processes.

Marked ``emulate``: tests/conftest.py skips these without root or iproute2. Each test uses its
own state directory, and checks that nothing of its run is left afterwards: no namespace, no
interface in the root namespace, no /dev/shm entry, no state file, no process.

The CLI is called in-process (``hetcomm.cli.main.main``) where that is enough: a fresh
``python -m hetcomm`` imports torch, which costs seconds on a loaded 2-core machine. The
end-to-end all-to-all and the SIGKILL test use real ``hetcomm`` subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hetcomm.cli.main import main as hetcomm_main
from hetcomm.emulate.cgroup import find_cpu_hierarchy, list_run_cgroups
from hetcomm.emulate.kernel import list_netns

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")
HERE = os.path.join(REPO, "tests", "emulate")
HETCOMM = [sys.executable, "-m", "hetcomm"]

pytestmark = pytest.mark.emulate


def _root_links() -> set:
    out = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _run_ids(text: str) -> set:
    return set(re.findall(r"\bhc([0-9a-f]{6})\b", text))


def _assert_nothing_left(run_ids, state_dir, links_before):
    assert run_ids, "no run id seen in the output"
    for rid in run_ids:
        assert not [n for n in list_netns() if n.startswith(f"hc{rid}-")]
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"hc{rid}-")]
        assert not [n for n in list_run_cgroups(find_cpu_hierarchy()) if n.startswith(f"hc{rid}-")]
        assert not os.path.exists(os.path.join(state_dir, f"hc{rid}.json"))
        assert not os.path.exists(os.path.join(state_dir, f"hc{rid}"))
    assert _root_links() == links_before


def _hetcomm_registered() -> bool:
    import torch.distributed as dist

    import hetcomm  # noqa: F401

    return "hetcomm" in dist.Backend.backend_list


def _within(measured_s: float, num_bytes: int, rate_bps: float) -> bool:
    """The transfer was shaped to ``rate_bps``: it cannot have run faster than the shaper lets
    it (a lower bound that holds on any machine; 0.7 leaves room for the token bucket's burst),
    and it did finish within a generous multiple of the nominal time. Only the lower bound is
    tight on purpose: a loaded CI machine makes transfers slower, never faster, so an upper
    bound near the nominal time would fail a correct program (it did at load 8: 1.34x). The
    lower bounds also order the links: 6 MB over the 100 Mbit/s path may not take less than
    0.34 s, which a 200 Mbit/s shaper (0.24 s) would violate."""
    expected_s = num_bytes * 8 / rate_bps
    return 0.7 * expected_s <= measured_s <= 10 * expected_s


@pytest.mark.timeout(150)
def test_alltoall_through_shaped_links(tmp_path):
    """4 ranks on 3 emulated nodes (mixed-mini): an uneven all-to-all checked against a local
    expectation, then timed transfers over the slow (cross-vendor) and a fast link. Backend
    ``hetcomm`` (ranks 0 and 1 share a100-0: shm rail; others TCP over the veths) once it is
    registered, gloo until then."""
    links_before = _root_links()
    backend = "hetcomm" if _hetcomm_registered() else "gloo"
    out_json = tmp_path / "out.json"
    num_bytes = 6_000_000
    proc = subprocess.run(
        HETCOMM
        + [
            "emulate",
            "run",
            "--cluster",
            MINI,
            "--state-dir",
            str(tmp_path / "st"),
            "--timeout",
            "120",
            "--",
            sys.executable,
            os.path.join(HERE, "rank_alltoall.py"),
            str(out_json),
            backend,
            str(num_bytes),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out_json.read_text())
    ranks = result["ranks"]
    assert result["backend"] == backend
    assert [r["ok"] for r in ranks] == [True] * 4
    assert [r["node"] for r in ranks] == ["a100-0", "a100-0", "h800-0", "ascend-0"]
    assert [r["ifname"] for r in ranks] == ["nic0"] * 4
    timings = {k: v for r in ranks for k, v in r["timings"].items()}
    # At scale 1e-3 the a100 -> 910B path is the 100 Gb/s host bridge -> 100 Mbit/s; a100 ->
    # h800 is a 200 Gb/s RoCE port -> 200 Mbit/s. (TCP/IP headers take ~4% of the wire.)
    assert _within(timings["slow_0to3"], num_bytes, 100e6), timings
    assert _within(timings["fast_0to2"], num_bytes, 200e6), timings
    _assert_nothing_left(_run_ids(proc.stderr), str(tmp_path / "st"), links_before)


@pytest.mark.timeout(60)
def test_p2p_mode_shapes_each_pair(tmp_path, capfd):
    links_before = _root_links()
    num_bytes = 6_000_000
    # p2p addresses: subnet base + 1 + node index (a100-0, h800-0, ascend-0).
    code = hetcomm_main(
        [
            "emulate",
            "run",
            "--cluster",
            MINI,
            "--mode",
            "p2p",
            "--state-dir",
            str(tmp_path / "st"),
            "--timeout",
            "50",
            "--",
            sys.executable,
            os.path.join(HERE, "rank_socket.py"),
            str(tmp_path),
            str(num_bytes),
            "10.213.0.2",
            "10.213.0.3",
        ]
    )
    err = capfd.readouterr().err
    assert code == 0, err
    slow_s, slow_n = (tmp_path / "rank3.txt").read_text().split()
    fast_s, fast_n = (tmp_path / "rank2.txt").read_text().split()
    assert int(slow_n) == int(fast_n) == num_bytes
    assert _within(float(slow_s), num_bytes, 100e6), (
        slow_s,
        fast_s,
    )  # a100-0 <-> ascend-0 veth: bridge rate
    assert _within(float(fast_s), num_bytes, 200e6), (
        slow_s,
        fast_s,
    )  # a100-0 <-> h800-0 veth: port rate
    _assert_nothing_left(_run_ids(err), str(tmp_path / "st"), links_before)


@pytest.mark.timeout(60)
def test_first_failure_propagates_with_rank(tmp_path, capfd):
    links_before = _root_links()
    script = (
        'if [ "$RANK" = 2 ]; then echo "bad input on $HETCOMM_EMULATE_NODE"; exit 7; fi; sleep 30'
    )
    t0 = time.monotonic()
    code = hetcomm_main(
        [
            "emulate",
            "run",
            "--cluster",
            MINI,
            "--state-dir",
            str(tmp_path),
            "--",
            "sh",
            "-c",
            script,
        ]
    )
    err = capfd.readouterr().err
    assert code == 7
    assert "rank 2 (node h800-0) exited with code 7" in err
    assert "bad input on h800-0" in err  # the tail of the failing rank's log
    assert time.monotonic() - t0 < 25  # the sleeping ranks were stopped, not waited for
    (rid,) = _run_ids(err)
    # A failed run keeps its rank logs (plain files) until `down`; no kernel object survives.
    assert "bad input on h800-0" in (tmp_path / f"hc{rid}" / "rank2.log").read_text()
    assert hetcomm_main(["emulate", "down", "--state-dir", str(tmp_path)]) == 0
    _assert_nothing_left({rid}, str(tmp_path), links_before)


@pytest.mark.timeout(60)
def test_timeout_names_the_ranks_and_exits_3(tmp_path, capfd):
    code = hetcomm_main(
        [
            "emulate",
            "run",
            "--cluster",
            MINI,
            "--state-dir",
            str(tmp_path),
            "--timeout",
            "2",
            "--",
            "sh",
            "-c",
            'if [ "$RANK" = 3 ]; then sleep 30; fi',
        ]
    )
    err = capfd.readouterr().err
    assert code == 3
    assert "ranks [3] did not finish within 2 s" in err
    for rid in _run_ids(err):
        assert not [n for n in list_netns() if n.startswith(f"hc{rid}-")]


@pytest.mark.timeout(60)
def test_up_status_down(tmp_path, capfd):
    links_before = _root_links()
    assert (
        hetcomm_main(["emulate", "up", "--cluster", MINI, "--state-dir", str(tmp_path), "--json"])
        == 0
    )
    state = json.loads(capfd.readouterr().out)
    rid = state["run_id"]
    try:
        assert set(state["namespaces"]) <= set(list_netns())
        qd = subprocess.run(
            ["tc", "-n", f"hc{rid}-ascend-0", "qdisc", "show", "dev", "nic0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf 1: root" in qd and "rate 200Mbit" in qd and "htb 10:" in qd
        cls = subprocess.run(
            ["tc", "-n", f"hc{rid}-fabric", "class", "show", "dev", "n2r0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "class htb 10:20" in cls and "rate 100Mbit ceil 100Mbit" in cls
        assert hetcomm_main(["emulate", "status", "--state-dir", str(tmp_path)]) == 0
        out = capfd.readouterr().out
        assert f"hc{rid}" in out and "4/4 namespaces present" in out and "10.213.0.3/24" in out
    finally:
        code = hetcomm_main(["emulate", "down", "--state-dir", str(tmp_path)])
    assert code == 0
    _assert_nothing_left({rid}, str(tmp_path), links_before)


@pytest.mark.timeout(90)
def test_killed_run_is_cleaned_by_down(tmp_path):
    """SIGKILL the `run` parent mid-run: ranks, namespaces, /dev/shm segments and (with compute
    emulation) the nodes' cpu cgroups stay behind until `down` removes them from the state file
    (issue 11.4: no cgroup, namespace, link or /dev/shm entry is left)."""
    links_before = _root_links()
    compute = ["--compute", "--cpu-per-rank", "0.25"] if find_cpu_hierarchy() else []
    script = 'echo "segment of rank $RANK" > /dev/shm/hetcomm-test-seg$RANK; exec sleep 60'
    proc = subprocess.Popen(
        HETCOMM
        + [
            "emulate",
            "run",
            "--cluster",
            MINI,
            "--state-dir",
            str(tmp_path),
            *compute,
            "--",
            "sh",
            "-c",
            script,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    state = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            files = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
            try:
                state = json.loads((tmp_path / files[0]).read_text()) if files else None
            except ValueError:
                state = None
            segs = [
                os.path.join(d, f)
                for d in (state or {}).get("shm_dirs", [])
                if os.path.isdir(d)
                for f in os.listdir(d)
            ]
            if state and len(state["rank_pids"]) == 4 and len(segs) == 4:
                break
            time.sleep(0.1)
        assert state and len(state["rank_pids"]) == 4 and len(segs) == 4, (
            "run never got its ranks going"
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    rid = state["run_id"]
    # The crash left everything behind: namespaces, rank processes, shm segments.
    assert [n for n in list_netns() if n.startswith(f"hc{rid}-")]
    assert any(_alive(p) for p in state["rank_pids"])
    if compute:
        assert len(state["cgroups"]) == 4 and all(os.path.isdir(c) for c in state["cgroups"])
        for pid in state["rank_pids"]:  # every rank runs in its node's cgroup
            with open(f"/proc/{pid}/cgroup") as f:
                assert f"/hc{rid}-" in f.read()
    assert hetcomm_main(["emulate", "down", "--state-dir", str(tmp_path)]) == 0
    assert not any(_alive(p) for p in state["rank_pids"])
    assert not any(os.path.exists(s) for s in segs)
    _assert_nothing_left({rid}, str(tmp_path), links_before)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_run_refuses_more_ranks_than_one_machine_starts(tmp_path, capfd):
    """The 80-rank preset: `run` would start 80 local processes; refused before anything is
    built (`up` still builds it for inspection)."""
    big = os.path.join(REPO, "configs", "clusters", "mixed-a100-h800-910b.yaml")
    argv = ["emulate", "run", "--cluster", big, "--state-dir", str(tmp_path), "--", "true"]
    code = hetcomm_main(argv)
    err = capfd.readouterr().err
    assert code == 2 and "has 80 ranks" in err and "at most 64" in err, err
    assert "namespaces created" not in err and not list(tmp_path.glob("hc*"))
