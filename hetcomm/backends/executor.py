"""Execution of all-to-all steps and plans over the rails (deciding them is ``hetcomm.sched``).

Notation (as in ``hetcomm.sched.plan``): ``n`` ranks, ``T[i][j]`` bytes rank i delivers to rank
j; a *segment* is ``T[origin][final_dst]``, a chunk a byte range of one segment.

Two entry points:

* :func:`direct_all_to_all` — the default route of ``all_to_all_single``: one step, each peer's
  rows over that peer's rail, segments cut into chunks of whole rows by a rule every rank agrees
  on (:func:`chunk_rows`), every rail running at once.
* :func:`execute_plan` — any :class:`~hetcomm.sched.plan.Plan`, stage by stage: in stage s this
  rank posts every transfer of stage s it sends or receives, over the rail the transfer names (or
  the pair's rail), and waits for them before stage s+1. A forwarded chunk lands in a staging
  buffer (one per segment this rank relays) and leaves from it in a later stage.

:class:`Executor` is the thread that runs a group's routed collectives in call order.

Both ends of each pair post their transfers in ``Plan.transfers`` order (direct: peer order,
then chunk order), which is what the FIFO rails (shm rings, gloo pairs) need. Every wait is
bounded by a deadline and names the peers and rails still pending when it expires.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hetcomm.backends.devices import RailStreams
from hetcomm.backends.doorbell import Doorbell
from hetcomm.backends import heartbeat
from hetcomm.backends.faults import SeqDiagnosis, release_frames
from hetcomm.backends.rails.base import CompositeOp, Rail, RailOp, Xfer, as_bytes
from hetcomm.backends.rails.cma import copy_bytes
from hetcomm.backends.work import HetcommWork
from hetcomm.errors import CollectiveError, PeerTimeout
from hetcomm.sched.plan import Plan
from hetcomm.backends.thread_name import name_native_thread

__all__ = ["chunk_rows", "direct_all_to_all", "execute_plan", "drive", "Executor", "TAG_BASE", "meta_tag"]

#: Internal gloo tags start here; user send/recv tags below it never collide with ours.
TAG_BASE = 1 << 30


#: Bits of a tag that number the transfers of one collective. A plan of 80 ranks has ~16k
#: transfers; 20 bits keep them distinct up to 1M. Past that, tags wrap, which stays correct
#: because both ends post one pair's transfers in the same order and rails match in order.
_INDEX_BITS = 20
#: Index reserved for the split-check metadata message of a collective.
META_INDEX = (1 << _INDEX_BITS) - 1


def tag_for(seq: int, index: int) -> int:
    """The tag of transfer ``index`` of collective ``seq`` (same on both ends, < 2**31)."""
    return TAG_BASE + (((seq & 0x3FF) << _INDEX_BITS) | (index % META_INDEX))


def meta_tag(seq: int) -> int:
    """The tag of collective ``seq``'s split-check message (never a transfer's tag)."""
    return TAG_BASE + (((seq & 0x3FF) << _INDEX_BITS) | META_INDEX)


def chunk_rows(num_rows: int, row_bytes: int, chunk_bytes: int) -> List[Tuple[int, int]]:
    """Cut ``num_rows`` rows into ``(start, count)`` chunks of at most ``chunk_bytes`` (>= 1 row).

    Sender and receiver call it with the same arguments (split sizes are checked across ranks
    first), so both post the same chunks.
    """
    if num_rows <= 0:
        return []
    per = max(1, chunk_bytes // max(1, row_bytes))
    return [(s, min(per, num_rows - s)) for s in range(0, num_rows, per)]


def _backoff(idle: int) -> None:
    # 2 cores shared by 4+ ranks: spinning starves the peer we wait for. Yield first, then sleep
    # in growing steps up to 1 ms (a rail that progresses resets ``idle``).
    if idle < 32:
        os.sched_yield()
    else:
        time.sleep(min(1e-3, 20e-6 * (idle - 31)))


def drive(
    ops: List[RailOp],
    deadline: float,
    op: str,
    rank: int,
    diagnose: Optional[Callable[[List[int]], Tuple[List[int], str]]] = None,
    wakeup: Optional[threading.Event] = None,
) -> None:
    """Poll ``ops`` (as one :class:`CompositeOp`) until all are done; raise :class:`PeerTimeout`
    at ``deadline`` (monotonic).

    Args:
        diagnose: given the pending peers, returns ``(ranks at fault, extra text)`` for the
            timeout (:meth:`FaultDiagnosis.for_seq <hetcomm.backends.faults.FaultDiagnosis.for_seq>`);
            the error's ``peer`` is the first rank at fault.
        wakeup: set by rail threads when a transfer completes; while every pending op is of a
            kind that does not need polling, the loop sleeps on it instead of spinning. A
            :class:`~hetcomm.backends.doorbell.Doorbell` is also rung by same-node peers after
            shared-memory progress, so the loop sleeps on it for shm steps too.
    """
    rung_by_peers = isinstance(wakeup, Doorbell)
    step = CompositeOp(ops)
    idle = 0
    # A peer the heartbeat declared lost ends the wait at once (hetcomm.backends.heartbeat);
    # checked only when the heartbeat's loss counter moves.
    watch = diagnose if isinstance(diagnose, SeqDiagnosis) else None
    beat = heartbeat.active()
    losses_seen = 0
    while True:
        if watch is not None and beat is not None and beat.version != losses_seen:
            losses_seen = beat.version
            lost = watch.lost_error(step.pending_peers(), op)
            if lost is not None:
                raise lost
        done = step.poll()
        if done:
            return
        if time.monotonic() > deadline:
            peers = step.pending_peers()
            rails = step.pending_rails()
            # The rank at fault: among the peers still pending, those provably silent or dead.
            blamed, extra = diagnose(peers) if diagnose else (peers, "")
            raise PeerTimeout(
                f"timed out: no answer from peer(s) {peers} over rail(s) {', '.join(rails)} within the "
                f"group timeout{extra}; check that every rank calls the same collectives in the same order",
                op=op,
                rank=rank,
                peer=blamed[0] if blamed else (peers[0] if peers else None),
                rail=rails[0] if len(rails) == 1 else None,
                diagnosed=diagnose is not None,
            )
        idle = 0 if step.progressed else idle + 1
        if idle and step.can_block:
            step.block()  # only thread-driven rails left: wait in this thread, no hand-off
        elif idle and wakeup is not None and (rung_by_peers or not step.needs_polling):
            wakeup.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            wakeup.clear()
        elif idle:
            _backoff(idle)


def _group_by_rail(xfers: Sequence[Xfer], rail_of: Callable[[int], Rail]) -> Dict[int, Tuple[Rail, List[Xfer]]]:
    out: Dict[int, Tuple[Rail, List[Xfer]]] = {}
    for x in xfers:
        rail = rail_of(x.peer)
        out.setdefault(id(rail), (rail, []))[1].append(x)
    return out


def start_step(sends: Sequence[Xfer], recvs: Sequence[Xfer], rail_of: Callable[[int], Rail], op: str, seq: int) -> List[RailOp]:
    """Post ``sends`` and ``recvs``, each over its peer's rail; one RailOp per rail."""
    s_by = _group_by_rail(sends, rail_of)
    r_by = _group_by_rail(recvs, rail_of)
    ops = []
    for key in list(dict.fromkeys(list(r_by) + list(s_by))):
        rail = (s_by.get(key) or r_by.get(key))[0]
        ops.append(rail.start(s_by.get(key, (rail, []))[1], r_by.get(key, (rail, []))[1], op, seq))
    return ops


