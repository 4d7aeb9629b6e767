"""Issue 21 item 15: ``hetcomm report`` and ``hetcomm doctor`` on hostile files end at once with
exit 2 and one ``file:line, key: what is wrong`` line: no traceback, no hang, no summary of
nonsense. Real processes (the installed ``hetcomm``) on real files, FIFOs and devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HETCOMM = [sys.executable, "-m", "hetcomm.cli.main"]


def _step(**over):
    rec = {"kind": "step", "step": 1, "time_s": 0.1, "loss": 5.0, "tokens": 64, "step_s": 0.1,
           "step_s_by_rank": [0.1, 0.1], "phase_s": {"forward": 0.05}, "moe_s": {}, "bytes_by_rail": {"gloo": 10},
           "bytes_by_link_class": {"IB": 10}, "expert_load": [[1.0, 2.0]]}
    rec.update(over)
    return json.dumps(rec)


RUN = json.dumps({"kind": "run", "schema": "hetcomm.metrics/1", "world_size": 2, "cluster": "c",
                  "ranks": [{"rank": 0, "model": "A100", "node": "n0"}, {"rank": 1, "model": "A100", "node": "n0"}],
                  "config": {}, "start_step": 0})


def _run(cmd, files, timeout=60):
    proc = subprocess.run(HETCOMM + [cmd, *files], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _metrics(tmp_path, name, *lines, raw=None):
    p = tmp_path / name
    if raw is not None:
        p.write_bytes(raw)
    else:
        p.write_text("\n".join([RUN, *lines]) + "\n")
    return str(p)


CASES = {
    "wrong-type": (lambda t: _metrics(t, "a.jsonl", _step(step_s="fast"), _step(step=2)), ":2, key 'step_s'"),
    "negative-step-time": (lambda t: _metrics(t, "b.jsonl", _step(step_s=-5.0), _step(step=2)), ":2, key 'step_s'"),
    "negative-rank-time": (lambda t: _metrics(t, "c.jsonl", _step(step_s_by_rank=[0.1, -5.0]), _step(step=2)),
                           "key 'step_s_by_rank[1]'"),
    "deep-nesting": (lambda t: _metrics(t, "d.jsonl", '{"kind": "step", "x": ' + "[" * 100000 + "]" * 100000 + "}",
                                        _step(step=2)), ":2: nested too deeply"),
    "huge-number": (lambda t: _metrics(t, "e.jsonl", _step(tokens=int("9" * 4000)), '{"kind":"step","tokens":' +
                                       "9" * 100000 + "}", _step(step=3)), ":2, key 'tokens'"),
    "utf16-bad": (lambda t: _metrics(t, "f.jsonl", raw=b"\xff\xfe" + "{\"kind\": 1}\n".encode("utf-16-le")
                                     + b"\x00\xd8"), "UTF-16"),
    "binary": (lambda t: _metrics(t, "g.jsonl", raw=b"\x00\x01\x02garbage\n"), "binary file"),
    "bool-for-int": (lambda t: _metrics(t, "h.jsonl", _step(tokens=True), _step(step=2)), "key 'tokens'"),
    "nan-time": (lambda t: _metrics(t, "i.jsonl", _step(step_s=float("nan")), _step(step=2)), "key 'step_s'"),
    # report took max() of the empty list: a ValueError traceback.
    "empty-by-rank": (lambda t: _metrics(t, "j.jsonl", _step(step_s_by_rank=[]), _step(step=2)),
                      ":2, key 'step_s_by_rank': holds 0 number(s), expected one per rank (the run's 2 ranks)"),
    "short-by-rank": (lambda t: _metrics(t, "k.jsonl", _step(), _step(step=2, expert_s_by_rank=[0.1])),
                      ":3, key 'expert_s_by_rank': holds 1 number(s)"),
}


@pytest.mark.parametrize("cmd", ["report", "doctor"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_metrics_file_is_one_line_exit_2(tmp_path, cmd, case):
    make, want = CASES[case]
    path = make(tmp_path)
    code, out = _run(cmd, [path])
    assert code == 2, out[-2000:]
    assert "Traceback" not in out and path in out and want in out, out[-2000:]
    assert len(out.strip().splitlines()) == 1, out[-2000:]


def test_utf16_metrics_file_with_a_bom_is_read(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_bytes(("\n".join([RUN, _step(), _step(step=2)]) + "\n").encode("utf-16"))
    code, out = _run("report", [str(p)])
    assert code == 0, out[-2000:]


@pytest.mark.parametrize("cmd", ["report", "doctor"])
def test_links_to_devices_and_fifos_without_writer_are_refused_at_once(tmp_path, cmd):
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.jsonl")
    for name, why in (("zero.jsonl", "a character device"), ("fifo.jsonl", "a FIFO")):
        code, out = _run(cmd, [str(tmp_path / name)], timeout=30)  # before: read forever / blocked forever
        assert code == 2 and why in out and "Traceback" not in out, out[-2000:]


@pytest.mark.parametrize("text,key", [
    ("Reference ID    : C0A80001 (gw)\nSystem time     : 1.2.3 seconds fast of NTP time\nLeap status     : Normal\n",
     "System time"),
    ("Reference ID    : C0A80001 (gw)\nSystem time     : " + "9" * 400 + " seconds slow of NTP time\n", "System time"),
    ("     remote           refid      st t when poll reach   delay   offset  jitter\n"
     "==============================================================================\n"
     "*ntp.example.org .GPS.            1 u   33   64  377    1.234   --5.0   0.321\n", "offset"),
])
def test_bad_clock_numbers_name_the_line(tmp_path, text, key):
    p = tmp_path / "clock.txt"
    p.write_text(text)
    code, out = _run("doctor", [str(p)])
    assert code == 2 and f"key '{key}'" in out and "Traceback" not in out, out[-2000:]


@pytest.mark.parametrize("body", ['{"findings": [{"code": 1, "severity": [], "subject": {}, "message": 2}]}',
                                  '{"findings": ' + "[" * 50000 + "]" * 50000 + "}"])
def test_bad_audit_json_is_exit_2(tmp_path, body):
    p = tmp_path / "audit.json"
    p.write_text(body)
    code, out = _run("doctor", [str(p)])
    assert code == 2 and "Traceback" not in out and str(p) in out, out[-2000:]
