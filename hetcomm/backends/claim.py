"""One process per rank of a store: refuse to join another job's store.

A second job started with a running job's ``MASTER_ADDR:MASTER_PORT`` has its rank 0 fail to
bind the port, but its other ranks connect to the *first* job's store as clients, read that job's
keys and complete ``init_process_group`` on them, then time out much later with a misleading
message. So before a hetcomm group publishes anything, every rank *claims* its rank in the
group's store with ``compare_set`` (atomic in every c10d store): the first claim of
``hetcomm/claim/<rank>`` wins and holds ``<job id>|<host>|<pid>|<process token>``; a later claim by
another process, or a group size other than the one the store's first rank recorded
(``hetcomm/claim/world_size``), is a foreign store: a :class:`~hetcomm.errors.ConfigError`
(``key="MASTER_PORT"``) at once, naming the job that owns the store. Nothing is written over, so
the first job is unharmed.

The same process may claim again (a group re-created after ``destroy_process_group`` reuses its
store prefix). torchrun prefixes the store per restart attempt, so restarted workers claim fresh
keys. The job id is torchrun's ``TORCHELASTIC_RUN_ID`` where set (for the message only).
"""

from __future__ import annotations

import os
import socket
import uuid

from hetcomm.errors import ConfigError

__all__ = ["claim_rank"]

#: This process's token: the same for every group this process creates.
_TOKEN = uuid.uuid4().hex[:12]


def _identity() -> str:
    job = os.environ.get("TORCHELASTIC_RUN_ID", "") or "-"
    return f"{job}|{socket.gethostname()}|{os.getpid()}|{_TOKEN}"


def _describe(identity: str) -> str:
    job, host, pid, _ = (identity.split("|") + ["?"] * 4)[:4]
    return f"pid {pid} on {host}" + (f" (job {job})" if job not in ("-", "?") else "")


def claim_rank(store, rank: int, size: int, where: str = "hetcomm group") -> None:
    """Claim ``rank`` of a group of ``size`` in ``store`` (see the module docstring).

    Raises:
        ConfigError: another process holds this rank, or the store's group has another size.
    """
    me = _identity()
    recorded = store.compare_set("hetcomm/claim/world_size", "", str(size)).decode()
    if recorded != str(size):
        raise ConfigError(
            f"{where} (rank {rank} of {size}): this store belongs to another job: its group has "
            f"{recorded} ranks, this process expects {size}. A second job was started with a running "
            f"job's MASTER_ADDR:MASTER_PORT; give each job its own MASTER_PORT (or --rdzv-endpoint)",
            key="MASTER_PORT",
        )
    holder = store.compare_set(f"hetcomm/claim/{rank}", "", me).decode()
    if holder != me:
        raise ConfigError(
            f"{where} (rank {rank} of {size}): rank {rank} of this store is already held by "
            f"{_describe(holder)}; this process ({_describe(me)}) joined another job's store. A second "
            f"job was started with a running job's MASTER_ADDR:MASTER_PORT; give each job its own "
            f"MASTER_PORT (or --rdzv-endpoint)",
            key="MASTER_PORT",
        )
