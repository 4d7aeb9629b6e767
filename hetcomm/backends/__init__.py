"""The ``hetcomm`` torch.distributed backend and its rails.

``dist.init_process_group("hetcomm")`` builds a :class:`~.process_group.HetcommBackend` (torch's
c10d ``Backend``, torch >= 2.14) or a :class:`~.process_group.HetcommProcessGroup` (torch 2.13);
pass ``pg_options=HetcommOptions(...)`` to choose rails, chunk size, plans and checks.
"""

from hetcomm.backends.checks import splits_agreed
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.registry import register
from hetcomm.backends.stats import reset_stats, stats

__all__ = ["HetcommOptions", "register", "stats", "reset_stats", "hetcomm_group", "splits_agreed"]


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
