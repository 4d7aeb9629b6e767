"""Issue 21 items 3, 5, 6, 7, 20: checkpoint directories that are not the caller's alone are
refused, a kill mid-save leaves the last good checkpoint untouched, damage is found before DCP
reads a byte and reported in one line (exit 2), a resume with nothing left to train says so.

Real file system; the kill is a real SIGKILL of a process in the middle of a save; the CLI cases
run ``hetcomm train`` on 4 real ranks."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from hetcomm.errors import CheckpointError, HetcommError, UnsafePathError
from hetcomm.ops.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests.ops.jobs import STEPS, TINY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by another user")


def _model(seed: int = 0, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))


def _tree(path):
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


# -- item 3 / 20: private directories, no links --------------------------------------------------


def test_saved_checkpoint_is_private_and_checksummed(tmp_path):
    root = str(tmp_path / "ck")
    path = save_checkpoint(root, 3, _model())
    assert os.path.basename(path) == "step-00000003"
    for d, dirs, names in os.walk(root):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
        for n in names:
            assert stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode) == 0o600, n
    assert "hetcomm-checksums.json" in os.listdir(path)
    assert load_checkpoint(latest_checkpoint(root), _model(1)) == 3


def test_planted_links_are_refused_or_replaced_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    root = tmp_path / "ck"
    save_checkpoint(str(root), 1, _model())
    (root / "latest.tmp").symlink_to(victim)  # what the old save wrote through
    save_checkpoint(str(root), 2, _model())
    assert victim.read_text() == "precious\n"
    # `latest` itself a link: refused on load.
    os.unlink(root / "latest")
    (tmp_path / "elsewhere").write_text("step-00000001\n")
    (root / "latest").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePathError) as e:
        latest_checkpoint(str(root))
    assert e.value.reason == "open" and "symbolic link" in str(e.value)
    os.unlink(root / "latest")
    # The step directory `latest` names is a link to someone's directory: refused.
    shutil.copytree(root / "step-00000001", tmp_path / "theirs")
    (root / "step-00000009").symlink_to(tmp_path / "theirs")
    (root / "latest").write_text("step-00000009\n")
    with pytest.raises(UnsafePathError) as e:
        latest_checkpoint(str(root))
    assert e.value.reason == "symlink"
    # The checkpoint directory a link: refused by save and load.
    (tmp_path / "ck-link").symlink_to(root)
    for call in (lambda: save_checkpoint(str(tmp_path / "ck-link"), 3, _model()),
                 lambda: latest_checkpoint(str(tmp_path / "ck-link"))):
        with pytest.raises(UnsafePathError):
            call()


def test_group_writable_checkpoint_directory_is_refused(tmp_path):
    root = tmp_path / "ck"
    save_checkpoint(str(root), 1, _model())
    os.chmod(root, 0o777)
    with pytest.raises(UnsafePathError) as e:
        latest_checkpoint(str(root))
    assert e.value.reason == "mode"
    with pytest.raises(UnsafePathError):
        save_checkpoint(str(root), 2, _model())
    os.chmod(root, 0o700)
    os.chmod(root / "step-00000001", 0o777)
    with pytest.raises(UnsafePathError):
        latest_checkpoint(str(root))


@root_only
def test_checkpoint_directory_of_another_user_is_refused(tmp_path):
    root = tmp_path / "ck"
    save_checkpoint(str(root), 1, _model())
    os.chown(root, 65534, 65534)
    with pytest.raises(UnsafePathError) as e:
        latest_checkpoint(str(root))
    assert e.value.reason == "owner" and "uid 65534" in str(e.value)


# -- item 6: damage, found before DCP reads a byte -------------------------------------------------


def _shard(path):
    return next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".distcp"))


def _damage(kind, path):
    meta = os.path.join(path, ".metadata")
    if kind == "random-metadata":
        open(meta, "wb").write(os.urandom(os.path.getsize(meta)))
    elif kind == "truncated-metadata":
        open(meta, "r+b").truncate(os.path.getsize(meta) // 2)
    elif kind == "empty-metadata":
        open(meta, "wb").close()
    elif kind == "truncated-shard":
        open(_shard(path), "r+b").truncate(10)
    elif kind == "missing-shard":
        os.unlink(_shard(path))
    elif kind == "overwritten-shard":  # same size, other bytes: loaded silently before (NaN loss)
        with open(_shard(path), "r+b") as f:
            f.seek(os.path.getsize(_shard(path)) // 2)
            f.write(b"\xff" * 16)
    elif kind == "no-checksums":
        os.unlink(os.path.join(path, "hetcomm-checksums.json"))
    return meta if "metadata" in kind else None


@pytest.mark.parametrize("kind", ["random-metadata", "truncated-metadata", "empty-metadata", "truncated-shard",
                                  "missing-shard", "overwritten-shard", "no-checksums"])
def test_damaged_checkpoint_names_the_file(tmp_path, kind):
    root = str(tmp_path / "ck")
    path = save_checkpoint(root, 5, _model())
    blamed = _damage(kind, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(latest_checkpoint(root), _model(1))
    assert isinstance(e.value, HetcommError) and e.value.path is not None
    if blamed is not None:
        assert e.value.path == blamed
    assert "\n" not in str(e.value) and ("earlier step" in str(e.value) or "start fresh" in str(e.value))


def test_other_shapes_and_missing_state_are_named_before_loading(tmp_path):
    root = str(tmp_path / "ck")
    save_checkpoint(root, 5, _model(width=8))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(latest_checkpoint(root), _model(width=16))
    assert e.value.reason == "mismatch" and e.value.key == "model/0.weight" and "(8, 8)" in str(e.value)

    class State:  # a Stateful the checkpoint does not have (a resume that adds --balance)
        def state_dict(self):
            return {"x": torch.zeros(2)}

        def load_state_dict(self, sd):
            pass

    with pytest.raises(CheckpointError) as e:
        load_checkpoint(latest_checkpoint(root), _model(), extras={"balancer": State()})
    assert e.value.reason == "missing-state" and "--balance" in str(e.value)


# -- item 5: a real kill during a save -----------------------------------------------------------

_SAVER = """
import sys, torch
sys.path.insert(0, {repo!r})
from hetcomm.ops.checkpoint import save_checkpoint
torch.manual_seed(1)
model = torch.nn.Linear(2048, 4096)  # 32 MiB: a save takes long enough to be killed inside it
print("saving", flush=True)
for i in range(1000):
    save_checkpoint({root!r}, 4, model)
