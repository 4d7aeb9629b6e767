"""`emulate down` acts only on what hetcomm itself recorded (issue 14 items 1, 2 and 15).

Marked ``emulate`` (root, iproute2). Every foreign object here (a "victim" namespace with a
process in it, a victim directory, an unrecorded ``hc<id>-*`` namespace) is made by the test
itself with a random name, and removed by the test whatever hetcomm did.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time

import pytest

from hetcomm.cli.main import main as hetcomm_main
from hetcomm.emulate.cgroup import find_cpu_hierarchy
from hetcomm.emulate.kernel import list_netns

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")
NOBODY = 65534

pytestmark = pytest.mark.emulate


def _netns_with_sleeper(name: str) -> subprocess.Popen:
    subprocess.run(["ip", "netns", "add", name], check=True)
    return subprocess.Popen(["ip", "netns", "exec", name, "sleep", "120"])


def _remove_netns(name: str, proc: subprocess.Popen = None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _planted_state(state_dir, rid: str, victim_ns: str, victim_dir: str) -> str:
    path = os.path.join(state_dir, f"hc{rid}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "run_id": rid,
                "cluster_name": "x",
                "cluster_path": "",
                "namespaces": [victim_ns],
                "shm_dirs": [victim_dir],
            },
            f,
        )
    return path


@pytest.fixture
def victim(tmp_path):
    """A namespace hetcomm never made (with a process in it) and a directory with a file."""
    tag = secrets.token_hex(3)
    ns = f"victim-{tag}"
    proc = _netns_with_sleeper(ns)
    vdir = tmp_path / f"victim-dir-{tag}"
    vdir.mkdir()
    (vdir / "precious").write_text("keep me")
    yield ns, proc, str(vdir)
    _remove_netns(ns, proc)


def _victim_intact(ns, proc, vdir) -> None:
    assert ns in list_netns()
    assert proc.poll() is None, "the process inside the victim namespace was killed"
    assert os.path.exists(os.path.join(vdir, "precious"))


def test_planted_state_file_names_are_refused(tmp_path, victim, capfd):
    """A state file in the caller's own (private) state directory that lists foreign names:
    nothing is deleted, nothing killed, and the error says why."""
    ns, proc, vdir = victim
    sd = tmp_path / "sd"
    sd.mkdir(mode=0o700)
    rid = secrets.token_hex(3)
    path = _planted_state(sd, rid, ns, vdir)
    code = hetcomm_main(["emulate", "down", "--state-dir", str(sd)])
    err = capfd.readouterr().err
    _victim_intact(ns, proc, vdir)
    assert code == 2, err
    assert ns in err and f"hc{rid}-" in err
    assert os.path.exists(path), "a refused state file is left for the user to inspect"
    # --id takes the same path.
    assert hetcomm_main(["emulate", "down", "--state-dir", str(sd), "--id", rid]) == 2
    _victim_intact(ns, proc, vdir)


@pytest.mark.parametrize("how", ["other-owner", "world-writable", "symlink"])
def test_untrusted_state_dir_is_refused(tmp_path, victim, capfd, how):
    """The issue's reproduction: --state-dir /tmp/sd that someone else controls."""
    ns, proc, vdir = victim
    real = tmp_path / "sd"
    real.mkdir(mode=0o700)
    rid = secrets.token_hex(3)
    _planted_state(real, rid, ns, vdir)
    sd = real
    if how == "other-owner":
        os.chown(real, NOBODY, NOBODY)
    elif how == "world-writable":
        os.chmod(real, 0o777)
    else:
        sd = tmp_path / "link"
        os.symlink(real, sd)
    code = hetcomm_main(["emulate", "down", "--state-dir", str(sd)])
    err = capfd.readouterr().err
    _victim_intact(ns, proc, vdir)
    assert code == 2, err
    assert str(sd) in err
    # `up` refuses it too, before creating anything.
    code = hetcomm_main(["emulate", "up", "--cluster", MINI, "--state-dir", str(sd)])
    err = capfd.readouterr().err
    assert code == 2 and str(sd) in err
    assert not [n for n in list_netns() if n.startswith("hc") and ns in n]


