"""Wire dtypes: activations travel in FP16/BF16/FP32 per rank pair, converted back on arrival.

The policy comes from the cluster YAML (``wire_dtype:`` per link class, see
:meth:`hetcomm.topo.cluster.Cluster.wire_dtype_for`); by default FP16 across vendors (BF16
transfers were wrong on one Ascend firmware) and FP32 elsewhere.

``all_to_all_single`` carries ONE dtype per call, while the pairs of one rank may need
different wire dtypes (A100 -> A100 over NVLink in FP32, A100 -> 910B over the host bridge in
FP16). Two ways out: one collective per wire dtype (zero splits for the other peers), or one
collective over raw bytes. We pack bytes: one call, no extra latency, and the cast into the
packed buffer is the copy we would pay anyway. Each peer's segment is padded to 8 bytes so that
every segment can be viewed as its own dtype in place. When every pair of the *whole group*
uses one dtype (decided from the full matrix, so all ranks agree), the exchange skips packing
and sends the typed tensor directly.

Notation: ``S`` rows sent, ``R`` rows received, ``D`` model dim, ``W`` ranks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hetcomm.backends.checks import splits_agreed
from hetcomm.errors import CollectiveError, ConfigError, HetcommError
from hetcomm.moe import buffers

__all__ = [
    "WIRE_DTYPES",
    "WirePolicy",
    "Exchange",
    "wire_policy",
    "counters",
    "reset_counters",
]

WIRE_DTYPES: Dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
_ALIGN_BYTES = 8

_lock = threading.Lock()
_counters: Dict[str, int] = {"a2a_calls": 0, "a2a_bytes_sent": 0, "a2a_bytes_recv": 0}


def counters() -> Dict[str, int]:
    """This process's MoE all-to-all counters (bytes to/from *other* ranks, calls): the layer's
    dispatch/combine rows (:func:`hetcomm.backends.token_dispatch.counters`, forward and
    backward, wire dtypes applied) plus any :class:`Exchange` made directly."""
    from hetcomm.backends import token_dispatch

    td = token_dispatch.counters()
    with _lock:
        out = dict(_counters)
    out["a2a_calls"] += td["calls"]
    out["a2a_bytes_sent"] += td["bytes_sent"]
    out["a2a_bytes_recv"] += td["bytes_recv"]
    return out


def reset_counters() -> None:
    """Zero the MoE all-to-all counters (the token dispatch's included)."""
    from hetcomm.backends import token_dispatch

    token_dispatch.reset_counters()
    with _lock:
        for k in _counters:
            _counters[k] = 0


def _count(sent: int, recv: int) -> None:
    with _lock:
        _counters["a2a_calls"] += 1
        _counters["a2a_bytes_sent"] += sent
        _counters["a2a_bytes_recv"] += recv


@dataclass(frozen=True)
class WirePolicy:
    """Wire dtype of every ordered rank pair of a group.

    Attributes:
        names: ``names[a][b]`` is ``fp32``/``fp16``/``bf16`` for traffic between group ranks
            ``a`` and ``b`` (symmetric; the diagonal is ``fp32``: local rows are not cast).
    """

    names: Tuple[Tuple[str, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.names)

    @property
    def uniform(self) -> Optional[str]:
        """The one wire dtype of every off-diagonal pair, or None when pairs differ."""
        off = {self.names[a][b] for a in range(self.world_size) for b in range(self.world_size) if a != b}
        if not off:
            return "fp32"
        return off.pop() if len(off) == 1 else None

    def peer_dtypes(self, rank: int, act_dtype: torch.dtype) -> List[torch.dtype]:
        """The dtype each peer's rows travel in from/to ``rank``, for activations of ``act_dtype``.

        A wire never widens: FP32 on the wire for FP16 activations sends FP16.
        """
        out = []
        for peer in range(self.world_size):
            if peer == rank:
                out.append(act_dtype)
                continue
            wd = WIRE_DTYPES[self.names[rank][peer]]
            out.append(act_dtype if wd.itemsize >= act_dtype.itemsize else wd)
        return out

    def describe(self) -> Dict[str, str]:
        """``{"0-3": "fp16", ...}`` for every unordered pair."""
        return {
            f"{a}-{b}": self.names[a][b]
            for a in range(self.world_size)
            for b in range(a + 1, self.world_size)
        }


def wire_policy(
    world_size: int,
    wire_dtype: str = "auto",
    cluster=None,
    global_ranks: Optional[Sequence[int]] = None,
) -> WirePolicy:
    """Build the policy of a group.

    Args:
        world_size: ranks in the group.
        wire_dtype: ``auto`` (the cluster's policy; FP32 without a cluster) or one of
            ``fp32``/``fp16``/``bf16`` for every pair.
        cluster: a :class:`hetcomm.topo.cluster.Cluster`, or None.
        global_ranks: global rank of each group rank (default: the identity).

    Raises:
        ConfigError: an unknown ``wire_dtype``, or a cluster smaller than the group.
    """
    if wire_dtype != "auto" and wire_dtype not in WIRE_DTYPES:
        raise ConfigError(
            f"unknown wire dtype {wire_dtype!r}; expected auto, fp32, fp16 or bf16",
            key="moe.wire_dtype",
        )
    ranks = list(global_ranks) if global_ranks is not None else list(range(world_size))
    names = [["fp32"] * world_size for _ in range(world_size)]
    for a in range(world_size):
        for b in range(world_size):
            if a == b:
                continue
            if wire_dtype != "auto":
                names[a][b] = wire_dtype
            elif cluster is not None:
                if max(ranks) >= cluster.num_ranks:
                    raise ConfigError(
                        f"the process group has global rank {max(ranks)} but cluster "
                        f"'{cluster.name}' describes {cluster.num_ranks} ranks; launch "
                        f"{cluster.num_ranks} ranks or pick another cluster file",
                        path=cluster.path,
                    )
                lo, hi = sorted((ranks[a], ranks[b]))
                names[a][b] = cluster.wire_dtype_for(cluster.link_class(lo, hi))
    return WirePolicy(tuple(tuple(r) for r in names))


def _pad(n: int) -> int:
    return (n + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES


class Exchange:
    """One all-to-all of rows with uneven splits and per-peer wire dtypes, possibly async.

    Args:
        send_rows: rows for each peer (length ``W``), in peer order in the input.
        recv_rows: rows from each peer (length ``W``).
        policy: the group's :class:`WirePolicy`.
        rank: this process's rank in ``group``.
        group: the process group (None: the default group).
        tag: label for counters/errors (``dispatch``, ``combine``).
    """

    def __init__(
        self,
        send_rows: Sequence[int],
        recv_rows: Sequence[int],
        policy: WirePolicy,
        rank: int,
        group: Optional[dist.ProcessGroup],
        tag: str = "a2a",
    ) -> None:
        self.send_rows = [int(x) for x in send_rows]
        self.recv_rows = [int(x) for x in recv_rows]
        self.policy = policy
        self.rank = rank
        self.group = group
        self.tag = tag
        self._work = None
        self._finish = None
        self.bytes_sent = 0
        self.bytes_recv = 0

    def reversed(self) -> "Exchange":
        """The exchange that sends the received rows back (backward of dispatch = combine)."""
        return Exchange(self.recv_rows, self.send_rows, self.policy, self.rank, self.group, self.tag + "^T")

    def start(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Launch the exchange of ``x``; :meth:`wait` completes it.

        Args:
            x: ``[S, D]`` rows, grouped by destination peer; any float dtype.
        Returns:
            ``[R, D]`` tensor of ``x.dtype``, valid only after :meth:`wait`.
        """
        assert x.dim() == 2 and x.size(0) == sum(self.send_rows), (tuple(x.shape), self.send_rows)
        x = x.contiguous()
        D = x.size(1)
        act = x.dtype
        R = sum(self.recv_rows)
        if out is None:
            # A recycled buffer: a fresh [R, D] would be page-faulted in anew every step.
            out = buffers.empty((R, D), act, x.device)
        W = len(self.send_rows)
        dtypes = self.policy.peer_dtypes(self.rank, act)
        uniform = self.policy.uniform
        if uniform is not None:
            wd = dtypes[(self.rank + 1) % W] if W > 1 else act
            send = x
            if wd != act:
                send = buffers.empty(x.shape, wd, x.device)
                send.copy_(x)
            recv = out if wd == act else buffers.empty((R, D), wd, x.device)
            self.bytes_sent = sum(n for p, n in enumerate(self.send_rows) if p != self.rank) * D * wd.itemsize
            self.bytes_recv = sum(n for p, n in enumerate(self.recv_rows) if p != self.rank) * D * wd.itemsize
            with splits_agreed():  # recv_rows came from the (checked) exchange of counts
                self._work = dist.all_to_all_single(
                    recv, send, self.recv_rows, self.send_rows, group=self.group, async_op=True
                )

            def finish() -> None:
                if recv is not out:
                    out.copy_(recv)

            self._finish = finish
            self._keep = (send, recv)
            return out

        # Mixed wire dtypes: pack every peer's segment, cast in the copy, as raw bytes.
        send_bytes = [_pad(n * D * dtypes[p].itemsize) for p, n in enumerate(self.send_rows)]
        recv_bytes = [_pad(n * D * dtypes[p].itemsize) for p, n in enumerate(self.recv_rows)]
        sbuf = buffers.empty((sum(send_bytes),), torch.uint8, x.device)
        rbuf = buffers.empty((sum(recv_bytes),), torch.uint8, x.device)
        off = row = 0
        for p, n in enumerate(self.send_rows):
            if n:
                seg = sbuf[off : off + n * D * dtypes[p].itemsize].view(dtypes[p]).view(n, D)
                seg.copy_(x[row : row + n])
            off += send_bytes[p]
            row += n
        self.bytes_sent = sum(b for p, b in enumerate(send_bytes) if p != self.rank)
        self.bytes_recv = sum(b for p, b in enumerate(recv_bytes) if p != self.rank)
        with splits_agreed():  # recv_bytes follow from the (checked) exchange of counts
            self._work = dist.all_to_all_single(
                rbuf, sbuf, recv_bytes, send_bytes, group=self.group, async_op=True
            )

        def finish_packed() -> None:
            off = row = 0
            for p, n in enumerate(self.recv_rows):
                if n:
                    seg = rbuf[off : off + n * D * dtypes[p].itemsize].view(dtypes[p]).view(n, D)
                    out[row : row + n].copy_(seg)
                off += recv_bytes[p]
                row += n

        self._finish = finish_packed
        self._keep = (sbuf, rbuf)
        return out

    def wait(self) -> None:
        """Block until the rows have arrived and are converted back (idempotent)."""
        if self._work is not None:
            try:
                self._work.wait()
            except HetcommError:
                raise
            except RuntimeError as e:
                # Name the MoE step and this rank's splits; the backend's message says which
                # peer or rail failed (or timed out).
                raise CollectiveError(
                    f"MoE {self.tag} exchange failed (sending {self.send_rows} rows, expecting "
                    f"{self.recv_rows}): {e}; check that every rank runs the same layers in the "
                    f"same order and that no rank died",
                    op="all_to_all_single",
                    rank=self.rank,
                ) from e
            self._work = None
            self._finish()
            self._finish = None
            self._keep = None
            _count(self.bytes_sent, self.bytes_recv)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Synchronous :meth:`start` + :meth:`wait`."""
        out = self.start(x)
        self.wait()
        return out
