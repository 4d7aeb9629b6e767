"""``hetcomm doctor``: every rule fires on its trace and stays quiet on a clean one."""

from __future__ import annotations

import os

import pytest

from hetcomm.cli.main import main
from hetcomm.ops.doctor import DOCTOR_CODES, diagnose, load_record
from tests.ops.traces import make_traces

T = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces")
FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
CLEAN = os.path.join(T, "demo_clean.jsonl")
DERIVED: list = []


@pytest.fixture(scope="module", autouse=True)
def derived(tmp_path_factory):
    """The firing traces, derived from the recorded ones (tests/ops/traces/make_traces.py)."""
    d = str(tmp_path_factory.mktemp("traces"))
    make_traces.main(d)
    DERIVED[:] = [d]
    yield d


def _path(name: str) -> str:
    if os.path.isabs(name):
        return name
    recorded = os.path.join(T, name)
    return recorded if os.path.exists(recorded) else os.path.join(DERIVED[0], name)


def codes(*names: str):
    paths = [_path(n) for n in names]
    findings = diagnose(load_record(paths))
    return {f.code for f in findings}, findings


def test_clean_demo_record_is_clean(capsys):
    got, findings = codes(CLEAN)
    assert findings == []
    assert main(["doctor", CLEAN]) == 0
    assert "No problems found" in capsys.readouterr().out


# (rule, firing trace, quiet trace): each quiet trace differs from the firing one in the cause.
CASES = [
    ("step-time-jitter", ["jitter.jsonl"], ["demo_clean.jsonl"]),
    ("expert-starved", ["starved.jsonl"], ["demo_clean.jsonl"]),
    ("oom-prefetch", ["prefetch_on.jsonl", "oom_prefetch.log"], ["demo_clean.jsonl", "oom_prefetch.log"]),
    ("oom", ["demo_clean.jsonl", "oom_prefetch.log"], ["demo_clean.jsonl"]),
    ("loss-oscillation-migration", ["migrations.jsonl"], ["migrations_quiet.jsonl"]),
    ("init-hang", ["nccl_init_hang.txt"], [os.path.join(FIX, "nccl_log_g6e_l40s_shm.txt")]),
    ("clock-offset", ["chrony_node_a.txt", "chrony_node_b_fast.txt"], ["chrony_node_a.txt", "ntpq_node_d.txt"]),
    ("env-nccl-algo", ["demo_clean.jsonl", "env_algo.txt"], ["demo_clean.jsonl", "env_ok.txt"]),
    ("env-roce-gid", ["nccl_roce_no_gid.txt"], [os.path.join(FIX, "nccl_log_h100_2node_roce_gdrdma_p2pipc.txt")]),
    ("env-hccl-buffsize", ["big_alltoall.jsonl"], ["demo_clean.jsonl"]),
    ("env-async-error-handling", ["env_async_off.txt"], ["env_ok.txt"]),
    # Health records (hetcomm.ops.ops_records): the in-training probe of an emulated run with a
    # throttled H800, its first (healthy) window, the hang-variant shrink run's membership change,
    # and a network window built with hetcomm.ops.probe.judge_window (a rank's bridge 6x its class).
    ("slow-rank", ["probe-throttled-h800.health.jsonl"], ["probe-healthy.health.jsonl"]),
    ("slow-link", ["slow-link.health.jsonl"], ["probe-throttled-h800.health.jsonl"]),
    ("membership-change", ["shrink-stop.health.jsonl"], ["probe-throttled-h800.health.jsonl"]),
    ("work-lost", ["work_lost.jsonl"], ["demo_clean.jsonl"]),
    ("store-reverse-dns", ["store_reverse_dns.log"], ["store_dns_ok.log"]),
]


def test_every_rule_has_a_case():
    assert {c for c, _, _ in CASES} == set(DOCTOR_CODES)


@pytest.mark.parametrize("code,fires,quiet", CASES, ids=[c[0] for c in CASES])
def test_rule_fires_on_its_trace_and_not_on_the_clean_one(code, fires, quiet):
    got, findings = codes(*fires)
    assert code in got, [f"{f.code}: {f.subject}: {f.message}" for f in findings]
    f = next(f for f in findings if f.code == code)
    assert f.subject and f.message and f.fix  # what, where, how
    assert f.severity == DOCTOR_CODES[code].severity
    assert code not in codes(*quiet)[0]


def test_findings_say_where():
    _, f = codes("jitter.jsonl")
    (j,) = [x for x in f if x.code == "step-time-jitter"]
    assert "steps 36, 42, 48" in j.subject and "'grad_sync'" in j.message and "rank 2 (h800-0)" in j.message
    _, f = codes("starved.jsonl")
    (s,) = [x for x in f if x.code == "expert-starved"]
    assert "layer 1" in s.subject and "expert 5 0.20%" in s.message
    _, f = codes("nccl_init_hang.txt")
    (h,) = [x for x in f if x.code == "init-hang"]
    assert "ranks 1, 3" in h.subject
    _, f = codes("chrony_node_b_fast.txt", "chrony_node_c_unsynced.txt", "nccl_init_hang.txt")
    assert {x.subject.split(":")[0].rsplit("/", 1)[-1] for x in f if x.code == "clock-offset"} == {
        "chrony_node_b_fast.txt", "chrony_node_c_unsynced.txt"
    }
    (h,) = [x for x in f if x.code == "init-hang"]
    assert "chrony_node_b_fast.txt" in h.message  # the hang points at the clocks
    _, f = codes("prefetch_on.jsonl", "oom_prefetch.log")
    (o,) = [x for x in f if x.code == "oom-prefetch"]
    assert o.subject.endswith("oom_prefetch.log:6 (rank 3)") and "config prefetch=True" in o.message


def test_cli_exit_codes(capsys, tmp_path):
    assert main(["doctor", _path("nccl_init_hang.txt")]) == 1  # an error finding
    out = capsys.readouterr().out
    assert "[ERROR] init-hang" in out and "fix:" in out and "means:" in out
    assert main(["doctor", _path("jitter.jsonl")]) == 0  # warnings only
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"kind":"step","nope":1}\n{"kind":"step"}\n')
    assert main(["doctor", str(bad)]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
