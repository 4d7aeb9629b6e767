"""hetcomm train's heterogeneity defaults (hetcomm.train.het_defaults): the split is on for a
mixed cluster, off on an equal one or with --no-balance; --chunks parsing; the MoE-time row."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import load_cluster
from hetcomm.train.het_defaults import MoETimeTracker, cluster_is_mixed, resolve_chunks, token_split_default
from hetcomm.train.loop import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cluster(name):
    return load_cluster(os.path.join(REPO, "configs", "clusters", name))


def test_split_on_for_mixed_clusters_only():
    mixed, half, equal = _cluster("mixed-mini.yaml"), _cluster("mixed-mini-halfspeed.yaml"), _cluster("mixed-mini-equal.yaml")
    assert cluster_is_mixed(mixed, 4) and cluster_is_mixed(half, 4)
    assert token_split_default(None, True, mixed, 4) and token_split_default(None, True, half, 4)
    assert token_split_default(None, True, equal, 4) == cluster_is_mixed(equal, 4)
    assert not token_split_default(False, True, mixed, 4)  # --no-balance
    assert not token_split_default(None, False, mixed, 4)  # no copies to split among
    assert not token_split_default(True, True, mixed, 1)


def test_no_balance_and_chunks_reach_the_config():
    from hetcomm.cli import train as cli

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    cli.add_parser(sub)
    args = p.parse_args(["train", "--no-balance", "--chunks", "2"])
    assert args.no_balance and cli._chunks(args.chunks) == 2
    assert p.parse_args(["train", "--token-split", "auto"]).token_split == "auto"
    assert TrainConfig().token_split is False
    with pytest.raises(ConfigError) as ei:
        TrainConfig(token_split="sometimes")
    assert ei.value.key == "train.token_split"
    with pytest.raises(ConfigError) as ei:
        cli._chunks("two")
    assert ei.value.key == "train.chunks"
    with pytest.raises(ConfigError) as ei:
        TrainConfig(chunks=0)
    assert ei.value.key == "train.chunks"
    assert resolve_chunks("auto", torch.device("cpu"))[0] == 1 and resolve_chunks(3, torch.device("cpu"))[0] == 3


def test_moe_time_row_is_the_median_max_over_mean():
    table = [[9.0, 1.0]] + [[1.0, 1.0]] * 5 + [[3.0, 1.0]] * 6  # the first step is skipped as warm-up
    assert MoETimeTracker.summary(table).startswith("1.50 ")