def test_state_file_of_another_user_is_refused(tmp_path, victim, capfd):
    ns, proc, vdir = victim
    sd = tmp_path / "sd"
    sd.mkdir(mode=0o700)
    rid = secrets.token_hex(3)
    path = _planted_state(sd, rid, f"hc{rid}-fabric", vdir)
    os.chown(path, NOBODY, NOBODY)
    code = hetcomm_main(["emulate", "down", "--state-dir", str(sd)])
    err = capfd.readouterr().err
    assert code == 2 and "owned by" in err, err
    _victim_intact(ns, proc, vdir)


def test_down_id_without_state_file_removes_nothing(tmp_path, capfd):
    """Issue 14.15: `down --id ID` with no state file used to sweep every hc<ID>-* name."""
    rid = secrets.token_hex(3)
    name = f"hc{rid}-n0"
    proc = _netns_with_sleeper(name)
    shm = f"/dev/shm/hc{rid}-n0"
    os.mkdir(shm)
    try:
        code = hetcomm_main(["emulate", "down", "--state-dir", str(tmp_path), "--id", rid])
        err = capfd.readouterr().err
        assert code == 1, err
        assert name in list_netns() and proc.poll() is None and os.path.isdir(shm)
        assert "no state file" in err and "--sweep" in err
    finally:
        _remove_netns(name, proc)
        shutil.rmtree(shm, ignore_errors=True)


def test_sweep_spares_live_emulations_and_busy_names(tmp_path, capfd):
    """Issue 14.2: --sweep removes only provable orphans and names what it skips: an emulation
    recorded in another state directory, and an unrecorded namespace with a live process."""
    other = tmp_path / "other"
    mine = tmp_path / "mine"
    assert (
        hetcomm_main(["emulate", "up", "--cluster", MINI, "--state-dir", str(other), "--json"]) == 0
    )
    live_rid = json.loads(capfd.readouterr().out)["run_id"]
    busy_rid, orphan_rid = secrets.token_hex(3), secrets.token_hex(3)
    busy = _netns_with_sleeper(f"hc{busy_rid}-n0")
    subprocess.run(["ip", "netns", "add", f"hc{orphan_rid}-n0"], check=True)
    os.mkdir(f"/dev/shm/hc{orphan_rid}-n0")
    try:
        # status no longer advertises --sweep for names it would not remove.
        assert hetcomm_main(["emulate", "status", "--state-dir", str(mine)]) == 0
        out = capfd.readouterr().out
        for rid in (live_rid, busy_rid, orphan_rid):
            assert f"hc{rid}" in out
        lines = {
            rid: [x for x in out.splitlines() if f"hc{rid}" in x]
            for rid in (live_rid, busy_rid, orphan_rid)
        }
        assert str(other) in " ".join(lines[live_rid])
        assert "--sweep" not in " ".join(lines[live_rid] + lines[busy_rid])
        assert "--sweep" in " ".join(lines[orphan_rid])

        for rid in (live_rid, busy_rid, orphan_rid):
            hetcomm_main(["emulate", "down", "--sweep", "--state-dir", str(mine), "--id", rid])
        err = capfd.readouterr().err
        # The live emulation and the busy namespace survive, with a reason each.
        assert f"hc{live_rid}-fabric" in list_netns()
        assert f"hc{busy_rid}-n0" in list_netns() and busy.poll() is None
        assert f"hc{live_rid}" in err and str(other) in err
        assert f"hc{busy_rid}" in err and str(busy.pid) in err
        # The orphan is gone.
        assert f"hc{orphan_rid}-n0" not in list_netns()
        assert not os.path.exists(f"/dev/shm/hc{orphan_rid}-n0")
    finally:
        _remove_netns(f"hc{busy_rid}-n0", busy)
        _remove_netns(f"hc{orphan_rid}-n0")
        shutil.rmtree(f"/dev/shm/hc{orphan_rid}-n0", ignore_errors=True)
        assert hetcomm_main(["emulate", "down", "--state-dir", str(other)]) == 0
    assert not [n for n in list_netns() if n.startswith(f"hc{live_rid}-")]