def direct_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    rank: int,
    rail_of: Callable[[int], Rail],
    chunk_bytes: int,
    op: str,
    seq: int,
    deadline: float,
    diagnose: Optional[Callable[[List[int]], Tuple[List[int], str]]] = None,
    wakeup: Optional[threading.Event] = None,
) -> None:
    """Run an ``all_to_all_single`` as one step, every peer over its own rail.

    Args:
        output: ``[sum(output_split_sizes), *row_shape]``, contiguous; rows from rank j land at
            ``output[sum(output_split_sizes[:j]) : ...]``.
        input: ``[sum(input_split_sizes), *row_shape]``, contiguous, same dtype.
        rail_of: the rail for a peer.
    """
    n = len(input_split_sizes)
    row_bytes = input.element_size() * _row_numel(input)
    in_off = _offsets(input_split_sizes)
    out_off = _offsets(output_split_sizes)
    sends: List[Xfer] = []
    recvs: List[Xfer] = []
    # Peer order (me+1, me+2, ...) spreads the first chunks of all ranks over different peers.
    for k in range(1, n):
        dst, src = (rank + k) % n, (rank - k) % n
        for i, (s, c) in enumerate(chunk_rows(input_split_sizes[dst], row_bytes, chunk_bytes)):
            base = in_off[dst] + s
            sends.append(Xfer(dst, input[base : base + c], tag_for(seq, i)))
        for i, (s, c) in enumerate(chunk_rows(output_split_sizes[src], row_bytes, chunk_bytes)):
            base = out_off[src] + s
            recvs.append(Xfer(src, output[base : base + c], tag_for(seq, i), where=(src, base, c)))
    # Our own rows: a local copy, done while the rails move the rest.
    ops = start_step(sends, recvs, rail_of, op, seq)
    mine = input_split_sizes[rank]
    if mine:
        local_copy(output[out_off[rank] : out_off[rank] + mine], input[in_off[rank] : in_off[rank] + mine])
    drive(ops, deadline, op, rank, diagnose, wakeup=wakeup)


