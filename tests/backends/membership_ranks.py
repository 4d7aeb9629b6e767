"""Rank bodies of the membership-change tests (``test_reconfigure.py``) and of
``benchmarks/reconfigure_time.py``: five processes over one store, four members and a joiner.

Ranks 0-3 create the group (``enable_reconfigure=True``, then a first reconfigure over the four
handles: torch's contract, on gloo and hetcomm alike), run the collectives, and rank 3 kills
itself with SIGKILL. The survivors shrink to three (``dist.shrink_group([3])`` where the
backend supports shrinking, else a reconfigure over the survivors' handles: gloo), run the
collectives; rank 4, the joiner, creates a group of one over the same store (the same c10d
prefix) and the four reconfigure together; the collectives run once more. Each member returns
what every collective produced, per membership, and the seconds each change took.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist


def collectives(tag: int) -> Dict[str, List[float]]:
    """all_reduce, all_to_all_single (uneven splits) and broadcast (from rank 1) of the default
    group; inputs depend on the rank, the size and ``tag`` only (the same on every backend)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.arange(6, dtype=torch.float32, device="cpu") * (rank + 1) + tag  # host: CPU groups
    dist.all_reduce(x)
    in_splits = [(rank + p) % 3 + 1 for p in range(size)]
    out_splits = [(p + rank) % 3 + 1 for p in range(size)]
    inp = torch.arange(sum(in_splits), dtype=torch.float32, device="cpu") + 100 * rank + tag  # host: CPU groups
    out = torch.empty(sum(out_splits), dtype=torch.float32, device="cpu")  # host: CPU groups
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    b = torch.full((4,), float(rank * 10 + tag), device="cpu")  # host: CPU groups
    dist.broadcast(b, src=1)
    return {"rank": [float(rank)], "size": [float(size)], "all_reduce": x.tolist(), "all_to_all_single": out.tolist(),
            "broadcast": b.tolist()}


def served_by() -> str:
    """Which object serves the default group's CPU tensors, and over how many ranks its
    communicator runs (``HetcommBackend/4``; gloo: ``ProcessGroupGloo``). On hetcomm,
    ``hetcomm.communicator()`` must be the backend's own communicator, serving this very group."""
    import hetcomm

    pg = dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    if dist.get_backend() != "hetcomm":
        return type(backend).__name__
    comm = hetcomm.communicator()
    if comm is not backend.communicator or comm.group is not pg:
        return f"{type(backend).__name__}: hetcomm.communicator() is not the backend's, or serves another group"
    from hetcomm.backends import hetcomm_group

    return f"{type(backend).__name__}/{comm.world_size} " + ",".join(hetcomm_group().rail_names("cpu"))


def _handles(store, key: str, n: int) -> List[str]:
    return [store.get(f"{key}/{r}").decode() for r in range(n)]


def _change(store, key: str, uuid: int, mine: int, n: int, timeout: timedelta) -> float:
    """Publish this member's handle under ``key``, read all ``n``, reconfigure; the seconds it took."""
    store.set(f"{key}/{mine}", dist._get_reconfigure_handle())
    handles = _handles(store, key, n)
    t0 = time.perf_counter()
    dist._reconfigure(uuid=uuid, handles=handles, timeout=timeout).wait()
    return time.perf_counter() - t0


def member(backend: str, timeout_s: float = 20.0) -> Dict[str, Any]:
    """One process of the run (its role from ``RANK``: 0-3 members, 4 the joiner); ``timeout_s``
    bounds every wait (the group's, the store's, each change's).

    Returns:
        ``{"four" | "three" | "grown": collectives(...), "served": {...}, "seconds": {"shrink",
        "grow"}}`` for the phases this process took part in.
    """
    role = int(os.environ["RANK"])
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 5, False, timeout=timeout)
    import hetcomm  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    out: Dict[str, Any] = {"seconds": {}}
    if role == 4:  # the joiner: a group of one, configured by the grow
        store.wait(["shrunk"], timedelta(seconds=120))
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, enable_reconfigure=True)
        out["seconds"]["grow"] = _change(store, "grow", 3, 3, 4, timeout)
        out["grown"] = collectives(2)
        out["served"] = {"grown": served_by()}
        dist.destroy_process_group()
        return out
    dist.init_process_group(backend, store=store, rank=role, world_size=4, timeout=timeout, enable_reconfigure=True)
    _change(store, "start", 1, role, 4, timeout)
    out["four"] = collectives(0)
    if role == 3:
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 3 took part: it dies after its last collective
    t0 = time.perf_counter()
    pg = dist.distributed_c10d._get_default_group()
    if _shrinks(pg):
        dist.shrink_group([3])
    else:
        _change(store, "shrink", 2, role, 3, timeout)
    out["seconds"]["shrink"] = time.perf_counter() - t0
    out["three"] = collectives(1)
    out["served"] = {"three": served_by()}
    if role == 0:
        store.set("shrunk", "1")
    out["seconds"]["grow"] = _change(store, "grow", 3, role, 4, timeout)
    out["grown"] = collectives(2)
    out["served"]["grown"] = served_by()
    dist.destroy_process_group()
    return out


def _shrinks(pg) -> bool:
    """Whether ``pg``'s backend supports ``dist.shrink_group`` (gloo on torch 2.14: no)."""
    try:
        return bool(pg._get_backend(torch.device("cpu")).supports_shrinking)
    except Exception:  # noqa: BLE001 - no CPU backend
        return False
