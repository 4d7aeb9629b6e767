"""hetcomm as torch's c10d ``Backend`` (torch >= 2.14): DeviceMesh, DTensor, FSDP2, functional
collectives, each equal bit for bit to the same thing on gloo in the same job; and what the
Backend face cannot serve (``dist.recv`` without ``src``, ``dist.gather_into_tensor``) next to
hetcomm's replacement (the gather one runs on torch 2.13 too).

Every test runs one job of 4 real rank processes whose default group is ``hetcomm`` and builds
its gloo twin beside it (``init_device_mesh(..., backend_override=...)`` / ``new_group(backend=
"gloo")``), so both see the same inputs and the comparison is direct. The ranks run under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which wraps every backend in torch's ``_ProcessGroupWrapper``
(collective fingerprints checked across ranks before each call); that needs fresh interpreters
(``spawn``): torch reads the variable once, at import.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import run_ranks

_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
needs_214 = pytest.mark.skipif(_TORCH < (2, 14), reason="torch's c10d Backend is subclassable from Python from torch 2.14")
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
STEPS = 20


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, rank: int, reduce_group) -> list:
    """``STEPS`` SGD steps on this rank's own batches; the per-step loss averaged over
    ``reduce_group`` (a plain all_reduce, so every rank returns the same list)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        t = local.detach().clone()
        dist.all_reduce(t, group=reduce_group)
        losses.append(t)
    return losses


def _faces(mesh) -> list:
    """The backend class behind every dimension of ``mesh`` (hetcomm's face, or the raw one)."""
    from hetcomm.backends.process_group import face_of

    out = []
    for i in range(mesh.ndim):
        g = mesh.get_group(i)
        face = face_of(g)
        out.append(type(face).__name__ if face is not None else type(g._get_backend(torch.device("cpu"))).__name__)
    return out


# -- (a) FSDP2 on a 1-D mesh ------------------------------------------------------------------
def fsdp_1d(rank: int, n: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for backend, override in (("hetcomm", None), ("gloo", {0: "gloo"})):
        mesh = init_device_mesh("cpu", (n,), backend_override=override) if override else init_device_mesh("cpu", (n,))
        model = _model(0)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out[backend] = _train(model, rank, mesh.get_group(0))
        out[backend + "_faces"] = _faces(mesh)
    return out


@needs_214
@pytest.mark.timeout(240)
def test_fsdp2_on_1d_mesh_matches_gloo():
    got = run_ranks(fsdp_1d, world_size=4, timeout=180, env=DETAIL, start_method="spawn")
    for rank, r in enumerate(got):
        assert r["hetcomm_faces"] == ["HetcommBackend"], r["hetcomm_faces"]
        assert r["gloo_faces"] == ["_ProcessGroupWrapper"], r["gloo_faces"]  # DETAIL really wrapped
        assert len(r["hetcomm"]) == STEPS
        for step, (a, b) in enumerate(zip(r["hetcomm"], r["gloo"])):
            assert torch.equal(a, b), f"rank {rank} step {step}: loss {a.item()!r} on hetcomm, {b.item()!r} on gloo"
    assert not torch.equal(got[0]["hetcomm"][0], got[0]["hetcomm"][-1])  # it trained


# -- (b) a 2-D mesh: DTensor redistribution and FSDP x TP ------------------------------------
def _redistributions(mesh, rank: int) -> dict:
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, DTensor

    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12) / 7.0
    out = {}
    cases = {
        "shard_to_replicate": ([Shard(0), Shard(1)], [Replicate(), Replicate()]),
        "replicate_to_shard": ([Replicate(), Replicate()], [Shard(0), Shard(1)]),
        "shard0_to_shard1": ([Shard(0), Shard(0)], [Shard(1), Shard(1)]),
        "shard0_to_shard1_dim1": ([Replicate(), Shard(0)], [Replicate(), Shard(1)]),
    }
    for name, (src, dst) in cases.items():
        d = distribute_tensor(full, mesh, src).redistribute(mesh, dst)
        out[name] = (d.to_local().clone(), d.full_tensor())
    # Partial -> Replicate: every rank's own addend, summed over both dims (an all_reduce each)
    mine = torch.full((4, 6), float(rank) + 0.25) * torch.arange(24, dtype=torch.float32).reshape(4, 6)
    p = DTensor.from_local(mine, mesh, [Partial(), Partial()]).redistribute(mesh, [Replicate(), Replicate()])
    out["partial_to_replicate"] = (p.to_local().clone(), p.full_tensor())
    return out


