"""A user's loop with the one call (hetcomm.moe.MeasuredLoop) takes the placement decisions
``hetcomm train`` takes, on two real ranks: with given unequal speeds (``--speed oracle``) both place
each layer by speed at the same step, by the same rule; with measured speeds each decides at its
second agreement, as its own verdict says. ``hetcomm train`` prints
its policy at the top of the summary and writes it to the metrics file."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List

import pytest
import torch

from tests.backends.ranks import run_ranks
from tests.ops.jobs import _free_port

_NODE = """  - name: {name}
    count: 1
    device: {{model: {model}, count: {count}, strong: {strong}, tflops: {tflops}}}
    fabric: {fabric}
    nics:
      - {{class: NET_ROCE_GDR, gbps: 200, count: 1}}
"""
_TAIL = """interconnect:
  same_vendor: auto
  cross_vendor: {class: HOST_BRIDGE, gbps: 100, latency_us: 30}
wire_dtype:
  HOST_BRIDGE: fp16
"""


def _clusters(tmp_path) -> Dict[str, str]:
    """``halfspeed``: an A100 rank and a 910B rank at half its datasheet speed; ``equal``: two
    A100 ranks on one node."""
    half = ("name: two-halfspeed\nnode_groups:\n"
            + _NODE.format(name="a100", model="A100-SXM4-80GB", count=1, strong="true", tflops=100, fabric="NVLINK")
            + _NODE.format(name="ascend", model="910B", count=1, strong="false", tflops=50, fabric="HCCS") + _TAIL)
    equal = ("name: two-equal\nnode_groups:\n"
             + _NODE.format(name="a100", model="A100-SXM4-80GB", count=2, strong="true", tflops=100, fabric="NVLINK")
             + _TAIL)
    out = {}
    for name, text in (("halfspeed", half), ("equal", equal)):
        out[name] = str(tmp_path / f"{name}.yaml")
        with open(out[name], "w") as f:
            f.write(text)
    return out


def _train_rank(rank: int, world_size: int, cfg, port: int) -> str:
    import torch.distributed as dist

    from hetcomm.train.loop import last_summary, train_worker

    dist.destroy_process_group()  # train_worker makes its own group, as under torchrun
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train_worker(rank, world_size, cfg)
    return last_summary()["text"]


def _user_rank(rank: int, world_size: int, cluster: str, speed: str) -> Dict[str, Any]:
    """A loop of the user's own: a model with one MoE layer, AdamW, the one call per step."""
    import torch.distributed as dist

    from hetcomm.moe import MeasuredLoop, MoELayer
    from hetcomm.moe.placement.assign import balance_busy_time
    from hetcomm.moe.placement.migration import seconds_per_row
    from hetcomm.moe.policy import policy_of_layers

    torch.manual_seed(0)
    layer = MoELayer(16, 4, k=2, cluster=cluster, replicate=True, speed_pool="device")
    if speed == "oracle":  # the datasheet prior is the truth; agreements bring the busy times
        layer.speed.set_prior(layer.speed.prior, given=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loop = MeasuredLoop(model, opt, policy=policy_of_layers([layer], speed=speed))
    dense = [p for p in model.parameters() if p.requires_grad and not getattr(p, "hetcomm_expert", False)]
    gen = torch.Generator().manual_seed(rank)
    owners: List[List[int]] = []
    expected: List[int] = []
    line_at_decision = ""
    for step in range(1, 13):
        loss = model(torch.randn(32, 16, generator=gen)).square().mean() + 0.01 * layer.l_aux
        opt.zero_grad()
        loss.backward()
        for p in dense:
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
        owners.append(list(layer.placement.owner))
        if not expected and not loop.cold.done[0] and layer.speed_placement_due():
            # what the placement by speed must decide from the agreed busy times and the load
            rows = loop.cold.expert_rows(0)
            expected = balance_busy_time(owners[-1], rows, seconds_per_row(layer))
        undecided = not loop.cold.done[0]
        loop.after_step(step)
        if undecided and loop.cold.done[0]:
            line_at_decision = loop.policy.line()  # the verdict the decision was taken on
    # A restart builds the layer with the initial placement; the loop's state re-places it (and
    # remembers the move), so recovery never depends on the initial placement.
    torch.manual_seed(0)
    fresh = MoELayer(16, 4, k=2, cluster=cluster, replicate=True, speed_pool="device")
    restarted = MeasuredLoop([fresh], None, policy=policy_of_layers([fresh], speed=speed))
    restarted.load_state_dict(loop.state_dict())
    restored = {"owner": list(fresh.placement.owner), "rows": list(restarted.cold.rows), "done": restarted.cold.done}
    return {"rows": list(loop.cold.rows), "line": line_at_decision, "owners": owners, "expected": expected,
            "final": list(layer.placement.owner), "restored": restored}


def _cold_lever(line: str) -> str:
    return re.search(r"cold_placement (on|off) \(([^)]*)\)", line).group(0)


@pytest.mark.timeout(400)
def test_user_loop_and_hetcomm_train_take_the_same_placement_decisions(tmp_path):
    from hetcomm.ops.metrics import read_metrics
    from hetcomm.train.loop import TrainConfig

    clusters = _clusters(tmp_path)
    for kind, speed in (("halfspeed", "oracle"), ("equal", "measured")):
        metrics = str(tmp_path / f"{kind}.jsonl")
        # The decision's step: given speeds have their verdict at once, so the first agreement
        # (step 5) brings what the placement needs; measured ones wait for their second (step 10:
        # the noise includes the drift).
        due = 5 if speed == "oracle" else 10
        cfg = TrainConfig(cluster=clusters[kind], steps=due + 2, experts=4, layers=1, model_dim=16, hidden_dim=32,
                          batch_size=4, seq_len=8, speed=speed, metrics=metrics, snapshot_every=0, probe_every=0,
                          log_every=100, timeout_s=60.0)
        text = run_ranks(_train_rank, 2, cluster=clusters[kind], args=(cfg, _free_port()), timeout=180)[0]
        user = run_ranks(_user_rank, 2, cluster=clusters[kind], args=(clusters[kind], speed), timeout=120)
        lines = text.splitlines()
        assert lines[3].startswith("policy: initial weights"), text  # the policy opens the summary
        cold_row = next(line for line in lines if line.startswith("placement by speed"))
        events = [e for e in read_metrics(metrics).events if e.event == "policy"]
        assert events and events[0].step == 0, events  # written before the first step
        # the verdict each run decided on (measured speeds are each run's own: two runs of equal
        # ranks on a shared host may read them differently, given ones never do)
        train_line = [e for e in events if e.step <= due][-1].detail
        if speed == "oracle":
            assert _cold_lever(train_line) == _cold_lever(user[0]["line"]), (train_line, user[0]["line"])
        for u in user:
            assert u == user[0] or u["rows"] == user[0]["rows"]  # every rank decided the same
        assert len(user[0]["rows"]) == 1 and user[0]["rows"][0].startswith(f"layer 0 at step {due}: "), user[0]["rows"]
        assert f"layer 0 at step {due}: " in cold_row, cold_row  # the same step in hetcomm train
        before, after = user[0]["owners"][due - 1], user[0]["owners"][due]  # around the decision's call
        for u in user:
            assert u["restored"] == {"owner": u["final"], "rows": u["rows"], "done": [True]}, u["restored"]
        if kind == "halfspeed":
            assert "cold_placement on (the agreed speeds differ" in train_line
        # each run placed as its verdict says: by the busy times and the load when the speeds
        # differ, not at all when they are equal
        if "ranks differ" in user[0]["line"]:
            assert after == user[0]["expected"], user[0]
        else:
            assert "ranks equal" in user[0]["line"] and "nothing to move" in user[0]["rows"][0], user[0]
            assert after == before == user[0]["final"]
        if "speed verdict: ranks equal" in train_line:
            assert "nothing to move" in cold_row, (train_line, cold_row)
            assert after == before == user[0]["final"]
