"""The replica refresh on real ranks: a forced refresh skips the changed-flag all-reduce (issue 19:
fewer collectives per training step) and still leaves every replica equal to its owner."""

from __future__ import annotations

from typing import Dict, List

import torch

from tests.backends.ranks import run_ranks

D, F = 8, 16


def _gloo_ops() -> int:
    import hetcomm

    return int(hetcomm.stats().get("gloo", {}).get("ops", 0))


def _flat(m: torch.nn.Module) -> List[float]:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()


def _refresh_body(rank: int, world_size: int) -> Dict[str, object]:
    from torch import nn

    from hetcomm.moe.placement import ExpertPlacement
    from hetcomm.moe.placement.replicate import HotExpertReplicator

    placement = ExpertPlacement(owner=(0, 1, 0, 1), world_size=2)
    torch.manual_seed(rank)
    make = lambda e: nn.Sequential(nn.Linear(D, F), nn.Linear(F, D))  # noqa: E731
    owned = {e: make(e) for e in placement.experts_of(rank)}
    rep = HotExpertReplicator(placement, rank, (0, 1), make, owned, None, num_hot=2, every=1, alpha=0.0)
    rep.observe(torch.tensor([50.0, 40.0, 1.0, 1.0], dtype=torch.float64))  # hot: 0 (rank 0), 1 (rank 1)
    rep.sync()  # the new replicas take their owners' weights
    ops = {}
    with torch.no_grad():
        for p in owned[rank].parameters():  # an optimizer step on this rank's hot expert
            p.add_(0.25)
    before = _gloo_ops()
    ops["forced_changed"] = (rep.sync(force=True), _gloo_ops() - before)
    before = _gloo_ops()
    ops["unforced_unchanged"] = (rep.sync(), _gloo_ops() - before)
    before = _gloo_ops()
    ops["forced_unchanged"] = (rep.sync(force=True), _gloo_ops() - before)
    return {"ops": ops, "owned": _flat(owned[rank]), "replica": _flat(rep.replicas[1 - rank])}


def test_forced_refresh_skips_the_flag_and_keeps_replicas_equal_to_owners():
    out = run_ranks(_refresh_body, 2, backend="hetcomm", timeout=120)
    for r in (0, 1):
        ops = out[r]["ops"]
        assert ops["forced_changed"] == (True, 1)  # the weights' all-reduce only, no changed flag
        assert ops["unforced_unchanged"] == (False, 1)  # unforced: the flag, which says nothing moved
        assert ops["forced_unchanged"] == (True, 1)  # forced: refreshed anyway, to the same values
        assert out[r]["replica"] == out[1 - r]["owned"]  # bit for bit the owner's weights
