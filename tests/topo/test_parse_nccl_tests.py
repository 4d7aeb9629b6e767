"""Tests for hetcomm.topo.parse.nccl_tests on the B300 alltoall fixture and synthetic layouts."""

from __future__ import annotations

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.parse import nccl_tests
from hetcomm.topo.parse.nccl_tests import (
    busbw_factor,
    normalize_op,
    parse_nccl_tests,
    sniff_nccl_tests,
)

FIXTURE = "nccltests_alltoall_perf_b300_1node_2node.txt"


def _read(fixture_path, name: str) -> str:
    with open(fixture_path(name), encoding="utf-8") as f:
        return f.read()


def test_b300_two_blocks(fixture_path):
    text = _read(fixture_path, FIXTURE)
    assert sniff_nccl_tests(text)
    topo = parse_nccl_tests(text, "b300.txt")
    ms = topo.measurements
    assert len(ms) == 4  # one row per block, out-of-place and in-place
    assert [m.op for m in ms] == ["alltoall"] * 4
    assert [m.in_place for m in ms] == [False, True, False, True]
    assert [m.num_ranks for m in ms] == [8, 8, 16, 16]
    first = ms[0]
    assert (first.size_bytes, first.count, first.dtype, first.redop, first.root) == (
        8589934592,
        268435456,
        "float",
        "none",
        -1,
    )
    assert (first.time_us, first.algbw_gbps, first.busbw_gbps, first.wrong) == (
        11126.0,
        772.06,
        675.55,
        0,
    )
    assert ms[1].wrong is None  # in-place #wrong is N/A
    assert (ms[2].time_us, ms[2].algbw_gbps, ms[2].busbw_gbps) == (44498.0, 193.04, 180.98)
    assert {m.source for m in ms} == {"b300.txt"}
    assert topo.facts["formats"] == ["nccl-tests"]


def test_b300_bandwidth_formulas_hold(fixture_path):
    """busbw = algbw * (n-1)/n for alltoall, with n from the fixture's own description (8 ranks
    on one node, 16 on two), and algbw = size / time."""
    text = _read(fixture_path, FIXTURE)
    ranks_per_block = [8, 8, 16, 16]  # ground truth from the fixture header, per measurement
    for m, n in zip(parse_nccl_tests(text).measurements, ranks_per_block):
        assert m.busbw_gbps == pytest.approx(m.algbw_gbps * (n - 1) / n, abs=0.01)
        # time is printed in whole microseconds, so algbw agrees to that rounding (~5e-5).
        assert m.algbw_gbps == pytest.approx(m.size_bytes / (m.time_us * 1e-6) / 1e9, rel=1e-4)
        # size = count * sizeof(float) * nranks for alltoall.
        assert m.size_bytes == m.count * 4 * n


# synthetic: two old-layout blocks (nccl-tests#78 era: no root column, "error" instead of
# "#wrong", alltoall rows with a blank redop cell), each preceded by its command line.
OLD_LAYOUT = """\
$ mpirun -np 16 ./build/all_reduce_perf -b 256M -e 512M -f 2
# nThread 1 nGpus 1 minBytes 268435456 maxBytes 536870912 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
#                                                       out-of-place                       in-place
#       size         count      type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                       (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
   268435456      67108864     float     sum    20000   13.42   25.16  2e-06    20010   13.42   25.15  2e-06
   536870912     134217728     float     sum    39000   13.77   25.81  0e+00    39010   13.76   25.80  0e+00
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 25.48
$ mpirun -np 16 ./build/alltoall_perf -b 256M -e 512M -f 2
# nThread 1 nGpus 1 minBytes 268435456 maxBytes 536870912 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
#                                                       out-of-place                       in-place
#       size         count      type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                       (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
   268435456       4194304     float            30000    8.95    8.39  0e+00    30020    8.94    8.38  0e+00
   536870912       8388608     float            59000    9.10    8.53  0e+00    59050    9.09    8.52  0e+00
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 8.45
"""