def _fsdp_tp(mesh, rank: int) -> list:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model(1)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return _train(model, rank, None)


def mesh_2d(rank: int, n: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    names = ("dp", "tp")
    for backend, override in (("hetcomm", None), ("gloo", {"dp": "gloo", "tp": "gloo"})):
        kw = {"backend_override": override} if override else {}
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names, **kw)
        out[backend + "_faces"] = _faces(mesh)
        out[backend + "_redistribute"] = _redistributions(mesh, rank)
        out[backend + "_train"] = _fsdp_tp(mesh, rank)
    return out


@needs_214
@pytest.mark.timeout(240)
def test_2d_mesh_dtensor_and_fsdp_tp_match_gloo():
    got = run_ranks(mesh_2d, world_size=4, timeout=180, env=DETAIL, start_method="spawn")
    for rank, r in enumerate(got):
        assert r["hetcomm_faces"] == ["HetcommBackend", "HetcommBackend"], r["hetcomm_faces"]
        for name, (local, full) in r["hetcomm_redistribute"].items():
            ref_local, ref_full = r["gloo_redistribute"][name]
            assert torch.equal(local, ref_local) and torch.equal(full, ref_full), f"rank {rank}: {name} differs from gloo"
        for step, (a, b) in enumerate(zip(r["hetcomm_train"], r["gloo_train"])):
            assert torch.equal(a, b), f"rank {rank} step {step}: loss {a.item()!r} on hetcomm, {b.item()!r} on gloo"
    assert len(got[0]["hetcomm_train"]) == STEPS
    assert not torch.equal(got[0]["hetcomm_train"][0], got[0]["hetcomm_train"][-1])
    # the redistributions moved data (a rank's Shard(1) piece is not its Shard(0) piece)
    local, _ = got[0]["hetcomm_redistribute"]["shard0_to_shard1"]
    assert local.shape == (8, 3)


