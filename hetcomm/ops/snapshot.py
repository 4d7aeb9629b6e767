"""In-memory snapshots of a training job: a killed rank or a restarted group loses at most a step.

Every ``snapshot_every`` steps (default: every step under torchrun) each rank writes its whole
training state into node-local shared memory, ``$HETCOMM_SNAPSHOT_ROOT/hetcomm-<uid>-<job id>/``
(``/dev/shm`` by default), which outlives the process: a rank killed by ``kill -9``, an OOM kill
or a crash leaves its last snapshot behind, and torchrun's restart of the group reads it back in
a fraction of a second instead of redoing every step since the last disk checkpoint.

What a snapshot holds is exactly what :mod:`hetcomm.ops.checkpoint` saves, under the same keys:
dense parameters and buffers (gate calibrator history included), this rank's experts by global
id, AdamW state, replicator heat and hot set, every ``extras`` object (the layers' expert
placement as changed at run time, balancer maps, PowerSGD's per-rank error feedback), the step, and the data-stream generator (the data position). One file
per rank and step, ``r<rank>-w<world>-s<step>.snap`` (:func:`pack`: a small ``torch.save``d header,
then the tensors' bytes), written
to a temporary name and renamed, so a process killed mid-write leaves the previous one; the
two newest steps are kept.

**Peer copy.** The bytes of each snapshot also go, in a background thread over a gloo group of
their own, to a *buddy*: the next rank (cyclically) that sits on another node of the cluster
YAML, which keeps them as ``p<rank>-w<world>-s<step>.snap`` in its node's shared memory. A lost
node's ranks are then restored from their buddies' copies. A one-node job has no buddy (its
shared memory is the same either way). The ranks meet at a barrier (in that thread) after each
exchange, and a step's snapshot first waits for the previous exchange: a rank that finished
step n+1 implies every peer copy of step n exists.

**Restore** (collective, at the start of ``train``, before the disk checkpoint is looked at):
every rank reports the snapshots its node's shared memory holds, of any world size; the newest
step for which every rank of some world size is held somewhere is chosen. Same world size: a
rank reads its own file, or receives the copy from the rank that holds it. Another world size
(a shrunk or grown job), or the same on other nodes (a node replaced: the experts may be placed
otherwise): every new rank's state is rebuilt from the old ranks' snapshots, dense
state from any, experts by global id from whichever holds them
(:mod:`hetcomm.ops.snapshot_reshard`). When no step is complete in memory (the first start),
the job resumes from disk (``--resume``) as before. Memory first, disk second: a disk
checkpoint newer than the newest snapshot wins. Files of another world size are deleted once
the new world's first snapshot is complete everywhere (its second one begins) or at a normal
end.

**Steps lost.** Each rank also records the last step it finished (``done-r<rank>``, a few bytes
per step). At a restore, *lost* = the newest step any rank finished minus the step restored:
the work redone. The own-memory write is synchronous (inside the step's end), so a rank that
finished step ``n`` holds snapshot ``n`` and a restore loses at most one step (from peer
copies too, by the barrier above); the count is
carried in the snapshots across restarts and reported in the summary and metrics.

**Disk.** Disk checkpoints (``--checkpoint-every``) stay DCP's, resharding across world sizes;
``--checkpoint-async`` writes them with ``torch.distributed.checkpoint.async_save``
(:func:`hetcomm.ops.hooks.maybe_checkpoint`) so the step does not wait for the disk.

**Cleanup.** A normal end removes each rank's files; ``hetcomm launch`` removes the job's
directory when it ends whatever the outcome (:func:`remove_job`), and ``hetcomm train``'s own
launcher does the same for its ranks. Names carry the user id and the job id (``hetcomm launch``'s
rendezvous id, else torchrun's run id), so concurrent jobs never collide.

**Whose state.** The id alone does not name one run (torchrun's default is ``none``): the
directory's ``owner.json`` and every header name the launch (:mod:`hetcomm.ops.job_identity`).
Only that launch's restarts restore; a dead namesake's snapshots are removed with one line, a
live namesake is refused (:meth:`Snapshotter._claim`).

Why not an existing engine (both install from PyPI and import with torch 2.13 CPU here; checked
with torchft 0.2.0 and dlrover 0.6.1):

* **DLRover flash checkpoint** keeps the state in shared memory and persists it asynchronously,
  but the memory outlives a worker only under DLRover's own agent (``dlrover-run`` replaces
  torchrun, whose rendezvous, restarts and supervision ``hetcomm launch`` is built on); under
  torchrun its saver is a child of local rank 0 and ends with it (its own docstring says so).
  Its engines know DDP, FSDP, Megatron and DeepSpeed layouts: the DDP one saves rank 0's copy,
  and an expert lives on one rank only. It also brings grpc, psutil and pynvml.
* **torchft** recovers a failed replica *from a healthy replica group* holding the same state
  (DP/HSDP), live, with its lighthouse and reconfigurable process groups. Expert-parallel state
  has one owner per expert: in a job of one expert-parallel group there is no replica to copy
  from, and its process-group wrappers would replace the ``hetcomm`` backend's all-to-all.

So this module is small and uses torch's own pieces (``torch.save``, a gloo group for the peer
copies, DCP for disk).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import uuid
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hetcomm import settings
from hetcomm.errors import CollectiveError
from hetcomm.ops import checkpoint as ck
from hetcomm.ops import job_identity, snapshot_reshard
from hetcomm.ops.checkpoint import Stateful, TrainState
from hetcomm.ops.snapshot_format import Restored, apply_state, pack, read_bytes, unpack

__all__ = ["Snapshotter", "Restored", "job_dir", "check_job_dir", "remove_job", "buddies", "job_id", "pack", "unpack"]

_NAME = re.compile(r"^([rp])(\d+)-w(\d+)-s(\d+)\.snap$")
_KEEP = 2  # generations kept per rank: a write killed half-way leaves the one before
_WARNED = "warned-no-space"  # a rank of this node has warned that the file system is full


def job_id() -> str:
    """This job's id as the environment gives it (``hetcomm launch``'s, else torchrun's), or ''."""
    return settings.JOB_ID.get() or os.environ.get("TORCHELASTIC_RUN_ID", "")


