"""One uninterrupted 4-rank run of the tiny job, shared by the metrics, report and resume tests."""

from __future__ import annotations

import pytest

from tests.ops.jobs import CHECKPOINT_EVERY, STEPS, TINY, train_ranks


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """``STEPS`` steps of the tiny job with metrics and a checkpoint every ``CHECKPOINT_EVERY``
    steps, on real ranks: returns (directory, metrics file, checkpoint directory)."""
    from hetcomm.train.loop import load_train_config

    d = tmp_path_factory.mktemp("demo")
    metrics, ck = str(d / "m.jsonl"), str(d / "ck")
    # balance=False: no balancer state in the checkpoints (a resume that adds --balance is refused:
    # test_checkpoint_safety), and no decision from measured timings
    cfg = load_train_config(TINY, steps=STEPS, metrics=metrics, checkpoint_dir=ck, checkpoint_every=CHECKPOINT_EVERY,
                            balance=False, keep_checkpoints=0)  # every step's checkpoint: tests resume from several
    codes = train_ranks(cfg)
    # The loss verdict of a few tiny steps is not the point here (1 = the loss did not fall enough).
    assert codes[0] in (0, 1)
    return d, metrics, ck