# -- (c) functional collectives ---------------------------------------------------------------
def functional(rank: int, n: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    import hetcomm
    from hetcomm.backends import HetcommOptions, hetcomm_group

    out = {}
    # what the default group and a subgroup with pg_options are made of, under DETAIL's wrapper
    sub = dist.new_group([0, 1], backend="hetcomm", pg_options=HetcommOptions(chunk_bytes=1 << 20))
    out["faces"] = [
        type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__,
        type(hetcomm_group()).__name__,
        hetcomm.communicator() is hetcomm_group().communicator,
        dist.group.WORLD._get_backend(torch.device("cpu")).name(),
        hetcomm.communicator(sub).options.chunk_bytes if rank < 2 else None,
    ]
    groups = {"hetcomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    x = (torch.arange(n * 6, dtype=torch.float32).reshape(n * 2, 3) + 100 * rank) / 3.0
    splits_in = [(rank + j) % 3 for j in range(n)]
    splits_out = [(j + rank) % 3 for j in range(n)]
    rows = torch.arange(sum(splits_in) * 2, dtype=torch.float32).reshape(-1, 2) + 10 * rank
    for name, g in groups.items():
        r = {}
        r["all_reduce"] = fc.all_reduce(x, "sum", g) + 0  # "+ 0" waits (AsyncCollectiveTensor)
        r["all_reduce_max"] = fc.all_reduce(x, "max", g) + 0
        r["all_gather_tensor"] = fc.all_gather_tensor(x, 0, g) + 0
        r["all_gather_dim1"] = fc.all_gather_tensor(x, 1, g) + 0
        r["reduce_scatter_tensor"] = fc.reduce_scatter_tensor(x, "sum", 0, g) + 0
        r["all_to_all_single"] = fc.all_to_all_single(x, None, None, g) + 0
        r["all_to_all_uneven"] = fc.all_to_all_single(rows, splits_out, splits_in, g) + 0
        out[name] = r
    return out


@needs_214
@pytest.mark.timeout(240)
def test_functional_collectives_match_gloo():
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    got = run_ranks(functional, world_size=4, timeout=180, env=DETAIL, start_method="spawn")
    for rank, r in enumerate(got):
        assert r["faces"] == ["_ProcessGroupWrapper", "HetcommBackend", True, "hetcomm", (1 << 20) if rank < 2 else None], r["faces"]
        assert r["hetcomm"].keys() == r["gloo"].keys()
        for op, v in r["hetcomm"].items():
            assert torch.equal(v, r["gloo"][op]), f"rank {rank}: {op} differs from gloo"


# -- a torch 2.14 limit: dist.recv without src --------------------------------------------
def recv_without_src(rank: int, n: int) -> dict:
    import torch.distributed as dist

    from hetcomm.backends import recv_any

    out = {}
    if rank == 1:
        dist.send(torch.tensor([5.0]), 0, tag=2)
        dist.send(torch.tensor([6.0]), 0, tag=2)
    else:
        buf = torch.zeros(1)
        try:
            out["src"] = dist.recv(buf, tag=2)
        except RuntimeError as e:
            out["error"] = str(e).splitlines()[0]
        out["delivered"] = buf.item()
        buf = torch.zeros(1)
        out["recv_any"] = (recv_any(buf, tag=2), buf.item())
    return out


@needs_214
@pytest.mark.timeout(120)
def test_recv_without_src_needs_recv_any_on_the_backend_face():
    # c10d hands a Python Backend's Work back in a C++ holder that forwards wait/get_future
    # only: dist.recv(src=None) gets the data, then its work._source_rank() raises.
    got = run_ranks(recv_without_src, world_size=2, timeout=90)[0]
    assert got["error"].startswith("sourceRank() may only be called on work objects"), got
    assert got["delivered"] == 5.0
    assert got["recv_any"] == (1, 6.0)


# -- gather_into_tensor: hetcomm.backends.gather_into_tensor (torch 2.14 cannot forward dist's) --
#: (dtype, input shape, output on dst: flat or stacked, global dst)
_GATHER_CASES = (
    (torch.float32, (2, 3), "stacked", 1),
    (torch.int64, (5,), "flat", 3),
    (torch.bfloat16, (3, 1, 2), "flat", 2),
    (torch.float64, (0,), "flat", 1),
    (torch.int16, (4, 2), "stacked", 3),  # gloo refuses int16: hetcomm moves its bytes
)


def _gather_input(rank: int, case: int, dtype: torch.dtype, shape) -> torch.Tensor:
    numel = int(torch.Size(shape).numel())
    return (torch.arange(numel, dtype=torch.float64) * (case + 2) - 7 * rank - 0.5 * case).to(dtype).reshape(shape)


def _gloo_gather_into_tensor(x, o, dst: int, group) -> None:
    """gloo's result of a gather into one tensor: its list gather into ``o``'s rows (gloo has no
    ``gather_single`` on torch 2.14.1 either: "Backend gloo does not support gather_single")."""
    import torch.distributed as dist

    rows = list(o.view(dist.get_world_size(group), *x.shape).unbind(0)) if o is not None else None
    dist.gather(x, rows, dst=dst, group=group)


def gather_into_tensor(rank: int, n: int) -> dict:
    import warnings

    import torch.distributed as dist

    from hetcomm.backends import gather_into_tensor as het_gather
    from hetcomm.errors import CrossRankMismatch

    warnings.simplefilter("ignore", FutureWarning)  # torch 2.14: gather_into_tensor is gather_single's old name
    groups = {"hetcomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    # a subgroup whose group ranks differ from the global ones (dst 3 is group rank 2)
    sub_ranks = [1, 2, 3]
    subs = {"hetcomm": dist.new_group(sub_ranks, backend="hetcomm"), "gloo": dist.new_group(sub_ranks, backend="gloo")}
    out = {}
    for name in ("hetcomm", "gloo"):
        gather = het_gather if name == "hetcomm" else _gloo_gather_into_tensor
        r = {}
        for case, (dtype, shape, form, dst) in enumerate(_GATHER_CASES):
            if dtype == torch.int16 and name == "gloo":
                continue
            x = _gather_input(rank, case, dtype, shape)
            o = None
            if rank == dst:
                o = torch.full((n, *shape) if form == "stacked" else (n * x.numel(),), 99, dtype=dtype)
            gather(x, o, dst=dst, group=groups[name])
            r[case] = o
        if rank in sub_ranks:
            x = _gather_input(rank, 10, torch.float32, (2, 2))
            o = torch.zeros(len(sub_ranks), 2, 2) if rank == 3 else None
            gather(x, o, dst=3, group=subs[name])
            r["subgroup"] = o
        out[name] = r
    # async_op, group_dst, and a strided view of a bigger tensor as the destination
    x = _gather_input(rank, 9, torch.float32, (4,))
    base = torch.zeros(n, 8)
    work = het_gather(x, base[:, ::2] if rank == 2 else None, group_dst=2, async_op=True)
    work.wait()
    out["async_strided"] = base if rank == 2 else None
    # dist's own function: torch 2.14.1 serves it on no CPU backend (hetcomm: the trampoline does
    # not forward gather_single; gloo: not implemented); torch 2.13 has none
    if hasattr(dist, "gather_into_tensor"):
        for name, g in groups.items():
            try:
                dist.gather_into_tensor(x, torch.zeros(n * 4) if rank == 0 else None, dst=0, group=g)
                out["dist_" + name] = "served"
            except RuntimeError as e:
                out["dist_" + name] = str(e).splitlines()[0]
    # a wrong output size on dst 2: every rank raises, before any byte moved; the group goes on
    x = torch.ones(3)
    o = torch.zeros(n * 3 + 1) if rank == 2 else None
    try:
        het_gather(x, o, dst=2)
        out["bad"] = ("ok",)
    except CrossRankMismatch as e:
        out["bad"] = (type(e).__name__, e.field, e.ranks, str(e))
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = t.item()
    return out


@pytest.mark.timeout(240)
def test_gather_into_tensor_matches_gloo():
    got = run_ranks(gather_into_tensor, world_size=4, timeout=180, env=DETAIL, start_method="spawn")
    n = 4
    for rank, r in enumerate(got):
        for case, (dtype, shape, form, dst) in enumerate(_GATHER_CASES):
            v = r["hetcomm"][case]
            if rank != dst:
                assert v is None
                continue
            want = torch.stack([_gather_input(p, case, dtype, shape) for p in range(n)])
            assert v.dtype == dtype and v.shape == ((n, *shape) if form == "stacked" else (want.numel(),))
            assert torch.equal(v.reshape(want.shape), want), f"case {case} on dst {dst}: {v} != {want}"
            if dtype != torch.int16:
                assert torch.equal(v, r["gloo"][case]), f"case {case}: hetcomm {v} != gloo {r['gloo'][case]}"
        if rank == 3:
            want = torch.stack([_gather_input(p, 10, torch.float32, (2, 2)) for p in (1, 2, 3)])
            assert torch.equal(r["hetcomm"]["subgroup"], want) and torch.equal(r["gloo"]["subgroup"], want)
        if rank == 2:
            base = r["async_strided"]
            want = torch.stack([_gather_input(p, 9, torch.float32, (4,)) for p in range(n)])
            assert torch.equal(base[:, ::2], want) and not base[:, 1::2].any(), base  # only the view's elements
        if _TORCH >= (2, 14):
            for name in ("hetcomm", "gloo"):
                assert r["dist_" + name] == f"Backend {name} does not support gather_single", r["dist_" + name]
        kind, field, ranks, msg = r["bad"]
        assert (kind, field, ranks) == ("CrossRankMismatch", "arguments", [2]), r["bad"]
        assert msg.startswith("hetcomm gather_into_tensor: invalid arguments, detected on rank") and "rank 2 refused its own arguments" in msg, msg
        if rank == 2:
            assert "13 elements" in msg and "4 x 3 elements" in msg and "pass a tensor of shape (4 * tensor.numel(),)" in msg, msg
        assert r["after"] == 4.0