def test_old_layout_keyed_on_header():
    assert sniff_nccl_tests(OLD_LAYOUT)
    ms = parse_nccl_tests(OLD_LAYOUT).measurements
    assert len(ms) == 8
    allreduce, alltoall = ms[:4], ms[4:]
    assert {m.op for m in allreduce} == {"allreduce"} and {m.op for m in alltoall} == {"alltoall"}
    assert allreduce[0].redop == "sum" and allreduce[0].root is None
    assert alltoall[0].redop is None  # the blank cell
    assert (alltoall[0].time_us, alltoall[0].algbw_gbps, alltoall[0].busbw_gbps) == (
        30000.0,
        8.95,
        8.39,
    )
    # "error" is a max deviation: 0 means nothing wrong; 2e-06 is not a count of wrong values.
    assert [m.wrong for m in allreduce] == [None, None, 0, 0]
    # No Rank lines: n solved from busbw = algbw*2(n-1)/n and algbw*(n-1)/n, both give 16.
    assert {m.num_ranks for m in ms} == {16}


RANKS = """\
[1,0]<stdout>:# nccl-tests version 2.17.8 nccl-headers=23004 nccl-library=23004
[1,0]<stdout>:# Collective test starting: all_gather_perf
[1,0]<stdout>:# nThread 1 nGpus 1 minBytes 1048576 maxBytes 2097152 step: 2(factor) warmup iters: 1 iters: 10 agg iters: 1 validation: 1 graph: 0
[1,0]<stdout>:#
[1,0]<stdout>:# Using devices
[1,0]<stdout>:#  Rank  0 Group  0 Pid  11111 on     node-a device  0 [0000:4e:00] NVIDIA H800
[1,0]<stdout>:#  Rank  1 Group  0 Pid  11112 on     node-a device  1 [0000:5f:00] NVIDIA H800
[1,0]<stdout>:#  Rank  2 Group  0 Pid  22221 on     node-b device  0 [0000:4e:00] NVIDIA H800
[1,0]<stdout>:#
[1,0]<stdout>:#                                                              out-of-place                       in-place
[1,0]<stdout>:#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
[1,0]<stdout>:#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
[1,0]<stdout>:     1048576         87381     float    none      -1    40.00   26.21   19.66      0    39.50   26.55   19.91      0
[1,0]<stdout>:     2097152        174762     float    none      -1    70.00   29.96   22.47      0    69.00   30.39   22.79      0
[1,0]<stdout>:# Out of bounds values : 0 OK
[1,0]<stdout>:# Avg bus bandwidth    : 18.85
[1,0]<stdout>:#
[1,0]<stdout>:# Collective test concluded: all_gather_perf
"""  # synthetic: 3 ranks on 2 hosts, mpirun --tag-output prefixes; busbw fits n = 4 on purpose


def test_rank_lines_and_mpi_prefixes():
    topo = parse_nccl_tests(RANKS)
    ms = topo.measurements
    assert len(ms) == 4 and {m.op for m in ms} == {"allgather"}
    # 3 Rank lines -> 3 ranks; the bandwidths were written to fit n = 4 instead, so the count can
    # only have come from the Rank lines (they outrank the busbw/algbw inference).
    assert {m.num_ranks for m in ms} == {3}
    assert [(d.name, d.host, d.index, d.model) for d in topo.devices] == [
        ("rank0", "node-a", 0, "H800"),
        ("rank1", "node-a", 1, "H800"),
        ("rank2", "node-b", 0, "H800"),
    ]


def test_op_inferred_from_columns_when_never_named():
    # synthetic: header and rows only (a pasted excerpt), allreduce-shaped (size == count * 4).
    text = (
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
        "     1048576        262144     float     sum      -1    50.00   20.97   36.70      0    49.00   21.40   37.45      0\n"
    )
    ms = parse_nccl_tests(text).measurements
    assert {m.op for m in ms} == {"allreduce"}
    assert {m.num_ranks for m in ms} == {8}  # 2*(n-1)/n = 1.75 -> n = 8
    # alltoall/allgather/sendrecv rows look alike: no guess.
    ambiguous = text.replace("  sum", " none").replace("262144", " 32768")
    assert {m.op for m in parse_nccl_tests(ambiguous).measurements} == {"unknown"}


