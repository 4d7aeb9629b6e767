"""``hetcomm bench``: flag validation (in-process), data patterns, table shape, real 4-rank runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from hetcomm.cli import _benchlib as lib
from hetcomm.cli.main import main
from hetcomm.errors import UsageError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIXED_MINI = os.path.join(REPO_ROOT, "configs", "clusters", "mixed-mini.yaml")
RUN_FLAGS = ["-b", "1K", "-e", "64K", "-f", "4", "-n", "2", "-w", "1", "-c", "1", "--nprocs", "4"]


# -- flag validation: exit code 2 and a message naming the flag, before any process starts ------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["alltoall", "-b", "64K", "-e", "1K"], "-b/--minbytes 64K (65536 B) is larger than -e"),
        (["alltoall", "-b", "1.5"], "-b/--minbytes: bad size '1.5' is 1.5 bytes, not a whole number"),
        (["alltoall", "-e", "-4"], "-e/--maxbytes: bad size '-4'"),
        (["alltoall", "-e", "99999999999999999999999"], "must be at most 1 TiB"),
        (["alltoall", "--nprocs", "65"], "--nprocs 65: at most 64 ranks"),
        (["alltoall", "--nprocs", "0"], "--nprocs 0: need at least 1 rank"),
        (["alltoall", "-J", "/nonexistent/dir/out.json"], "-J/--output_file /nonexistent/dir/out.json: cannot write it"),
        (["alltoall", "-d", "fp8"], "-d/--datatype 'fp8' is not supported"),
        (["alltoall", "-c", "2"], "-c/--check 2"),
        (["alltoall", "-n", "0"], "-n/--iters 0"),
        (["alltoall", "-w", "-1"], "-w/--warmup_iters -1"),
        (["alltoall", "-f", "4", "-i", "1M"], "conflict"),
        (["alltoall", "-f", "0"], "-f/--stepfactor 0"),
        (["alltoall", "-o", "sum"], "alltoall does not reduce"),
        (["allreduce", "-o", "avg"], "-o/--op 'avg'"),
        (
            ["alltoall", "--backend", "gloo", "--rails", "shm"],
            "--rails applies to --backend hetcomm",
        ),
        (["alltoall", "--rails", "shm,tcp"], "unknown rail(s) tcp"),
        (["alltoall", "--backend", "gloo", "--plan", "direct"], "--plan applies"),
        (["alltoall", "--nprocs", "0"], "--nprocs 0"),
        (["alltoall", "--cluster", MIXED_MINI, "--nprocs", "2"], "has 4 ranks but the run has 2"),
        (["alltoall", "--cluster", "/nonexistent/cluster.yaml"], "no such file"),
        (["alltoall", "-b", "1", "-e", "8"], "no size between -b 1 and -e 8"),
        (["alltoall", "-b", "1T", "-e", "1T"], "of memory"),
        (["alltoall", "-T", "0"], "-T/--timeout"),
        (["alltoall", "-b", "1", "-e", "1G", "-i", "1"], "more than 1000"),
    ],
)
def test_bad_flags_exit_2_with_message(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("HETCOMM_CLUSTER", raising=False)
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_nprocs_refused_under_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["bench", "alltoall", "--nprocs", "4"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_unknown_collective_is_argparse_usage_error():
    with pytest.raises(SystemExit) as e:
        main(["bench", "broadcast"])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8", 8),
        ("1K", 1024),
        ("128M", 128 << 20),
        ("1G", 1 << 30),
        ("4kB", 4096),
        ("2MiB", 2 << 20),
    ],
)
def test_parse_bytes(text, expected):
    assert lib.parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(UsageError, match="-e/--maxbytes"):
        lib.parse_bytes("12X", "-e/--maxbytes")


# -- sizes and formulas --------------------------------------------------------------------------


def test_message_sizes_round_alltoall_counts_to_peers():
    cfg = lib.BenchConfig("alltoall", minbytes=1024, maxbytes=65536, stepfactor=4)
    assert lib.message_sizes(cfg, 4) == [(1024, 256), (4096, 1024), (16384, 4096), (65536, 16384)]
    # 3 ranks: 256 floats -> 255 (85 per peer), and the printed size follows the count.
    assert lib.message_sizes(cfg, 3)[0] == (1020, 255)


def test_message_sizes_additive_step_and_dedup():
    cfg = lib.BenchConfig(
        "allreduce", minbytes=0, maxbytes=12, stepfactor=1, stepbytes=2, datatype="int32"
    )
    # 0 B holds no element; 2 B and 6 B round down to the counts of 0 B and 4 B.
    assert lib.message_sizes(cfg, 4) == [(4, 1), (8, 2), (12, 3)]


def test_bus_factor():
    assert lib.bus_factor("alltoall", 4) == pytest.approx(0.75)
    assert lib.bus_factor("allreduce", 4) == pytest.approx(1.5)
    assert lib.bus_factor("alltoall", 1) == 0.0


# -- data patterns: what #wrong checks -----------------------------------------------------------


def _alltoall_by_hand(inputs, num_ranks):
    """Rank r receives block r of every rank's input, in source order."""
    return [torch.cat([inp.chunk(num_ranks)[r] for inp in inputs]) for r in range(num_ranks)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float16])
