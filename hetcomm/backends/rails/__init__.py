"""Rails: one transport each (``shm``, ``gloo``, ``nccl``, ``hccl``, ``bridge``) behind :class:`Rail`."""

from hetcomm.backends.rails.base import Rail, RailOp, Xfer, as_bytes

__all__ = ["Rail", "RailOp", "Xfer", "as_bytes"]
