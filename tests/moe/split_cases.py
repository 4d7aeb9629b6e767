"""Rank bodies for the per-step token split tests (``tests/moe/test_token_split.py``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from tests.moe.cases import zipf_gate_input, zipf_gate_weight


def split_vs_static(
    rank: int,
    world_size: int,
    speeds: Sequence[float],
    hot: Sequence[int],
    owner: Optional[Sequence[int]] = None,
    num_experts: int = 12,
    steps: int = 3,
) -> Dict[str, Any]:
    """A layer whose hot experts are split per step among copies on every rank vs the same
    layer without copies: outputs, input and parameter gradients, parameters after SGD steps."""
    from hetcomm.moe import MoELayer
    from hetcomm.moe.placement import ExpertPlacement

    E, D, T = num_experts, 24, 96
    w = zipf_gate_weight(E, D, 1.2)
    placement = ExpertPlacement(tuple(owner), world_size) if owner is not None else None

    def make(split: bool):
        layer = MoELayer(
            D, E, k=2, dropless=True, calibrate=False, wire_dtype="fp32", placement=placement,
            replicate=split, token_split=split, replicate_top=len(hot), replicate_every=10**6, speed_every=0,
            expert=lambda d: torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.GELU(), torch.nn.Linear(16, d)),
        )
        with torch.no_grad():
            layer.gate.wg.weight.copy_(w)
        return layer

    a, b = make(True), make(False)
    a.replicator.set_hot(hot)
    a.speed.set_prior(speeds)
    params_a = [p for p in a.parameters() if p.requires_grad]
    params_b = [p for p in b.parameters() if p.requires_grad]
    opt_a = torch.optim.SGD(params_a, lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD(params_b, lr=0.05, momentum=0.9)
    out = {"out": 0.0, "x_grad": 0.0, "grad": 0.0, "param": 0.0, "rows": [], "received": [], "predicted_mm": [], "split_experts": []}
    for step in range(steps):
        x = zipf_gate_input(T, E, D, 1.2, seed=300 + 10 * step + rank)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = a(xa), b(xb)
        out["out"] = max(out["out"], float((ya - yb).detach().abs().max()))
        ya.square().mean().backward()
        yb.square().mean().backward()
        out["x_grad"] = max(out["x_grad"], float((xa.grad - xb.grad).abs().max()))
        for pa, pb in zip(params_a, params_b):
            ga = pa.grad if pa.grad is not None else torch.zeros_like(pa)
            gb = pb.grad if pb.grad is not None else torch.zeros_like(pb)
            out["grad"] = max(out["grad"], float((ga - gb).abs().max()))
        st = a.step_stats()
        out["rows"].append(st.get("moe_rows"))
        out["received"].append(sum(st["rows_per_expert"]))
        out["predicted_mm"].append(st.get("moe_time_predicted_max_over_mean"))
        out["split_experts"].append(st.get("split_experts"))
        opt_a.step(); opt_b.step(); opt_a.zero_grad(); opt_b.zero_grad()
    for pa, pb in zip(params_a, params_b):
        out["param"] = max(out["param"], float((pa - pb).detach().abs().max()))
    out["num_replicas"] = len(a.replicator.replicas)
    return out


def auto_split_follows_the_verdict(rank: int, world_size: int, speeds: Sequence[float]) -> Dict[str, Any]:
    """A layer built with the default ``token_split="auto"`` under a :class:`MeasuredLoop`: the
    given speeds' verdict (known from the start) decides whether the hot experts' rows are split."""
    from hetcomm.moe import MeasuredLoop, MoELayer

    E, D, T = 8, 16, 64
    layer = MoELayer(D, E, k=2, dropless=True, calibrate=False, wire_dtype="fp32", replicate=True, replicate_top=2,
                     replicate_every=10**6, speed_every=0)
    with torch.no_grad():
        layer.gate.wg.weight.copy_(zipf_gate_weight(E, D, 1.2))
    layer.replicator.set_hot([0, 1])
    layer.speed.set_prior(speeds, given=True)
    opt = torch.optim.SGD([p for p in layer.parameters() if p.requires_grad], lr=0.05)
    loop = MeasuredLoop(layer, opt)
    split_experts = []
    for step in range(1, 3):
        layer(zipf_gate_input(T, E, D, 1.2, seed=50 + step + rank).requires_grad_(True)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        loop.after_step(step)
        split_experts.append(layer.step_stats().get("split_experts"))
    return {"on": layer.token_split_on, "lever": str(loop.policy.token_split), "split_experts": split_experts}


def speed_agreement(rank: int, world_size: int) -> Dict[str, Any]:
    """Layers measure their expert compute and agree one vector every 2 steps; rank 1's experts
    are made slower (the expert spins on the CPU: busy time, not a sleep, which the busy clock
    rightly does not count), which the agreed vector must show. The hot set (one expert,
    refreshed every 2 steps) then goes to the measured-fastest rank only."""
    import time

    from hetcomm.moe import MoELayer
    from hetcomm.moe.cold import ColdMoves

    class Slow(torch.nn.Module):
        def __init__(self, d: int, delay: float):
            super().__init__()
            self.lin = torch.nn.Linear(d, d)
            self.delay = delay

        def forward(self, x):
            if x.size(0) and self.delay:
                spent = time.thread_time() + self.delay
                while time.thread_time() < spent:  # CPU seconds of this thread: compute, however loaded
                    pass
            return self.lin(x)

    delay = 0.05 if rank == 1 else 0.0
    layer = MoELayer(16, 4, k=2, dropless=True, calibrate=False, speed_every=2, expert=lambda d: Slow(d, delay),
                     replicate=True, replicate_top=1, replicate_every=2)
    cold = ColdMoves([layer], enabled=True)
    seen: List[Any] = []
    for step in range(6):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(rank * 10 + step + 3))
        layer(x).sum().backward()
        st = layer.step_stats()
        seen.append((st["speed_agreements"], st["speed_measured"], st["speed_rows_per_s"]))
    layer.sync_replicas()  # collective: the refresh at step 6 (after an agreement with a verdict) lands
    rep = layer.replicator
    before = list(layer.placement.owner)
    due = layer.speed_placement_due()
    rows = cold.expert_rows(0)
    events = cold.after_step(6, None)  # collective: the placement by the measured busy time
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(99))
    layer(x).sum().backward()  # the layer runs on the new map (replicas rebuilt from the new owners)
    return {"seen": seen, "local": layer.speed.local_speed(), "room": layer.speed.room, "holders": rep.holders,
            "differ": layer.speed.differ, "noise": layer.speed.noise,
            "replicas": sorted(rep.replicas), "hot": rep.hot, "due": due, "events": events, "before": before,
            "owner": list(layer.placement.owner), "rows": rows}