def test_alltoall_pattern_detects_corruption_and_misrouting(dtype):
    n, count = 4, 4 * 50
    cfg = lib.BenchConfig("alltoall", datatype="float")
    inputs = [lib.alltoall_input(r, n, count, dtype) for r in range(n)]
    outputs = _alltoall_by_hand(inputs, n)
    for r in range(n):
        assert torch.equal(outputs[r], lib.alltoall_expected(r, n, count, dtype))
        assert lib.count_wrong(cfg, r, n, outputs[r]) == 0
    corrupted = outputs[2].clone()
    corrupted[7] += 1
    assert lib.count_wrong(cfg, 2, n, corrupted) == 1
    # Blocks from sources 0 and 1 swapped: every element of both blocks is wrong.
    b = count // n
    swapped = torch.cat([outputs[1][b : 2 * b], outputs[1][:b], outputs[1][2 * b :]])
    assert lib.count_wrong(cfg, 1, n, swapped) == 2 * b
    # The aliasing bug gloo shows (rank receives its own input back) is caught.
    assert lib.count_wrong(cfg, 1, n, inputs[1]) > 0


@pytest.mark.parametrize(
    "redop, reduce", [("sum", torch.sum), ("max", torch.amax), ("min", torch.amin)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64])
def test_allreduce_pattern_matches_reduction(redop, reduce, dtype):
    n, count = 5, 31
    cfg = lib.BenchConfig("allreduce", datatype="float", redop=redop)
    stacked = torch.stack([lib.allreduce_input(r, count, torch.int64) for r in range(n)])
    result = reduce(stacked, dim=0).to(dtype)
    assert torch.equal(result, lib.allreduce_expected(n, count, redop, dtype))
    assert lib.count_wrong(cfg, 0, n, result) == 0
    result[3] += 1
    assert lib.count_wrong(cfg, 0, n, result) == 1


# -- table shape on a synthetic result ------------------------------------------------------------


def _synthetic_result(collective="alltoall", n=4):
    cfg = lib.BenchConfig(
        collective,
        minbytes=1024,
        maxbytes=4096,
        stepfactor=4,
        iters=3,
        redop="none" if collective == "alltoall" else "sum",
    )
    sizes = lib.message_sizes(cfg, n)
    per_rank = []
    for r in range(n):
        rows = [
            {
                "size": s,
                "count": c,
                "out_of_place": {"seconds": 1e-3 * (r + 1) * (i + 1), "wrong": 0},
                "in_place": {"seconds": 2e-3 * (i + 1), "wrong": 1 if (r, i) == (2, 1) else 0},
            }
            for i, (s, c) in enumerate(sizes)
        ]
        per_rank.append(
            {
                "info": {
                    "rank": r,
                    "pid": 100 + r,
                    "host": "h",
                    "device": r,
                    "torch_device": "cpu",
                    "model": None,
                    "node": None,
                    "label_only": False,
                },
                "rows": rows,
                "rails": None,
            }
        )
    return lib._merge(cfg, n, per_rank)


def test_merge_takes_max_over_ranks_and_applies_busbw_formula():
    result = _synthetic_result("alltoall", 4)
    row = result["rows"][1]  # 4096 B; rank 3 is the slowest out-of-place: 4 * 2 ms
    assert row["out_of_place"]["time_us"] == pytest.approx(8000.0)
    assert row["out_of_place"]["algbw_gbps"] == pytest.approx(4096 / 8e-3 / 1e9)
    assert row["out_of_place"]["busbw_gbps"] == pytest.approx(
        row["out_of_place"]["algbw_gbps"] * 0.75
    )
    assert row["in_place"]["wrong"] == 1 and result["out_of_bounds"] == 1
    busbws = [r[k]["busbw_gbps"] for r in result["rows"] for k in ("out_of_place", "in_place")]
    assert result["avg_busbw_gbps"] == pytest.approx(sum(busbws) / len(busbws))
    allreduce = _synthetic_result("allreduce", 4)["rows"][0]["out_of_place"]
    assert allreduce["busbw_gbps"] == pytest.approx(allreduce["algbw_gbps"] * 1.5)


