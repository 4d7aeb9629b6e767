"""`hetcomm audit` and `hetcomm simulate` predict one time for one cluster and size (issue #18)."""

from __future__ import annotations

import json
import os

import pytest

from hetcomm.cli.main import main
from hetcomm.sched.cost import DEFAULT_LATENCY_US
from hetcomm.topo.linkcost import LATENCY_US

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "clusters")


def _json(capsys, argv):
    try:
        main(argv)
    except SystemExit:
        pass
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name,size", [("mixed-mini.yaml", "64M"), ("emulated-4node.yaml", "1M")])
def test_audit_and_simulate_predict_the_same_time(capsys, name, size):
    path = os.path.join(CLUSTERS, name)
    audit = _json(capsys, ["audit", "--cluster", path, "--size", size, "--json"])
    sim = _json(capsys, ["simulate", "--cluster", path, "--size", size, "--plans", "flat", "--json"])
    predicted = audit["answers"]["alltoall_estimate"]
    assert predicted["model"] == "cost-model"
    assert predicted["time_us"] == pytest.approx(sim["plans"][0]["time_s"] * 1e6, rel=1e-9)


def test_one_latency_table():
    for cls, us in LATENCY_US.items():
        if cls.name != "HOST_BRIDGE":  # the cluster's own bridge latency wins in both
            assert DEFAULT_LATENCY_US[cls.name] == us
