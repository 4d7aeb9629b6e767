"""``--keep-checkpoints N``: a checkpoint directory keeps the N newest committed checkpoints,
older ones deleted only once a newer one is complete; 0 keeps all. A real ``hetcomm train`` run
(4 ranks), and the pruning rule on real checkpoint directories made by ``commit``."""

from __future__ import annotations

import os
import subprocess
import sys

from hetcomm.ops import checkpoint_files as files
from tests.ops.jobs import TINY

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _steps(root) -> list:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def test_train_keeps_the_newest_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "hetcomm.cli.main", "train", "--config", TINY, "--steps", "8", "--checkpoint-dir",
         str(ck), "--checkpoint-every", "2", "--keep-checkpoints", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), (proc.stdout + proc.stderr)[-3000:]  # the tiny job's loss verdict
    assert _steps(ck) == ["step-00000006", "step-00000008"], os.listdir(ck)
    assert (ck / "latest").read_text().strip() == "step-00000008"
    files.verify_checkpoint(str(ck / "step-00000008"))  # what is left is complete


def _save(root: str, step: int, keep: int) -> str:
    staging = files.begin_staging(root, step)
    with open(os.path.join(staging, ".metadata"), "wb") as f:
        f.write(b"m%d" % step)
    return files.commit(root, staging, step, keep)


def test_prune_deletes_older_committed_checkpoints_only_after_a_newer_one(tmp_path):
    root = files.prepare_root(str(tmp_path / "ck"))
    for step in (2, 4, 6):
        _save(root, step, keep=0)
    assert _steps(root) == ["step-00000002", "step-00000004", "step-00000006"]  # 0: all kept
    # Not candidates: a directory without checksums (not committed by hetcomm), a link, a save in
    # progress (.partial-), and the resume's own: only committed step directories go.
    os.mkdir(os.path.join(root, "step-00000001"), 0o700)
    os.symlink(os.path.join(root, "step-00000002"), os.path.join(root, "step-00000003"))
    _save(root, 8, keep=2)
    assert _steps(root) == ["step-00000001", "step-00000003", "step-00000006", "step-00000008"]
    # A resume from an earlier step: the newest commits stay, whatever their step numbers.
    files.write_private(os.path.join(root, "latest"), "step-00000006\n")
    made = _save(root, 8, keep=2)  # step-00000008 exists: this one is step-00000008.1
    assert os.path.basename(made) == "step-00000008.1"
    assert _steps(root) == ["step-00000001", "step-00000003", "step-00000008", "step-00000008.1"]
    files.verify_checkpoint(made)
