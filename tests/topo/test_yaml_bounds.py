"""The YAML loader under hostile input (issue 14 item 8): every case is a ConfigError with the
file and line, in bounded time and memory, through the API, ``$HETCOMM_CLUSTER`` and the CLI."""

from __future__ import annotations

import os
import time
import tracemalloc

import pytest

from hetcomm._yaml import MAX_ALIAS_VALUES, MAX_YAML_BYTES, MAX_YAML_DEPTH, load_yaml_text
from hetcomm.cli.main import main
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import CLUSTER_ENV, cluster_from_env, load_cluster, load_cluster_text

from tests.conftest import REPO_ROOT

MIXED_MINI = os.path.join(REPO_ROOT, "configs", "clusters", "mixed-mini.yaml")
GOOD = "name: g\nnode_groups:\n  - name: c\n    device: {model: cpu, count: 2}\n"


def alias_bomb(levels: int = 10, width: int = 10) -> str:
    """The issue's 520-byte file: each level is a list of ``width`` aliases of the level below,
    so the last one expands to width**levels values."""
    lines = ["name: bomb", "a0: &a0 [" + ",".join(['"x"'] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    lines.append(f"node_groups: [*a{levels - 1}]")
    return "\n".join(lines) + "\n"


def write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return str(path)


def test_alias_bomb_stops_at_the_value_cap_in_bounded_time_and_memory(tmp_path):
    text = alias_bomb()
    assert len(text) < 600
    path = write(tmp_path, "bomb.yaml", text)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ConfigError, match=f"aliases expand to more than {MAX_ALIAS_VALUES:,} values") as e:
            load_cluster(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - start
    assert e.value.path == path and e.value.line == 2  # the anchor being expanded
    # Before: 645 MB and more than 60 s. The cap allows 10,000 small values.
    assert peak < 32 << 20, f"peak {peak >> 20} MiB"
    assert elapsed < 60, f"{elapsed:.1f} s"


def test_aliases_within_the_cap_still_work():
    text = GOOD.replace("node_groups:", "common: &dev {model: cpu, count: 2}\nnode_groups:")
    with pytest.raises(ConfigError, match="unknown key 'common'"):  # aliases parse; the key is foreign
        load_cluster_text(text, "a.yaml")
    doc = load_yaml_text("a: &x [1, 2]\nb: *x\nc: *x\n", "a.yaml")
    assert doc.data == {"a": [1, 2], "b": [1, 2], "c": [1, 2]}


def test_recursive_alias_is_a_config_error_not_recursion_error():
    with pytest.raises(ConfigError, match="recursive alias") as e:
        load_cluster_text("name: x\ndescription: &d [*d]\nnode_groups: []\n", "rec.yaml")
    assert (e.value.path, e.value.line, e.value.key) == ("rec.yaml", 2, "description[0]")
    with pytest.raises(ConfigError, match="recursive alias"):
        load_yaml_text("a: &m {b: *m}\n", "m.yaml")


@pytest.mark.parametrize("key", ["? [a, b]\n: 1\n", "? {a: 1}\n: 1\n", "[a, b]: 1\n"])
def test_complex_key_is_a_config_error(key):
    with pytest.raises(ConfigError, match="complex key") as e:
        load_cluster_text("name: x\n" + key, "k.yaml")
    assert e.value.line == 2


@pytest.mark.parametrize(
    "text, needle",
    [
        ("name: !!python/object:os.system x\n", "could not determine a constructor"),
        ("name: x\ncount: !!int abc\n", "invalid value 'abc'"),
        ("name: x\ngbps: !!float fast\n", "invalid value 'fast'"),
        ("name: x\nwhen: !!timestamp 2020-13-45\n", "invalid value"),
    ],
)
def test_scalars_their_tag_cannot_build_name_their_line(text, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_yaml_text(text, "t.yaml")
    assert e.value.line == text.count("\n")


def test_deep_nesting_is_refused():
    deep = "a: " + "[" * (MAX_YAML_DEPTH + 5) + "]" * (MAX_YAML_DEPTH + 5) + "\n"
    with pytest.raises(ConfigError, match=f"nested deeper than {MAX_YAML_DEPTH}"):
        load_yaml_text(deep, "d.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):  # libyaml's own limit (1000)
        load_yaml_text("a: " + "[" * 5000 + "]" * 5000, "d.yaml")


@pytest.mark.parametrize(
    "data, needle",
    [
        ("name: caf\u00e9\n".encode("latin-1"), r"not UTF-8 text \(byte 0xe9"),
        ("name: x\n".encode("utf-16-le"), "UTF-16 without a byte-order mark"),
        (b"name: x\n\x00\n", "binary file"),
        (b"\xff\xfename: x\n\x00\xd8", "invalid UTF-16"),
    ],
)
def test_undecodable_files_are_config_errors(tmp_path, data, needle):
    path = write(tmp_path, "enc.yaml", data)
    with pytest.raises(ConfigError, match=needle) as e:
        load_cluster(path)
    assert e.value.path == path


def test_utf16_and_utf8_bom_files_load(tmp_path):
    assert load_cluster(write(tmp_path, "u16.yaml", GOOD.encode("utf-16"))).num_ranks == 2
    assert load_cluster(write(tmp_path, "bom.yaml", GOOD.encode("utf-8-sig"))).num_ranks == 2


def test_oversized_and_endless_files_are_refused_before_reading(tmp_path):
    big = write(tmp_path, "big.yaml", GOOD + "#" * MAX_YAML_BYTES + "\n")
    with pytest.raises(ConfigError, match="larger than the 256 KiB"):
        load_cluster(big)
    with pytest.raises(ConfigError, match="character device"):
        load_cluster("/dev/zero")
    with pytest.raises(ConfigError, match="is a directory"):
        load_cluster(str(tmp_path))


def test_every_rank_gets_the_same_error_through_hetcomm_cluster(tmp_path, monkeypatch):
    path = write(tmp_path, "bomb.yaml", alias_bomb())
    monkeypatch.setenv(CLUSTER_ENV, path)
    with pytest.raises(ConfigError, match="values") as e:
        cluster_from_env()
    assert e.value.path == path


@pytest.mark.parametrize(
    "name, data, flag",
    [
        ("bomb.yaml", alias_bomb(), "--cluster"),
        ("rec.yaml", "name: x\ndescription: &d [*d]\nnode_groups: []\n", "--cluster"),
        ("complex.yaml", "name: x\n? [a, b]\n: 1\n", "--cluster"),
        ("latin1.yaml", "name: caf\u00e9\n".encode("latin-1"), "--cluster"),
        ("cost.json", '{"gbps": {}} \u00e9'.encode("latin-1"), "--cost"),
    ],
)
def test_simulate_exits_2_with_file_and_line(tmp_path, capsys, name, data, flag):
    path = write(tmp_path, name, data)
    cluster = path if flag == "--cluster" else MIXED_MINI
    argv = ["simulate", "--cluster", cluster, "--size", "1M"] + (["--cost", path] if flag == "--cost" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{path}:" in err and "Traceback" not in err, err


def test_utf16_cost_file_is_read(tmp_path, capsys):
    path = write(tmp_path, "cost.json", '{"gbps": {"NVLINK": 100}}'.encode("utf-16"))
    assert main(["simulate", "--cluster", MIXED_MINI, "--size", "1M", "--cost", path]) == 0