def job_dir(job: str, root: Optional[str] = None) -> str:
    """``<root>/hetcomm-<uid>-<job>``: the job's snapshot directory on this node."""
    root = root or settings.SNAPSHOT_ROOT.get()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:64] or "job"
    return os.path.join(root, f"hetcomm-{os.getuid()}-{safe}")


#: What to do about a job directory that is not private to this user (UnsafePathError's fix).
_DIR_FIX = ("it is not this job's to use: ask its owner (or root) to remove it, give the job another id "
            "(hetcomm launch --rdzv-id, torchrun --rdzv-id), or set HETCOMM_SNAPSHOT_ROOT to a directory only you "
            "can write")


def check_job_dir(job: str) -> str:
    """Refuse the job's snapshot directory on this node if it exists and is not private to the
    caller (``hetcomm launch`` before torchrun starts: exit 2 naming the path and owner, not a
    rank failure restarted ``--max-restarts`` times). Returns its path.

    Raises:
        UnsafePathError: a link, not a directory, another user's, or group/other-writable.
    """
    from hetcomm.ops.safe_fs import check_private_dir

    path = job_dir(job)
    if os.path.lexists(path):
        check_private_dir(path, what="the job's snapshot directory", fix=_DIR_FIX)
    return path


def remove_job(job: str, nonce: Optional[str] = None) -> bool:
    """Remove the job's snapshot directory on this node (``hetcomm launch`` at its end), only
    if it is the caller's own directory: one another user planted at the name is left alone,
    and so is one whose owner record names another launch (``nonce`` given: a live namesake
    this launch's ranks refused to share it with).

    Returns:
        True when there was one and it was removed.
    """
    from hetcomm.ops.job_identity import read_record
    from hetcomm.ops.safe_fs import remove_own_tree

    path = job_dir(job)
    rec = read_record(path) if nonce is not None else None
    if rec is not None and rec.get("launch") != nonce:
        return False
    return remove_own_tree(path)


