"""hetcomm train's heterogeneity parts (hetcomm.train.het_defaults): --chunks parsing; the
MoE-time row from the one rank-speed source. Which levers are on: tests/moe/test_policy.py."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe.speed import SpeedSnapshot
from hetcomm.train.het_defaults import moe_time_summary
from hetcomm.train.loop import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_no_balance_and_chunks_reach_the_config():
    from hetcomm.cli import train as cli

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    cli.add_parser(sub)
    args = p.parse_args(["train", "--no-balance", "--chunks", "2"])
    assert args.no_balance and cli._chunks(args.chunks) == 2
    assert p.parse_args(["train", "--token-split", "auto"]).token_split == "auto"
    assert TrainConfig().token_split == "auto"  # the policy turns it on once the agreed speeds differ
    with pytest.raises(ConfigError) as ei:
        TrainConfig(token_split="sometimes")
    assert ei.value.key == "train.token_split"
    with pytest.raises(ConfigError) as ei:
        cli._chunks("two")
    assert ei.value.key == "train.chunks"
    with pytest.raises(ConfigError) as ei:
        TrainConfig(chunks=0)
    assert ei.value.key == "train.chunks"


def test_balancing_defaults_and_their_knobs():
    assert TrainConfig().balance == "auto" and TrainConfig().speed == "measured"
    for key, value in (("balance", "sometimes"), ("speed", "guessed")):
        with pytest.raises(ConfigError) as ei:
            TrainConfig(**{key: value})
        assert ei.value.key == f"train.{key}"
    from hetcomm.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    cfg = cli.train_config(p.parse_args(["train", "--no-balance"]))
    assert cfg.balance is False and cfg.token_split is False
    assert cli.train_config(p.parse_args(["train", "--speed", "datasheet"])).speed == "datasheet"


def test_measure_chunks_picks_a_candidate_and_leaves_the_layers_there():
    from hetcomm.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(16, 4, k=2, calibrate=False)
    x = torch.randn(32, 16)
    ref = layer(x).detach()
    from hetcomm.train.het_defaults import measure_chunks

    def step():
        layer(x).sum().backward()

    n, times = measure_chunks([layer], step, candidates=(1, 2), repeats=1)
    assert n in (1, 2) and set(times) == {1, 2} and layer.config.num_chunks == n
    assert torch.allclose(layer(x), ref, atol=1e-6)  # chunking never changes the result


def test_compute_bound_config_loads():
    from hetcomm.train.loop import load_train_config

    cfg = load_train_config(os.path.join(REPO, "configs", "train", "compute-bound.yaml"))
    assert cfg.hidden_dim > 4 * cfg.model_dim and os.path.exists(cfg.cluster)


def test_moe_time_row_reads_the_agreed_busy_seconds_of_every_layer():
    from hetcomm.moe import MoELayer

    layers = [MoELayer(8, 4, calibrate=False) for _ in range(2)]
    assert moe_time_summary(layers) == "not measured"  # before an agreement
    for m, secs in zip(layers, ([0.001, 0.003], [0.002, 0.002])):
        m.speed.agreed = SpeedSnapshot((1.0, 1.0), (0.1, 0.1), False, measured=True, agreements=1,
                                       seconds_per_step=tuple(secs))
    # per rank 3 ms and 5 ms: max / mean = 5 / 4
    assert moe_time_summary(layers).startswith("1.25 ") and "4.0 ms/step" in moe_time_summary(layers)
