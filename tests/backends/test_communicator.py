"""hetcomm.Communicator: one per group, over hetcomm and plain gloo groups, any world size."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.backends.ranks import MIXED_MINI, run_ranks


def _identity(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import hetcomm

    comm = hetcomm.communicator()
    again = hetcomm.communicator(dist.group.WORLD)
    direct = hetcomm.Communicator()
    return {
        "same": again is comm,
        "rank": comm.rank,
        "world_size": comm.world_size,
        "group_ok": comm.group is dist.group.WORLD,
        "direct_is_cached": direct is comm,
        "placement": len(comm.placement.ranks),
        "cluster": comm.cluster.name if comm.cluster else None,
        "wire_to_0": str(comm.wire_dtype(0, torch.float32, policy="cluster")),
        "wire_int": comm.wire_dtype(0, torch.int64, policy="fp16"),
        "wire_widen": comm.wire_dtype((rank + 1) % world_size, torch.float16, policy="fp32"),
        "stats": isinstance(comm.stats(), dict),
        "bad_policy": _raises_config_error(lambda: comm.wire_dtype(0, torch.float32, policy="fp8")),
        "narrow": str(comm.wire_dtype((rank + 1) % world_size, torch.float32, policy="bf16")) if world_size > 1 else "torch.bfloat16",
    }


def _raises_config_error(fn) -> bool:
    from hetcomm.errors import ConfigError

    try:
        fn()
    except ConfigError:
        return True
    return False


def test_communicator_on_hetcomm_group_is_the_groups_own():
    out = run_ranks(_identity, world_size=2, timeout=60)
    for r, o in enumerate(out):
        assert o["same"] and o["group_ok"] and o["rank"] == r and o["world_size"] == 2
        assert o["placement"] == 2 and o["stats"] and o["wire_int"] is None and o["wire_widen"] is None
        assert o["bad_policy"] and o["narrow"] == "torch.bfloat16"
    # One's own rows are never cast; the other rank's wire follows the (hostname) policy: fp32.
    assert out[0]["wire_to_0"] == "None" and out[1]["wire_to_0"] == "None"


def test_communicator_on_gloo_group_with_cluster():
    out = run_ranks(_identity, world_size=4, backend="gloo", cluster=MIXED_MINI, timeout=60)
    for r, o in enumerate(out):
        assert o["same"] and o["direct_is_cached"] is False and o["rank"] == r and o["world_size"] == 4
        assert o["cluster"] is not None and o["placement"] == 4


def test_communicator_world_size_one():
    out = run_ranks(_identity, world_size=1, backend="gloo", timeout=60)
    assert out[0]["rank"] == 0 and out[0]["world_size"] == 1 and out[0]["wire_to_0"] == "None"


def test_import_hetcomm_stays_cheap():
    code = (
        "import sys, torch, hetcomm; "
        "bad = [m for m in ('hetcomm.backends.communicator', 'hetcomm.backends.process_group') if m in sys.modules]; "
        "assert not bad, bad; assert not torch.cuda.is_initialized(); "
        "assert callable(hetcomm.communicator); hetcomm.Communicator; assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
