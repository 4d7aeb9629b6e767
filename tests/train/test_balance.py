"""Config checks of ``hetcomm train --balance/--powersgd`` (the runs themselves: tests/moe)."""

from __future__ import annotations

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe.powersgd import FlatBucket
from hetcomm.train.loop import TrainConfig


@pytest.mark.parametrize("key,value", [("powersgd_rank", -1), ("balance_every", 0), ("balance_cooldown", -5)])
def test_bad_balance_and_powersgd_values_name_the_key(key, value):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{key: value})
    assert info.value.key == f"train.{key}"


def test_flat_bucket_views_share_the_buffer():
    buf = torch.arange(10.0)
    b = FlatBucket(0, buf, [torch.Size([2, 3]), torch.Size([4])])
    g = b.gradients()
    g[0][1, 2] = -1.0
    assert buf[5] == -1.0 and g[1].tolist() == [6.0, 7.0, 8.0, 9.0] and b.is_last() and b.index() == 0
    with pytest.raises(ConfigError):
        FlatBucket(0, buf, [torch.Size([3])])
