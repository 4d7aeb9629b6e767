"""Registration of backend ``"hetcomm"`` with torch.distributed.

``import hetcomm`` calls :func:`register`; so does torch itself at ``import torch`` through the
``torch.backends`` entry point (``hetcomm:_autoload``), so a script that never imports hetcomm can
still call ``dist.init_process_group("hetcomm")``. The creator (torch's extended API: it gets
c10d's ``_DistributedBackendOptions`` and ``pg_options``) builds one face per group (default group
and every ``new_group(backend="hetcomm")``), with ``pg_options`` as its :class:`HetcommOptions`:

* torch >= 2.14: a :class:`~hetcomm.backends.process_group.HetcommBackend` (torch's c10d
  ``Backend``). c10d registers it in the ``ProcessGroup`` it made (``opts.process_group``) for
  every device of :func:`supported_devices` under ``BackendType.CUSTOM`` (``register_backend``
  maps a plugin's name to CUSTOM), after wrapping it in a ``_ProcessGroupWrapper`` under
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``;
* torch 2.13: a :class:`~hetcomm.backends.process_group.HetcommProcessGroup` (a Python
  ``ProcessGroup``), which c10d takes as the group itself.
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
    from hetcomm.backends.process_group import HetcommBackend, HetcommProcessGroup, backend_subclassable

    args = (opts.store, opts.group_rank, opts.group_size, opts.timeout)
    kwargs = dict(options=backend_options, global_ranks=list(opts.global_ranks_in_group or []), group_id=str(opts.group_id))
    if backend_subclassable():
        # init_process_group(enable_reconfigure=True): torch >= 2.14 only, where this face is used
        return HetcommBackend(*args, process_group=opts.process_group, enable_reconfigure=bool(opts.enable_reconfigure),
                              **kwargs)
    return HetcommProcessGroup(*args, **kwargs)


def register() -> None:
    """Register backend "hetcomm" with torch.distributed (idempotent)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if BACKEND_NAME.upper() in dist.Backend.__dict__ and dist.Backend._plugins.get(BACKEND_NAME.upper()):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=supported_devices())
