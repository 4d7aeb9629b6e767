"""The wire rule: what token rows and routing weights travel in, per link.

One place decides, for every pair of ranks, the dtype a tensor's rows cross in and how the
bytes are laid out; the communicator's :meth:`~hetcomm.backends.communicator.Communicator.wire_dtype`
(read by the bridge rail and the MoE layer), :class:`~hetcomm.backends.tokens.deepep.GroupComm`,
both faces of the token engine and the bench's byte counts all ask it.

* **rows** (:func:`link_wire_dtype`): a policy (:mod:`hetcomm.wire_dtypes`) resolves per link:
  ``exact`` keeps the dtype, ``cluster`` takes the link's own wire dtype (the cluster YAML's per
  link class), ``fp32``/``fp16``/``bf16`` one for every link. Only floating-point rows are cast,
  and only to a *narrower* dtype: a wire never widens, and a same-width cast (bf16 rows over an
  fp16 wire) saves no byte and loses range, so the rows keep their dtype;
* **segments** (:func:`segment_bytes`): one ``all_to_all_single`` carries one dtype while the
  peers of one rank may need different ones, so rows travel as ``torch.uint8``, each peer's
  segment padded to :data:`ALIGN` bytes so that it can be viewed as its own dtype in place;
* **weights** (:data:`WEIGHT_WIRE`, :func:`encode_weights`): routing weights, their gradients
  and expert ids travel exactly, whatever the rows' policy: weights as float32 bits inside the
  int32 metadata rows, their gradients as float32 rows.

Every function here is pure (no communication); both ends of a pair reach the same answer from
the group's agreed settings, and the dispatch's argument digest (:func:`dtype_code`) checks it.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple, Union

import torch

from hetcomm.wire_dtypes import WireDtype, parse_wire_dtype

__all__ = [
    "ALIGN",
    "WEIGHT_WIRE",
    "WireComm",
    "link_wire_dtype",
    "row_wires",
    "exact_wires",
    "segment_bytes",
    "encode_weights",
    "decode_weights",
    "dtype_code",
    "dtype_name",
]

ALIGN = 8  # bytes: every peer's segment starts 8-byte aligned, so it can be viewed as any dtype
#: The dtype routing weights and their gradients travel in (exact for every float gate dtype up
#: to float32; a float64 gate is rounded once, like the combine weights themselves).
WEIGHT_WIRE = torch.float32

#: What a link's own wire dtype may be given as: a cluster YAML name, a torch dtype, or None
#: (the link has none: rows travel as they are).
LinkWire = Union[str, WireDtype, torch.dtype, None]


def link_wire_dtype(dtype: torch.dtype, policy: object, link: Callable[[], LinkWire]) -> Optional[torch.dtype]:
    """The dtype ``dtype`` rows cross one link in, or None (as they are): THE wire rule.

    Args:
        dtype: the rows' dtype.
        policy: a wire-dtype spelling (:data:`hetcomm.wire_dtypes.ALL_SPELLINGS`).
        link: the link's own wire dtype, asked only under ``cluster``/``auto`` (e.g.
            ``Placement.wire_dtype(a, b)``, the cluster YAML's per link class).

    Returns:
        A floating-point dtype strictly narrower than ``dtype``, or None.

    Raises:
        ConfigError: ``policy`` (or the link's name) is not a wire-dtype spelling.
    """
    name = parse_wire_dtype(policy)
    if not dtype.is_floating_point or name is WireDtype.EXACT:
        return None
    if name is WireDtype.CLUSTER:
        own = link()
        if own is None:
            return None
        wire = own if isinstance(own, torch.dtype) else parse_wire_dtype(own).torch_dtype()
    else:
        wire = name.torch_dtype()
    if not wire.is_floating_point or wire.itemsize >= dtype.itemsize:
        return None  # never widen; a same-width cast saves no byte
    return wire


class WireComm(Protocol):
    """What the wire rule reads of a communicator: its rank, its size, its per-link answer."""

    rank: int
    world_size: int

    def wire_dtype(self, peer: int, dtype: torch.dtype, policy: Optional[str] = None) -> Optional[torch.dtype]:
        """:func:`link_wire_dtype` towards ``peer`` under ``policy`` (None: the comm's own)."""


def row_wires(comm: WireComm, dtype: torch.dtype, policy: Optional[str] = None) -> Tuple[torch.dtype, ...]:
    """``[W]`` the dtype ``dtype`` rows travel in to every peer (``dtype`` itself to this rank
    and wherever the rule keeps it).

    Args:
        comm: the communicator (its ``wire_dtype`` applies :func:`link_wire_dtype`).
        dtype: the rows' dtype.
        policy: the call's policy (e.g. the MoE layer's ``wire_dtype``); None: the comm's own.
    """
    out = []
    for p in range(comm.world_size):
        w = None if p == comm.rank else comm.wire_dtype(p, dtype, policy)
        out.append(w or dtype)
    return tuple(out)


def exact_wires(comm: WireComm, dtype: torch.dtype) -> Tuple[torch.dtype, ...]:
    """``[W]`` ``dtype`` for every peer: metadata, counts and weight gradients travel exactly."""
    return (dtype,) * comm.world_size


def segment_bytes(rows: int, width: int, wire: torch.dtype) -> int:
    """Bytes of one peer's segment: ``rows x width`` elements of ``wire``, padded to :data:`ALIGN`."""
    n = rows * width * wire.itemsize
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode_weights(weights: torch.Tensor) -> torch.Tensor:
    """``[S]`` float weights -> ``[S]`` int32 bit patterns of their :data:`WEIGHT_WIRE` values
    (they ride in the int32 metadata rows, exactly)."""
    return weights.detach().to(WEIGHT_WIRE).contiguous().view(torch.int32)


def decode_weights(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_weights`: ``[S]`` int32 -> ``[S]`` float32."""
    return bits.contiguous().view(WEIGHT_WIRE)


#: Row dtypes by code (the dispatch's digest carries the code; messages name the dtype).
_DTYPES: Tuple[torch.dtype, ...] = tuple(
    getattr(torch, n)
    for n in (
        "float32", "float16", "bfloat16", "float64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if hasattr(torch, n)
)


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype`` in a digest (``len(_DTYPES)`` = another dtype)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def dtype_name(code: int) -> str:
    """The dtype a :func:`dtype_code` names, for messages."""
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else f"dtype #{code}"

