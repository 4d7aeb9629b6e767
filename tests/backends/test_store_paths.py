"""Paths read from the store are opened only if a hetcomm peer could have made them (issue 14
item 3): the shm rail's segment and a peer's doorbell FIFO must sit directly in /dev/shm under
the expected name, be no link, have the right type, belong to this user and be private.

Anyone who can write to the TCPStore could otherwise make a rank open any file as its user: the
shm rail maps a path ``O_RDWR`` (and writes ring counters into it), the doorbell writes a byte
into a path ``O_WRONLY``. Each test plants such a path in a real in-process store and checks that
the victim file is unchanged and the error names the path.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from hetcomm.backends.doorbell import Doorbell
from hetcomm.backends.rails.shm import SHM_DIR, map_segment
from hetcomm.errors import CollectiveError

NOBODY = 65534
TIMEOUT = timedelta(seconds=2)
SIZE = 4096


def _victim(tmp_path) -> str:
    path = tmp_path / "victim"
    path.write_bytes(b"A" * SIZE)
    return str(path)


def _shm_name(kind: str) -> str:
    middle = "bell-" if kind == "bell" else ""
    return os.path.join(SHM_DIR, f"hetcomm-{middle}{os.getpid()}-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def planted():
    """Paths in /dev/shm that the test plants; removed afterwards."""
    made = []
    yield made
    for p in made:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _segment_case(case: str, victim: str, planted) -> str:
    if case == "outside":
        return victim
    if case == "traversal":
        return os.path.join(SHM_DIR, "..", os.path.relpath(victim, "/dev"))
    path = _shm_name("segment")
    planted.append(path)
    if case == "symlink":
        os.symlink(victim, path)
    elif case == "fifo":
        os.mkfifo(path, 0o600)
    elif case == "other-user":
        with open(path, "wb") as f:
            f.write(b"B" * SIZE)
        os.chmod(path, 0o600)
        os.chown(path, NOBODY, NOBODY)
    elif case == "world-readable":
        with open(path, "wb") as f:
            f.write(b"B" * SIZE)
        os.chmod(path, 0o644)
    elif case == "short":
        with open(path, "wb") as f:
            f.write(b"B" * (SIZE // 2))
        os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize(
    "case", ["outside", "traversal", "symlink", "fifo", "other-user", "world-readable", "short"]
)
def test_shm_segment_from_store_is_checked(tmp_path, planted, case):
    victim = _victim(tmp_path)
    path = _segment_case(case, victim, planted)
    store = dist.HashStore()
    store.set("k/name", path)
    with pytest.raises(CollectiveError) as e:
        mm = map_segment(store, "k", 1, [0, 1], SIZE, TIMEOUT)
        mm[:8] = b"CORRUPT!"  # what the ring's counters would do to a mapped file
        mm.close()
    assert e.value.rail == "shm" and e.value.peer == 0
    assert path in str(e.value)
    if case == "other-user":
        assert "owned by" in str(e.value)
    with open(victim, "rb") as f:
        assert f.read() == b"A" * SIZE
    assert not store.check(["k/attached/1"])


def test_shm_segment_made_by_a_peer_is_accepted(planted):
    """Positive control: a segment as the leader makes it maps, and the follower says so."""
    path = _shm_name("segment")
    planted.append(path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, SIZE)
    os.close(fd)
    store = dist.HashStore()
    store.set("k/name", path)
    mm = map_segment(store, "k", 1, [0, 1], SIZE, TIMEOUT)
    assert len(mm) == SIZE and store.check(["k/attached/1"])
    mm.close()


def _bell_case(case: str, victim: str, planted) -> str:
    if case == "outside":
        return victim
    path = _shm_name("bell")
    planted.append(path)
    if case == "symlink":
        os.symlink(victim, path)
    elif case == "regular":
        with open(path, "wb") as f:
            f.write(b"B")
        os.chmod(path, 0o600)
    elif case == "other-user":
        os.mkfifo(path, 0o600)
        os.chown(path, NOBODY, NOBODY)
    return path


@pytest.mark.parametrize("case", ["outside", "symlink", "regular", "other-user"])
def test_doorbell_path_from_store_is_checked(tmp_path, planted, case):
    victim = _victim(tmp_path)
    path = _bell_case(case, victim, planted)
    store = dist.HashStore()
    # Rank 1 "published" its doorbell and reported it opened ours: setup would complete.
    store.set("b/path/1", path)
    store.set("b/opened/1", "1")
    with pytest.raises(CollectiveError) as e:
        bell = Doorbell(store, "b", 0, [0, 1], TIMEOUT)
        bell.ring(1)  # the byte that used to land in the victim file
        bell.close()
    assert e.value.rail == "shm" and e.value.peer == 1
    assert path in str(e.value)
    if case == "other-user":
        assert "owned by" in str(e.value)
    with open(victim, "rb") as f:
        assert f.read() == b"A" * SIZE
    if case == "regular":
        with open(path, "rb") as f:
            assert f.read() == b"B"
