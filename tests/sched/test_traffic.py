"""Traffic matrices and the size/skew parsers the CLI uses."""

from __future__ import annotations

import pytest

from hetcomm.errors import UsageError
from hetcomm.sched.traffic import format_bytes, from_splits, make_traffic, parse_size, parse_skew, uniform, zipf


@pytest.mark.parametrize(
    "text, value",
    [("4096", 4096), ("64K", 65536), ("64M", 64 << 20), ("256MiB", 256 << 20), ("1.5G", 3 << 29), ("1mb", 1 << 20)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "M", "-1M", "1X", "0", "64 M B", "1e6"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError, match="bad size"):
        parse_size(text)


def test_parse_skew():
    assert parse_skew("uniform") == ("uniform", 0.0)
    assert parse_skew("zipf:1.2") == ("zipf", 1.2)
    assert parse_skew("ZIPF: 0.5") == ("zipf", 0.5)
    for bad in ("zipf", "zipf:", "zipf:0", "zipf:-1", "pareto:2", "zipf:a"):
        with pytest.raises(UsageError, match="bad skew"):
            parse_skew(bad)


def test_uniform_rows_sum_exactly_and_spread_the_remainder():
    T = uniform(3, 100)
    assert T.sum(axis=1).tolist() == [100, 100, 100]
    assert sorted(T[0].tolist()) == [33, 33, 34]
    assert (uniform(4, 64 << 20) == (16 << 20)).all()
    assert (uniform(3, 1001, align_bytes=4)[0] % 4).tolist().count(0) >= 2


def test_zipf_is_skewed_seeded_and_exact():
    a = zipf(16, 1 << 20, 1.2, seed=3)
    assert (a.sum(axis=1) == 1 << 20).all()
    assert (a == zipf(16, 1 << 20, 1.2, seed=3)).all()
    assert not (a == zipf(16, 1 << 20, 1.2, seed=4)).all()
    col = a[0]
    # the hottest rank gets 1 / H(16, 1.2) of the bytes, the coldest 16**-1.2 of that
    h = sum(k ** -1.2 for k in range(1, 17))
    assert abs(col.max() - (1 << 20) / h) <= 1
    assert abs(col.min() - (1 << 20) / h * 16 ** -1.2) <= 1
    assert (make_traffic(16, 1 << 20, "zipf:1.2", seed=3) == a).all()


def test_from_splits_validates():
    assert from_splits([[0, 1], [2, 3]]).tolist() == [[0, 1], [2, 3]]
    with pytest.raises(UsageError, match="row 1 has 1 entries"):
        from_splits([[0, 1], [2]])
    with pytest.raises(UsageError, match=r"split_bytes\[0\]\[1\] = -1"):
        from_splits([[0, -1], [2, 3]])
    with pytest.raises(UsageError, match="whole numbers"):
        from_splits([[0, 1.5], [2, 3]])


def test_format_bytes():
    assert format_bytes(64 << 20) == "64 MiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"
