"""``hetcomm train``: config errors, and a short real run over the hetcomm backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hetcomm.cli.main import main
from hetcomm.errors import ConfigError
from hetcomm.train.loop import load_train_config

from tests.conftest import REPO_ROOT


def test_unknown_config_key_names_file_line_and_suggestion(tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("steps: 10\nexperst: 4\n")
    with pytest.raises(ConfigError) as info:
        load_train_config(str(bad))
    assert info.value.line == 2 and "did you mean 'experts'" in str(info.value)


def test_bad_value_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "train.yaml"
    bad.write_text("steps: 0\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "train.yaml:1" in capsys.readouterr().err


def test_wrong_process_count_for_the_cluster(capsys):
    assert main(["train", "--nprocs", "3", "--steps", "1"]) == 2
    assert "has 4 ranks but 3 processes" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_short_training_run_over_hetcomm_reports_falling_loss():
    proc = subprocess.run(
        [sys.executable, "-m", "hetcomm", "train", "--steps", "40", "--backend", "hetcomm"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = proc.stdout + proc.stderr
    assert "hetcomm train summary" in out, out[-3000:]
    first, last = [
        float(x) for x in out.split("loss first -> last")[1].split("(")[0].replace("->", " ").split()
    ]
    assert last < first - 1.0, out[-2000:]
    # Per-rail byte counters came from the hetcomm backend, not from a plain gloo group.
    assert "rank0 sent over" in out, out[-2000:]
    assert "labels" in out


# -- issue 21 item 18: train CLI edges ---------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--balance-every", "--balance-cooldown"])
def test_balance_knobs_without_the_balancer_are_refused(flag, capsys):
    assert main(["train", "--steps", "1", flag, "5"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "--balance" in err


def _run_train(tmp_path, *args, config=None):
    cmd = [sys.executable, "-m", "hetcomm", "train", *args]
    if config is not None:
        cfg = tmp_path / "train.yaml"
        cfg.write_text(config)
        cmd += ["--config", str(cfg)]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)


TINY = os.path.join(REPO_ROOT, "tests", "ops", "tiny.yaml")


@pytest.mark.timeout(300)
def test_two_experts_train_with_replication_on(tmp_path):
    # Before: ConfigError moe.replicate_top=3 (the layer's default), a knob the CLI cannot change.
    proc = _run_train(tmp_path, "--config", TINY, "--experts", "2", "--steps", "2", "--replicate")
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1) and "hetcomm train summary" in out, out[-3000:]
    assert "replicate_top" not in out


@pytest.mark.timeout(300)
def test_nan_loss_is_named_in_the_verdict(tmp_path):
    with open(TINY) as f:
        text = f.read().replace("lr: 0.003", "lr: 1.0e+30")  # diverges to inf/NaN within a few steps
    proc = _run_train(tmp_path, "--steps", "6", config=text.replace("configs/clusters", os.path.join(REPO_ROOT, "configs/clusters")))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    verdict = next(ln for ln in proc.stdout.splitlines() if ln.startswith("verdict"))
    assert "nan" in verdict.lower() and "diverged" in verdict, verdict


@pytest.mark.parametrize("argv, says", [
    # Two steps used to run for minutes: 100000 exchanges per layer per step, all but 8 empty.
    (["--chunks", "100000"], "hetcomm train: error: --chunks 100000: more than the 8 experts of a layer"),
    (["--chunks", "9"], "use --chunks 8 or fewer, or --chunks auto"),
    (["--experts", "4", "--chunks", "5"], "--chunks 5: more than the 4 experts of a layer"),
])
def test_chunks_beyond_the_experts_are_refused_before_any_rank_starts(argv, says, capsys):
    assert main(["train", "--steps", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "starting" not in err and len(err.strip().splitlines()) == 1, err


def test_chunks_beyond_the_experts_in_a_config_file_name_the_file_and_key(tmp_path, capsys):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("steps: 2\nexperts: 4\nchunks: 6\n")
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}, key 'chunks': 6 is more than the 4 experts of a layer" in err and "set chunks to 4" in err, err


def test_chunks_up_to_the_experts_pass_the_check():
    from hetcomm.cli.main import build_parser
    from hetcomm.cli.train import train_config

    args = build_parser().parse_args(["train", "--steps", "2", "--chunks", "8"])
    assert train_config(args).chunks == 8
