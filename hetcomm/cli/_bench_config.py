"""``hetcomm bench`` configuration: collectives, datatypes, rails, sizes, :class:`BenchConfig` (identical on every rank)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from hetcomm import settings
from hetcomm.errors import UsageError
from hetcomm.units import format_bytes, parse_size  # noqa: F401  (format_bytes re-exported)


COLLECTIVES = ("alltoall", "allreduce")

# nccl-tests type names first (the table prints them), then accepted aliases.
DATATYPES: Dict[str, str] = {
    "int8": "int8",
    "char": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int": "int32",
    "int64": "int64",
    "half": "half",
    "float16": "half",
    "fp16": "half",
    "float": "float",
    "float32": "float",
    "fp32": "float",
    "double": "double",
    "float64": "double",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
_TORCH_DTYPE = {
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "bfloat16": "bfloat16",
}
_ITEMSIZE = {
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "half": 2,
    "float": 4,
    "double": 8,
    "bfloat16": 2,
}

# AVG and PRODUCT are left out on purpose: gloo has no AVG, and an exact PRODUCT check would
# overflow every small integer type after a few ranks.
REDOPS = ("sum", "max", "min")

# Rails the backend issue defines; the backend itself decides which exist on this machine.
KNOWN_RAILS = settings.RAIL_NAMES  # the one vocabulary (hetcomm.settings)

def parse_bytes(text: str, flag: str = "size") -> int:
    """A byte count as nccl-tests reads ``-b/-e``: ``8``, ``1K``, ``1.5M``, ``1G`` (powers of 2).

    The one size parser of every command (:func:`hetcomm.units.parse_size`); ``flag`` is named
    in the error.

    Raises:
        UsageError: not a whole, positive number of bytes up to 1 TiB.
    """
    return parse_size(text, what=flag)


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run needs; identical on every rank.

    Attributes:
        collective: ``alltoall`` or ``allreduce``.
        minbytes / maxbytes: first and last message size, bytes per rank.
        stepfactor: multiply the size by this between rows (> 1), or 1 to add ``stepbytes``.
        stepbytes: bytes added between rows when ``stepfactor`` is 1.
        iters: timed iterations per size and variant.
        warmup_iters: untimed iterations before the timed ones, per size and variant.
        check: verify the results of one extra call per size and variant (``#wrong``).
        datatype: nccl-tests type name (a key of the table in :data:`DATATYPES` values).
        redop: ``none`` for alltoall, else one of :data:`REDOPS`.
        backend: torch.distributed backend name (``hetcomm`` or ``gloo``).
        rails: rails forced through ``HETCOMM_RAILS`` (None: the backend chooses per peer).
        cluster: cluster YAML path the ranks were given (``HETCOMM_CLUSTER``), or None.
        plan: value passed to the backend's plan option, or None.
        timeout_s: collective and store timeout, seconds.
    """

    collective: str
    minbytes: int = 32 << 20
    maxbytes: int = 32 << 20
    stepfactor: int = 2
    stepbytes: int = 1 << 20
    iters: int = 20
    warmup_iters: int = 1
    check: bool = True
    datatype: str = "float"
    redop: str = "none"
    backend: str = "hetcomm"
    rails: Optional[Tuple[str, ...]] = None
    cluster: Optional[str] = None
    plan: Optional[str] = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # The CLI validates with flag names first; this guards programmatic use.
        if self.collective not in COLLECTIVES:
            raise UsageError(
                f"collective {self.collective!r} is not one of {', '.join(COLLECTIVES)}"
            )
        if self.datatype not in _ITEMSIZE:
            raise UsageError(f"datatype {self.datatype!r} is not one of {', '.join(_ITEMSIZE)}")
        if self.minbytes > self.maxbytes:
            raise UsageError(f"minbytes {self.minbytes} > maxbytes {self.maxbytes}")
        if self.iters < 1 or self.warmup_iters < 0:
            raise UsageError("iters must be >= 1 and warmup_iters >= 0")
        if self.stepfactor < 1 or (self.stepfactor == 1 and self.stepbytes < 1):
            raise UsageError("stepfactor must be >= 1, and stepbytes >= 1 when stepfactor is 1")

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`datatype`."""
        return _ITEMSIZE[self.datatype]

    def to_json(self) -> str:
        """This config as a JSON string (how the parent hands it to its ranks)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        if data.get("rails") is not None:
            data["rails"] = tuple(data["rails"])
        return cls(**data)


def bus_factor(collective: str, num_ranks: int) -> float:
    """busbw / algbw: (n-1)/n for alltoall, 2(n-1)/n for allreduce (nccl-tests' factors)."""
    if num_ranks < 1:
        raise UsageError(f"a group needs at least one rank, got {num_ranks}")
    base = (num_ranks - 1) / num_ranks
    return 2.0 * base if collective == "allreduce" else base


def message_sizes(config: BenchConfig, num_ranks: int) -> List[Tuple[int, int]]:
    """The ``(size_bytes, count)`` rows of a run, in order.

    Sizes follow nccl-tests' loop (``size *= stepfactor`` or ``size += stepbytes`` while
    ``size <= maxbytes``). ``count = size // itemsize``; for alltoall it is rounded down to a
    multiple of ``num_ranks`` (every peer gets the same number of elements), and the printed
    size is ``count * itemsize``. Sizes that round to zero elements, or to the same count as the
    previous row, are dropped.
    """
    rows: List[Tuple[int, int]] = []
    size = config.minbytes
    while size <= config.maxbytes:
        count = size // config.itemsize
        if config.collective == "alltoall":
            count = (count // num_ranks) * num_ranks
        if count > 0 and (not rows or rows[-1][1] != count):
            rows.append((count * config.itemsize, count))
        if config.stepfactor > 1:
            if size == 0:
                size = 1
            size *= config.stepfactor
        else:
            size += config.stepbytes
    return rows