def test_table_columns_align_with_nccl_tests_header():
    text = lib.format_table(_synthetic_result())
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("#       size"))
    ends = [m.end() for m in re.finditer(r"\S+", lines[header])][1:]
    rows = [ln for ln in lines if ln and not ln.startswith("#")]
    assert len(rows) == 2
    for row in rows:
        tokens = list(re.finditer(r"\S+", row))
        assert [t.end() for t in tokens] == ends
    assert rows[1].split()[-1] == "1"  # in-place #wrong of the 4096 B row
    assert "# Out of bounds values : 1 FAILED" in lines
    assert lines[-1] == "# Collective test concluded: alltoall_perf"


def test_json_flag_prints_the_result_document(capsys):
    import argparse

    from hetcomm.cli import bench

    result = _synthetic_result()
    bench._emit(result, argparse.Namespace(json=True, output_file=None))
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))


# -- real runs: 4 processes ------------------------------------------------------------------------


def _run_cli(args, tmp_path, timeout=150):
    out_json = tmp_path / "result.json"
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("HETCOMM_CLUSTER", None)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hetcomm", "bench", *args, "-J", str(out_json)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return (
        proc,
        (json.loads(out_json.read_text()) if out_json.exists() else None),
        time.monotonic() - t0,
    )


def _check_table_against_json(stdout, doc, num_ranks, factor):
    lines = stdout.splitlines()
    rank_lines = [ln for ln in lines if ln.startswith("#  Rank ")]
    assert len(rank_lines) == num_ranks
    rows = [ln.split() for ln in lines if ln and not ln.startswith("#")]
    assert [int(r[0]) for r in rows] == [1024, 4096, 16384, 65536]
    assert len(doc["rows"]) == len(rows)
    for cols, row in zip(rows, doc["rows"]):
        assert len(cols) == 13
        size, count = int(cols[0]), int(cols[1])
        assert (cols[2], cols[3], cols[4]) == ("float", "none", "-1")
        assert count * 4 == size and count % num_ranks == 0
        for offset, block in ((5, row["out_of_place"]), (9, row["in_place"])):
            # time max over ranks; algbw = size / time; busbw = algbw * (n-1)/n.
            assert block["time_us"] == pytest.approx(max(block["time_us_per_rank"]))
            assert block["algbw_gbps"] == pytest.approx(size / (block["time_us"] * 1e-6) / 1e9)
            assert block["busbw_gbps"] == pytest.approx(block["algbw_gbps"] * factor)
            assert float(cols[offset]) == pytest.approx(block["time_us"], rel=1e-2, abs=0.01)
            assert float(cols[offset + 2]) == pytest.approx(block["busbw_gbps"], abs=0.006)
            assert cols[offset + 3] == "0" and block["wrong"] == 0
    assert "# Out of bounds values : 0 OK" in lines
    avg = next(ln for ln in lines if ln.startswith("# Avg bus bandwidth"))
    assert float(avg.split(":")[1]) == pytest.approx(doc["avg_busbw_gbps"], rel=1e-4)


