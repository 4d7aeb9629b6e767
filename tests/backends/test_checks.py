"""The cross-rank check vector (:mod:`hetcomm.backends.checks`): stable dtype codes, messages that
name what really differs, and the same verdict on every rank. Multi-rank behaviour is in
test_checks_ranks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hetcomm.backends import checks
from hetcomm.backends.checks import check_meta, dtype_code, dtype_from_code, encode_collective, encode_meta
from hetcomm.errors import CrossRankMismatch

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def test_every_torch_dtype_has_a_distinct_code_that_maps_back():
    codes = {d: dtype_code(d) for d in ALL_DTYPES}
    assert len(set(codes.values())) == len(ALL_DTYPES), codes
    for d, c in codes.items():
        assert dtype_from_code(c) == d
    # the FP8 wire dtypes and the wide unsigned ints are in the fixed table, not the fallback
    for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64):
        assert 0 <= codes[d] < len(checks.DTYPE_NAMES)


def test_dtype_codes_are_the_same_in_another_process_with_another_hash_seed():
    # Ranks are separate processes: Python's str hash differs between them (PYTHONHASHSEED).
    script = (
        "import json, torch\n"
        "from hetcomm.backends.checks import dtype_code\n"
        "ds = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)\n"
        "print(json.dumps({str(d): dtype_code(d) for d in ds}))\n"
    )
    mine = {str(d): dtype_code(d) for d in ALL_DTYPES}
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # another seed than this process's
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == mine


def _a2a(n, dtype=torch.float32, row_bytes=8, row_shape=(2,), sends=None, seq=5, op="all_to_all_single"):
    sends = sends or [[1] * n for _ in range(n)]
    return [encode_meta(op, seq, dtype, row_bytes, row_shape, sends[r], [sends[j][r] for j in range(n)]) for r in range(n)]


def test_dtype_mismatch_is_reported_as_a_dtype_mismatch_not_a_split_size_one():
    metas = _a2a(3)
    metas[1] = _a2a(3, dtype=torch.float16, row_bytes=4)[1]
    with pytest.raises(CrossRankMismatch) as e:
        check_meta("all_to_all_single", 2, metas)
    assert e.value.field == "dtype" and e.value.ranks == [1]
    msg = str(e.value)
    assert "rank 1 has dtype torch.float16" in msg and "torch.float32" in msg
    assert "split" not in msg and "input_split_sizes" not in msg


def test_row_shape_mismatch_shows_the_shapes_not_hashes():
    metas = _a2a(2, row_bytes=16, row_shape=(4,))
    metas[1] = _a2a(2, row_bytes=20, row_shape=(5,))[1]
    with pytest.raises(CrossRankMismatch) as e:
        check_meta("all_to_all_single", 0, metas)
    msg = str(e.value)
    assert e.value.field == "shape"
    assert "(5,)" in msg and "(4,)" in msg and "#" not in msg
    assert "split size" not in msg


def test_same_row_bytes_but_different_row_shape_is_caught():
    metas = _a2a(2, row_bytes=24, row_shape=(2, 3))
    metas[1] = _a2a(2, row_bytes=24, row_shape=(3, 2))[1]
    with pytest.raises(CrossRankMismatch, match=r"\(3, 2\)"):
        check_meta("all_to_all_single", 0, metas)


def test_a_rank_in_another_collective_is_named_with_both_kinds_and_numbers():
    n = 4
    metas = [encode_collective("all_reduce", 7, n, torch.float32, 4, (4,), "SUM") for _ in range(n)]
    metas[2] = _a2a(n, seq=7)[2]
    with pytest.raises(CrossRankMismatch) as e:
        check_meta("all_reduce", 0, metas)
    assert e.value.field == "order" and e.value.ranks == [2]
    assert "rank 2 is in collective #7 (all_to_all_single)" in str(e.value)
    assert "#7 (all_reduce)" in str(e.value)


@pytest.mark.parametrize(
    "field,kwargs,needle",
    [
        ("count", dict(count=5, shape=(5,)), "rank 3 has 5 elements (shape (5,))"),
        ("dtype", dict(dtype=torch.float64), "rank 3 has dtype torch.float64"),
        ("reduce_op", dict(reduce_op="MAX"), "rank 3 reduces with MAX"),
        ("root", dict(root=1), "rank 3 names root 1"),
    ],
)
def test_delegated_collective_mismatches_name_the_odd_rank(field, kwargs, needle):
    n = 4
    base = dict(dtype=torch.float32, count=4, shape=(4,), reduce_op="SUM", root=0)
    metas = [encode_collective("reduce", 3, n, **base) for _ in range(n)]
    metas[3] = encode_collective("reduce", 3, n, **{**base, **kwargs})
    for me in range(n):  # every rank reaches the same verdict
        with pytest.raises(CrossRankMismatch) as e:
            check_meta("reduce", me, metas)
        assert e.value.field == field and e.value.ranks == [3], str(e.value)
        assert needle in str(e.value)


def test_a_rank_that_refused_its_arguments_makes_every_rank_raise():
    n = 3
    metas = [encode_collective("all_gather", 1, n, torch.float32, 4, (4,)) for _ in range(n)]
    metas[1] = encode_collective("all_gather", 1, n, torch.float32, 4, (4,), local_problem=True)
    with pytest.raises(CrossRankMismatch, match="rank 1 refused its own arguments") as e:
        check_meta("all_gather", 0, metas)
    assert e.value.field == "arguments"
    with pytest.raises(CrossRankMismatch, match="here \\(rank 1\\): output_tensors has 2 tensors"):
        check_meta("all_gather", 1, metas, local_error="output_tensors has 2 tensors for a group of 3")


def test_matching_vectors_pass_and_a_split_mismatch_still_names_the_pairs():
    n = 3
    sends = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    m = check_meta("all_to_all_single", 0, _a2a(n, sends=sends))
    assert m.sends(1) == [4, 5, 6] and m.recvs(2) == [3, 6, 9]
    bad = _a2a(n, sends=sends)
    bad[0] = encode_meta("all_to_all_single", 5, torch.float32, 8, (2,), [1, 2, 4], [1, 4, 7])
    with pytest.raises(CrossRankMismatch, match="rank 0 sends 4 rows to rank 2, but rank 2 expects 3") as e:
        check_meta("all_to_all_single", 1, bad)
    assert e.value.field == "splits" and "split size mismatch" in str(e.value)


def test_ring_bytes_errors_name_the_variable_the_user_set():
    # issue 14.15: the error used to name HETCOMM_RING_BYTES, a variable that does not exist
    from hetcomm.backends.options import options_from_env
    from hetcomm.errors import ConfigError

    for value in ("100", "abc"):
        with pytest.raises(ConfigError) as e:
            options_from_env(environ={"HETCOMM_SHM_RING_BYTES": value})
        assert e.value.key == "HETCOMM_SHM_RING_BYTES" and "HETCOMM_SHM_RING_BYTES" in str(e.value)
