"""Cross-rank checks of every collective, on real rank processes (issue 14 items 4, 6, 7, 12, 15).

Every mismatch must be a ``CrossRankMismatch`` (a ``ValueError``) on *every* rank, before any byte
moves, and the group must stay usable afterwards — where plain gloo returns garbage, times out,
or aborts the process (a float64 vs float32 all_reduce killed rank 0 with SIGABRT). One rank
function runs many scenarios in one group, on the three paths the check takes: the shared-memory
board (one node), one gloo all_gather (every pair on gloo), and tiny messages over the rails
(mixed-mini: shm, gloo and bridge pairs).
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import MIXED_MINI, run_ranks

PG_TIMEOUT = 20.0

# Moved bit for bit as bytes; reduced in a wider dtype and cast back.
ODD_DTYPES = (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)


def _outcome(fn):
    """``("ok", value)`` or ``(field, ranks, message)`` of the CrossRankMismatch fn raised."""
    from hetcomm.errors import CrossRankMismatch

    try:
        return ("ok", fn())
    except CrossRankMismatch as e:
        return (e.field, e.ranks, str(e))


def mismatches(rank: int, n: int) -> dict:
    import torch.distributed as dist

    out = {}
    last = n - 1
    # 1. element count: 5 elements on the last rank, 4 elsewhere (gloo: garbage or a bogus store error)
    out["count"] = _outcome(lambda: dist.all_reduce(torch.ones(5 if rank == last else 4)))
    # 2. dtype: float64 on the last rank (gloo: SIGABRT on rank 0)
    out["dtype"] = _outcome(lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64 if rank == last else torch.float32)))
    # 3. broadcast of mismatched sizes (gloo: silently fills part of the receivers' tensors)
    out["bcast"] = _outcome(lambda: dist.broadcast(torch.zeros(3 if rank == last else 6), src=0))
    # 4. reduce op / root
    op = dist.ReduceOp.MAX if rank == last else dist.ReduceOp.SUM
    out["op"] = _outcome(lambda: dist.all_reduce(torch.ones(2), op=op))
    out["root"] = _outcome(lambda: dist.broadcast(torch.ones(2), src=1 if rank == last else 0))
    # 5. a rank whose own arguments are wrong: every rank hears of it
    outs = [torch.empty(2) for _ in range(n - 1 if rank == last else n)]
    out["args"] = _outcome(lambda: dist.all_gather(outs, torch.ones(2)))
    # 6. reduce_scatter_tensor and gather with mismatched pieces
    rows = 3 if rank == last else 2
    out["rs"] = _outcome(lambda: dist.reduce_scatter_tensor(torch.empty(rows), torch.ones(rows * n)))
    glist = [torch.empty(2) for _ in range(n)] if rank == 0 else None
    out["gather"] = _outcome(lambda: dist.gather(torch.ones(3 if rank == last else 2), glist, dst=0))
    # 6b. an all_to_all_single whose split list has the wrong length on one rank: its peers hear of
    #     it at once (they used to wait for it until the timeout)
    bad_in = [2] * (n - 1 if rank == last else n)
    out["a2a_args"] = _outcome(lambda: dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n), [2] * n, bad_in))
    # 7. a skipped collective (item 12): the last rank skips one all_to_all_single, then everybody
    #    calls all_reduce: its all_reduce meets the others' all_to_all_single
    x = torch.arange(2 * n, dtype=torch.float32)
    y = torch.empty_like(x)
    if rank != last:
        out["skip"] = _outcome(lambda: dist.all_to_all_single(y, x))
    else:
        out["skip"] = _outcome(lambda: dist.all_reduce(torch.ones(1)))
    # 8. still usable (no byte moved, every rank counted each call once): correct collectives of every kind give gloo's results
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=last)
    g = [torch.empty(2) for _ in range(n)]
    dist.all_gather(g, torch.full((2,), float(rank)))
    dist.barrier()
    dist.all_to_all_single(y, x)
    out["after"] = (t.tolist(), b.tolist(), [v.tolist() for v in g])
    return out


def _assert_mismatches(outs, n):
    last = n - 1
    expect = {
        "count": ("count", [last], f"rank {last} has 5 elements"),
        "dtype": ("dtype", [last], f"rank {last} has dtype torch.float64"),
        "bcast": ("count", [last], f"rank {last} has 3 elements"),
        "op": ("reduce_op", [last], f"rank {last} reduces with MAX"),
        "root": ("root", [last], f"rank {last} names root 1"),
        "args": ("arguments", [last], f"rank {last} refused its own arguments"),
        "rs": ("count", [last], f"rank {last} has 3 elements"),
        "gather": ("count", [last], f"rank {last} has 3 elements"),
        "a2a_args": ("arguments", [last], f"rank {last} refused its own arguments"),
    }
    for rank, o in enumerate(outs):
        for key, (field, ranks, needle) in expect.items():
            got = o[key]
            assert got[0] == field and got[1] == ranks, f"rank {rank} {key}: {got}"
            assert needle in got[2] and "before any data moved" in got[2], f"rank {rank} {key}: {got[2]}"
        skip = o["skip"]
        assert skip[0] == "order", f"rank {rank}: a skipped all_to_all_single went unnoticed: {skip}"
        assert "(all_to_all_single)" in skip[2] and "(all_reduce)" in skip[2], skip[2]
        t, b, g = o["after"]
        assert t == [n * (n + 1) / 2] * 3 and b == [float(last)] * 2
        assert g == [[float(r)] * 2 for r in range(n)]
    assert "here (rank %d): output_tensors has %d tensors" % (last, n - 1) in outs[last]["args"][2]
    assert "input_split_sizes has %d entries for a group of %d" % (n - 1, n) in outs[last]["a2a_args"][2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "env,n,cluster",
    [({}, 2, None), ({"HETCOMM_RAILS": "gloo"}, 2, None), ({}, 4, MIXED_MINI)],
    ids=["board", "gloo-rails", "mixed-mini-rails"],
)
def test_every_collective_mismatch_is_a_value_error_on_every_rank(env, n, cluster):
    outs = run_ranks(mismatches, world_size=n, cluster=cluster, env=env, timeout=90, pg_timeout=PG_TIMEOUT)
    _assert_mismatches(outs, n)


def strided_and_odd_dtypes(rank: int, n: int) -> dict:
    import torch.distributed as dist

    out = {}
    # item 7: an AVG all_reduce of a strided view changes the view's elements and nothing else
    base = torch.full((10,), float(rank + 1))
    view = base[2:8:2]
    dist.all_reduce(view, op=dist.ReduceOp.AVG)
    out["base"] = base.tolist()
    col = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    dist.broadcast(col[:, 1], src=1)  # a column: stride 4
    out["col"] = col.tolist()
    outs = [torch.zeros(4, 2)[:, 0] for _ in range(n)]  # strided outputs of an all_gather
    dist.all_gather(outs, torch.full((4,), float(rank)))
    out["gathered"] = [o.tolist() for o in outs]
    # item 15: dtypes gloo refuses with "Invalid scalar type"
    for dt in ODD_DTYPES:
        r = {}
        t = torch.full((3,), rank + 1, dtype=torch.float32).to(dt)
        dist.all_reduce(t)
        r["sum"] = t.to(torch.float64).tolist()
        if dt != torch.uint64:
            m = torch.tensor([rank, 7 - rank], dtype=torch.float32).to(dt)
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
            r["max"] = m.to(torch.float64).tolist()
        b = torch.arange(4, dtype=torch.float32).to(dt) if rank == 0 else torch.zeros(4).to(dt)
        dist.broadcast(b, src=0)
        r["bcast"] = b.to(torch.float64).tolist()
        g = [torch.zeros(2).to(dt) for _ in range(n)]
        dist.all_gather(g, torch.full((2,), rank).to(dt))
        r["gather"] = [v.to(torch.float64).tolist() for v in g]
        out[str(dt)] = r
    # int16 wraps exactly like int16 arithmetic
    w = torch.tensor([32767], dtype=torch.int16)
    dist.all_reduce(w)
    out["wrap"] = w.tolist()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", ["1", "0"], ids=["checked", "unchecked"])
def test_strided_views_and_dtypes_gloo_refuses(check):
    n = 2
    outs = run_ranks(strided_and_odd_dtypes, world_size=n, env={"HETCOMM_CHECK": check}, timeout=90, pg_timeout=PG_TIMEOUT)
    for rank, o in enumerate(outs):
        mine = float(rank + 1)
        assert o["base"] == [mine, mine, 1.5, mine, 1.5, mine, 1.5, mine, mine, mine], o["base"]
        col = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1))
        col[:, 1] = torch.tensor([1.0, 5.0, 9.0]) * 2  # rank 1's column
        assert o["col"] == col.tolist()
        assert o["gathered"] == [[float(r)] * 4 for r in range(n)]
        for dt in ODD_DTYPES:
            r = o[str(dt)]
            assert r["sum"] == [3.0] * 3, (dt, r)
            if dt != torch.uint64:
                assert r["max"] == [1.0, 7.0], (dt, r)
            assert r["bcast"] == [0.0, 1.0, 2.0, 3.0], (dt, r)
            assert r["gather"] == [[0.0, 0.0], [1.0, 1.0]], (dt, r)
        assert o["wrap"] == [-2]  # 32767 + 32767 in int16


def uint64_max(rank: int, n: int) -> tuple:
    import torch.distributed as dist

    return _outcome(lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint64), op=dist.ReduceOp.MAX))


@pytest.mark.timeout(60)
def test_a_reduction_gloo_cannot_do_is_refused_clearly_on_every_rank():
    for o in run_ranks(uint64_max, world_size=2, timeout=60, pg_timeout=PG_TIMEOUT):
        assert o[0] == "arguments" and o[1] == [0, 1], o
        assert "MAX of torch.uint64" in o[2] and "Invalid scalar type" not in o[2], o


def a2a_every_dtype(rank: int, n: int) -> list:
    """all_to_all_single of every dtype a tensor can be made of here, as bit patterns (item 4)."""
    import torch.distributed as dist

    bad = []
    for dt in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        esize = dt.itemsize
        mod = 2 if dt == torch.bool else 251  # a bool byte other than 0/1 is not a bool
        pattern = lambda j: torch.arange(n * 2 * 3 * esize, dtype=torch.int32).remainder(mod).add(j).remainder(mod).to(torch.uint8)
        rows = pattern(rank)
        try:
            x = rows.view(dt).reshape(n * 2, 3)
            y = torch.empty_like(x)
        except Exception:  # no plain tensors of this dtype (quantized kinds)
            continue
        try:
            dist.all_to_all_single(y, x)
        except Exception as e:
            bad.append((str(dt), type(e).__name__, str(e)[:200]))
            continue
        want = torch.cat([pattern(j).view(dt).reshape(n * 2, 3)[2 * rank : 2 * rank + 2] for j in range(n)])
        if not torch.equal(y.view(torch.uint8), want.view(torch.uint8)):
            bad.append((str(dt), "wrong bytes", ""))
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", [{}, {"HETCOMM_RAILS": "gloo"}], ids=["shm-board", "gloo"])
def test_all_to_all_single_moves_every_dtype(env):
    for rank, bad in enumerate(run_ranks(a2a_every_dtype, world_size=2, env=env, timeout=90, pg_timeout=PG_TIMEOUT)):
        assert bad == [], f"rank {rank}: {bad}"


def nested_in_callbacks(rank: int, n: int) -> list:
    """PowerSGD's pattern: a future callback that starts another collective and waits for it,
    while earlier async collectives keep the executor busy (so jobs run on its thread)."""
    import torch.distributed as dist

    got = []
    for _ in range(20):
        b = torch.ones(1)
        earlier = dist.all_reduce(torch.ones(64), async_op=True)
        w = dist.all_reduce(torch.ones(1), async_op=True)
        f = w.get_future().then(lambda fut: dist.all_reduce(b, async_op=True).get_future().wait()[0])
        got.append(f.wait().item())
        earlier.wait()
    return got


@pytest.mark.timeout(120)
def test_a_callback_may_start_and_wait_for_another_collective():
    for got in run_ranks(nested_in_callbacks, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT):
        assert got == [2.0] * 20