@pytest.mark.timeout(120)
def test_full_output_device_is_one_error_line_exit_2(tmp_path):
    # Through a link to /dev/full (the write fails with ENOSPC, like a full disk): a regression
    # that unlinks the -J path then removes the link, not the machine's /dev/full.
    link = tmp_path / "out.json"
    link.symlink_to("/dev/full")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HETCOMM_CLUSTER")}
    proc = subprocess.run(
        [sys.executable, "-m", "hetcomm", "bench", "alltoall", "--nprocs", "2", "--backend", "gloo", "-b", "8",
         "-e", "8", "-n", "1", "-w", "0", "-J", str(link)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"-J/--output_file {link}: cannot write it (No space left on device)" in proc.stderr
    assert "# Out of bounds values : 0 OK" in proc.stdout  # the table is not lost
    assert link.is_symlink()  # only a regular file the run never filled is removed


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    return _run_cli(["alltoall", *RUN_FLAGS, "--backend", "gloo"], tmp_path_factory.mktemp("gloo"))


@pytest.mark.timeout(180)
def test_real_alltoall_gloo_4_ranks(gloo_run):
    proc, doc, seconds = gloo_run
    assert proc.returncode == 0, proc.stderr
    _check_table_against_json(proc.stdout, doc, 4, 0.75)
    assert doc["num_ranks"] == 4 and doc["config"]["backend"] == "gloo"
    assert len({r["pid"] for r in doc["ranks"]}) == 4  # four real processes
    assert "hetcomm bench: alltoall 64 KiB done (4/4 sizes" in proc.stderr


@pytest.mark.timeout(180)
def test_real_alltoall_hetcomm_4_ranks_labels(tmp_path):
    proc, doc, _ = _run_cli(
        ["alltoall", *RUN_FLAGS, "--backend", "hetcomm", "--cluster", MIXED_MINI], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    _check_table_against_json(proc.stdout, doc, 4, 0.75)
    assert "# Device kinds are labels" in proc.stdout
    assert [r["model"] for r in doc["ranks"]] == [
        "A100-SXM4-80GB",
        "A100-SXM4-80GB",
        "H800",
        "910B",
    ]
    # Rank 0's peers reach it over at least two different rails on the mixed-mini cluster.
    sent = [rail for rail, c in doc["rails"][0].items() if c.get("bytes_sent", 0) > 0]
    assert len(sent) >= 2, doc["rails"]


def test_nccl_tests_parser_reads_our_table(gloo_run):
    parser = pytest.importorskip("hetcomm.topo.parse.nccl_tests")
    proc, doc, _ = gloo_run
    assert proc.returncode == 0, proc.stderr
    topo = parser.parse_nccl_tests(proc.stdout, path="<hetcomm bench>")
    got = sorted((m.size_bytes, m.in_place, m.op, m.num_ranks, m.wrong) for m in topo.measurements)
    want = sorted(
        (r["size"], in_place, "alltoall", 4, 0) for r in doc["rows"] for in_place in (False, True)
    )
    assert got == want
    for m in topo.measurements:
        block = next(r for r in doc["rows"] if r["size"] == m.size_bytes)
        block = block["in_place" if m.in_place else "out_of_place"]
        assert m.busbw_gbps == pytest.approx(block["busbw_gbps"], abs=0.006)
    assert sorted(d.name for d in topo.devices) == [f"rank{r}" for r in range(4)]


# -- failures: a rank that raises makes the launch fail with its error, never hang -----------------


def failing_rank(payload, rank, world_size, store):
    """launch_ranks target: rank 1 raises after the group is up; the others wait on a barrier."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=20),
    )
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()
    dist.barrier()
    return {"unreachable": True}


@pytest.mark.timeout(120)
def test_failing_rank_is_reported_first_and_nothing_hangs():
    t0 = time.monotonic()
    outcome = lib.launch_ranks(
        "tests.cli.test_bench_cli:failing_rank",
        "{}",
        2,
        timeout_s=20,
        env={"PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
        grace_s=5,
    )
    assert not outcome.ok and outcome.result is None
    first = outcome.failures[0]
    assert (first.rank, first.error_type) == (1, "ValueError")
    assert "deliberate failure on rank 1" in first.message and not first.is_timeout
    assert time.monotonic() - t0 < 90


def crash_at_exit(payload, rank, world_size, store):
    """launch_ranks target: finishes normally, then rank 1 aborts while the interpreter exits."""
    import atexit

    if rank == 1:
        atexit.register(os.abort)
    return {"rank0": rank}


@pytest.mark.timeout(300)
def test_crash_after_finishing_is_reported_not_hidden():
    # A generous launch limit: at load 40 two ranks importing torch took longer than 20 s, and a
    # run stopped at its limit reports the limit, not the crash this test is about.
    outcome = lib.launch_ranks(
        "tests.cli.test_bench_cli:crash_at_exit",
        "{}",
        2,
        timeout_s=200,
        env={"PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert outcome.ok and outcome.result == {"rank0": 0}
    assert [(w.rank, w.message) for w in outcome.exit_warnings] == [(1, "killed by SIGABRT")]


def silent_rank(payload, rank, world_size, store):
    """launch_ranks target: rank 1 never joins the barrier; rank 0 must time out, not hang."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=3),
    )
    if rank == 1:
        time.sleep(600)
    dist.barrier()
    return {}


@pytest.mark.timeout(300)
def test_silent_rank_times_out_and_is_stopped():
    # Outcomes, not timings: rank 0's own 3 s group timeout must end its wait (is_timeout, not
    # stopped by the launch limit, which is generous so that a loaded machine's slow start does
    # not reach it), and the silent rank is then stopped by the launcher.
    outcome = lib.launch_ranks(
        "tests.cli.test_bench_cli:silent_rank",
        "{}",
        2,
        timeout_s=200,
        env={"PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
        grace_s=2,
    )
    by_rank = {f.rank: f for f in outcome.failures}
    assert by_rank[0].is_timeout and not by_rank[0].killed_by_launcher, by_rank[0]
    assert by_rank[1].killed_by_launcher
    assert outcome.failures[0].rank == 0  # the rank's own error first, the stopped rank last
