"""The ``hetcomm`` torch.distributed backend and its rails.

``dist.init_process_group("hetcomm")`` builds a :class:`~.process_group.HetcommBackend` (torch's
c10d ``Backend``, torch >= 2.14) or a :class:`~.process_group.HetcommProcessGroup` (torch 2.13);
pass ``pg_options=HetcommOptions(...)`` to choose rails, chunk size, plans and checks.
"""

from hetcomm.backends.checks import splits_agreed
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.registry import register
from hetcomm.backends.stats import reset_stats, stats

__all__ = ["HetcommOptions", "register", "stats", "reset_stats", "hetcomm_group", "splits_agreed", "recv_any"]


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
