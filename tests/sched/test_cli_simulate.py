"""`hetcomm simulate`, in process: the table, the JSON document and every usage error."""

from __future__ import annotations

import io
import json
import sys

import pytest

from hetcomm.cli import simulate as sim_cli
from hetcomm.cli.main import main
from tests.sched.clusters import BIG, MINI

PLAN_KEYS = {
    "name", "strategy", "time_s", "ratio_to_bound", "num_stages", "num_messages", "num_transfers",
    "bytes_by_class", "busiest_resource", "stage_end_s", "plan_s", "simulate_s", "notes",
}


def _run(capsys, *argv):
    rc = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_document_schema(capsys):
    rc, out, err = _run(capsys, "--cluster", BIG, "--size", "64M", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "hetcomm.simulate/1"
    assert set(doc) == {"schema", "cluster", "traffic", "cost_model", "lower_bound", "plans"}
    assert doc["cluster"]["num_ranks"] == 80 and doc["cluster"]["devices_are_labels"] is True
    assert doc["cluster"]["devices"] == {"A100-SXM4-80GB": 32, "H800": 32, "910B": 16}
    assert doc["traffic"]["size_bytes"] == 64 << 20 and doc["traffic"]["total_bytes"] == 80 * (64 << 20)
    lb = doc["lower_bound"]
    assert set(lb["binding"]) == {"name", "num_bytes", "gbps", "alpha_s", "time_s"}
    assert lb["time_s"] == lb["binding"]["time_s"] == lb["terms"][0]["time_s"]
    assert [p["name"] for p in doc["plans"]] == ["flat", "hier", "multirail", "auto"]
    for p in doc["plans"]:
        assert set(p) == PLAN_KEYS
        assert p["time_s"] >= lb["time_s"]
        assert p["ratio_to_bound"] == pytest.approx(p["time_s"] / lb["time_s"])
        assert set(p["busiest_resource"]) == {"name", "busy_s", "utilization"}
        assert 0 < p["busiest_resource"]["utilization"] <= 1 + 1e-9
        assert sum(p["bytes_by_class"].values()) >= doc["traffic"]["moved_bytes"]
    auto = doc["plans"][-1]
    assert auto["strategy"] in ("flat", "hier", "multirail")
    assert auto["notes"][0].startswith("auto: chose")
    assert auto["time_s"] == min(p["time_s"] for p in doc["plans"][:3])


def test_table_names_the_bound_and_every_plan(capsys):
    rc, out, err = _run(capsys, "--cluster", MINI, "--size", "1M", "--skew", "zipf:1.2", "--plans", "flat,hier")
    assert rc == 0, err
    assert "cluster mixed-mini: 4 ranks on 3 nodes" in out and "device kinds are labels" in out
    assert "traffic: zipf:1.2, 1 MiB sent per rank" in out
    assert "lower bound:" in out and "bridge" in out
    lines = out.splitlines()
    assert any(line.startswith("flat ") and " ms " in line for line in lines)
    assert any(line.startswith("hier ") for line in lines)
    assert "bytes per link class" in out and "HOST_BRIDGE" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "64Q"], "bad size '64Q'"),
        (["--size", "0"], "at least 1 byte"),
        (["--size", "1M", "--plans", "flat,ring"], "unknown plan 'ring'"),
        (["--size", "1M", "--plans", ","], "--plans is empty"),
        (["--size", "1M", "--skew", "zipf:-2"], "bad skew 'zipf:-2'"),
        (["--size", "1M", "--skew", "pareto"], "bad skew 'pareto'"),
        (["--size", "1M", "--calibrate", "NVLINK"], "expected CLASS=FILE"),
        (["--size", "1M", "--seed", "-1"], "--seed must be >= 0"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    rc, out, err = _run(capsys, "--cluster", MINI, *argv)
    assert rc == 2 and out == ""
    assert message in err and err.startswith("hetcomm simulate: error:")


def test_bad_cluster_files_exit_2(capsys, tmp_path):
    rc, _, err = _run(capsys, "--cluster", str(tmp_path / "nope.yaml"), "--size", "1M")
    assert rc == 2 and "cannot read file" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnode_groups:\n  - name: a\n    device: {model: A100, count: 2}\n    nics:\n      - {class: NET_ROCE, gbsp: 100}\n")
    rc, _, err = _run(capsys, "--cluster", str(bad), "--size", "1M")
    assert rc == 2 and f"{bad}:6" in err and "gbsp" in err


def test_calibration_file_changes_the_prediction(capsys, tmp_path):
    rows = [{"size_bytes": s, "time_us": 20 + s / 1.25e3} for s in (1 << 20, 1 << 24)]  # 10 Gb/s
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(rows))
    _, base, _ = _run(capsys, "--cluster", BIG, "--size", "64M", "--plans", "flat", "--json")
    rc, out, err = _run(capsys, "--cluster", BIG, "--size", "64M", "--plans", "flat", "--json",
                        "--calibrate", f"NET_ROCE_GDR={f}")
    assert rc == 0, err
    doc, ref = json.loads(out), json.loads(base)
    assert "NET_ROCE_GDR" in doc["cost_model"]["source"]
    assert doc["plans"][0]["time_s"] > ref["plans"][0]["time_s"]
    rc, _, err = _run(capsys, "--cluster", BIG, "--size", "64M", "--calibrate", f"NVLNK={f}")
    assert rc == 2 and "unknown link class" in err


def test_plot_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, out, err = _run(capsys, "--cluster", MINI, "--size", "1M", "--plot", str(tmp_path / "p.png"))
    assert rc == 2 and "pip install 'hetcomm[plot]'" in err and out == ""


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    rc, out, err = _run(capsys, "--cluster", MINI, "--size", "1M", "--plot", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_appears_only_after_a_second(monkeypatch):
    clock = iter([0.0, 0.5, 1.5, 2.0])
    monkeypatch.setattr(sim_cli.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    p = sim_cli._Progress(total=3, stream=stream)
    p.step("bound")
    assert stream.getvalue() == ""
    p.step("flat")
    p.step("hier")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("simulate [") and "2/3 flat (1.5 s)" in lines[0]
