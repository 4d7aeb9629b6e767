"""The token engine: expert-parallel dispatch and combine over any process group.

One engine, two faces:

* ``Communicator.dispatch``/``combine`` (DeepEP's shape; :mod:`.deepep`: ``dispatch``,
  ``combine``, ``DispatchHandle``, ``DispatchResult``, ``GroupComm`` for a plain group);
* ``hetcomm.TokenSwitch`` (torch 2.14's ``torch.distributed._token_switch`` contract;
  :mod:`.switch`).

Both plan with :mod:`.plan` (capacity, token rows, the count and metadata exchanges), move rows
with :mod:`.flow` (both directions, the runs, Works and autograd functions) over :mod:`.exchange`
(one ``all_to_all_single`` of rows over bytes, the counters), and ask :mod:`.wire` what every
link carries (the one wire rule: row dtypes, segment padding, exact weights).

``dispatch`` sends each token to the ranks that own its experts and hands the receiver its rows
grouped by local expert; ``combine`` brings the expert outputs back as the weighted sum over
each token's ``k`` experts. Both are autograd functions (the backward of dispatch is a combine
and the backward of combine is a dispatch) and run as plain functions under ``torch.no_grad()``.

Notation:
    T   tokens on this rank;  k  experts per token;  D  hidden size;  E  global experts
    W   ranks in the group;  L  experts this rank owns;  C  chunks (default 1)
    U   *token rows*: distinct ``(destination rank, chunk, token)`` triples. A token whose k
        experts include several on one rank crosses to that rank ONCE; the receiver expands it
        into one row per local expert (that is where the bytes go down: E=64, k=2 on 4 ranks
        under uniform routing sends ~0.88x the rows of a per-copy exchange, k=8 ~0.46x)
    R   rows this rank receives after expansion: one per (token, local expert), expert-major

Layout of one dispatch (the same on every rank, decided by the exchanged counts):
    1. plan (local, vectorised): capacity, one ``torch.unique`` over the keys
       ``(dest * C + chunk) * T + token`` of the valid copies gives the token rows in send order
       (destination-major, then chunk, then token) and, per copy, its token row;
    2. counts (one small int64 ``all_to_all_single``, then ``.tolist()``: the host
       synchronisation every dispatch needs, since the splits of the exchanges below are host
       integers): per destination, its token rows per chunk and its copies per local expert,
       behind a head every rank sends every rank: the routing's digest (an error flag, ``k``,
       ``C``, ``E``, a CRC of the owners) and the rows and copies it sends to each rank (so
       every rank knows every rank's receive counts: ``TokenSwitch``'s room checks);
    3. metadata (one int32 all-to-all, ``[U, 2k]``): for each token row, the local expert
       index and the float32 weight of each of its ``k`` slots (``-1`` = not for that rank),
       behind the call's digest (an error flag, the caller's room, hidden size, dtype, the
       wire dtype towards every peer). A digest that differs raises on every rank before any
       row moves;
    4. rows, one all-to-all per chunk over raw bytes, each peer's segment in that pair's wire
       dtype (:mod:`.wire`: ``comm.wire_dtype(peer, dtype)``), cast on the wire only. Rows for
       this rank's own experts never enter an exchange: they are read straight from ``x``.
    5. expansion on arrival: ``recv_x[r] = token_rows[slot_index[r] // k]``, experts in local
       order; inside an expert the rows from other ranks by source rank, then the own rows.
       (``TokenSwitch``'s ``flat`` layout skips it: its slots are the token rows,
       ``Plan.as_token_rows``.)

``combine`` runs it backwards: each receiver sums ``w * y`` over the copies of one token row
(so a token's results cross back once per rank too), returns the sums, and the sender adds the
returns of each token. No second count exchange: the plan (in ``DispatchHandle``) holds the layout.

Host synchronisations per dispatch: the count exchange's ``.tolist()``, the call digests'
``.tolist()`` after the metadata exchange, ``torch.unique``'s output size (a device sync on
CUDA/NPU), and the number of dropped copies when ``capacity`` is set. Combine has none besides
its exchange.

Why hand-written: DeepEP's kernels are CUDA-only (NVLink/RDMA), Megatron's token dispatchers
sit on NCCL's ``all_to_all`` per copy; a cross-vendor group (gloo, the hetcomm backend with a
host bridge) needs the same semantics over ``all_to_all_single``.
"""

from hetcomm.backends.tokens.deepep import DispatchHandle, DispatchResult, GroupComm, combine, dispatch
from hetcomm.backends.tokens.exchange import DispatchComm, counters, reset_counters
from hetcomm.backends.tokens.flow import CombineWork, DispatchWork
from hetcomm.backends.tokens.plan import count_token_rows, drop_over_capacity

__all__ = [
    "DispatchComm",
    "GroupComm",
    "DispatchHandle",
    "DispatchResult",
    "DispatchWork",
    "CombineWork",
    "dispatch",
    "combine",
    "drop_over_capacity",
    "count_token_rows",
    "counters",
    "reset_counters",
]
