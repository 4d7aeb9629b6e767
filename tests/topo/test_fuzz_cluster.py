"""Fuzzing the YAML loader and the cluster validator (issue 14, "Done when").

Every generated file — cluster-shaped documents with hostile values (huge and non-finite numbers,
wrong types, foreign keys), alias bombs, recursive aliases, complex keys, four encodings, and raw
YAML-alphabet noise — must end in a :class:`Cluster` or a :class:`ConfigError` (the CLI's exit 2)
within a time and memory bound. Any other exception, a hang or a memory blow-up fails the test.
Examples are capped so the module runs in ~10-20 s on a loaded 2-core machine.
"""

from __future__ import annotations

import math
import time

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hetcomm.cli.main import main  # noqa: E402
from hetcomm.errors import ConfigError  # noqa: E402
from hetcomm.topo.cluster import Cluster, load_cluster  # noqa: E402

# CPU seconds of one example (process time, so a loaded machine does not trip it): typically
# a few ms; the alias bomb used to run past 60 s.
CASE_CPU_SECONDS = 5.0
# Growth of the process's peak RSS over one example; an alias bomb alone was 645 MB.
PEAK_GROWTH_BYTES = 200 << 20

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples every run: CI never flakes on a new seed
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)

numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, 1, 2, 8, 64, 65, 1024, 1025, 10_000, 10**12, 2**63, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(
    numbers,
    st.booleans(),
    st.none(),
    st.text(max_size=20),
    st.sampled_from(["NVLINK", "NET_ROCE_GDR", "HOST_BRIDGE", "cpu", "910B", "H800", "A100-SXM4-80GB", "fp16", "auto", "x" * 300]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def maybe(keys_values):
    """A mapping holding a random subset of the schema's keys, plus sometimes a foreign one."""
    return st.fixed_dictionaries({}, optional=keys_values)


nic = maybe({"class": st.one_of(st.sampled_from(["NET_ROCE_GDR", "NET_IB", "NVLINK"]), values), "gbps": values, "count": values, "numa": values})
device = maybe({"model": st.one_of(st.sampled_from(["cpu", "H800", "910B", "A100-SXM4-80GB"]), values), "count": values, "strong": values, "numa_nodes": values})
group = maybe(
    {
        "name": st.one_of(st.sampled_from(["a", "b", "x/y"]), values),
        "count": values,
        "device": st.one_of(device, values),
        "fabric": values,
        "fabric_gbps": values,
        "nics": st.one_of(st.lists(nic, max_size=2), values),
    }
)
cluster_doc = maybe(
    {
        "name": st.one_of(st.just("fuzz"), values),
        "description": values,
        "node_groups": st.one_of(st.lists(group, min_size=1, max_size=3), values),
        "interconnect": st.one_of(
            maybe({"same_vendor": values, "cross_vendor": st.one_of(maybe({"class": values, "gbps": values, "latency_us": values}), values)}),
            values,
        ),
        "wire_dtype": st.one_of(st.dictionaries(st.sampled_from(["HOST_BRIDGE", "NVLINK", "default", "BOGUS"]), values, max_size=2), values),
        "emulation": values,
        "nodes": values,  # a foreign key
    }
)

# Text appended to a dumped document: the hostile constructs.
EXTRAS = [
    "",
    "bomb0: &b0 [x,x,x,x,x,x,x,x,x,x]\n"
    + "".join(f"bomb{i}: &b{i} [" + ",".join([f"*b{i - 1}"] * 10) + "]\n" for i in range(1, 9)),
    "loop: &l [*l]\n",
    "? [a, b]\n: 1\n",
    "? {k: v}\n: 1\n",
    "tagged: !!python/object:os.system x\n",
    "deep: " + "[" * 80 + "]" * 80 + "\n",
    "big: 99999999999999999999999999999999999999\n",
    "--- \nsecond: document\n",
    "dup: 1\ndup: 2\n",
]
ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "latin-1"]


def _encode(text: str, encoding: str) -> bytes:
    return text.encode(encoding, errors="replace") if encoding == "latin-1" else text.encode(encoding, errors="surrogatepass")


class _Bounded:
    """Runs cases and checks each ends in a Cluster or a ConfigError within the bounds."""

    def __init__(self, tmp_path) -> None:
        self.path = tmp_path / "fuzz.yaml"
        self.outcomes = {"cluster": 0, "config_error": 0}

    def check(self, data: bytes) -> None:
        self.path.write_bytes(data)
        # Peak memory per example, like the CPU time: what hypothesis itself allocates (its
        # unicode tables on a fresh checkout, ~200 MiB) and what earlier tests in this process
        # reached do not count either way.
        rss_before = _reset_peak_rss()
        start = time.process_time()
        try:
            result = load_cluster(str(self.path))
        except ConfigError as e:
            assert e.path == str(self.path), e  # every error names the file
            self.outcomes["config_error"] += 1
        else:
            assert isinstance(result, Cluster)
            assert 1 <= result.num_ranks <= 1024
            assert math.isfinite(result.interconnect.cross_vendor_latency_us)
            self.outcomes["cluster"] += 1
        elapsed = time.process_time() - start
        assert elapsed < CASE_CPU_SECONDS, f"{elapsed:.1f} CPU s for {data[:200]!r}"
        growth = _status_bytes("VmHWM") - rss_before
        assert growth < PEAK_GROWTH_BYTES, f"peak RSS grew by {growth >> 20} MiB for {data[:200]!r}"


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise AssertionError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); returns that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