def local_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; host tensors of one dtype, both contiguous, by ``memmove`` on this
    thread instead (torch's OpenMP threads spin after a parallel copy and take the cores from the
    other ranks on an oversubscribed host: :func:`hetcomm.backends.rails.cma.copy_bytes`)."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()):
        copy_bytes(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
    else:
        dst.copy_(src)


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _offsets(sizes: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def execute_plan(
    plan: Plan,
    output: torch.Tensor,
    input: torch.Tensor,
    rank: int,
    rail_for: Callable[[int, Optional[str]], Rail],
    op: str = "all_to_all_single",
    seq: int = 0,
    deadline: Optional[float] = None,
    timeout_s: float = 300.0,
    diagnose: Optional[Callable[[List[int]], Tuple[List[int], str]]] = None,
    wakeup: Optional[threading.Event] = None,
) -> None:
    """Run ``plan`` on this rank: the byte-level all-to-all ``plan.traffic``.

    Args:
        plan: the plan (``plan.traffic[i][j]`` bytes from rank i to rank j).
        output: contiguous; its bytes are ``T[0][me] | T[1][me] | ...`` in origin order.
        input: contiguous; its bytes are ``T[me][0] | T[me][1] | ...`` in destination order.
        rank: this rank (``0 <= rank < plan.num_ranks``).
        rail_for: ``(peer, transfer.rail)`` -> the rail to use for that transfer.
        deadline: monotonic time by which every stage must be done (default now + timeout_s).

    Raises:
        ValueError: the tensors' byte sizes do not match ``plan.traffic`` for this rank.
        CollectiveError / PeerTimeout: a transfer failed or a peer went silent.
    """
    n = plan.num_ranks
    traffic = plan.traffic
    in_b, out_b = as_bytes(input), as_bytes(output)
    want_in = sum(traffic[rank])
    want_out = sum(traffic[i][rank] for i in range(n))
    if in_b.numel() != want_in or out_b.numel() != want_out:
        raise ValueError(
            f"hetcomm execute_plan (rank {rank}): input has {in_b.numel()} bytes and output "
            f"{out_b.numel()}, but the plan's traffic row/column for this rank need {want_in} and "
            f"{want_out}; build the plan from the same split sizes"
        )
    deadline = deadline if deadline is not None else time.monotonic() + timeout_s
    in_off = _offsets(traffic[rank])
    out_off = _offsets([traffic[i][rank] for i in range(n)])
    staging: Dict[Tuple[int, int], torch.Tensor] = {}

    def buffer(origin: int, final_dst: int) -> torch.Tensor:
        """Where the bytes of segment origin->final_dst are on this rank."""
        if origin == rank:
            return in_b[in_off[final_dst] : in_off[final_dst] + traffic[origin][final_dst]]
        if final_dst == rank:
            return out_b[out_off[origin] : out_off[origin] + traffic[origin][final_dst]]
        key = (origin, final_dst)
        if key not in staging:  # this rank relays the segment: hold it until it is sent on
            staging[key] = torch.empty(traffic[origin][final_dst], dtype=torch.uint8, device=in_b.device)
        return staging[key]

    own = traffic[rank][rank]
    if own:
        out_b[out_off[rank] : out_off[rank] + own].copy_(in_b[in_off[rank] : in_off[rank] + own])
    for s in range(plan.num_stages):
        sends, recvs, rails = [], [], {}
        for t in plan.stage(s):
            if t.src == rank:
                view = buffer(t.origin, t.final_dst)[t.offset_bytes : t.offset_bytes + t.num_bytes]
                x = Xfer(t.dst, view, tag_for(seq, t.index))
                sends.append(x)
                rails[id(x)] = rail_for(t.dst, t.rail)
            elif t.dst == rank:
                view = buffer(t.origin, t.final_dst)[t.offset_bytes : t.offset_bytes + t.num_bytes]
                x = Xfer(t.src, view, tag_for(seq, t.index))
                recvs.append(x)
                rails[id(x)] = rail_for(t.src, t.rail)
        if not sends and not recvs:
            continue
        ops = []
        by_rail: Dict[int, Tuple[Rail, List[Xfer], List[Xfer]]] = {}
        for x in recvs:
            r = rails[id(x)]
            by_rail.setdefault(id(r), (r, [], []))[2].append(x)
        for x in sends:
            r = rails[id(x)]
            by_rail.setdefault(id(r), (r, [], []))[1].append(x)
        for r, snd, rcv in by_rail.values():
            ops.append(r.start(snd, rcv, op, seq))
        drive(ops, deadline, f"{op} (plan '{plan.strategy}', stage {s})", rank, diagnose, wakeup=wakeup)


class _JobLocal(threading.local):
    """Per thread: the completions made while this thread runs a job (None outside jobs)."""

    deferred: Optional[List[Tuple[HetcommWork, Optional[BaseException]]]] = None


class Executor:
    """The one thread per group that runs routed collectives, one after another, in call order,
    so that every pair's transfers stay in step on every rank. A blocking call with nothing
    queued runs inline on the caller's thread instead (saves two thread hand-offs).

    Completion callbacks: a Work's torch-future callbacks run where the Work is
    completed, and torch's communication hooks (``powerSGD_hook``) start further collectives
    there and wait for them. So a job's Works are completed only after the job has released the
    executor (:meth:`complete` defers completions made inside a job), and when a completed Work
    has a future whose callbacks would run on the executor's thread, that thread first *hands the
    queue over* to a fresh executor thread and then runs the callbacks, leaving the loop
    afterwards: later jobs (those the callbacks start included) run in submission order on the
    new thread while the callbacks wait for them. A thread is started only for a Work that has a
    future at completion time (``get_future()`` before it finished), never on the plain path.

    Args:
        name: thread name suffix (the group id).
        rank: this rank (for errors).
        blame: maps a job's :class:`CollectiveError` and its collective's sequence number to the
            error to report (fault diagnosis).
    """

    def __init__(self, name: str, rank: int, blame: Callable[[CollectiveError, int], CollectiveError]):
        self.rank = rank
        self.blame = blame
        self._name = name
        self._jobs: "queue.Queue[Optional[Tuple[Callable, HetcommWork]]]" = queue.Queue()
        self._exec_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending = 0
        self._closed = False
        #: Threads that handed the queue over and still run a completion's callbacks: close()
        #: waits for them too, so destroy_process_group returns after those callbacks.
        self._retiring: "set[threading.Thread]" = set()
        self._local = _JobLocal()
        #: Device jobs run on these streams, ordered after the caller's (hetcomm.backends.devices).
        self.streams = RailStreams()
        self._thread = self._start_thread()

    def _start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self._run, name=f"hetcomm-exec-{self._name}", daemon=True)
        self._thread = t
        t.start()
        return t

    def complete(self, work: HetcommWork, exc: Optional[BaseException]) -> None:
        """Complete ``work`` with ``exc`` (None: success) — at once, or, when called from inside
        a job on this thread, once the job has released the executor (see the class docstring)."""
        deferred = self._local.deferred
        if deferred is not None:
            deferred.append((work, exc))
        else:
            self._finish(work, exc)

    def _finish(self, work: HetcommWork, exc: Optional[BaseException]) -> None:
        work._complete(exc, before_callbacks=self._hand_over if self.on_thread() else None)

    def _hand_over(self) -> None:
        """Called on the executor thread just before it runs a future's callbacks: a new thread
        takes the queue; this one leaves the loop once the callbacks returned."""
        if self.on_thread() and not self._closed:
            with self._pending_lock:
                self._retiring.add(threading.current_thread())
            self._start_thread()

    def _execute(self, fn: Callable[[HetcommWork], None], work: HetcommWork) -> None:
        outer = self._local.deferred
        self._local.deferred = deferred = []
        try:
            with self._exec_lock:
                try:
                    # Data movement is never part of an autograd graph (grad mode is per thread,
                    # and the caller's no_grad of e.g. an autograd.Function forward does not
                    # reach here). Device work runs on the rail stream, after the event the call
                    # recorded on the caller's stream; the scope records the done event before
                    # the work completes.
                    with torch.no_grad(), self.streams.scope(work.order):
                        fn(work)
                # release_frames: a stored error must not keep this frame (and so the work, the
                # job and the group's rails) alive in a reference cycle (faults.release_frames).
                except CollectiveError as e:
                    deferred.append((work, release_frames(self.blame(e, work.seq))))
                except BaseException as e:  # delivered to the caller through the Work
                    deferred.append((work, release_frames(e)))
                else:
                    deferred.append((work, None))
                finally:
                    with self._pending_lock:
                        self._pending -= 1
        finally:
            self._local.deferred = outer
        # Outside the lock: callbacks may submit (and wait for) further jobs.
        for w, e in deferred:
            self._finish(w, e)

    def _run(self) -> None:
        name_native_thread()  # /proc shows which thread spends a rank's CPU
        me = threading.current_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._execute(*job)
            if self._thread is not me:  # handed the queue over while completing: leave
                with self._pending_lock:
                    self._retiring.discard(me)
                return

    def on_thread(self) -> bool:
        """True on the executor's own thread (where nothing may wait for a later job)."""
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[[HetcommWork], None], work: HetcommWork, async_op: bool = True) -> HetcommWork:
        """Run ``fn(work)`` after every earlier job; ``work`` completes with its outcome."""
        if self._closed:
            raise CollectiveError("the process group was destroyed", rank=self.rank)
        with self._pending_lock:
            inline = not async_op and self._pending == 0 and self._local.deferred is None
            self._pending += 1
        if inline:
            self._execute(fn, work)
        else:
            self._jobs.put((fn, work))
        return work

    def close(self, timeout_s: float) -> None:
        """Let queued jobs finish (each bounded by the group timeout), then stop the thread, and
        wait for retired threads still running completion callbacks (within ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        thread = self._thread
        deadline = time.monotonic() + timeout_s
        if thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
        # A callback that destroys its own group runs on one of these: it must not wait for itself.
        with self._pending_lock:
            retiring = [t for t in self._retiring if t is not threading.current_thread()]
        for t in retiring:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