def test_num_ranks_none_when_no_single_n_fits():
    text = (  # synthetic: busbw not any (n-1)/n multiple of algbw
        "# Collective test starting: alltoall_perf\n"
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
        "     1048576        262144     float    none      -1    50.00   20.00   12.34      0    49.00   21.40   13.00      0\n"
    )
    assert {m.num_ranks for m in parse_nccl_tests(text).measurements} == {None}


@pytest.mark.parametrize(
    "name, op",
    [
        ("all_reduce_perf", "allreduce"),
        ("./build/alltoall_perf_mpi", "alltoall"),
        ("reduce_scatter_perf", "reducescatter"),
        ("sendrecv", "sendrecv"),
    ],
)
def test_normalize_op(name, op):
    assert normalize_op(name) == op


def test_busbw_factor():
    assert busbw_factor("alltoall", 8) == pytest.approx(7 / 8)
    assert busbw_factor("allreduce", 16) == pytest.approx(2 * 15 / 16)
    assert busbw_factor("broadcast", 8) is None


# -- errors ------------------------------------------------------------------------------------------


def test_empty_and_headerless():
    with pytest.raises(TopologyParseError, match=r"t.txt:1: empty input"):
        parse_nccl_tests("  \n", "t.txt")
    with pytest.raises(TopologyParseError, match="no nccl-tests result header") as err:
        parse_nccl_tests("# source: x\n# nThread 1 nGpus 8 minBytes 8\nhello\n", "t.txt")
    assert err.value.line == 2


def test_row_before_header():
    text = "# nThread 1 nGpus 8\n 8589934592   268435456     float    none      -1    11126  772.06  675.55      0    11206  766.58  670.76    N/A\n"
    with pytest.raises(TopologyParseError, match="result row before any nccl-tests header") as err:
        parse_nccl_tests(text)
    assert err.value.line == 2


def test_truncated_row_names_line_and_expected_cells(fixture_path):
    lines = _read(fixture_path, FIXTURE).splitlines()
    idx = next(i for i, l in enumerate(lines) if l.startswith(" 8589934592"))
    lines[idx] = lines[idx][:60]  # the run was cut mid-row
    with pytest.raises(TopologyParseError) as err:
        parse_nccl_tests("\n".join(lines), "b300.txt")
    assert err.value.line == idx + 1
    assert "expects 13" in str(err.value)


def test_header_without_rows_is_truncated(fixture_path):
    lines = _read(fixture_path, FIXTURE).splitlines()
    header = next(i for i, l in enumerate(lines) if "algbw" in l and "size" in l)
    with pytest.raises(TopologyParseError, match="not followed by any result row") as err:
        parse_nccl_tests("\n".join(lines[: header + 2]))
    assert err.value.line == header + 1


def test_non_numeric_cell():
    text = (
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
        "     1048576        262144     float     sum      -1    50.00   fast   36.70      0    49.00   21.40   37.45      0\n"
    )
    with pytest.raises(TopologyParseError, match="column 'algbw' holds 'fast'") as err:
        parse_nccl_tests(text)
    assert err.value.line == 2


def test_formats_contract():
    assert [name for name, _, _ in nccl_tests.FORMATS] == ["nccl-tests"]


def test_numbers_after_a_finished_table_are_not_rows(fixture_path):
    # synthetic: a table, its footer, then another tool's numeric output in the same capture.
    text = _read(fixture_path, FIXTURE) + "\n$ numastat -c\n 0  1  2  3\n 12 34 56 78\n"
    assert len(parse_nccl_tests(text).measurements) == 4


def test_every_truncation_parses_or_fails_cleanly(fixture_path):
    text = _read(fixture_path, FIXTURE)
    for cut in range(0, len(text), 23):
        try:
            parse_nccl_tests(text[:cut], "cut.txt")
        except TopologyParseError as err:
            assert err.path == "cut.txt"
