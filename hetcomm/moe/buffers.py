"""Recycled row buffers: re-exported from :mod:`hetcomm.backends.rowpool` (where the token
dispatch, a backend module, can use them without importing the MoE package)."""

from hetcomm.backends.rowpool import MIN_POOL_BYTES, BufferPool, default_pool, empty, zeros

__all__ = ["BufferPool", "MIN_POOL_BYTES", "default_pool", "empty", "zeros"]
