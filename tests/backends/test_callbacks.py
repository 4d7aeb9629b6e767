"""Collectives launched from a Work's future callbacks (issue 23.1), on real ranks.

torch's communication hooks chain futures whose callbacks start further collectives and wait for
them (``powerSGD_hook``). On a hetcomm group every such collective must run and complete — routed
(``all_to_all_single``) and delegated (``all_reduce``) alike, on every rail (``mixed-mini``:
shm, gloo and bridge pairs), on a *subgroup* of a larger job too — with the results gloo gives
(the reference runs the same bodies over gloo). A callback that raises reaches ``wait()``.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.ranks import MIXED_MINI, run_ranks

PG_TIMEOUT = 30.0

# Two subgroups of the 4-rank mixed-mini job: {0,1,3} has shm (0-1) and bridge (x-3) pairs,
# {1,2,3} gloo (1-2) and bridge pairs.
SUBGROUPS = ([0, 1, 3], [1, 2, 3])


def _chain_of_three(group, rank_in_group: int, size: int) -> list:
    """all_to_all_single -> (callback) all_reduce -> (callback) all_to_all_single, each callback
    starting the next collective and waiting for it inside the callback (powerSGD_hook's
    pattern), plus a ``Work.then`` style chain that returns the next future instead."""
    import torch.distributed as dist

    x = torch.arange(2 * size, dtype=torch.float32) + 100 * rank_in_group
    out = torch.empty_like(x)

    def second(fut):
        y = fut.value()[0].clone()
        dist.all_reduce(y, group=group, async_op=True).get_future().wait()
        return y

    def third(fut):
        y = fut.value().clone()
        o = torch.empty_like(y)
        dist.all_to_all_single(o, y * (rank_in_group + 1), group=group, async_op=True).get_future().wait()
        return o

    first = dist.all_to_all_single(out, x, group=group, async_op=True)
    waited = first.get_future().then(second).then(third).wait()

    # Returned futures instead of waits: each callback launches and hands back the next future.
    z = torch.full((3,), float(rank_in_group + 1))
    f = dist.all_reduce(z, group=group, async_op=True).get_future()
    f = f.then(lambda fu: dist.all_to_all_single(torch.empty(size * 2), torch.arange(size * 2, dtype=torch.float32) + fu.value()[0][0], group=group, async_op=True).get_future())
    f = f.then(lambda fu: fu.value().wait()[0])
    returned = f.wait()
    return [waited.tolist(), returned.tolist()]


def chains(rank: int, n: int) -> dict:
    import torch.distributed as dist

    out = {}
    if n == 2:
        out["world"] = _chain_of_three(None, rank, n)
        return out
    for ranks in SUBGROUPS:
        sub = dist.new_group(ranks)  # the default group's backend: hetcomm (or gloo, the reference)
        if rank in ranks:
            out[tuple(ranks)] = _chain_of_three(sub, ranks.index(rank), len(ranks))
    dist.barrier()  # nobody leaves while a peer still uses a subgroup
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_chain_of_three_collectives_from_callbacks_matches_gloo(world_size):
    ref = run_ranks(chains, world_size=world_size, backend="gloo", timeout=120, pg_timeout=PG_TIMEOUT)
    got = run_ranks(chains, world_size=world_size, cluster=MIXED_MINI if world_size == 4 else None, timeout=120, pg_timeout=PG_TIMEOUT)
    assert got == ref
    assert all(r for r in got)  # every rank ran at least one chain


def ddp_hooks(rank: int, n: int, ranks: list) -> dict:
    """DDP on a (sub)group with torch's powerSGD_hook and batched_powerSGD_hook."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    # torch 2.13's batched_powerSGD_hook hands _orthogonalize the 2-D [side, r] Q where it wants a
    # batch of matrices and raises AssertionError on every backend (gloo too): give it the batch of
    # one it expects (a view: orthogonalised in place), the same patch in the gloo reference run.
    orthogonalize = powersgd._orthogonalize
    powersgd._orthogonalize = lambda m, epsilon=0: orthogonalize(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)
    group = dist.new_group(ranks) if len(ranks) < n else None
    results = {}
    if rank not in ranks:
        dist.barrier()  # stay until the members are done: an early exit breaks their gloo pairs
        return results
    for name, hook in (("powerSGD_hook", powersgd.powerSGD_hook), ("batched_powerSGD_hook", powersgd.batched_powerSGD_hook)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = DDP(model, process_group=group, bucket_cap_mb=0.001)
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=7)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(5):
            loss = ddp(torch.randn(8, 16, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        results[name] = [p.detach().clone() for p in model.parameters()]
    dist.barrier()
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,ranks", [(2, [0, 1]), (4, [0, 1, 3])], ids=["2-ranks", "subgroup-of-4"])
def test_powersgd_hooks_on_a_hetcomm_group_match_gloo(world_size, ranks):
    ref = run_ranks(ddp_hooks, world_size=world_size, backend="gloo", args=(ranks,), timeout=150, pg_timeout=PG_TIMEOUT, start_method="spawn")
    got = run_ranks(
        ddp_hooks, world_size=world_size, args=(ranks,), cluster=MIXED_MINI if world_size == 4 else None,
        timeout=150, pg_timeout=PG_TIMEOUT, start_method="spawn",
    )
    for rank in ranks:
        for name in ("powerSGD_hook", "batched_powerSGD_hook"):
            for a, b in zip(got[rank][name], ref[rank][name]):
                assert torch.equal(a, b), f"rank {rank} {name}: parameters differ from DDP over gloo"


def raising_callback(rank: int, n: int) -> list:
    """A callback that raises: its error reaches wait() on the caller, for routed and delegated
    Works; the group stays usable afterwards (a later collective started from a callback runs)."""
    import torch.distributed as dist

    seen = []

    def boom(fut):
        raise KeyError(f"callback failed on rank {rank}")

    for launch in (
        lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n), async_op=True),
        lambda: dist.all_reduce(torch.ones(2), async_op=True),
    ):
        fut = launch().get_future().then(boom)
        try:
            fut.wait()
        except Exception as e:  # torch wraps a callback's error in a RuntimeError with its text
            seen.append(f"callback failed on rank {rank}" in str(e))
        else:
            seen.append(False)
    after = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(
        lambda f: dist.all_to_all_single(torch.empty(n), torch.full((n,), 2.0), async_op=True).get_future().wait()[0]
    ).wait()
    seen.append(after.tolist())
    return seen


@pytest.mark.timeout(120)
def test_a_callback_that_raises_reaches_wait():
    for got in run_ranks(raising_callback, world_size=2, timeout=90, pg_timeout=PG_TIMEOUT):
        assert got == [True, True, [2.0, 2.0]]
