"""Checkpoints through torch.distributed.checkpoint: bit-identical round trip, 4 -> 2 resharding."""

from __future__ import annotations

import os

import pytest
import torch

from tests.backends.ranks import MIXED_MINI, run_ranks

D, E = 16, 8


def _lm(replicate: bool = True):
    from hetcomm.moe import MoELayer
    from hetcomm.train.lm import LMConfig, MoETransformerLM

    cfg = LMConfig(vocab_size=32, seq_len=8, model_dim=D, num_layers=2, num_experts=E, hidden_dim=32)
    torch.manual_seed(0)
    # The datasheet's speeds (speed_every=0) have their verdict from the start, so copies come
    # from the first step (measured ones wait for theirs, at step 10).
    return MoETransformerLM(
        cfg, lambda i: MoELayer(D, E, k=2, replicate=replicate, replicate_every=1, speed_every=0, seed=i,
                                cluster=MIXED_MINI)
    )


def _train_steps(model, opt, gen, steps: int) -> None:
    import torch.distributed as dist

    for _ in range(steps):
        tokens = torch.randint(0, 32, (4, 9), generator=gen)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():  # average everything: enough to change every weight
            if p.grad is not None and not getattr(p, "hetcomm_expert", False):
                dist.all_reduce(p.grad)
        opt.step()
        for m in model.moe_layers:
            m.sync_replicas()


def _round_trip(rank: int, world_size: int, root: str):
    from hetcomm.ops.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    model = _lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    _train_steps(model, opt, gen, 4)  # long enough for replicas (every=1) to exist
    save_checkpoint(root, 4, model, opt, gen)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(opt.param_groups[0]["params"])}
    rng_before = gen.get_state().clone()
    hot_before = [m.replicator.hot for m in model.moe_layers]
    ema_before = [m.replicator.ema.clone() for m in model.moe_layers]

    fresh = _lm()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_gen = torch.Generator().manual_seed(999)
    differs = any(not torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    step = load_checkpoint(latest_checkpoint(root), fresh, fresh_opt, fresh_gen)
    after = fresh.state_dict()
    bad = [k for k in before if not torch.equal(before[k], after[k])]
    opt_after = {i: fresh_opt.state[p] for i, p in enumerate(fresh_opt.param_groups[0]["params"])}
    bad += [f"optim {i}" for i, s in opt_before.items() if set(s) != set(opt_after[i])]
    bad += [f"optim {i}.{k}" for i, s in opt_before.items() for k, v in s.items() if not torch.equal(v, opt_after[i].get(k))]
    if not torch.equal(rng_before, fresh_gen.get_state()):
        bad.append("rng")
    if [m.replicator.hot for m in fresh.moe_layers] != hot_before:
        bad.append("hot")
    if any(not torch.equal(a, m.replicator.ema) for a, m in zip(ema_before, fresh.moe_layers)):
        bad.append("ema")
    # Replicas hold their owners' loaded weights: the next step is the same on both models.
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(rank))
    same_out = torch.equal(model(tokens[:, :-1], tokens[:, 1:])[1], fresh(tokens[:, :-1], tokens[:, 1:])[1])
    return {"step": step, "differs": differs, "bad": bad, "same_out": same_out, "hot": hot_before}


def test_round_trip_is_bit_identical_on_the_same_world_size(tmp_path):
    results = run_ranks(_round_trip, world_size=4, cluster=MIXED_MINI, args=(str(tmp_path),), timeout=120)
    for r, res in enumerate(results):
        assert res["step"] == 4
        assert res["differs"], "a fresh model must differ from the trained one, or the test proves nothing"
        assert res["bad"] == [], f"rank {r}: not restored bit for bit: {res['bad']}"
        assert res["same_out"], f"rank {r}: the reloaded model computes another loss"
    assert any(h for res in results for h in res["hot"]), "no replicas were made: the replicated set went untested"
    assert os.path.exists(tmp_path / "latest")
    assert any(n.endswith(".distcp") for n in os.listdir(tmp_path / "step-00000004"))


def _layer():
    from hetcomm.moe import MoELayer

    return MoELayer(D, E, k=2, dropless=True, wire_dtype="fp32", seed=7)


class _Holder(torch.nn.Module):
    def __init__(self, layer) -> None:
        super().__init__()
        self.moe = layer


