"""The CLI parts of issue 14 item 15 and issue 10's one size parser: bad values fail before any
work with exit 2, and an interrupted benchmark leaves nothing behind."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

from hetcomm.cli import _benchlib as lib
from hetcomm.cli.main import main
from hetcomm.errors import ConfigError, UsageError
from hetcomm.sched import traffic
from hetcomm.topo import audit
from hetcomm.units import MAX_SIZE, format_bytes, parse_size

from tests.conftest import REPO_ROOT

MIXED_MINI = os.path.join(REPO_ROOT, "configs", "clusters", "mixed-mini.yaml")


# -- one size parser, one byte formatter ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [("4096", 4096), ("1.5M", 3 << 19), ("1.5K", 1536), ("64 MiB", 64 << 20), ("1mb", 1 << 20), ("1T", 1 << 40)],
)
def test_every_command_reads_sizes_alike(text, value):
    # Before: simulate read 1.5M, bench refused it, audit and the options each had their own rules.
    assert parse_size(text) == traffic.parse_size(text) == audit.parse_size(text) == lib.parse_bytes(text) == value


@pytest.mark.parametrize(
    "text, needle",
    [
        ("1.5", "1.5 bytes, not a whole number"),
        ("0.1K", "not a whole number"),
        ("99999999999999999999999", "at most 1 TiB"),
        ("1e6", "bad size"),
        ("0", "at least 1 byte"),
        ("-4", "bad size"),
        ("1" + "0" * 40, "bad size"),
    ],
)
def test_sizes_are_refused_not_rounded_or_wrapped(text, needle):
    with pytest.raises(UsageError, match=needle):
        parse_size(text, what="--size")
    with pytest.raises(ConfigError, match=needle):
        parse_size(text, error=ConfigError)
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE


def test_one_byte_formatter():
    assert (format_bytes(12), format_bytes(1536), format_bytes(64 << 20)) == ("12 B", "1.50 KiB", "64 MiB")
    assert format_bytes(3 << 40) == "3 TiB" and format_bytes(float("nan")) == "nan B"
    assert traffic.format_bytes is lib.format_bytes is audit.format_bytes is format_bytes


@pytest.mark.parametrize(
    "size, needle",
    [
        ("99999999999999999999999", "--size: bad size '99999999999999999999999'; must be at most 1 TiB"),
        ("1.5", "--size: bad size '1.5' is 1.5 bytes"),
    ],
)
def test_simulate_size_fails_before_any_work(size, needle, capsys):
    # Before: the first wrapped to a negative size, the second silently became 2 B.
    assert main(["simulate", "--cluster", MIXED_MINI, "--size", size]) == 2
    assert needle in capsys.readouterr().err


def test_steep_zipf_prints_no_numpy_warning(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any RuntimeWarning (overflow in power) fails the run
        assert main(["simulate", "--cluster", MIXED_MINI, "--size", "1M", "--skew", "zipf:1000", "--plans", "flat"]) == 0
    m = traffic.zipf(4, 1 << 20, 1000)
    assert (m.sum(axis=1) == 1 << 20).all() and (m > 0).sum() == 4  # everything to the hottest rank


def test_bench_accepts_fractional_units():
    from hetcomm.cli.bench import add_parser, config_from_args

    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "alltoall", "-b", "1.5M", "-e", "1.5M", "--nprocs", "2"])
    config, num_ranks, spawn = config_from_args(args)
    assert (config.minbytes, num_ranks, spawn) == (3 << 19, 2, True)


@pytest.mark.parametrize("nprocs", ["0", "65", "-3"])
def test_train_nprocs_is_checked(nprocs, capsys):
    # Before: --nprocs 0 silently ran the default 4 ranks.
    assert main(["train", "--nprocs", nprocs, "--steps", "1"]) == 2
    assert f"--nprocs {nprocs}" in capsys.readouterr().err


# -- an interrupted benchmark ----------------------------------------------------------------------


def test_sigterm_leaves_no_bench_directory_or_rank(tmp_path):
    # Before: SIGTERM ended the launcher without unwinding: /tmp/hetcomm-bench-* stayed.
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=REPO_ROOT)
    env.pop("RANK", None)
    env.pop("HETCOMM_CLUSTER", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetcomm.cli.main", "bench", "alltoall", "--nprocs", "2", "--backend", "gloo",
         "-b", "1K", "-e", "1K", "-n", "100000000", "-T", "60"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(str(tmp_path / "hetcomm-bench-*", )) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        assert glob.glob(str(tmp_path / "hetcomm-bench-*")), "the benchmark never started"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGTERM, proc.stderr.read()
    assert glob.glob(str(tmp_path / "hetcomm-bench-*")) == []
    assert _processes_with_env(f"TMPDIR={tmp_path}") == []  # the ranks were stopped too


def _processes_with_env(entry: str) -> list:
    """Pids whose environment holds ``entry`` (this test's TMPDIR marks the benchmark's ranks)."""
    found = []
    for env_file in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(env_file, "rb") as f:
                if entry.encode() in f.read().split(b"\0"):
                    found.append(int(env_file.split("/")[2]))
        except OSError:
            continue  # gone, or another user's
    return found
