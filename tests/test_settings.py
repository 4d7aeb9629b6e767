"""The settings registry (hetcomm/settings.py) and the one wire-dtype vocabulary (hetcomm/wire_dtypes.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hetcomm import settings
from hetcomm.errors import ConfigError, SettingError
from hetcomm.wire_dtypes import (
    LAYER_SPELLINGS,
    LINK_SPELLINGS,
    WireDtype,
    parse_wire_dtype,
    wire_torch_dtype,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_hetcomm_name_in_the_tree_is_declared():
    # Every HETCOMM_* spelled anywhere in the package is a declared variable (a typo or a new,
    # undeclared variable fails here).
    names = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "hetcomm")):
        for f in files:
            if f.endswith(".py") and f != "settings.py":  # the registry's own docs name a typo
                with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                    names.update(re.findall(r"\bHETCOMM_[A-Z0-9_]*[A-Z0-9]\b", fh.read()))
    undeclared = sorted(names - set(settings.REGISTRY))
    assert not undeclared, f"undeclared HETCOMM_* names: {undeclared}"
    assert len(settings.REGISTRY) >= 26


def test_declarations_are_complete():
    for name, s in settings.REGISTRY.items():
        assert name.startswith("HETCOMM_") and s.name == name
        assert s.doc and "\n" not in s.doc, name
        assert s.readers, f"{name} has no reader"
        if s.default is not None:
            assert s.get({}) == s.default


def test_readers_read_through_the_declaration():
    # A declared reader inside hetcomm/ reads the setting through its declaration: it names
    # ``settings.X`` (or imports X from hetcomm.settings).
    by_value = {id(v): k for k, v in vars(settings).items() if isinstance(v, settings.Setting)}
    for s in settings.REGISTRY.values():
        const = by_value[id(s)]
        for mod in s.readers:
            if not mod.startswith("hetcomm."):
                continue
            path = os.path.join(ROOT, *mod.split(".")) + ".py"
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            through = re.search(rf"\bsettings\.{const}\b", text) or re.search(
                rf"from hetcomm\.settings import [^\n]*\b{const}\b", text)
            assert through, f"{mod} is declared to read {s.name} but does not use settings.{const}"


@pytest.mark.parametrize(
    "name, value, reason",
    [
        ("HETCOMM_CHECK", "maybe", None),
        ("HETCOMM_DETECT", "2", None),
        ("HETCOMM_CHUNK_BYTES", "1.5", "whole bytes"),
        ("HETCOMM_SHM_RING_BYTES", "1K", "at least 4096"),
        ("HETCOMM_RAILS", "shm,tcp", "'tcp'"),
        ("HETCOMM_PLAN", "fastest", None),
        ("HETCOMM_WIRE_DTYPE", "fp8", None),
        ("HETCOMM_GROUP_SIZE", "two", "whole number"),
        ("HETCOMM_GROUP_DELAY", "nan", "out of range"),
        ("HETCOMM_GROUP_DELAY", "1e308", "above 3600"),  # finite, and it overflowed time.sleep
        ("HETCOMM_SAME_HOST_RAIL", "rdma", None),
        ("HETCOMM_LOG", "loud", None),
        ("HETCOMM_MAX_INPUT_BYTES", "lots", None),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_the_allowed(name, value, reason):
    s = settings.setting(name)
    with pytest.raises(SettingError) as info:
        s.get({name: value})
    e = info.value
    assert isinstance(e, ConfigError) and isinstance(e, ValueError)
    assert (e.name, e.value, e.key) == (name, value, name)
    assert e.allowed == s.allowed()
    msg = str(e)
    assert name in msg and repr(value) in msg and e.allowed in msg
    if reason:
        assert reason in msg


def test_typed_values_and_defaults():
    env = {
        "HETCOMM_CHECK": "off", "HETCOMM_CHUNK_BYTES": "64K", "HETCOMM_RAILS": " shm , gloo ",
        "HETCOMM_GROUP_SIZE": "4", "HETCOMM_GROUP_DELAY": "0.5", "HETCOMM_LOG": "DEBUG",
        "HETCOMM_PLAN": "hier", "HETCOMM_CLUSTER": "  ",
    }
    assert settings.CHECK.get(env) is False
    assert settings.CHUNK_BYTES.get(env) == 65536
    assert settings.RAILS.get(env) == ("shm", "gloo")
    assert settings.GROUP_SIZE.get(env) == 4 and settings.GROUP_DELAY.get(env) == 0.5
    assert settings.LOG.get(env) == "debug" and settings.PLAN.get(env) == "hier"
    # Empty or blank = unset: the default.
    assert settings.CLUSTER.get(env) is None and not settings.CLUSTER.is_set(env)
    assert settings.DETECT.get({}) is True and settings.RECALIBRATE.get({}) is False
    assert settings.SHM_RING_BYTES.get({}) == 4 << 20


def test_unknown_names_suggest_the_declared_one():
    out = settings.unknown_names({"HETCOMM_CLUSTERS": "x", "HETCOMM_CLUSTER": "y", "PATH": "/bin"})
    assert out == [("HETCOMM_CLUSTERS", "HETCOMM_CLUSTER")]
    with pytest.raises(KeyError, match="not a declared"):
        settings.setting("HETCOMM_NOPE")


def test_vocabularies_are_the_registry_ones():
    from hetcomm.backends import calibrate, options

    assert options.RAIL_NAMES == settings.RAIL_NAMES and options.PLAN_NAMES == settings.PLAN_NAMES
    assert calibrate.WAYS == settings.SAME_HOST_WAYS


def test_docs_table_equals_the_registry():
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        page = f.read()
    m = re.search(r"<!-- settings:begin -->\n(.*?)<!-- settings:end -->", page, re.S)
    assert m, "docs/ARCHITECTURE.md lacks the generated settings table"
    assert m.group(1) == settings.markdown_table(), (
        "docs/ARCHITECTURE.md's table is stale: paste `hetcomm settings --markdown`"
    )
    out = subprocess.run([sys.executable, "-m", "hetcomm.cli.main", "settings", "--markdown"], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    assert out.stdout == m.group(1)


def test_settings_command_lists_values_and_flags_typos():
    env = dict(os.environ, HETCOMM_CHUNK_BYTES="64K", HETCOMM_CLUSTRE="x.yaml")
    out = subprocess.run([sys.executable, "-m", "hetcomm.cli.main", "settings"], capture_output=True, text=True,
                         cwd=ROOT, env=env)
    assert out.returncode == 1, out.stderr
    assert "HETCOMM_CLUSTRE is set but not a hetcomm setting" in out.stderr and "did you mean HETCOMM_CLUSTER?" in out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("HETCOMM_CHUNK_BYTES"))
    assert "65536" in line
    env = dict(os.environ, HETCOMM_CHECK="maybe")
    out = subprocess.run([sys.executable, "-m", "hetcomm.cli.main", "settings"], capture_output=True, text=True,
                         cwd=ROOT, env=env)
    assert out.returncode == 2 and "HETCOMM_CHECK='maybe' is not valid" in out.stderr


# -- wire dtypes ------------------------------------------------------------------------------


def test_wire_dtype_spellings():
    import torch

    assert parse_wire_dtype("auto") is WireDtype.CLUSTER is parse_wire_dtype("cluster")
    assert parse_wire_dtype("fp16") == "fp16" and str(WireDtype.BF16) == "bf16"
    assert parse_wire_dtype(WireDtype.EXACT) is WireDtype.EXACT
    assert wire_torch_dtype("bf16") is torch.bfloat16 and WireDtype.FP32.torch_dtype() is torch.float32
    assert [parse_wire_dtype(s).is_concrete for s in LINK_SPELLINGS] == [True] * 3
    with pytest.raises(ValueError, match="policy"):
        WireDtype.CLUSTER.torch_dtype()


def test_wire_dtype_errors_name_the_key_and_the_allowed():
    with pytest.raises(ConfigError) as info:
        parse_wire_dtype("exact", allowed=LAYER_SPELLINGS, key="train.wire_dtype")
    assert info.value.key == "train.wire_dtype"
    assert "'exact'" in str(info.value) and "auto, fp32, fp16, bf16" in str(info.value)
    with pytest.raises(ConfigError, match=r"16 \(int\)"):
        parse_wire_dtype(16)
    with pytest.raises(ConfigError):
        wire_torch_dtype("cluster")


# -- explicit beats the environment: a cluster object through pg_options ---------------------


def _cluster_of_group(rank: int, world: int):
    import torch
    import torch.distributed as dist

    import hetcomm

    comm = hetcomm.communicator()
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return {"name": comm.cluster.name, "source": comm.options.source("cluster"), "out": out.tolist()}


def test_a_cluster_object_in_pg_options_beats_a_bad_environment_variable():
    # hetcomm train hands each rank's parsed Cluster to the backend this way; a stray
    # HETCOMM_CLUSTER naming a missing file must not be read at all.
    from hetcomm.backends.options import HetcommOptions
    from hetcomm.topo.cluster import load_cluster
    from tests.backends.ranks import run_ranks

    cluster = load_cluster(os.path.join(ROOT, "configs", "clusters", "mixed-mini.yaml"))
    res = run_ranks(_cluster_of_group, world_size=cluster.num_ranks, pg_options=HetcommOptions(cluster=cluster),
                    env={"HETCOMM_CLUSTER": "/nonexistent/cluster.yaml"}, timeout=180)
    for r, got in enumerate(res):
        assert got["name"] == cluster.name and got["source"] == "pg_options"
        assert got["out"] == [float(10 * s + r) for s in range(4)]
