"""``hetcomm train --metrics`` and ``hetcomm report``: one real 4-rank run (``demo_run`` in
conftest.py), its records and plots."""

from __future__ import annotations

import json
import os

import pytest

from hetcomm.cli.main import main
from hetcomm.errors import ConfigError
from hetcomm.ops.metrics import PHASES, read_metrics
from tests.ops.jobs import CHECKPOINT_EVERY, STEPS


def test_one_record_per_step_with_every_field(demo_run):
    _, metrics, _ = demo_run
    log = read_metrics(metrics)
    assert log.run is not None and log.run.world_size == 4 and log.run.cluster == "mixed-mini"
    assert [r["node"] for r in log.run.ranks] == ["a100-0", "a100-0", "h800-0", "ascend-0"]
    assert [s.step for s in log.steps] == list(range(1, STEPS + 1))
    for s in log.steps:
        assert set(s.phase_s) == set(PHASES)
        assert abs(sum(s.phase_s.values()) - s.step_s) < 1e-3 + 0.01 * s.step_s  # phases cover the step
        assert len(s.step_s_by_rank) == 4 and all(t > 0 for t in s.step_s_by_rank)
        # Every copy the gates routed is counted once: tokens * k per layer.
        assert [sum(layer) for layer in s.expert_load] == [s.tokens * 2] * 2
        assert len(s.expert_load[0]) == 4
        # The link-class split re-attributes the rails' bytes, neither losing nor adding any.
        assert abs(sum(s.bytes_by_link_class.values()) - sum(s.bytes_by_rail.values())) <= len(s.bytes_by_link_class)
        assert {"shm", "gloo", "bridge"} <= set(s.bytes_by_rail)
        assert {"NVLINK", "NET_ROCE_GDR", "HOST_BRIDGE"} <= set(s.bytes_by_link_class)
        assert s.page_hits is None and s.migrations is None  # not reported by this layer: null, not 0
        assert s.max_rss_bytes and s.max_rss_bytes > 10 * 2**20
    # The policy before the first step (balance=False: no verdict changes a lever later), then the checkpoints.
    assert [(e.step, e.event) for e in log.events] == [(0, "policy")] + [
        (s, "checkpoint") for s in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY)]
    assert "migrations off (--no-balance)" in log.events[0].detail and "cold_placement off" in log.events[0].detail


def test_report_prints_a_summary_and_draws_four_pngs(demo_run, tmp_path, capsys):
    _, metrics, _ = demo_run
    assert main(["report", metrics, "--plot", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    for needle in ("step time (rank 0)", "time by phase", "bytes over HOST_BRIDGE", "layer1 expert load",
                   "initial_weights off (--no-balance: speed-blind", "cold_placement off (--no-balance)"):
        assert needle in out, out
    want = ", ".join(str(s) for s in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    assert [ln.split(None, 1)[1].strip() for ln in out.splitlines() if ln.startswith("checkpoints")] == [want]
    names = sorted(os.listdir(tmp_path / "plots"))
    assert names == sorted(["step_time.png", "bytes_by_link_class.png", "expert_load.png", "loss.png"])
    for n in names:
        data = (tmp_path / "plots" / n).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, n


def test_reader_names_file_line_and_key(tmp_path, demo_run, capsys):
    _, metrics, _ = demo_run
    lines = open(metrics).read().splitlines()
    bad = tmp_path / "bad.jsonl"
    assert json.loads(lines[1])["event"] == "policy"  # the run header, the policy, then the steps
    step = json.loads(lines[2])
    step["bytes_per_rail"] = step.pop("bytes_by_rail")
    bad.write_text("\n".join([lines[0], lines[1], json.dumps(step)]) + "\n")
    with pytest.raises(ConfigError) as e:
        read_metrics(str(bad))
    assert e.value.line == 3 and e.value.key == "bytes_per_rail" and e.value.path == str(bad)
    bad.write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    with pytest.raises(ConfigError) as e:
        read_metrics(str(bad))
    assert e.value.line == 2
    torn = tmp_path / "torn.jsonl"  # a job killed mid-write: the last line is cut
    torn.write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])
    assert len(read_metrics(str(torn)).steps) == 2
    assert main(["report", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
