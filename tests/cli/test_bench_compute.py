"""``hetcomm bench compute``: a GEMM and the expert FFN measured on this process's device."""

from __future__ import annotations

import json

from hetcomm.cli.bench_compute import load_measured_tflops, measure_expert_ffn
from hetcomm.cli.main import main


def test_bench_compute_writes_one_row_per_rank(tmp_path, capsys):
    out = tmp_path / "compute.json"
    code = main(["bench", "compute", "-n", "2", "-w", "0", "--gemm-n", "64", "--tokens", "64",
                 "--model-dim", "32", "--hidden-dim", "64", "-J", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "GEMM TFLOPS" in text and "cpu" in text
    doc = json.loads(out.read_text())
    assert doc["schema"] == "hetcomm.bench.compute/1" and len(doc["ranks"]) == 1
    row = doc["ranks"][0]
    assert row["device"] == "cpu" and row["gemm"]["tflops"] > 0 and row["expert_ffn"]["time_s"] > 0
    assert load_measured_tflops(str(out)) == {0: row["expert_ffn"]["tflops"]}


def test_ffn_flops_count_both_passes():
    r = measure_expert_ffn(16, 8, 16, iters=1, warmup=0)
    assert r["tflops"] == 12.0 * 16 * 8 * 16 / r["time_s"] / 1e12
