"""The ``hetcomm`` torch.distributed backend and its rails.

``dist.init_process_group("hetcomm")`` builds a :class:`~.process_group.HetcommBackend` (torch's
c10d ``Backend``, torch >= 2.14) or a :class:`~.process_group.HetcommProcessGroup` (torch 2.13);
pass ``pg_options=HetcommOptions(...)`` to choose rails, chunk size, plans and checks.
"""

from hetcomm.backends.checks import splits_agreed
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.registry import register
from hetcomm.backends.stats import reset_stats, stats

__all__ = ["HetcommOptions", "register", "stats", "reset_stats", "hetcomm_group", "splits_agreed", "recv_any", "gather_into_tensor"]


def hetcomm_group(group=None):
    """The hetcomm object behind ``group`` (default: the default group): its
    :class:`~.process_group.HetcommBackend` on torch >= 2.14 (also under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s wrapper), the group itself (a
    :class:`~.process_group.HetcommProcessGroup`) on 2.13. Either has ``rail_names``,
    ``placement``, ``run_plan`` and ``communicator``.

    Raises:
        UsageError: the group does not use backend ``hetcomm``.
    """
    import torch.distributed as dist

    from hetcomm.backends.process_group import face_of
    from hetcomm.errors import UsageError

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    face = face_of(pg)
    if face is None:
        raise UsageError(f"group {pg!r} does not use backend 'hetcomm'; create it with backend='hetcomm'")
    return face


def recv_any(tensor, group=None, tag: int = 0) -> int:
    """Receive ``tensor`` from whichever rank of ``group`` sends first with ``tag``; return the
    sender's global rank (what ``dist.recv(tensor, tag=tag)`` returns on torch 2.13).

    On torch >= 2.14 ``dist.recv`` without ``src`` cannot be served by a Python ``Backend``: c10d
    wraps the Work a Python backend returns in a C++ holder that forwards ``wait`` and
    ``get_future`` only, so its ``_source_rank()`` raises "sourceRank() may only be called on
    work objects that correspond to a recv or recv-from-any call" (after the data arrived).
    This asks the hetcomm face directly; same matching rules as ``dist.recv`` (p2p.py).

    Args:
        tensor: the receive buffer (its dtype and element count must match the message).
        group: a hetcomm group (default: the default group).
        tag: user tag, 0 <= tag < 2**29.

    Raises:
        UsageError: the group does not use backend ``hetcomm``, or a bad tag.
        CrossRankMismatch: the message's dtype or size differs from ``tensor``'s.
    """
    import torch.distributed as dist

    face = hetcomm_group(group)
    work = face.recv_anysource([tensor], tag)
    work.wait()
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return dist.get_global_rank(pg, work.source_rank())


def gather_into_tensor(tensor, gather_tensor=None, dst=None, group=None, async_op: bool = False, group_dst=None):
    """``dist.gather_into_tensor(tensor, gather_tensor, dst, group, async_op, group_dst)`` on a
    hetcomm group, on torch 2.13 and 2.14 alike: every rank's ``tensor`` lands, in group-rank
    order, in ``gather_tensor`` on ``dst``.

    torch 2.14's ``dist.gather_into_tensor`` (and its new name ``dist.gather_single``) cannot
    reach a Python ``Backend``: c10d's pybind11 trampoline does not forward ``gather_single``, so
    it raises "Backend hetcomm does not support gather_single" before hetcomm sees the call;
    torch 2.13 has no such function. This asks the hetcomm face directly, with the cross-rank
    check of every delegated collective (``docs/BACKEND.md``, "Cross-rank checks").

    Args:
        tensor: this rank's input, any shape, ``numel`` elements; the same dtype and ``numel``
            on every rank.
        gather_tensor: on ``dst`` only: ``group size * numel`` elements of ``tensor``'s dtype,
            flat ``[size * numel]`` or stacked ``[size, *tensor.shape]``; ignored elsewhere.
        dst: the destination's global rank (default: global rank 0, as in torch).
        group: a hetcomm group (default: the default group).
        async_op: return the Work instead of waiting for it.
        group_dst: the destination's rank in ``group`` (instead of ``dst``).

    Returns:
        The Work when ``async_op``, else None (``gather_tensor`` holds the result on ``dst``).

    Raises:
        UsageError: the group does not use backend ``hetcomm``; both or neither of ``dst`` and
            ``group_dst`` are usable; no ``gather_tensor`` on ``dst``.
        CrossRankMismatch: on every rank, before any byte moved, when a rank's arguments do not
            fit (wrong ``gather_tensor`` size or dtype on ``dst``, different sizes, dtypes or
            destinations across ranks).
    """
    import torch
    import torch.distributed as dist

    from hetcomm.errors import UsageError

    face = hetcomm_group(group)
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    me = face.communicator.rank
    if dst is not None and group_dst is not None:
        raise UsageError(f"hetcomm gather_into_tensor (rank {me}): pass dst (global rank) or group_dst, not both")
    if group_dst is None:
        global_dst = 0 if dst is None else dst
        try:
            group_dst = dist.get_group_rank(pg, global_dst)
        except (ValueError, RuntimeError) as e:
            raise UsageError(
                f"hetcomm gather_into_tensor (rank {me}): dst {global_dst} is not in the group ({e}); pass a "
                f"global rank of the group, or group_dst"
            ) from e
    if group_dst == me:
        if gather_tensor is None:
            raise UsageError(
                f"hetcomm gather_into_tensor (rank {me}): gather_tensor is required on the destination rank: "
                f"pass a tensor of {face.communicator.world_size} x tensor.numel() elements"
            )
        output = gather_tensor
    else:
        output = torch.empty(0, dtype=tensor.dtype, device=tensor.device)  # unused off the destination
    opts = dist.GatherOptions()
    opts.rootRank = group_dst
    opts.asyncOp = async_op
    work = face.gather_single(output, tensor, opts)
    if async_op:
        return work
    work.wait()
    return None