@pytest.fixture
def bounded(tmp_path):
    return _Bounded(tmp_path)


def test_cluster_shaped_documents(bounded):
    @settings(FUZZ, max_examples=150)
    @given(doc=cluster_doc, extra=st.sampled_from(EXTRAS), encoding=st.sampled_from(ENCODINGS))
    def run(doc, extra, encoding):
        text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False) + extra
        bounded.check(_encode(text, encoding))

    run()
    # Both outcomes occur: the generator is not producing only garbage (or only valid files).
    assert bounded.outcomes["config_error"] > 0


def test_valid_clusters_with_hostile_numbers(bounded):
    # Close to valid: only the numbers vary, so the validator (not the schema) is exercised.
    near = st.one_of(st.integers(min_value=1, max_value=8), numbers)

    @FUZZ
    @given(count=near, devices=near, gbps=near, latency=near, nics=near)
    def run(count, devices, gbps, latency, nics):
        doc = {
            "name": "n",
            "node_groups": [
                {"name": "a", "count": count, "device": {"model": "H800", "count": devices}, "nics": [{"class": "NET_IB", "gbps": gbps, "count": nics}]},
                {"name": "b", "device": {"model": "910B", "count": 1}},
            ],
            "interconnect": {"cross_vendor": {"class": "HOST_BRIDGE", "gbps": 100, "latency_us": latency}},
        }
        bounded.check(yaml.safe_dump(doc).encode())

    run()
    assert bounded.outcomes["cluster"] > 0 and bounded.outcomes["config_error"] > 0


def test_raw_yaml_noise(bounded):
    alphabet = st.sampled_from(list("abc019:-[]{},&*!?|>'\"#%@` \n\t.") + ["\u00e9", "\x00", "\ufeff", "node_groups", "name"])

    @FUZZ
    @given(text=st.lists(alphabet, max_size=120).map("".join), encoding=st.sampled_from(ENCODINGS))
    def run(text, encoding):
        bounded.check(_encode(text, encoding))

    run()


def test_cli_exits_2_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "cli.yaml"

    @settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(doc=cluster_doc, extra=st.sampled_from(EXTRAS))
    def run(doc, extra):
        path.write_text(yaml.safe_dump(doc, allow_unicode=True) + extra, encoding="utf-8")
        try:
            load_cluster(str(path))
        except ConfigError:
            pass
        else:
            return  # a valid cluster would run the simulator; the loader is what is fuzzed
        capsys.readouterr()
        assert main(["simulate", "--cluster", str(path), "--size", "1K"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hetcomm simulate: error: ") and "Traceback" not in err, err

    run()