"""


def test_kill_during_a_save_of_the_same_step_leaves_the_previous_checkpoint_intact(tmp_path):
    root = str(tmp_path / "ck")
    torch.manual_seed(0)
    old_model = torch.nn.Linear(2048, 4096)
    first = save_checkpoint(root, 4, old_model)  # an earlier job's checkpoint of step 4
    before = _tree(first)
    proc = subprocess.Popen([sys.executable, "-c", _SAVER.format(repo=REPO, root=root)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 120
        # Kill as soon as the new save has started writing (its staging directory, or before
        # issue 21 the shards of step-00000004 itself being rewritten).
        while time.monotonic() < deadline:
            names = os.listdir(root)
            if any(n.startswith(".partial-") for n in names) or _tree(first) != before:
                break
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert _tree(first) == before, "the checkpoint 'latest' named was written into"
    path = latest_checkpoint(root)
    model = torch.nn.Linear(2048, 4096)
    load_checkpoint(path, model)  # verifies every file first
    torch.manual_seed(1)
    new_model = torch.nn.Linear(2048, 4096)
    assert any(torch.equal(model.weight, m.weight) for m in (old_model, new_model))
    # The next save cleans up what the killed one left.
    save_checkpoint(root, 5, model)
    assert not any(n.startswith(".partial-") for n in os.listdir(root))


# -- CLI: exit 2, one line; nothing left to train --------------------------------------------------


def _train(ck, *extra, timeout=300):
    # demo_run trained with balance=False: resumes that are not about --balance say --no-balance
    cmd = [sys.executable, "-m", "hetcomm.cli.main", "train", "--config", TINY, "--checkpoint-dir", ck, "--resume",
           *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_train_resume_from_damaged_or_mismatched_checkpoint_is_exit_2(tmp_path, demo_run):
    ck = str(tmp_path / "ck")
    shutil.copytree(demo_run[2], ck)
    # Resume adding --balance: the checkpoint has no balancer state.
    code, out, err = _train(ck, "--steps", str(STEPS + 4), "--balance")
    assert code == 2 and "Traceback" not in err and "'balancer'" in err and ".metadata" in err, err[-3000:]
    # Overwritten shard bytes: found before loading (before issue 21: loaded, then NaN losses).
    path = latest_checkpoint(ck)
    _damage("overwritten-shard", path)
    code, out, err = _train(ck, "--steps", str(STEPS + 4), "--no-balance")
    assert code == 2 and "Traceback" not in err and "SHA-256" in err and _shard(path) in err, err[-3000:]
    assert [ln for ln in err.splitlines() if "error" in ln] == [ln for ln in err.splitlines() if "SHA-256" in ln]


@pytest.mark.slow
def test_resume_with_nothing_left_to_train_reports_the_recorded_verdict(tmp_path, demo_run):
    ck = str(tmp_path / "ck")
    shutil.copytree(demo_run[2], ck)
    # demo_run's job ran to STEPS and recorded its verdict; a resume at STEPS trains nothing.
    code, out, err = _train(ck, "--steps", str(STEPS), "--no-balance")
    assert "nothing to train" in err and "recorded verdict" in err, err[-3000:]
    assert "hetcomm train summary" not in out and "0.000 -> 0.000" not in out
    assert code in (0, 1)  # the recorded verdict's code
    # --steps below the checkpoint: nothing was trained and no verdict exists for it.
    code, out, err = _train(ck, "--steps", str(STEPS - 4), "--no-balance")
    assert code == 2 and "nothing to train" in err and "Traceback" not in err, err[-3000:]