def buddies(nodes: Sequence[str]) -> List[Optional[int]]:
    """``rank -> the rank keeping its peer copy``: the next rank, cyclically, on another node
    (None for every rank of a one-node job).

    Args:
        nodes: each rank's node name, in rank order.
    """
    n = len(nodes)
    out: List[Optional[int]] = []
    for r in range(n):
        out.append(next((s % n for s in range(r + 1, r + n) if nodes[s % n] != nodes[r]), None))
    return out


class Snapshotter:
    """One rank's snapshots (create on every rank at the same point: makes a gloo group).

    Args:
        rank / world_size: this process in the job.
        nodes: each rank's node name (from the cluster YAML), for the buddy choice.
        every: steps between snapshots (>= 1).
        peer: also keep a copy on the buddy rank.
        timeout_s: timeout of the snapshot group's transfers.
        models: each rank's device model (from the cluster YAML): with the agreed measured speeds
            in every snapshot's header, what a restore onto another membership places its
            experts by (:func:`hetcomm.ops.membership.snapshot_placement`); None: not recorded.

    Attributes:
        weights: the placement weights this job's experts were built with (None: the datasheet);
            set by the caller before the first snapshot, carried in each header.
    """

    def __init__(self, rank: int, world_size: int, nodes: Sequence[str], every: int = 1, peer: bool = True,
                 timeout_s: float = 120.0, models: Optional[Sequence[str]] = None) -> None:
        import datetime

        from hetcomm.ops.safe_fs import private_dir

        self.rank, self.world_size, self.every = rank, world_size, every
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # One name on every rank, and rank 0's process mark: the launch identity of ranks that
        # neither hetcomm launch nor torchrun started (job_identity.this_launch).
        box = [(job_id() or uuid.uuid4().hex[:12], job_identity.process_mark(os.getpid()))]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self.job = str(box[0][0])
        self.launch = job_identity.this_launch(self.job, fallback=str(box[0][1]))
        self.dir = private_dir(job_dir(self.job), what="the job's snapshot directory", fix=_DIR_FIX)
        bud = buddies(list(nodes)) if peer else [None] * world_size
        self.buddy = bud[rank]
        self.nodes = list(nodes)
        self.models = list(models) if models is not None else None
        self.weights: Optional[List[float]] = None
        self.node_ranks = {r for r, n in enumerate(nodes) if n == nodes[rank]}  # share this node's directory
        self.sources = [s for s in range(world_size) if bud[s] == rank]
        self.lost = 0  # steps lost over the whole job (carried in the snapshots)
        self.restores = 0
        self.restored: Optional[Restored] = None
        self.count = 0
        self.bytes = 0
        self.skipped = 0  # snapshots (own or peer copies) not written: the file system was full
        self.no_space: Optional[str] = None  # why, the first time
        self.blocking_s = 0.0  # time the steps waited for snapshots (capture, write, the previous send)
        self.background_s = 0.0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._done_path = os.path.join(self.dir, f"done-r{rank}")
        self._claim()

    # -- whose directory -------------------------------------------------------------------

    def _claim(self) -> None:
        """Make this node's directory this launch's (collective; :mod:`hetcomm.ops.job_identity`).

        The owner record names this launch: a restart of it, keep everything (that is what is
        restored). It names another launch that still runs (two jobs given one id): refused on
        every rank. Anything else (a dead launch's record, or snapshots without one) is stale
        state of a crashed namesake: the first rank to lock the directory deletes it with a
        one-line notice and writes this launch's record; this job starts on its own.

        Raises:
            UsageError: a live launch of another run owns the directory (names it and the fix).
        """
        from hetcomm.errors import UsageError

        import fcntl

        rec = job_identity.read_record(self.dir)
        dist.barrier(group=self.group)  # every rank read the record before any rewrites it: one verdict
        problem = None
        if rec is not None and rec.get("launch") == self.launch.nonce:
            pass
        elif rec is not None and job_identity.record_alive(rec):
            problem = (f"{self.dir}: job {self.job!r} is already running here as "
                       f"{job_identity.describe(rec)}; two jobs with one id would overwrite each other's snapshots: "
                       f"give this job another id (hetcomm launch --rdzv-id, torchrun --rdzv-id) or stop the other")
        else:
            # The ranks sharing this directory (one host, whatever the cluster YAML calls its
            # nodes) take turns; the first reclaims and writes this launch's record.
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                now = job_identity.read_record(self.dir)
                if now is None or now.get("launch") != self.launch.nonce:
                    stale = [n for n in os.listdir(self.dir) if _NAME.match(n) or n.startswith("done-r")]
                    steps = sorted({int(m.group(4)) for m in map(_NAME.match, stale) if m})
                    for name in stale:
                        try:
                            os.unlink(os.path.join(self.dir, name))
                        except FileNotFoundError:
                            pass
                    if steps:
                        print(f"hetcomm: ignored and removed the snapshots of job {self.job!r} in {self.dir} "
                              f"(steps {steps[0]}..{steps[-1]}) left by {job_identity.describe(now)}, which is not "
                              f"running: this launch starts on its own", file=sys.stderr, flush=True)
                    self._write_record()
                    # Killed jobs' directories are never removed by their own end: the first
                    # rank here to start a job reclaims those of this user's dead launches.
                    line = job_identity.sweep_line(job_identity.sweep(
                        os.path.dirname(self.dir), f"hetcomm-{os.getuid()}-", keep=self.dir))
                    if line:
                        print(line, file=sys.stderr, flush=True)
            finally:
                os.close(fd)  # releases the lock
        box: List[object] = [None] * self.world_size
        dist.all_gather_object(box, problem, group=self.group)  # also: the record is written before any rank goes on
        first = next((p for p in box if p), None)
        if first:
            raise UsageError(str(first))

    def _write_record(self) -> None:
        """This launch's owner record; a full file system skips it with the snapshots' one
        warning (no snapshot is written there either, so none can be mistaken for another's)."""
        from hetcomm.ops.safe_fs import NO_SPACE

        try:
            job_identity.write_record(self.dir, self.launch)
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            self._no_space_warning(e)

    def _check_identity(self, meta: Mapping[str, object], path: str, own: bool) -> None:
        """A snapshot proves its job and (own memory) its launch; another run's is never resumed.

        Raises:
            CheckpointError: the header names another job, or (``own``) another launch.
        """
        from hetcomm.errors import CheckpointError

        job, launch = meta.get("job"), meta.get("launch")
        if job != self.job or (own and launch != self.launch.nonce):
            raise CheckpointError(
                f"is a snapshot of job {job!r}, launch {launch!r}, not of this job {self.job!r}, launch "
                f"{self.launch.nonce!r}: another run's state is never resumed; remove {self.dir} (when no job of "
                f"that id runs) or give this job another id", path=path, reason="mismatch")

    # -- files ---------------------------------------------------------------------------

    def _path(self, kind: str, owner: int, step: int) -> str:
        return os.path.join(self.dir, f"{kind}{owner}-w{self.world_size}-s{step}.snap")

    def _scan(self) -> Dict[Tuple[int, int, int], Tuple[str, str]]:
        """``{(world size, rank whose state, step): (kind, path)}`` of the complete snapshots in
        this node's directory; kind ``r`` (the rank's own) before ``p`` (a peer copy)."""
        out: Dict[Tuple[int, int, int], Tuple[str, str]] = {}
        for name in sorted(os.listdir(self.dir), key=lambda n: n.startswith("p")):
            m = _NAME.match(name)
            if m:
                key = (int(m.group(3)), int(m.group(2)), int(m.group(4)))
                out.setdefault(key, (m.group(1), os.path.join(self.dir, name)))
        return out

    def _drop_other_worlds(self) -> None:
        """Delete this node's snapshots of other world sizes, and the finish marks of ranks that
        are not on this node now (a previous membership's, once this one's snapshots are complete)."""
        for name in os.listdir(self.dir):
            m = _NAME.match(name)
            stale = (m is not None and int(m.group(3)) != self.world_size) or (
                name.startswith("done-r") and name[6:].isdigit() and int(name[6:]) not in self.node_ranks)
            if stale:
                try:
                    os.unlink(os.path.join(self.dir, name))
                except FileNotFoundError:
                    pass

    def _finished(self) -> int:
        """The newest step any rank of this node recorded as finished (0: none)."""
        best = 0
        for name in os.listdir(self.dir):
            if name.startswith("done-r"):
                try:
                    with open(os.path.join(self.dir, name), "rb") as f:
                        best = max(best, int(f.read(32).split()[0]))
                except (OSError, ValueError, IndexError):
                    continue
        return best

    def _prune(self, kind: str, owner: int, step: int) -> None:
        for name in os.listdir(self.dir):
            m = _NAME.match(name)
            if m and m.group(1) == kind and int(m.group(2)) == owner:
                s = int(m.group(4))
                if s > step or s <= step - _KEEP * self.every or int(m.group(3)) != self.world_size:
                    try:
                        os.unlink(os.path.join(self.dir, name))
                    except FileNotFoundError:
                        pass

    # -- taking one ------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def mark_done(self, step: int) -> None:
        """Record that this rank finished ``step`` (every step; a few bytes)."""
        self._write(self._done_path, f"{step}\n".encode())

    def take(self, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], rng: torch.Generator,
             extras: Optional[Mapping[str, Stateful]] = None) -> None:
        """Snapshot the state after ``step`` into this node's shared memory, then (in the
        background) send it to the buddy and receive the copies this rank keeps.

        Raises:
            CollectiveError: the previous snapshot's peer transfer failed (a dead buddy).
        """
        t0 = time.perf_counter()
        self._join()
        if self.count == 1:  # every rank's first snapshot (and its peer copy) is complete now
            self._drop_other_worlds()
        state = ck._state(model, optimizer, TrainState(step, rng), {}, self.rank, create=False)
        head = {
            "meta": {"step": step, "rank": self.rank, "world_size": self.world_size, "lost": self.lost,
                     "job": self.job, "launch": self.launch.nonce,
                     "restores": self.restores, "nodes": self.nodes, "placement": self._placement(model)},
            "extras": {name: obj.state_dict() for name, obj in (extras or {}).items()},
        }
        blob = pack({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, head)
        if self._write(self._path("r", self.rank, step), blob):
            self._prune("r", self.rank, step)
            self.count += 1
        self.mark_done(step)
        self.bytes = len(blob)
        if self.buddy is not None or self.sources:
            self._thread = threading.Thread(target=self._exchange, args=(step, blob), daemon=True,
                                            name=f"hetcomm-snapshot-{step}")
            self._thread.start()
        self.blocking_s += time.perf_counter() - t0

    def _placement(self, model: nn.Module) -> Optional[Dict[str, object]]:
        """The header's ``placement`` (:mod:`hetcomm.ops.snapshot_format`), None without ``models``."""
        if self.models is None:
            return None
        from hetcomm.ops.membership import agreed_speed_record, measured_speeds_by_model

        return {"models": self.models, "weights": self.weights,
                "speeds_by_model": measured_speeds_by_model(model, self.models),
                "speed": agreed_speed_record(model)}

    def _write(self, path: str, data: bytes) -> bool:
        """Write one of this node's snapshot files; False when the file system is full.

        A full ``/dev/shm`` must not end the job (the disk checkpoints still stand): the snapshot
        is skipped, counted, and the first rank of the node to meet it says so once. A restore
        then finds an older complete step, or none, and counts the steps lost.
        """
        from hetcomm.ops.safe_fs import NO_SPACE, write_private

        try:
            write_private(path, data, fsync=False)
            return True
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            self.skipped += 1
            self._no_space_warning(e)
            return False

    def _no_space_warning(self, e: OSError) -> None:
        """Say once per node that the file system is full (the first rank of the node to meet it)."""
        if self.no_space is None:
            self.no_space = f"{os.path.dirname(self.dir)}: {e.strerror}"
            if self._first_to_warn():
                print(f"hetcomm train: warning: rank {self.rank}: no space left for in-memory snapshots in "
                      f"{self.no_space}; snapshots are skipped while it lasts (the disk checkpoints still "
                      f"stand); free space there, or set HETCOMM_SNAPSHOT_ROOT or --snapshot-every 0",
                      file=sys.stderr, flush=True)

    def _first_to_warn(self) -> bool:
        """Whether this rank is the first of its node to meet a full file system (an empty marker
        file in the job's directory: it needs an inode, not a page; when even that fails, warn)."""
        try:
            os.close(os.open(os.path.join(self.dir, _WARNED), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except FileExistsError:
            return False
        except OSError:
            pass
        return True

    def _exchange(self, step: int, blob: bytes) -> None:
        t0 = time.perf_counter()
        try:
            works, keep = [], []
            if self.buddy is not None:
                data = torch.frombuffer(blob, dtype=torch.uint8)  # host: bytes on the wire (never changed)
                head = torch.tensor([len(blob), step], dtype=torch.int64)  # host: header
                keep += [head, data]  # alive until the sends complete
                works.append(dist.isend(head, self.buddy, group=self.group))
                works.append(dist.isend(data, self.buddy, group=self.group))
            for src in self.sources:
                head = torch.empty(2, dtype=torch.int64)  # host: header
                dist.recv(head, src, group=self.group)
                got = torch.empty(int(head[0]), dtype=torch.uint8)  # host: bytes off the wire
                dist.recv(got, src, group=self.group)
                if self._write(self._path("p", src, int(head[1])), got.numpy().tobytes()):
                    self._prune("p", src, int(head[1]))
            for w in works:
                w.wait()
            # Every rank's copies of this step are written before any rank's next step ends:
            # a rank that finished step n+1 implies every peer copy of step n exists (lost <= 1).
            dist.barrier(group=self.group)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread at the next step
            self._error = e
        self.background_s += time.perf_counter() - t0

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise CollectiveError(
                f"the snapshot copy to or from a peer failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                f"buddy rank {self.buddy}, keeping copies of ranks {self.sources}",
                op="snapshot", rank=self.rank, peer=self.buddy,
            ) from None

    def settle(self) -> None:
        """Wait for the transfer in flight: the last snapshot's peer copies, which end with a
        barrier of the snapshot group, so every rank settles at the same point. Called before the
        job's group changes members on purpose (:mod:`hetcomm.train.growback`), whose restore
        then finds that step complete.

        Raises:
            CollectiveError: that transfer failed (a dead buddy).
        """
        self._join()

    def abandon(self, timeout_s: float = 5.0) -> None:
        """Let the transfer in flight go without a collective (this job's group lost a member and
        is being shrunk in place, :mod:`hetcomm.train.inplace`): its thread gets ``timeout_s``
        (a copy to or from the lost peer ends with its connection), its error is dropped, and
        every file stays for the restore."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread, self._error = None, None

    # -- restoring -----------------------------------------------------------------------

    def placement_record(self, not_before: int = 0, below: Optional[int] = None) -> Optional[Dict[str, object]]:
        """What the snapshots that :meth:`restore` will choose say about placement, read before
        the model exists (collective: one all-gather of every node's list and headers).

        Returns:
            ``{"world_size", "step", "nodes", "placement"}`` (``placement`` None: an older
            hetcomm's snapshot) of the newest complete step after ``not_before`` and before
            ``below``, or None (nothing complete in memory). Every rank gets the same answer.
        """
        from hetcomm.ops.snapshot_format import read_head

        seen = self._scan()
        heads: Dict[Tuple[int, int], object] = {}
        for (world, owner, step), (_, path) in sorted(seen.items()):
            if (world, step) in heads:
                continue
            try:
                meta = read_head(path)["meta"]
                heads[(world, step)] = {"nodes": meta.get("nodes"), "placement": meta.get("placement")}  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - a damaged file: another holder's header serves
                continue
        mine = sorted((world, owner, step) for (world, owner, step) in seen)
        box: List[object] = [None] * self.world_size
        dist.all_gather_object(box, (mine, heads), group=self.group)
        held: Dict[Tuple[int, int, int], Dict[int, str]] = {}
        for r, (keys, _) in enumerate(box):  # type: ignore[misc]
            for world, owner, st in keys:
                held.setdefault((int(world), int(owner), int(st)), {})[r] = "r"
        chosen = snapshot_reshard.newest_complete(held, self.world_size, below)
        if chosen is None or chosen[1] <= not_before:
            return None
        head = next((h[chosen] for _, h in box if chosen in h), None)  # type: ignore[misc,operator]
        if head is None:
            return None
        return {"world_size": chosen[0], "step": chosen[1], **head}  # type: ignore[dict-item]

    def restore(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], rng: torch.Generator,
                extras: Optional[Mapping[str, Stateful]] = None, not_before: int = 0,
                below: Optional[int] = None) -> Optional[Restored]:
        """Load the newest step every rank's state is held for, if it is after ``not_before``
        (and before ``below``: a job killed after its last step trains that step again rather
        than have nothing to train; collective over every rank; see the module docstring).

        Returns:
            What was restored, or None (nothing complete in memory: start fresh or from disk).

        Raises:
            CheckpointError: a snapshot that does not load into this model.
        """
        seen = self._scan()
        gathered: List[object] = [None] * self.world_size
        mine = sorted((world, owner, step, kind) for (world, owner, step), (kind, _) in seen.items())
        dist.all_gather_object(gathered, (mine, self._finished()), group=self.group)
        held: Dict[Tuple[int, int, int], Dict[int, str]] = {}  # (world, owner, step) -> {rank holding it: kind}
        finished = 0
        for r, (keys, done) in enumerate(gathered):  # type: ignore[misc]
            finished = max(finished, int(done))
            for world, owner, st, kind in keys:
                held.setdefault((int(world), int(owner), int(st)), {})[r] = kind
        chosen = snapshot_reshard.newest_complete(held, self.world_size, below)
        if chosen is None or chosen[1] <= not_before:
            return None
        world, step = chosen
        if world != self.world_size:  # a shrunk or grown job: rebuild each rank's state by key
            return self._reshard(world, step, held, seen, finished, model, optimizer, rng)
        W = self.world_size
        # Each rank reads what its node holds, else the lowest rank holding a copy sends it.
        holder = [r if r in held[(W, r, step)] else min(held[(W, r, step)]) for r in range(W)]
        peers = tuple(r for r in range(W) if held[(W, r, step)][holder[r]] == "p")
        blob: Optional[bytes] = None
        for r, h in enumerate(holder):  # the ranks whose node lost them: copies from their buddies
            if h == r:
                continue
            if self.rank == h:
                data = torch.frombuffer(bytearray(read_bytes(seen[(W, r, step)][1])), dtype=torch.uint8)  # host: bytes
                dist.send(torch.tensor([data.numel()], dtype=torch.int64), r, group=self.group)  # host: header
                dist.send(data, r, group=self.group)
            elif self.rank == r:
                head = torch.empty(1, dtype=torch.int64)  # host: header
                dist.recv(head, h, group=self.group)
                got = torch.empty(int(head[0]), dtype=torch.uint8)  # host: bytes
                dist.recv(got, h, group=self.group)
                blob = got.numpy().tobytes()
        path = seen[(W, self.rank, step)][1] if blob is None else f"<rank {holder[self.rank]}'s copy of step {step}>"
        if blob is None:
            blob = read_bytes(path)
        # weights_only=False: numpy state of the data stream inside; the file is this job's own,
        # in a 0700 directory of this user.
        payload = unpack(blob)
        self._check_identity(payload["meta"], path, own=holder[self.rank] == self.rank
                             and seen[(W, self.rank, step)][0] == "r")  # type: ignore[arg-type]
        moved: List[object] = [None] * W
        dist.all_gather_object(moved, payload["meta"].get("nodes", self.nodes) != self.nodes, group=self.group)
        if any(moved):  # as many ranks on other nodes: the experts may be placed otherwise
            return self._reshard(W, step, held, seen, finished, model, optimizer, rng)
        apply_state(payload, path, model, optimizer, rng, extras, self.rank)
        meta = payload["meta"]
        lost = max(0, finished - step)
        self.lost = int(meta.get("lost", 0)) + lost
        self.restores = int(meta.get("restores", 0)) + 1
        self.restored = Restored(step, "memory+peer" if peers else "memory", lost, peers)
        return self.restored

    def _reshard(self, old_world: int, step: int, held, seen, finished: int, model: nn.Module,
                 optimizer: Optional[torch.optim.Optimizer], rng: torch.Generator) -> Restored:
        """:func:`hetcomm.ops.snapshot_reshard.reshard`, then this rank's counts (collective)."""
        paths = {k: path for k, (_, path) in seen.items()}
        got = snapshot_reshard.reshard(self.group, self.rank, self.world_size, old_world, step, held, paths, finished,
                                       model, optimizer, rng)
        self.lost = got.lost_before + got.restored.lost
        self.restores = got.restores_before + 1
        self.restored = got.restored
        return got.restored

    def count_lost(self, step: int) -> int:
        """No snapshot held every rank's state: the job goes on from the disk checkpoint after
        ``step`` (0: from nothing). Count the steps any rank of this job finished since
        (collective); a first start, when none did, counts no restore.

        Returns:
            The steps lost (0 on a first start).
        """
        box: List[object] = [None] * self.world_size
        dist.all_gather_object(box, self._finished(), group=self.group)
        finished = max(int(b) for b in box)  # type: ignore[call-overload]
        if not step and not finished:
            return 0
        lost = max(0, finished - step)
        self.lost += lost
        self.restores += 1
        self.restored = Restored(step, "disk" if step else "nothing", lost)
        return lost

    # -- the end -----------------------------------------------------------------------------

    def close(self, remove: bool = True) -> None:
        """Wait for the last transfer; with ``remove`` (a normal end) delete this rank's files
        and, once every rank is done, the directory (collective)."""
        self._join()
        if not remove:
            return
        dist.barrier(group=self.group)
        self._drop_other_worlds()  # a previous membership's files: nobody restores them now
        for name in os.listdir(self.dir):
            m = _NAME.match(name)
            if name in (f"done-r{self.rank}", _WARNED) or (m and (int(m.group(2)) == self.rank and m.group(1) == "r"
                                                       or m.group(1) == "p" and int(m.group(2)) in self.sources)):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except FileNotFoundError:
                    pass
        dist.barrier(group=self.group)
        try:  # every snapshot is gone: nothing is left for the owner record to vouch for
            os.unlink(os.path.join(self.dir, job_identity.RECORD))
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.dir)  # the last rank of this node to get here removes it
        except OSError:
            pass

    def gather_skipped(self) -> None:
        """Make :attr:`skipped` the job's total and :attr:`no_space` the first reason any rank
        met (collective)."""
        box: List[object] = [None] * self.world_size
        dist.all_gather_object(box, (self.skipped, self.no_space), group=self.group)
        self.skipped = sum(int(n) for n, _ in box)  # type: ignore[misc]
        self.no_space = next((why for _, why in box if why), None)  # type: ignore[misc]

    def summary_rows(self, steps_run: int, elapsed_s: float) -> List[Tuple[str, str]]:
        """The summary's rows (rank 0's view): cadence, cost per step, restores and steps lost."""
        per = self.blocking_s / max(1, steps_run)
        step_s = elapsed_s / max(1, steps_run)
        where = (f"{os.path.dirname(self.dir)} + a copy on rank {self.buddy}" if self.buddy is not None
                 else f"{os.path.dirname(self.dir)} (one node: no peer copy)")
        rows = [
            ("snapshots", f"every {self.every} step(s) to {where}; {self.count} taken, {self.bytes / 1e6:.2f} MB each"
                          + (f"; {self.skipped} file(s) skipped, no space ({self.no_space})" if self.skipped else "")),
            ("snapshot cost", f"{per * 1e3:.2f} ms/step in the step ({per / max(step_s, 1e-12):.1%} of "
                              f"{step_s * 1e3:.1f} ms), {self.background_s / max(1, self.count) * 1e3:.2f} ms "
                              f"in the background"),
        ]
        r = self.restored
        if r is not None and r.source == "nothing":
            rows.append(("restores / steps lost", f"{self.restores} / {self.lost} (last: no snapshot or checkpoint "
                                                  f"held every rank's state, started again from step 0, lost {r.lost})"))
            return rows
        rows.append(("restores / steps lost", f"{self.restores} / {self.lost}" + (
            f" (last: after step {r.step} from {r.source}"
            f"{f', resharded from {r.resharded_from} ranks' if r.resharded_from is not None else ''}"
            f"{(', old ranks ' if r.resharded_from is not None else ', ranks ') + str(list(r.from_peer)) + ' from peers' if r.from_peer else ''}, "
            f"lost {r.lost})" if r is not None else "")))
        return rows
