"""The ``hetcomm`` torch.distributed backend and its rails.

``dist.init_process_group("hetcomm")`` builds a :class:`HetcommProcessGroup`; pass
``pg_options=HetcommOptions(...)`` to choose rails, chunk size, plans and checks.
"""

from hetcomm.backends.checks import splits_agreed
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.registry import register
from hetcomm.backends.stats import reset_stats, stats

__all__ = ["HetcommOptions", "register", "stats", "reset_stats", "hetcomm_group", "splits_agreed"]


def hetcomm_group(group=None):
    """The :class:`HetcommProcessGroup` behind ``group`` (default: the default group).

    Raises:
        UsageError: the group does not use backend ``hetcomm``.
    """
    import torch.distributed as dist

    from hetcomm.backends.process_group import HetcommProcessGroup
    from hetcomm.errors import UsageError

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, HetcommProcessGroup):
        raise UsageError(f"group {pg!r} does not use backend 'hetcomm'; create it with backend='hetcomm'")
    return pg
