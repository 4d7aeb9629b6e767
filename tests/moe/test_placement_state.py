"""A placement changed at run time survives a restore (hetcomm.moe.placement.state).

4 real ranks move experts between ranks mid-training (``migrate_now``, as ``hetcomm train``'s
placement by speed does; in layer 0 a rank gives an expert and another gains one), then snapshot into shared memory and checkpoint to disk. A fresh model, built
with the initial placement as a restarted job builds it, restores from each: with the
``LayerPlacements`` extra it takes the moved placement and every expert's weights and Adam
moments by global id; without it the snapshot is refused ("taken by another model"), which is
what stopped every restart of the default ``hetcomm launch -- train`` after its cold move.
"""

from __future__ import annotations

import os

import pytest

from tests.backends.ranks import run_ranks

NODES = ["a100", "a100", "h800", "ascend"]  # mixed-mini's ranks
EXPERTS = 8
#: Layer 0: expert 7 leaves rank 3 for rank 0 (3 experts on rank 0, 1 on rank 3); layer 1: 2 (rank 1)
#: and 5 (rank 2) trade places.
MOVES = {0: [0, 0, 1, 1, 2, 2, 3, 0], 1: [0, 0, 2, 1, 2, 1, 3, 3]}


def _model():
    import torch

    from hetcomm.moe import MoELayer

    torch.manual_seed(0)  # the same initial weights and placement on every rank, as in a restart
    return torch.nn.Sequential(*[MoELayer(8, EXPERTS, k=2, calibrate=False, replicate=False, seed=i) for i in range(2)])


def _step(model, opt, gen) -> None:
    import torch
    import torch.distributed as dist

    x = torch.randn(6, 8, generator=gen)
    opt.zero_grad()
    model(x).square().sum().backward()
    experts = {id(p) for layer in model for p in layer.experts.parameters()}
    for p in model.parameters():  # the dense (gate) weights stay one copy, as a training loop keeps them
        if id(p) not in experts and p.grad is not None:
            dist.all_reduce(p.grad)
    opt.step()


def _by_expert(model, opt):
    """Global (layer, expert) -> (weights, Adam exp_avg) of the experts this rank owns."""
    out = {}
    for i, layer in enumerate(model):
        for j, e in enumerate(layer.local_expert_ids):
            params = list(layer.experts.experts[j].parameters())
            out[(i, e)] = ([p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params])
    return out


def _same(a, b) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(a[k][0] + a[k][1], b[k][0] + b[k][1])) for k in a
    )


