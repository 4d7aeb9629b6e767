"""Registration of backend ``"hetcomm"`` with torch.distributed.

``import hetcomm`` calls :func:`register`; so does torch itself at ``import torch`` through the
``torch.backends`` entry point (``hetcomm:_autoload``), so a script that never imports hetcomm can
still call ``dist.init_process_group("hetcomm")``. The creator builds one
:class:`~hetcomm.backends.process_group.HetcommProcessGroup` per group (default group and every
``new_group(backend="hetcomm")``), with ``pg_options`` as its :class:`HetcommOptions`.
"""

from __future__ import annotations

from typing import List

from hetcomm.backends.options import HetcommOptions

__all__ = ["register", "HetcommOptions", "BACKEND_NAME", "supported_devices"]

BACKEND_NAME = "hetcomm"


def supported_devices() -> List[str]:
    """``["cpu"]`` plus ``cuda`` / ``npu`` where this process can use them (always a list)."""
    import torch

    devices = ["cpu"]
    try:
        # device_count() asks NVML first and leaves CUDA uninitialised; is_available() calls
        # cudaGetDeviceCount, which initialises the driver: done at import in the test
        # launcher's forkserver, every rank forked from it would then fail to use CUDA.
        if torch.cuda.device_count() > 0:
            devices.append("cuda")
    except Exception:
        pass
    npu = getattr(torch, "npu", None)
    try:
        if npu is not None and npu.is_available():
            devices.append("npu")
    except Exception:
        pass
    return devices


def _create(opts, backend_options):
    """The extended-API creator: ``opts`` is c10d's ``_DistributedBackendOptions``."""
    from hetcomm.backends.process_group import HetcommProcessGroup

    return HetcommProcessGroup(
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
        options=backend_options,
        global_ranks=list(opts.global_ranks_in_group or []),
        group_id=str(opts.group_id),
        # torch >= 2.14's init_process_group(enable_reconfigure=True); 2.13's options lack the field
        enable_reconfigure=bool(getattr(opts, "enable_reconfigure", False)),
    )


def register() -> None:
    """Register backend "hetcomm" with torch.distributed (idempotent)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if BACKEND_NAME.upper() in dist.Backend.__dict__ and dist.Backend._plugins.get(BACKEND_NAME.upper()):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=supported_devices())
