"""The measured loop (hetcomm.moe.MeasuredLoop): docs/MOE.md's loop of a user's own runs on real
ranks, its state travels, and it refuses a model without MoE layers."""

from __future__ import annotations

import os
import re
from typing import Any, Dict

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe import MeasuredLoop, MoELayer
from tests.backends.ranks import REPO_ROOT, run_ranks


def _docs_loop_source() -> str:
    text = open(os.path.join(REPO_ROOT, "docs", "MOE.md"), encoding="utf-8").read()
    sec = text[text.index("## The measured loop in your own training loop"):]
    return re.search(r"```python\n(.*?)```", sec, re.S).group(1)


def _run_docs_loop(rank: int, world_size: int, src: str) -> Dict[str, Any]:
    ns: Dict[str, Any] = {}
    exec(compile(src, "docs/MOE.md", "exec"), ns)  # the snippet as printed: model, AdamW, 30 steps
    loop = ns["loop"]
    return {"rows": list(loop.cold.rows), "policy": loop.policy.line(), "owner": list(loop.layers[0].placement.owner),
            "state": sorted(loop.state_dict()), "speed_measured": loop.layers[0].speed.measured}


@pytest.mark.timeout(180)
def test_docs_loop_runs_on_two_ranks_and_takes_the_cold_decision_at_the_due_step():
    res = run_ranks(_run_docs_loop, world_size=2, timeout=150, args=(_docs_loop_source(),))
    for r in res:
        assert r["speed_measured"] and r["state"] == ["cold_moves", "placement"], r
        # speed_every is 5: the speeds' first verdict comes at the second agreement (step 10:
        # the noise includes the drift of each rank's estimate between agreements,
        # hetcomm.moe.speed), and with it the placement by speed
        assert len(r["rows"]) == 1 and r["rows"][0].startswith("layer 0 at step 10: "), r
        assert "speed verdict: not agreed yet" not in r["policy"], r
    assert res[0]["owner"] == res[1]["owner"] and res[0]["policy"] == res[1]["policy"]  # one decision, every rank


def test_state_round_trip_and_a_model_without_moe_layers():
    layer = MoELayer(8, 4, k=2, calibrate=False, replicate=True)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    loop = MeasuredLoop(torch.nn.Sequential(layer), opt)
    assert loop.layers == [layer] and not loop.policy.cold_placement.on  # one rank: nowhere to move
    state = loop.state_dict()
    assert state["placement"]["owner0"].tolist() == [0, 0, 0, 0] and state["cold_moves"]["done"].tolist() == [True]
    again = MeasuredLoop([layer], opt)
    again.load_state_dict(state)
    assert again.cold.rows == [] and loop.after_step(1) == []
    with pytest.raises(ConfigError) as ei:
        MeasuredLoop(torch.nn.Linear(2, 2), opt)
    assert ei.value.key == "moe.layers" and "MoELayer" in str(ei.value)
    with pytest.raises(ConfigError) as ei:  # a saved state of another model (two layers)
        loop.load_state_dict({"cold_moves": {"done": torch.tensor([True, True]), "rows": []}})
    assert ei.value.key == "moe.cold_moves"