def _move_then_restore(rank: int, world_size: int, root: str):
    import torch
    import torch.distributed as dist

    from hetcomm.errors import CheckpointError
    from hetcomm.moe.placement.migration import migrate_now
    from hetcomm.moe.placement.state import LayerPlacements
    from hetcomm.ops.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from hetcomm.ops.snapshot import Snapshotter

    os.environ["HETCOMM_SNAPSHOT_ROOT"] = os.path.join(root, NODES[rank])
    os.environ["HETCOMM_JOB_ID"] = "placement"
    os.makedirs(os.environ["HETCOMM_SNAPSHOT_ROOT"], mode=0o700, exist_ok=True)
    model = _model()
    initial = [list(layer.placement.owner) for layer in model]
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    _step(model, opt, gen)
    moved = {i: migrate_now(model[i], MOVES[i], opt) for i in MOVES}
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    _step(model, opt, gen)
    # every expert held now is in the optimizer and took both steps (a gained module's too)
    steps = sorted({float(opt.state[p]["step"]) for layer in model for p in layer.experts.parameters()})
    held = all(id(p) in in_opt for layer in model for p in layer.experts.parameters())
    counts = [len(layer.local_expert_ids) for layer in model]
    snap = Snapshotter(rank, world_size, NODES, every=1, peer=True, timeout_s=30)
    extras = {"placement": LayerPlacements(list(model))}
    snap.take(2, model, opt, gen, extras)
    snap.close(remove=False)
    ck_dir = os.path.join(root, "ck")
    save_checkpoint(ck_dir, 2, model, opt, gen, extras)
    want = _by_expert(model, opt)
    probe = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))
    want_out = model(probe).detach()

    results = {"moved": moved, "initial": initial, "steps": steps, "held": held, "counts": counts,
               "opt_params": sum(len(g["params"]) for g in opt.param_groups)}
    # A restarted job builds the initial placement; without the extra the snapshot cannot load.
    bare = _model()
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=0.01)
    try:
        Snapshotter(rank, world_size, NODES, every=1, peer=True, timeout_s=30).restore(
            bare, bare_opt, torch.Generator())
        results["bare"] = "loaded"
    except CheckpointError as e:
        results["bare"] = str(e)
    dist.barrier()
    for source in ("snapshot", "checkpoint"):
        fresh = _model()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        fresh_gen = torch.Generator()
        placements = LayerPlacements(list(fresh), fresh_opt)
        if source == "snapshot":
            got = Snapshotter(rank, world_size, NODES, every=1, peer=True, timeout_s=30).restore(
                fresh, fresh_opt, fresh_gen, {"placement": placements})
            assert got is not None and got.step == 2
        else:
            load_checkpoint(latest_checkpoint(ck_dir), fresh, fresh_opt, fresh_gen, {"placement": placements})
        results[source] = {
            "owner": [list(layer.placement.owner) for layer in fresh],
            "restored_layers": placements.restored,
            "same_state": _same(want, _by_expert(fresh, fresh_opt)),
            "same_output": torch.equal(fresh(probe).detach(), want_out),
            "same_stream": torch.equal(fresh_gen.get_state(), gen.get_state()),
            "opt_params": sum(len(g["params"]) for g in fresh_opt.param_groups),
        }
    return results


@pytest.mark.timeout(180)
def test_a_moved_placement_comes_back_from_snapshots_and_checkpoints(tmp_path):
    res = run_ranks(_move_then_restore, 4, args=(str(tmp_path),), timeout=150)
    for rank, r in enumerate(res):
        assert r["initial"] == [[0, 0, 1, 1, 2, 2, 3, 3]] * 2, r["initial"]
        assert r["moved"] == {0: [7], 1: [2, 5]}, r["moved"]
        assert r["counts"] == [[3, 2, 2, 1][rank], 2], r["counts"]
        assert r["held"] and r["steps"] == [2.0], (rank, r)
        # rank 0 only gained expert 7: its bare model loads what it had and silently lacks 7
        assert rank == 0 or "taken by another model" in r["bare"], (rank, r["bare"])
        for source in ("snapshot", "checkpoint"):
            got = r[source]
            assert got["owner"] == [MOVES[0], MOVES[1]], (rank, source, got)
            assert got["restored_layers"] == [0, 1], (rank, source, got)
            assert got["same_state"] and got["same_output"] and got["same_stream"], (rank, source, got)
            assert got["opt_params"] == r["opt_params"], (rank, source, got)


def test_a_saved_placement_that_does_not_fit_is_refused_by_layer():
    import torch

    from hetcomm.errors import ConfigError
    from hetcomm.moe import MoELayer
    from hetcomm.moe.placement.state import LayerPlacements

    layers = [MoELayer(8, 4, calibrate=False), MoELayer(8, 4, calibrate=False)]
    state = LayerPlacements(layers).state_dict()
    assert [t.tolist() for t in state.values()] == [[0, 0, 0, 0]] * 2
    LayerPlacements(layers).load_state_dict(state)  # the same map: nothing changes
    with pytest.raises(ConfigError, match="MoE layer 1: the saved placement names 3 experts"):
        LayerPlacements(layers).load_state_dict({"owner0": state["owner0"], "owner1": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ConfigError, match="no placement of MoE layer 1"):
        LayerPlacements(layers).load_state_dict({"owner0": state["owner0"]})
    with pytest.raises(ConfigError, match="MoE layer 1: the saved placement gives rank 0 no expert"):
        LayerPlacements(layers).load_state_dict({"owner0": state["owner0"],
                                                 "owner1": torch.tensor([1, 1, 1, 1], dtype=torch.int64)})
