"""Settings that must agree across ranks: explicit options beat the environment; a mismatch is a
ConfigError on every rank, naming the ranks and the field, before any data moves (issues 10.1,
14.13)."""

from __future__ import annotations

import os
import time

import pytest

from hetcomm.backends.options import HetcommOptions, options_from_env
from hetcomm.errors import ConfigError
from tests.backends.ranks import run_ranks


@pytest.mark.parametrize(
    "field, var, explicit, env_value",
    [
        ("check_splits", "HETCOMM_CHECK", True, "0"),
        ("check_splits", "HETCOMM_CHECK", False, "1"),
        ("chunk_bytes", "HETCOMM_CHUNK_BYTES", 8 << 20, "1M"),  # explicit value equal to the default
        ("rails", "HETCOMM_RAILS", ("shm", "gloo"), "gloo"),
        ("ring_bytes", "HETCOMM_SHM_RING_BYTES", 4 << 20, "64K"),
    ],
)
def test_explicit_options_beat_the_environment(field, var, explicit, env_value):
    opts = options_from_env(HetcommOptions(**{field: explicit}), {var: env_value})
    assert getattr(opts, field) == explicit and opts.source(field) == "pg_options"
    # ...and the environment fills what was not passed.
    opts = options_from_env(HetcommOptions(), {var: env_value})
    assert getattr(opts, field) != explicit and opts.source(field) == var


def test_with_changes_keeps_the_rest_open_to_the_environment():
    base = HetcommOptions(check_splits=True).with_changes(plan="hier")
    assert base.explicit == {"check_splits", "plan"}
    opts = options_from_env(base, {"HETCOMM_CHECK": "0", "HETCOMM_CHUNK_BYTES": "2M"})
    assert opts.check_splits and opts.plan == "hier" and opts.chunk_bytes == 2 << 20


def _group_options(rank: int, world_size: int) -> dict:
    """The default group's effective options under HETCOMM_CHECK=0 and explicit pg_options."""
    import hetcomm

    o = hetcomm.communicator().options
    return {"check": o.check_splits, "chunk": o.chunk_bytes, "src": o.source("check_splits")}


def test_explicit_options_win_in_a_real_group():
    out = run_ranks(
        _group_options, world_size=2, timeout=60, env={"HETCOMM_CHECK": "0", "HETCOMM_CHUNK_BYTES": "1M"},
        pg_options=HetcommOptions(check_splits=True),
    )
    assert all(o == {"check": True, "chunk": 1 << 20, "src": "pg_options"} for o in out), out


# Each case: a per-rank setting that differs between ranks 0 and 1, and the field it must name.
_CASES = [
    ("chunk_bytes", {"pg_options": {"chunk_bytes": 1 << 20}}, {"pg_options": {"chunk_bytes": 2 << 20}}),
    ("chunk_bytes", {"env": {"HETCOMM_CHUNK_BYTES": "1M"}}, {"env": {"HETCOMM_CHUNK_BYTES": "4M"}}),
    ("rails", {"env": {"HETCOMM_RAILS": "shm,gloo"}}, {"env": {"HETCOMM_RAILS": "gloo"}}),
    ("ring_bytes", {"env": {"HETCOMM_SHM_RING_BYTES": "64K"}}, {"env": {"HETCOMM_SHM_RING_BYTES": "128K"}}),
    ("check_splits", {"env": {"HETCOMM_CHECK": "0"}}, {"env": {}}),
]


def _mismatched_groups(rank: int, world_size: int) -> list:
    """For every case, make a hetcomm subgroup with this rank's setting; report what it raised."""
    import torch.distributed as dist

    out = []
    for field, r0, r1 in _CASES:
        mine = r0 if rank == 0 else r1
        saved = {k: os.environ.get(k) for k in ("HETCOMM_CHUNK_BYTES", "HETCOMM_RAILS", "HETCOMM_SHM_RING_BYTES", "HETCOMM_CHECK")}
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(mine.get("env", {}))
        opts = HetcommOptions(**mine["pg_options"]) if "pg_options" in mine else None
        t0 = time.monotonic()
        try:
            dist.new_group(list(range(world_size)), backend="hetcomm", pg_options=opts)
            out.append({"field": field, "raised": None})
        except ConfigError as e:
            out.append({"field": field, "raised": "ConfigError", "key": e.key, "text": str(e), "seconds": time.monotonic() - t0})
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        dist.barrier()  # the default group still works after the refused subgroup
    return out


def test_mismatched_settings_raise_on_every_rank_naming_ranks_and_field():
    out = run_ranks(_mismatched_groups, world_size=2, timeout=120)
    for rank, cases in enumerate(out):
        for (field, r0, r1), got in zip(_CASES, cases):
            assert got["raised"] == "ConfigError", (rank, got)
            assert got["key"] == field, (rank, got)
            text = got["text"]
            assert f"{field}:" in text and "rank 0 =" in text and "rank 1 =" in text, text
            var = next(iter(r1.get("env", {}) or r0.get("env", {})), None)
            if var is not None:
                assert var in text, text  # where the value came from
            # Within 10 s (the agreement is one store round; generous for a loaded machine).
            assert got["seconds"] < 10.0, got
    # Both ranks raise the same message apart from the rank that reports it.
    assert [c["key"] for c in out[0]] == [c["key"] for c in out[1]]
