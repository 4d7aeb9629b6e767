"""The emulation in the kernel: real namespaces, veths, tbf shapers and rank processes.

Marked ``emulate``: tests/conftest.py skips these without root or iproute2. Each test uses its
own state directory, and checks that nothing of its run is left afterwards: no namespace, no
interface in the root namespace, no /dev/shm entry, no state file, no process.
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

from hetcomm.emulate.kernel import list_netns

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")
RANK_SCRIPT = os.path.join(REPO, "tests", "emulate", "rank_alltoall.py")
HETCOMM = [sys.executable, "-m", "hetcomm"]

pytestmark = pytest.mark.emulate


def _root_links() -> set:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _run_ids(text: str) -> set:
    return set(re.findall(r"\bhc([0-9a-f]{6})\b", text))


def _assert_nothing_left(run_ids, state_dir, links_before):
    assert run_ids, "no run id seen in the output"
    for rid in run_ids:
        assert not [n for n in list_netns() if n.startswith(f"hc{rid}-")]
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"hc{rid}-")]
        assert not os.path.exists(os.path.join(state_dir, f"hc{rid}.json"))
        assert not os.path.exists(os.path.join(state_dir, f"hc{rid}"))
    assert _root_links() == links_before


def _hetcomm_registered() -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "import hetcomm, torch.distributed as d; print('hetcomm' in d.Backend.backend_list)"],
        capture_output=True, text=True, timeout=120,
    )
    return probe.stdout.strip() == "True"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, backend", [("bridge", "hetcomm"), ("bridge", "gloo"), ("p2p", "gloo")])
def test_alltoall_through_shaped_links(tmp_path, mode, backend):
    """4 ranks on 3 emulated nodes: ranks 0 and 1 share a100-0 (shm rail with hetcomm), the
    others talk TCP over the shaped veths."""
    if backend == "hetcomm" and not _hetcomm_registered():
        pytest.skip("backend 'hetcomm' is not registered by this checkout")
    links_before = _root_links()
    out_json = tmp_path / "out.json"
    num_bytes = 8_000_000
    proc = subprocess.run(
        HETCOMM + ["emulate", "run", "--cluster", MINI, "--mode", mode, "--state-dir", str(tmp_path / "st"),
                   "--timeout", "90", "--", sys.executable, RANK_SCRIPT, str(out_json), backend, str(num_bytes)],
        capture_output=True, text=True, timeout=110, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out_json.read_text())
    ranks = result["ranks"]
    # Results equal the locally computed expectation on every rank.
    assert [r["ok"] for r in ranks] == [True] * 4
    assert [r["node"] for r in ranks] == ["a100-0", "a100-0", "h800-0", "ascend-0"]
    timings = {k: v for r in ranks for k, v in r["timings"].items()}
    # mixed-mini at scale 1e-3: the a100 -> 910B path is the 100 Gb/s host bridge -> 100 Mbit/s;
    # a100 -> h800 is a 200 Gb/s RoCE port -> 200 Mbit/s. TCP/IP headers take ~4% of the wire.
    for name, rate_bps in (("slow_0to3", 100e6), ("fast_0to2", 200e6)):
        expected_s = num_bytes * 8 / rate_bps
        assert 0.7 * expected_s <= timings[name] <= 1.3 * expected_s, (name, timings[name], expected_s)
    _assert_nothing_left(_run_ids(proc.stderr), str(tmp_path / "st"), links_before)


@pytest.mark.timeout(60)
def test_first_failure_propagates_with_rank(tmp_path):
    links_before = _root_links()
    script = 'if [ "$RANK" = 2 ]; then echo "bad input on $HETCOMM_EMULATE_NODE"; exit 7; fi; sleep 30'
    t0 = time.monotonic()
    proc = subprocess.run(
        HETCOMM + ["emulate", "run", "--cluster", MINI, "--state-dir", str(tmp_path), "--", "sh", "-c", script],
        capture_output=True, text=True, timeout=50, cwd=REPO,
    )
    assert proc.returncode == 7
    assert "rank 2 (node h800-0) exited with code 7" in proc.stderr
    assert "bad input on h800-0" in proc.stderr  # the tail of the failing rank's log
    assert time.monotonic() - t0 < 25  # the sleeping ranks were stopped, not waited for
    (rid,) = _run_ids(proc.stderr)
    # A failed run keeps its rank logs (plain files) until `down`; no kernel object survives.
    assert "bad input on h800-0" in (tmp_path / f"hc{rid}" / "rank2.log").read_text()
    down = subprocess.run(HETCOMM + ["emulate", "down", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=50, cwd=REPO)
    assert down.returncode == 0, down.stderr
    _assert_nothing_left({rid}, str(tmp_path), links_before)


@pytest.mark.timeout(60)
def test_timeout_names_the_ranks_and_exits_3(tmp_path):
    proc = subprocess.run(
        HETCOMM + ["emulate", "run", "--cluster", MINI, "--state-dir", str(tmp_path), "--timeout", "2",
                   "--", "sh", "-c", 'if [ "$RANK" = 3 ]; then sleep 30; fi'],
        capture_output=True, text=True, timeout=50, cwd=REPO,
    )
    assert proc.returncode == 3
    assert "ranks [3] did not finish within 2 s" in proc.stderr
    for rid in _run_ids(proc.stderr):
        assert not [n for n in list_netns() if n.startswith(f"hc{rid}-")]


@pytest.mark.timeout(60)
def test_up_status_down(tmp_path):
    links_before = _root_links()
    up = subprocess.run(HETCOMM + ["emulate", "up", "--cluster", MINI, "--state-dir", str(tmp_path), "--json"],
                        capture_output=True, text=True, timeout=50, cwd=REPO)
    assert up.returncode == 0, up.stderr
    state = json.loads(up.stdout)
    rid = state["run_id"]
    try:
        assert set(state["namespaces"]) <= set(list_netns())
        qd = subprocess.run(["tc", "-n", f"hc{rid}-ascend-0", "qdisc", "show", "dev", "nic0"],
                            capture_output=True, text=True, check=True).stdout
        assert "tbf 1: root" in qd and "rate 200Mbit" in qd and "htb 10:" in qd
        st = subprocess.run(HETCOMM + ["emulate", "status", "--state-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=50, cwd=REPO)
        assert f"hc{rid}" in st.stdout and "4/4 namespaces present" in st.stdout
        assert "10.213.0.3/24" in st.stdout
    finally:
        down = subprocess.run(HETCOMM + ["emulate", "down", "--state-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=50, cwd=REPO)
    assert down.returncode == 0, down.stderr
    _assert_nothing_left({rid}, str(tmp_path), links_before)


@pytest.mark.timeout(90)
def test_killed_run_is_cleaned_by_down(tmp_path):
    """SIGKILL the `run` parent mid-run: ranks, namespaces and /dev/shm segments stay behind
    until `down` removes them from the state file."""
    links_before = _root_links()
    script = 'echo "segment of rank $RANK" > /dev/shm/hetcomm-test-seg$RANK; exec sleep 60'
    proc = subprocess.Popen(
        HETCOMM + ["emulate", "run", "--cluster", MINI, "--state-dir", str(tmp_path), "--", "sh", "-c", script],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 40
        state = None
        while time.monotonic() < deadline:
            files = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
            if files:
                with open(tmp_path / files[0]) as f:
                    try:
                        state = json.load(f)
                    except ValueError:
                        state = None
                if state and len(state["rank_pids"]) == 4 and all(
                    os.path.exists(os.path.join(d, "hetcomm-test-seg0")) or "a100" not in d for d in state["shm_dirs"]
                ):
                    break
            time.sleep(0.1)
        assert state and len(state["rank_pids"]) == 4, "run never got its ranks going"
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    rid = state["run_id"]
    # The crash left everything behind: namespaces, rank processes, shm segments.
    assert [n for n in list_netns() if n.startswith(f"hc{rid}-")]
    assert any(_alive(p) for p in state["rank_pids"])
    segs = [os.path.join(d, f) for d in state["shm_dirs"] if os.path.isdir(d) for f in os.listdir(d)]
    assert segs, "ranks wrote no shm segment"
    down = subprocess.run(HETCOMM + ["emulate", "down", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=50, cwd=REPO)
    assert down.returncode == 0, down.stderr
    assert not any(_alive(p) for p in state["rank_pids"])
    assert not any(os.path.exists(s) for s in segs)
    _assert_nothing_left({rid}, str(tmp_path), links_before)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
