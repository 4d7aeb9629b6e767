"""``hetcomm bench dispatch`` (issue 23.5): runs on real ranks, and its bytes are hetcomm.stats()'s.

The benchmark computes each rank's logical bytes from the routing alone; the rails' counters of
the same run (``hetcomm.stats()`` over the timed iterations) must equal those row bytes plus the
metadata bytes the dispatch counters report, exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hetcomm.cli.bench_dispatch import FACES, PHASES, routing_weights
from hetcomm.cli.main import main
from hetcomm.errors import UsageError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, timeout=240):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    env.pop("RANK", None)
    env.pop("HETCOMM_CLUSTER", None)
    return subprocess.run(
        [sys.executable, "-m", "hetcomm", "bench", "dispatch", *args], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.timeout(300)
def test_bench_dispatch_nprocs_4_bytes_equal_hetcomm_stats():
    proc = _run(["--nprocs", "4", "--tokens", "96", "--hidden", "24", "--topk", "2", "--routing", "zipf:1.2", "-n", "3", "-w", "1", "--json"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["num_ranks"] == 4 and len(doc["ranks"]) == 4
    iters = doc["config"]["iters"]
    for r in doc["ranks"]:
        phases = r["phases"]
        assert set(phases) == set(PHASES)
        rows_sent = sum(p["send_bytes"] for p in phases.values()) * iters
        rows_recv = sum(p["recv_bytes"] for p in phases.values()) * iters
        counters = r["dispatch_counters"]
        assert counters["bytes_sent"] == rows_sent and counters["bytes_recv"] == rows_recv, r
        assert r["rail_bytes_sent"] == rows_sent + counters["meta_bytes_sent"], r
        for p in phases.values():
            assert p["p50_us"] <= p["p90_us"] <= p["p99_us"] <= p["p999_us"]
            assert p["local_bytes"] >= 0 and p["send_bytes"] > 0
        # dispatch-shaped phases receive what the combine-shaped ones send
        assert phases["dispatch"]["recv_bytes"] == phases["combine"]["send_bytes"]


@pytest.mark.timeout(300)
def test_bench_dispatch_table_on_2_ranks_with_hot_experts():
    proc = _run(["--nprocs", "2", "--tokens", "64", "--hidden", "16", "--routing", "hot:1:0.9", "-n", "2", "-w", "0"])
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert len(rows) == 2 * len(PHASES)
    assert "p999(us)" in proc.stdout and "routing hot:1:0.9" in proc.stdout


@pytest.mark.timeout(300)
def test_bench_dispatch_faces_side_by_side_on_4_ranks():
    """--face: both faces of the token engine in one table, on the same bytes, and a summary line
    per face (its step's median, spread and ratios); the shape, never the timings."""
    faces = ["communicator", "tokenswitch"]
    proc = _run(["--nprocs", "4", "--tokens", "48", "--hidden", "16", "--face", ",".join(faces), "-n", "5", "-w", "1"])
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert len(rows) == 4 * len(faces) * len(PHASES)
    for face in faces:
        mine = [r for r in rows if r[1] == face]
        assert sorted((int(r[0]), r[2]) for r in mine) == sorted((k, p) for k in range(4) for p in PHASES)
    # the same bytes per rank and phase, whichever face moved them (send, recv, local)
    by = {(r[0], r[1], r[2]): r[3:6] for r in rows}
    assert all(by[(r[0], "communicator", r[2])] == by[(r[0], "tokenswitch", r[2])] for r in rows)
    summary = {line.split()[1]: line.split()[2:] for line in proc.stdout.splitlines() if line.startswith("#  ") and line.split()[1] in faces}
    assert set(summary) == set(faces)
    assert all(len(v) == 8 for v in summary.values()), summary
    c = summary["communicator"]
    assert c[4:6] == ["1.000", "1.000"] and c[7] == "1.000"  # the first face is the yardstick
    assert "5 iterations, faces interleaved" in proc.stdout


@pytest.mark.timeout(300)
def test_bench_dispatch_faces_json():
    proc = _run(["--nprocs", "2", "--tokens", "32", "--hidden", "8", "--face", "tokenswitch-expert-major,communicator",
                 "-n", "5", "-w", "0", "--json"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["config"]["faces"] == ["tokenswitch-expert-major", "communicator"]
    assert set(doc["faces"]) == {"tokenswitch-expert-major", "communicator"}
    for f in doc["faces"].values():
        assert f["iterations"] == 5 and f["step_p10_us"] <= f["step_p50_us"] <= f["step_p90_us"] and f["spread_pct"] >= 0
    for r in doc["ranks"]:
        assert set(r["faces"]) == set(doc["faces"]) and r["phases"] == r["faces"]["tokenswitch-expert-major"]["phases"]
        assert all(len(f["step_s"]) == 5 and len(f["cpu_s"]) == 5 for f in r["faces"].values())


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--routing", "hot:9:0.5"], "--routing 'hot:9:0.5'"),
        (["--routing", "zipf:x"], "--routing 'zipf:x'"),
        (["--routing", "pareto"], "expected uniform"),
        (["--experts", "6"], "--experts 6: must be a multiple of the 4 ranks"),
        (["--topk", "9"], "--topk 9"),
        (["--wire-dtype", "fp8"], "--wire-dtype 'fp8'"),
        (["--face", "deepep"], "--face 'deepep': a comma-separated list of distinct faces from " + ", ".join(FACES)),
        (["--face", "communicator,communicator"], "--face 'communicator,communicator'"),
        (["--tokens", "0"], "--tokens 0"),
        (["-d", "int8"], "-d/--datatype 'int8'"),
        # A huge exponent used to overflow (i + 1) ** S: every weight but the first is 0.0 now.
        (["--routing", "zipf:1e308"], "only 1 of the 8 experts keep a weight above 0 in float64, fewer than --topk 2"),
        (["--routing", "zipf:inf"], "--routing 'zipf:inf': expected"),
        # Used to start the ranks and fail in torch.multinomial (2**24 categories at most).
        (["--experts", "100000000"], "--experts 100000000: at most 65536 experts"),
        (["--experts", "65536", "--tokens", "4096"], "--tokens x --experts = 268435456 routing weights per rank"),
    ],
)
def test_bad_dispatch_flags_exit_2(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench", "dispatch", "--nprocs", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "starting" not in err  # refused before any rank starts


def test_full_output_device_is_one_error_line_exit_2(tmp_path):
    # A link to /dev/full: the open succeeds and the write fails (ENOSPC), as on a full disk. The
    # link, not /dev/full itself, so that a run of this test against a regression that unlinks
    # the -J path cannot delete the machine's /dev/full.
    link = tmp_path / "out.json"
    link.symlink_to("/dev/full")
    proc = _run(["--nprocs", "2", "--tokens", "8", "--hidden", "8", "-n", "1", "-w", "0", "-J", str(link)], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"hetcomm bench: error: -J/--output_file {link}: cannot write it (No space left on device)" in proc.stderr
    assert "p50(us)" in proc.stdout  # the measurement is printed before the file fails
    assert link.is_symlink()  # a path that is not a regular file is never removed


def test_routing_weights():
    assert routing_weights("uniform", 4) == [1.0] * 4
    assert routing_weights("hot:1:0.7", 4)[0] == pytest.approx(0.7)
    assert routing_weights("zipf:1", 3) == pytest.approx([1.0, 0.5, 1 / 3])
    with pytest.raises(UsageError):
        routing_weights("hot:0:0.5", 4)


def _faces_body(rank: int, world_size: int):
    import torch

    import hetcomm
    from hetcomm.cli.bench_dispatch import DispatchBenchConfig, _face_step, _route, _Timer

    config = DispatchBenchConfig(tokens=24, hidden=8, topk=3, experts=8, routing="zipf:1.0", wire_dtype="exact",
                                 dtype="float32", iters=1, warmup_iters=0, timeout_s=60.0, faces=FACES)
    comm = hetcomm.communicator()
    x, idx, gate = _route(config, rank, torch.device("cpu"))
    expert_to_rank = torch.arange(config.experts, device=x.device) // (config.experts // world_size)
    timer = _Timer(torch.device("cpu"))
    out = {}
    for face in FACES:
        _, y, gx = _face_step(face, comm, config, expert_to_rank)(timer, x, idx, gate)
        out[face] = (y, gx)
    return {"x": x, "gate": gate, "faces": out}


def test_every_face_computes_the_same_weighted_sum_and_gradient():
    """The faces are compared on equal work: out[t] = sum_k gate[t, k] * x[t] (identity experts;
    TokenSwitch's experts apply the weights its combine leaves to them), and x's gradient
    sum_k gate[t, k]. A face that dropped the weights, or counted a slot twice, fails."""
    from tests.backends.ranks import run_ranks

    for rank, got in enumerate(run_ranks(_faces_body, 4, backend="hetcomm", timeout=120)):
        x, gate = got["x"], got["gate"]
        want_out, want_grad = x * gate.sum(1, keepdim=True), gate.sum(1, keepdim=True).expand_as(x)
        for face, (y, gx) in got["faces"].items():
            assert torch.allclose(y, want_out, atol=1e-6), (rank, face)
            assert torch.allclose(gx, want_grad, atol=1e-6), (rank, face)
