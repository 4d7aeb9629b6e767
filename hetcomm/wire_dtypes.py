"""The one wire-dtype vocabulary: what floating-point activations travel in between two ranks.

Before, three vocabularies and five validators said this (``backends/options.py`` with
``exact/cluster/auto/...``, the MoE layer and ``hetcomm train`` with ``auto/fp32/fp16/bf16``,
the cluster YAML's per-link ``fp32/fp16/bf16``, the CLI's ``choices=``), each with its own error.
Now every place reads a value with :func:`parse_wire_dtype`, passing the spellings that are
meaningful there:

* ``exact``: keep the tensor's dtype (torch.distributed's bit-exact contract); the backend only
  (``HetcommOptions.wire_dtype``, ``HETCOMM_WIRE_DTYPE``, :data:`BACKEND_SPELLINGS`);
* ``cluster`` (the backend's spelling) / ``auto`` (the MoE layer's and ``hetcomm train``'s,
  :data:`LAYER_SPELLINGS`; the backend accepts both): follow the cluster YAML's ``wire_dtype``
  per link class (FP16 across vendors by default, FP32 elsewhere);
* ``fp32`` / ``fp16`` / ``bf16``: one wire dtype for every pair; everywhere, and the only values
  a cluster YAML's ``wire_dtype:`` map may hold (:data:`LINK_SPELLINGS`).

``auto`` is the MoE layer's spelling of ``cluster`` (kept for source compatibility); both parse
to :attr:`WireDtype.CLUSTER`. :class:`WireDtype` is a ``str`` enum, so ``WireDtype.FP16 ==
"fp16"`` and code holding the plain strings keeps working.

This module sits on the lowest floor (it imports only :mod:`hetcomm.errors`; torch lazily), so
``topo``, ``backends``, ``moe``, ``train`` and ``cli`` can all read it.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

from hetcomm.errors import ConfigError

if TYPE_CHECKING:  # torch is imported lazily: the topology tools run without it
    import torch

__all__ = [
    "WireDtype",
    "ALL_SPELLINGS",
    "BACKEND_SPELLINGS",
    "LAYER_SPELLINGS",
    "LINK_SPELLINGS",
    "parse_wire_dtype",
    "wire_torch_dtype",
]


class WireDtype(str, enum.Enum):
    """A wire-dtype policy (``exact``, ``cluster``) or a concrete wire dtype (``fp32/fp16/bf16``)."""

    EXACT = "exact"
    CLUSTER = "cluster"
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value

    @property
    def is_concrete(self) -> bool:
        """True for ``fp32``/``fp16``/``bf16`` (a dtype), False for a policy."""
        return self in (WireDtype.FP32, WireDtype.FP16, WireDtype.BF16)

    def torch_dtype(self) -> "torch.dtype":
        """The torch dtype of a concrete wire dtype.

        Raises:
            ValueError: for ``exact``/``cluster`` (a policy has no single dtype; resolve it per
                pair first, e.g. with ``Cluster.wire_dtype_for``).
        """
        import torch

        table = {WireDtype.FP32: torch.float32, WireDtype.FP16: torch.float16, WireDtype.BF16: torch.bfloat16}
        if self not in table:
            raise ValueError(f"wire dtype {self.value!r} is a policy, not a dtype; resolve it per rank pair first")
        return table[self]


#: Every accepted spelling (``auto`` is an alias of ``cluster``).
ALL_SPELLINGS: Tuple[str, ...] = ("exact", "cluster", "auto", "fp32", "fp16", "bf16")
#: What the backend accepts (``HetcommOptions.wire_dtype``, ``HETCOMM_WIRE_DTYPE``).
BACKEND_SPELLINGS: Tuple[str, ...] = ALL_SPELLINGS
#: What the MoE layer and ``hetcomm train`` accept (``wire_dtype=``, ``--wire-dtype``, ``train.wire_dtype``).
LAYER_SPELLINGS: Tuple[str, ...] = ("auto", "fp32", "fp16", "bf16")
#: What one link class of a cluster YAML's ``wire_dtype:`` map may name (concrete dtypes only).
LINK_SPELLINGS: Tuple[str, ...] = ("fp32", "fp16", "bf16")

_ALIASES = {"auto": WireDtype.CLUSTER}


def parse_wire_dtype(
    value: object,
    *,
    allowed: Sequence[str] = ALL_SPELLINGS,
    key: str = "wire_dtype",
    error: Optional[Callable[[str], Exception]] = None,
) -> WireDtype:
    """The :class:`WireDtype` of ``value``; the one validator of wire-dtype spellings.

    Args:
        value: the spelling as given (a ``WireDtype`` is accepted too).
        allowed: the spellings meaningful where ``value`` came from (e.g. :data:`LINK_SPELLINGS`
            for a cluster YAML's map).
        key: the option, flag, variable or dotted key ``value`` came from, named in the error.
        error: builds the exception from the message (default: ``ConfigError(message, key=key)``;
            the cluster loader passes one that adds the file and line).

    Raises:
        ConfigError: (or what ``error`` builds) ``value`` is not one of ``allowed``; the message
            names the bad value and every allowed spelling.
    """
    text = value.value if isinstance(value, WireDtype) else value
    if not isinstance(text, str) or text not in allowed:
        shown = repr(text) if isinstance(text, str) else f"{text!r} ({type(text).__name__})"
        message = f"unknown wire dtype {shown}; expected one of {', '.join(allowed)}"
        raise (error(message) if error is not None else ConfigError(message, key=key))
    return _ALIASES.get(text) or WireDtype(text)


def wire_torch_dtype(name: object) -> "torch.dtype":
    """The torch dtype of concrete wire dtype ``fp32``/``fp16``/``bf16``.

    Raises:
        ConfigError: ``name`` is not a concrete wire dtype.
    """
    return parse_wire_dtype(name, allowed=LINK_SPELLINGS).torch_dtype()