@pytest.mark.skipif(find_cpu_hierarchy() is None, reason="no cgroup cpu controller")
def test_planted_cgroup_is_refused(tmp_path, capfd):
    """A state file otherwise well-formed (its own node, namespace and shm names) that also lists
    a cgroup hetcomm did not make: refused as a whole, the cgroup stays."""
    h = find_cpu_hierarchy()
    rid = secrets.token_hex(3)
    victim = os.path.join(h.root, f"victim-{rid}")
    os.mkdir(victim)
    try:
        sd = tmp_path / "sd"
        sd.mkdir(mode=0o700)
        state = {
            "run_id": rid,
            "cluster_name": "x",
            "cluster_path": "",
            "namespaces": [f"hc{rid}-n-0"],
            "shm_dirs": [f"/dev/shm/hc{rid}-n-0"],
            "cgroups": [victim],
            "nodes": [{"ns": f"hc{rid}-n-0", "node": "n-0", "ranks": [0], "ifaces": []}],
        }
        (sd / f"hc{rid}.json").write_text(json.dumps(state))
        code = hetcomm_main(["emulate", "down", "--state-dir", str(sd)])
        err = capfd.readouterr().err
        assert code == 2 and "cgroups[0]" in err, err
        assert os.path.isdir(victim)
    finally:
        os.rmdir(victim)


def test_copied_state_file_of_a_live_emulation_is_refused(tmp_path, capfd):
    """A valid state file copied from the directory that recorded the run into another private
    directory: the index says where the run lives, so `down` there acts on nothing."""
    home, other = tmp_path / "home", tmp_path / "other"
    assert (
        hetcomm_main(["emulate", "up", "--cluster", MINI, "--state-dir", str(home), "--json"]) == 0
    )
    rid = json.loads(capfd.readouterr().out)["run_id"]
    try:
        other.mkdir(mode=0o700)
        shutil.copy(home / f"hc{rid}.json", other / f"hc{rid}.json")
        code = hetcomm_main(["emulate", "down", "--state-dir", str(other)])
        err = capfd.readouterr().err
        assert code == 2 and "emulation index" in err and str(home) in err, err
        assert f"hc{rid}-fabric" in list_netns()
        assert hetcomm_main(["emulate", "status", "--state-dir", str(other)]) == 0
        assert f"refused {other}" in capfd.readouterr().out
    finally:
        assert hetcomm_main(["emulate", "down", "--state-dir", str(home)]) == 0
    assert not [n for n in list_netns() if n.startswith(f"hc{rid}-")]


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv to run as another user")
def _wait_until_owned_by(pid: int, uid: int, timeout_s: float = 30.0) -> None:
    """Until ``pid`` runs as ``uid``: ``setpriv`` starts as root and switches before its exec, and a
    `down` that looked in between would rightly see a process of this user (a race under load)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        if all(int(u) == uid for u in uids):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still not running as uid {uid} after {timeout_s} s")


def test_recorded_pid_of_another_user_is_not_signalled(tmp_path, capfd):
    """A state file (valid names) whose rank_pids names another user's process that even carries
    the run's id in its environment: `down` removes the state but signals nobody else's process."""
    rid = secrets.token_hex(3)
    proc = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"],
        env={"HETCOMM_EMULATE": f"hc{rid}", "PATH": os.environ["PATH"]},
        start_new_session=True,
    )
    try:
        _wait_until_owned_by(proc.pid, 65534)
        sd = tmp_path / "sd"
        sd.mkdir(mode=0o700)
        state = {
            "run_id": rid,
            "cluster_name": "x",
            "cluster_path": "",
            "namespaces": [f"hc{rid}-n-0"],
            "nodes": [{"ns": f"hc{rid}-n-0", "node": "n-0", "ranks": [0], "ifaces": []}],
            "rank_pids": [proc.pid],
        }
        (sd / f"hc{rid}.json").write_text(json.dumps(state))
        assert hetcomm_main(["emulate", "down", "--state-dir", str(sd)]) == 0
        assert proc.poll() is None, "another user's process was signalled"
        assert not (sd / f"hc{rid}.json").exists()
    finally:
        proc.kill()
        proc.wait(timeout=10)
