"""The training loop's global loss without a collective of its own (issue 19): each rank's loss in
its own slot, summed in a replica refresh's all-reduce (or, when no refresh runs over the whole
group, one all-reduce of the slots), then added exactly (``math.fsum``). Checked on 4 real ranks:
every rank gets the exact sum of all ranks' losses, carried or not, and the refresh the loss
rode in still copies the owners' weights exactly."""

from __future__ import annotations

import math
from typing import Dict, List

import torch

from tests.backends.ranks import MIXED_MINI, run_ranks

D, F = 8, 16
TRIALS = 30


def _loss_body(rank: int, world_size: int) -> Dict[str, object]:
    import torch.distributed as dist
    from torch import nn

    from hetcomm.moe.placement import ExpertPlacement
    from hetcomm.moe.placement.replicate import HotExpertReplicator
    from hetcomm.train.loop import _loss_slots, _loss_sum

    placement = ExpertPlacement(owner=(0, 1, 2, 3), world_size=world_size)
    torch.manual_seed(rank)
    make = lambda e: nn.Sequential(nn.Linear(D, F), nn.Linear(F, D))  # noqa: E731
    owned = {e: make(e) for e in placement.experts_of(rank)}
    # Candidates 0-2; hot expert 3 lives on rank 3, so its refresh runs over the whole group.
    whole = HotExpertReplicator(placement, rank, (0, 1, 2), make, owned, None, num_hot=1, every=1, alpha=0.0)
    whole.observe(torch.tensor([1.0, 1.0, 1.0, 50.0], dtype=torch.float64))
    # Hot expert 0 lives on candidate 0: its refresh runs over the holders' group only.
    holders = HotExpertReplicator(placement, rank, (0, 1, 2), make, owned, None, num_hot=1, every=1, alpha=0.0)
    holders.observe(torch.tensor([50.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    whole.sync(force=True)
    holders.sync(force=True)
    gen = torch.Generator().manual_seed(99)
    same_plain = same_carried = 0
    left: List[int] = []
    for _ in range(TRIALS):
        losses = (torch.rand(world_size, generator=gen, dtype=torch.float64) * 8).float()  # every rank's
        loss = losses[rank].clone()
        ref = math.fsum(losses.tolist())  # the exact sum of every rank's loss
        plain = _loss_slots(loss, rank, world_size)
        dist.all_reduce(plain)
        same_plain += _loss_sum(plain) == ref
        carried = _loss_slots(loss, rank, world_size)
        carry = [carried]
        holders.sync(force=True, carry=carry)  # the holders' group: not taken
        left.append(len(carry))
        whole.sync(force=True, carry=carry)  # the whole group: summed in the refresh
        left.append(len(carry))
        same_carried += _loss_sum(carried) == ref
    return {
        "same_plain": same_plain, "same_carried": same_carried, "left": left,
        "owned": {e: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist() for e, m in owned.items()},
        "replicas": {e: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()
                     for e, m in {**whole.replicas, **holders.replicas}.items()},
    }


def test_loss_rides_in_the_whole_group_refresh_and_is_the_exact_sum_on_every_rank():
    out = run_ranks(_loss_body, 4, backend="hetcomm", cluster=MIXED_MINI, timeout=180)
    owners = {e: out[r]["owned"][e] for r in range(4) for e in out[r]["owned"]}
    for r in range(4):
        assert out[r]["same_plain"] == TRIALS and out[r]["same_carried"] == TRIALS  # exact, carried or not
        assert out[r]["left"] == [1, 0] * TRIALS  # only the whole group's refresh took the loss
        for e, flat in out[r]["replicas"].items():
            assert flat == owners[e]  # the refresh it rode in is still exact
    assert {e for r in range(3) for e in out[r]["replicas"]} == {0, 3}
