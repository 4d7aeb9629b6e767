"""Bounded input reads (issue 14 item 9): captures larger than the cap, endless devices, gzip
bombs and FIFOs — refused or read within the documented cap, never read until memory runs out."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import threading
import tracemalloc

import pytest

from hetcomm.errors import SettingError

from hetcomm._input import CAPTURE_CAP_ENV, MAX_CAPTURE_BYTES, read_bounded
from hetcomm.cli.main import main
from hetcomm.errors import TopologyParseError, UsageError
from hetcomm.topo.parse import parse_file

from tests.conftest import FIXTURES

TOPO = os.path.join(FIXTURES, "nvsmi_topo_h800_nv8_mlx5_bond.txt")
NCCL_LOG = os.path.join(FIXTURES, "nccl_log_g6e_l40s_shm.txt")


def test_dev_zero_is_refused_at_once(capsys):
    # Before: read until the kernel's OOM killer stopped it at 24 GB.
    assert main(["topo", "-i", "/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert "/dev/zero: is a character device, not a regular file" in err


def test_a_50_mb_capture_is_refused_before_a_byte_is_read(tmp_path):
    # Before: 22 s and 1.1 GB. A sparse file: its size is known from fstat, nothing is read.
    path = tmp_path / "big.log"
    with open(path, "wb") as f:
        f.truncate(50_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(TopologyParseError, match="larger than the 16 MiB hetcomm reads") as e:
            parse_file(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes"
    assert CAPTURE_CAP_ENV in str(e.value) and e.value.path == str(path)


def test_the_cap_is_exact_and_configurable(tmp_path, monkeypatch):
    data = open(NCCL_LOG, "rb").read()
    path = tmp_path / "nccl.log"
    path.write_bytes(data)
    monkeypatch.setenv(CAPTURE_CAP_ENV, str(len(data)))
    assert "nccl-log" in parse_file(str(path)).facts["formats"]
    monkeypatch.setenv(CAPTURE_CAP_ENV, str(len(data) - 1))
    with pytest.raises(TopologyParseError, match="larger than"):
        parse_file(str(path))
    monkeypatch.setenv(CAPTURE_CAP_ENV, "lots")
    # read through the settings registry: a bad value is its SettingError, naming the variable
    with pytest.raises(SettingError, match=CAPTURE_CAP_ENV):
        parse_file(str(path))
    monkeypatch.delenv(CAPTURE_CAP_ENV)
    assert MAX_CAPTURE_BYTES == 16 << 20


def test_gzip_output_is_capped_too(tmp_path, monkeypatch):
    monkeypatch.setenv(CAPTURE_CAP_ENV, "64K")
    bomb = tmp_path / "bomb.log.gz"
    bomb.write_bytes(gzip.compress(b"NCCL INFO x\n" * 100_000))  # 1.2 MB from ~3 KB
    with pytest.raises(TopologyParseError, match="decompressed capture is larger than the 64 KiB"):
        parse_file(str(bomb))
    good = tmp_path / "topo.txt.gz"
    good.write_bytes(gzip.compress(open(TOPO, "rb").read()))
    assert parse_file(str(good)).facts["formats"][0] == "nvsmi-topo"
    cut = tmp_path / "cut.txt.gz"
    cut.write_bytes(good.read_bytes()[:-20])
    with pytest.raises(TopologyParseError, match="corrupt gzip file"):
        parse_file(str(cut))


def test_stdin_is_read_up_to_the_cap():
    def fail(message, path):
        return TopologyParseError(message, path=path)

    assert read_bounded("-", limit=4, error=fail, stdin=io.BytesIO(b"abcd")) == b"abcd"
    with pytest.raises(TopologyParseError, match="<stdin>: capture is larger than the 4 B"):
        read_bounded("-", limit=4, error=fail, what="capture", stdin=io.BytesIO(b"abcde"))


def test_endless_stdin_through_the_cli_stops_at_the_cap(monkeypatch, capsys):
    monkeypatch.setenv(CAPTURE_CAP_ENV, "1M")
    zeros = subprocess.Popen(["cat", "/dev/zero"], stdout=subprocess.PIPE)  # a pipe that never ends
    try:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(zeros.stdout))
        assert main(["topo", "-i", "-"]) == 2
    finally:
        zeros.kill()
        zeros.wait()
    assert "<stdin>: capture is larger than the 1 MiB" in capsys.readouterr().err


def test_a_fifo_is_read(tmp_path):
    fifo = tmp_path / "topo.fifo"
    os.mkfifo(fifo)
    data = open(TOPO, "rb").read()

    def writer():
        with open(fifo, "wb") as f:
            f.write(data)

    t = threading.Thread(target=writer)
    t.start()
    try:
        topo = parse_file(str(fifo))
    finally:
        t.join(timeout=30)
    assert topo.facts["formats"][0] == "nvsmi-topo" and len(topo.devices) == 8
