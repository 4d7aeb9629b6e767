"""Pipelined dispatch -> experts -> combine: compute on the chunks that have arrived.

The copies every rank sends are cut into ``C`` chunks by destination expert group
(:class:`~hetcomm.moe.dispatch.ChunkLayout`): chunk ``c`` holds, for each destination rank, the
copies bound for its ``c``-th group of local experts, so a chunk that has arrived is complete
work for those experts. All ``C`` dispatch exchanges are launched at once (async Works); the
experts of chunk 0 start as soon as chunk 0 is in, while chunks ``1..C-1`` are still in flight,
and chunk 0's results start travelling back while chunk 1 computes.

``C`` is the same on every rank (it is configuration, never derived from local sizes), so all
ranks issue the same collectives in the same order, which the process group requires.

Overlap is measured, not assumed: :class:`PipelineTimes` records the time blocked waiting for
the network (``comm_exposed_s``) and the time in the experts. ``overlap = 1 - exposed_C /
exposed_1`` compares a chunked run with the one-chunk run of the same step (see
``docs/MOE.md`` and ``benchmarks/moe_layer.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from hetcomm.moe.dispatch import ChunkLayout, launch, wait
from hetcomm.moe.experts import ExpertBank, cat_rows, split_rows
from hetcomm.moe.wire import Exchange, WirePolicy

__all__ = ["PipelineTimes", "run_pipeline"]

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


def run_pipeline(
    x_send: torch.Tensor,
    send_counts: torch.Tensor,
    recv_counts: torch.Tensor,
    layout: ChunkLayout,
    bank: ExpertBank,
    policy: WirePolicy,
    rank: int,
    group: Optional[dist.ProcessGroup],
    times: PipelineTimes,
    between=None,
) -> torch.Tensor:
    """Dispatch ``x_send``, run the local experts on what arrives, and combine the results back.

    Args:
        x_send: ``[S, D]`` copies in send order (chunk-major, destination rank, local expert).
        send_counts: ``[E]`` int64 copies sent to each global expert.
        recv_counts: ``[W, L]`` int64 copies received from each source for each local expert.
        layout: the chunk layout.
        bank: this rank's experts.
        policy: wire dtypes of the group.
        rank: this rank in ``group``.
        group: the process group.
        times: filled in place.
        between: optional callable run after the dispatches are launched and before the first
            wait (local-replica compute goes here, hidden behind the network).
    Returns:
        ``[S, D]`` expert outputs for the sent copies, in send order, dtype of ``x_send``.
    """
    W = recv_counts.size(0)
    C = layout.num_chunks
    times.num_chunks = C
    times.rows_per_expert = recv_counts.sum(0).tolist()
    t0 = time.perf_counter()
    # Per chunk and destination: copies sent. cell = c * W + r.
    cell = torch.tensor(
        [c * W + r for c in range(C) for r in range(W) for _ in layout.experts_in[c][r]], dtype=torch.int64, device=x_send.device
    )
    experts_cell_order = torch.tensor(
        [e for c in range(C) for r in range(W) for e in layout.experts_in[c][r]], dtype=torch.int64, device=x_send.device
    )
    send_split = torch.zeros(C * W, dtype=torch.int64, device=x_send.device)
    if cell.numel():
        send_split.index_add_(0, cell, send_counts[experts_cell_order])
    send_split = send_split.view(C, W).tolist()
    recv_split: List[List[int]] = []
    per_expert_counts: List[torch.Tensor] = []
    for c in range(C):
        lo, hi = layout.local_range[c][rank]
        sub = recv_counts[:, lo:hi]
        recv_split.append(sub.sum(1).tolist())
        per_expert_counts.append(sub)

    # Launch every dispatch chunk at once.
    pending = []
    pieces = split_rows(x_send, [sum(s) for s in send_split]) if C > 1 else (x_send,)
    for c in range(C):
        ex = Exchange(send_split[c], recv_split[c], policy, rank, group, tag="dispatch")
        out = launch(pieces[c], ex)
        pending.append((ex, out))
    if between is not None:
        between()

    results = []
    for c in range(C):
        ex, out = pending[c]
        tw = time.perf_counter()
        recv = wait(out, ex)
        times.comm_exposed_s += time.perf_counter() - tw
        times.bytes_sent += ex.bytes_sent
        times.bytes_recv += ex.bytes_recv
        sub = per_expert_counts[c]
        lo, _ = layout.local_range[c][rank]
        te = time.perf_counter()
        # Rows arrive in (source, expert) blocks; the bank makes each expert's rows contiguous
        # and returns the outputs in the same block order, the order they travel back in.
        y_sm = bank.forward_blocks(recv, sub.tolist(), first=lo)
        times.expert_s += time.perf_counter() - te
        back = Exchange(recv_split[c], send_split[c], policy, rank, group, tag="combine")
        results.append((back, launch(y_sm, back)))

    outs = []
    for back, out in results:
        tw = time.perf_counter()
        outs.append(wait(out, back))
        times.comm_exposed_s += time.perf_counter() - tw
        times.bytes_sent += back.bytes_sent
        times.bytes_recv += back.bytes_recv
    times.total_s += time.perf_counter() - t0
    return outs[0] if len(outs) == 1 else cat_rows(outs)
