"""Per-forward timing of the MoE data path (:class:`PipelineTimes`).

The pipelined dispatch itself lives in :mod:`hetcomm.backends.tokens` (``num_chunks``:
chunk ``c`` carries, for every rank, the token rows of its ``c``-th group of local experts, so an
arrived chunk is complete work); the layer waits chunk by chunk and records here the time
blocked waiting for the network (``comm_exposed_s``) and the time in the experts.
``overlap = 1 - exposed_C / exposed_1`` compares a chunked run with the one-chunk run of the same
step (see ``docs/MOE.md`` and ``benchmarks/moe_layer.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List

__all__ = ["PipelineTimes"]

@dataclass
class PipelineTimes:
    """Wall-clock seconds of one forward pipeline on this rank.

    Attributes:
        comm_exposed_s: time blocked in ``wait()`` on dispatch and combine exchanges.
        expert_s: time in the expert modules (received rows only).
        total_s: launch of the first exchange to arrival of the last result.
        bytes_sent: activation bytes sent to other ranks (dispatch + combine, forward only).
        bytes_recv: activation bytes received from other ranks.
        num_chunks: ``C``.
        rows_per_expert: rows each local expert computed (received copies, all sources).
    """

    comm_exposed_s: float = 0.0
    expert_s: float = 0.0
    total_s: float = 0.0
    bytes_sent: int = 0
    bytes_recv: int = 0
    num_chunks: int = 1
    rows_per_expert: List[int] = field(default_factory=list)

    def record_exchange(self, res, num_chunks: int, t_combine: float, t_start: float) -> None:
        """Fill in the exchange's part once the combine returned: ``res`` the forward's
        ``token_dispatch.DispatchResult``, ``t_combine`` / ``t_start`` the ``perf_counter``
        when the combine / the forward began."""
        self.comm_exposed_s = res.work.exposed_s + time.perf_counter() - t_combine
        self.num_chunks = num_chunks
        self.rows_per_expert = list(res.recv_counts)
        # Combine sends back exactly what dispatch received, in the same wire dtypes.
        self.bytes_sent = self.bytes_recv = res.handle.bytes_sent + res.handle.bytes_recv
        self.total_s = time.perf_counter() - t_start