def _inputs() -> torch.Tensor:
    return torch.randn(64, D, generator=torch.Generator().manual_seed(42))


def _save_on_four(rank: int, world_size: int, root: str):
    from hetcomm.ops.checkpoint import save_checkpoint

    model = _Holder(_layer())
    with torch.no_grad():  # weights that a freshly built layer cannot have
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(int(p.numel()))) * 0.1)
    x = _inputs()
    model.eval()
    with torch.no_grad():
        out = model.moe(x)
    save_checkpoint(root, 1, model)
    return out, list(model.moe.local_expert_ids)


def _load_on_two(rank: int, world_size: int, root: str):
    from hetcomm.ops.checkpoint import latest_checkpoint, load_checkpoint

    model = _Holder(_layer())
    model.eval()
    x = _inputs()
    with torch.no_grad():
        fresh = model.moe(x)
    load_checkpoint(latest_checkpoint(root), model)
    with torch.no_grad():
        out = model.moe(x)
    return fresh, out, list(model.moe.local_expert_ids)


def test_four_rank_checkpoint_loads_on_two_ranks_with_identical_outputs(tmp_path):
    saved = run_ranks(_save_on_four, world_size=4, args=(str(tmp_path),), timeout=90)
    ref = saved[0][0]
    assert all(torch.equal(o, ref) for o, _ in saved)  # gate weights equal everywhere: same output
    assert sorted(e for _, ids in saved for e in ids) == list(range(E))
    loaded = run_ranks(_load_on_two, world_size=2, args=(str(tmp_path),), timeout=90)
    assert sorted(e for _, _, ids in loaded for e in ids) == list(range(E))
    assert all(len(ids) == E // 2 for _, _, ids in loaded)  # each rank now owns experts of two old ranks
    for r, (fresh, out, _) in enumerate(loaded):
        assert not torch.allclose(fresh, ref), "a fresh layer already matches: the test proves nothing"
        assert torch.equal(out, ref), f"rank {r}: max diff {(out - ref).abs().max().item()}"


def _load_on_three(rank: int, world_size: int, root: str):
    # A shrunk job places its experts for its own ranks (hetcomm.ops.membership: by measured
    # speed per device model): here unevenly, 3/3/2 by weights 2, 2, 1.
    from hetcomm.moe import MoELayer
    from hetcomm.moe.placement import place_experts
    from hetcomm.ops.checkpoint import latest_checkpoint, load_checkpoint

    placement = place_experts(E, world_size, rank_weights=[2.0, 2.0, 1.0])
    model = _Holder(MoELayer(D, E, k=2, dropless=True, wire_dtype="fp32", seed=7, placement=placement))
    model.eval()
    load_checkpoint(latest_checkpoint(root), model)
    with torch.no_grad():
        out = model.moe(_inputs())
    return out, list(model.moe.local_expert_ids)


def test_four_rank_checkpoint_restores_every_expert_by_id_on_three_ranks(tmp_path):
    # 4 -> 3 (a node of one rank lost for good): no world size divides the other, every expert
    # comes back from whichever old rank saved it, under the new, uneven placement.
    saved = run_ranks(_save_on_four, world_size=4, args=(str(tmp_path),), timeout=90)
    ref = saved[0][0]
    loaded = run_ranks(_load_on_three, world_size=3, args=(str(tmp_path),), timeout=90)
    ids = [i for _, i in loaded]
    assert sorted(e for i in ids for e in i) == list(range(E))
    assert [len(i) for i in ids] == [3, 3, 2]
    old_owner = {e: r for r, (_, i) in enumerate(saved) for e in i}
    assert any(len({old_owner[e] for e in i}) > 1 for i in ids)  # a new rank holds experts of two old ones
    for r, (out, _) in enumerate(loaded):
        assert torch.equal(out, ref), f"rank {r}: max diff {(out - ref).abs().max().item()}"


def test_missing_key_names_it(tmp_path):
    from hetcomm.errors import ConfigError
    from hetcomm.moe import MoELayer
    from hetcomm.ops.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(str(tmp_path), 3, _Holder(MoELayer(D, 4, k=2, seed=1)))
    with pytest.raises(ConfigError) as e:
        load_checkpoint(str(tmp_path / "step-00000003"), _Holder(MoELayer(D, 6, k=2, seed=1)))
    assert e.value.key is not None and e.value.key.startswith("expert/moe/")
