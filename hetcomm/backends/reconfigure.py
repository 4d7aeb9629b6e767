"""Membership change of a hetcomm group: ``dist.shrink_group`` and ``reconfigure`` (torch >= 2.14).

torch 2.14 gave c10d two ways to change who is in a group without restarting the processes:

* ``dist.shrink_group(ranks_to_exclude, group)``: the survivors call it (never the excluded
  ranks); c10d asks the group's backend ``supports_shrinking`` and calls ``backend.shrink(...)``,
  which returns a *new* backend over the survivors, numbered in their old order; c10d wraps it
  in a new ProcessGroup and destroys the old one.
* ``get_reconfigure_handle()`` / ``reconfigure(ReconfigureOptions{uuid, handles, timeout})``
  (``dist._get_reconfigure_handle`` / ``dist._reconfigure``): every member of the *new*
  membership, old or joining, passes the same fresh ``uuid`` and the same handles (exchanged
  out of band, e.g. through a store); a list numbers the new ranks by position, a set lets the
  backend choose. On gloo the group object stays and its rank and size become the new ones; a
  Python backend's cannot (:func:`reconfigure_group` says what hetcomm does). A group created
  with ``enable_reconfigure=True`` has no communicator until its first reconfigure (a joining
  process creates a group of one that way, over the same store as the others).

What a hetcomm group must do for either, in this order (:func:`change_communicator`):

1. **Check the request** (:func:`shrink_change`, :func:`reconfigure_change`): excluding
   oneself, a rank out of range, a duplicate, every rank, an unparsable handle or one's own
   handle missing from the list is a :class:`~hetcomm.errors.UsageError` naming it, before
   anything is published.
2. **Agree on the new membership** (:func:`agree_change`): each new rank publishes the
   membership it computed (new rank -> cluster slot and handle) under the change's own store
   key and waits for every other new rank's, within the timeout; a rank that never answers is
   a :class:`~hetcomm.errors.PeerTimeout` naming it by its *old* rank (shrink) or its handle's
   host and pid (reconfigure), and a rank that computed another membership under the same key
   (another handle order) a :class:`~hetcomm.errors.ConfigError` naming the ranks and both
   memberships; another exclusion list is another key, so its ranks are named as not answering.
   Nothing of the new communicator exists yet, so a failed change leaves the group as it was.
   Entries stay (a rank that timed out does not take its entry back: a slower peer would then
   name it as silent): a retry of the same change counts them, so a rank that answered once and
   died before the retry is found by the communicator's build instead, whose store waits end at
   the timeout too.
3. **Build a new communicator** over a store prefix of its own (``hetcomm/membership/<key>/``):
   the placement (the cluster file's slot of each new rank: a survivor keeps its slot; a
   joiner whose handle names none takes its position), the option agreement, the rails, the
   inner gloo group and the heartbeat of a default group, exactly as at creation
   (:meth:`~hetcomm.backends.communicator.Communicator._for_backend`). Nothing of the old
   communicator is reused: its shm segments, rings and gloo pairs are laid out for the old
   numbering, and a dead peer's end of them is gone.
4. The caller (the group) swaps the new communicator in and closes the old one.

The store is the group's own (the one c10d gave it), so it must outlive the change: a job whose
store lived in the process that left cannot change its membership (the survivors' waits end at
the timeout naming the store). The change's key depends only on what every new member knows
(the group's change count and the survivors for a shrink, the ``uuid`` for a reconfigure), so
no extra round trip is needed to agree on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid as uuid_mod
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional, Sequence, Union

from hetcomm.errors import ConfigError, PeerTimeout, UsageError

__all__ = [
    "HANDLE_PREFIX", "Handle", "Change", "new_handle", "shrink_change", "reconfigure_change",
    "agree_change", "change_communicator", "supported", "Members", "NotConfigured", "done_work",
    "shrink_backend", "reconfigure_group",
]

#: Every hetcomm reconfigure handle starts with this (the format's version after the colon).
HANDLE_PREFIX = "hetcomm:1:"


def supported() -> bool:
    """Whether this torch has the membership-change API (``shrink_group``, ``ReconfigureOptions``):
    torch >= 2.14. On 2.13 a hetcomm group reports ``supports_reconfigure`` / ``supports_shrinking``
    False and membership changes go through a restart (``hetcomm launch``)."""
    import torch.distributed as dist

    return hasattr(dist, "shrink_group") and hasattr(dist, "_reconfigure")


@dataclass(frozen=True)
class Handle:
    """What one process tells the others so that they can take it into a new membership.

    Attributes:
        token: unique per process and group generation (a new one after every change).
        host / pid: where the process runs (for messages: "handle of pid 4711 on node-a").
        slot: the cluster file's rank this process stands for; -1: unknown (a joiner, or a group
            created with ``enable_reconfigure=True`` that has not been configured yet): it takes
            its position in the new membership.
    """

    token: str
    host: str
    pid: int
    slot: int = -1

    def encode(self) -> str:
        """The opaque string torch passes around (``hetcomm:1:{json}``)."""
        return HANDLE_PREFIX + json.dumps({"token": self.token, "host": self.host, "pid": self.pid, "slot": self.slot},
                                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def parse(cls, text: Any, *, rank: int, index: int) -> "Handle":
        """Read one handle; ``rank`` (this process) and ``index`` (its place in the list) go in the error.

        Raises:
            UsageError: not a hetcomm handle (another backend's, or damaged).
        """
        if not isinstance(text, str) or not text.startswith(HANDLE_PREFIX):
            raise UsageError(
                f"hetcomm reconfigure (rank {rank}): handle {index} is {str(text)[:60]!r}, not a hetcomm handle "
                f"(it starts with {HANDLE_PREFIX!r}); pass the strings dist._get_reconfigure_handle() returned on "
                f"each member's hetcomm group"
            )
        try:
            d = json.loads(text[len(HANDLE_PREFIX):])
            return cls(str(d["token"]), str(d["host"]), int(d["pid"]), int(d.get("slot", -1)))
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(
                f"hetcomm reconfigure (rank {rank}): handle {index} {text[:60]!r} is damaged ({e}); pass the "
                f"strings dist._get_reconfigure_handle() returned, unchanged"
            ) from None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}" + (f" (cluster rank {self.slot})" if self.slot >= 0 else "")


def new_handle(slot: int = -1) -> Handle:
    """A fresh handle for this process (a new token each call)."""
    return Handle(uuid_mod.uuid4().hex[:16], socket.gethostname(), os.getpid(), int(slot))


@dataclass(frozen=True)
class Change:
    """One membership change as this process computed it (the same on every new member, or
    :func:`agree_change` says who differs).

    Attributes:
        op: ``shrink_group`` or ``reconfigure`` (for messages).
        key: the change's store key (unique per change of this group's lineage).
        rank / size: this process's rank in the new membership, and its size.
        slots: the cluster file's rank of each new rank (``[size]``).
        labels: how to name each new rank in an error (its old rank, or its handle's process).
        members: what must agree (the text every new rank publishes).
    """

    op: str
    key: str
    rank: int
    size: int
    slots: List[int]
    labels: List[str]
    members: str


def shrink_change(rank: int, size: int, ranks_to_exclude: Iterable[int], slots: Sequence[int], generation: int) -> Change:
    """The change ``shrink_group(ranks_to_exclude)`` asks of old rank ``rank`` of a group of ``size``.

    Args:
        slots: the cluster slot of every old rank (``[size]``).
        generation: how many changes this group's lineage has seen (the same on every member).

    Raises:
        UsageError: ``ranks_to_exclude`` empty, with a rank out of range or twice, naming
            ``rank`` itself (an excluded rank must not call shrink), or every rank.
    """
    excluded = list(ranks_to_exclude)
    where = f"hetcomm shrink (rank {rank} of {size})"
    if not excluded:
        raise UsageError(f"{where}: ranks_to_exclude is empty; name the rank(s) that left, e.g. [3]")
    for r in excluded:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < size:
            raise UsageError(f"{where}: rank {r!r} in ranks_to_exclude is not a rank of this group (0..{size - 1})")
    dup = sorted({r for r in excluded if excluded.count(r) > 1})
    if dup:
        raise UsageError(f"{where}: rank {dup[0]} is in ranks_to_exclude more than once")
    if rank in excluded:
        raise UsageError(
            f"{where}: rank {rank} excludes itself; only the ranks that stay call shrink_group (an excluded "
            f"rank leaves: destroy_process_group() and exit)"
        )
    survivors = [r for r in range(size) if r not in excluded]
    key = f"shrink/{generation}/" + "-".join(map(str, survivors))
    new_slots = [int(slots[r]) for r in survivors]
    members = json.dumps({"op": "shrink", "survivors": survivors, "slots": new_slots})
    return Change("shrink_group", key, survivors.index(rank), len(survivors), new_slots,
                  [f"rank {r} (old numbering)" for r in survivors], members)


def reconfigure_change(handles: Union[Sequence[str], Iterable[str]], mine: Handle, uuid: int, rank: int) -> Change:
    """The change ``reconfigure(uuid, handles)`` asks of the process whose handle is ``mine``.

    A list numbers the new ranks by position; a set is ordered by (slot, handle text), so every
    member orders it alike. A handle without a slot takes its position; two handles naming the
    same slot are an error.

    Args:
        rank: this process's current rank (for messages; 0 in a group not configured yet).

    Raises:
        UsageError: an empty or damaged list, a handle twice, or ``mine`` not in it.
        ConfigError: two members stand for the same cluster slot.
    """
    texts = list(handles)
    if isinstance(handles, (set, frozenset)):
        parsed = sorted(((Handle.parse(t, rank=rank, index=i), t) for i, t in enumerate(texts)),
                        key=lambda ht: (ht[0].slot, ht[1]))
        texts = [t for _, t in parsed]
    if not texts:
        raise UsageError(f"hetcomm reconfigure (rank {rank}): the handle list is empty; every member's handle goes in it")
    parsed_list = [Handle.parse(t, rank=rank, index=i) for i, t in enumerate(texts)]
    tokens = [h.token for h in parsed_list]
    for i, t in enumerate(tokens):
        if tokens.index(t) != i:
            raise UsageError(f"hetcomm reconfigure (rank {rank}): handle {i} repeats handle {tokens.index(t)} "
                             f"({parsed_list[i].describe()}); give each member's handle once")
    if mine.token not in tokens:
        raise UsageError(
            f"hetcomm reconfigure (rank {rank}): this process's handle ({mine.describe()}) is not in the list of "
            f"{len(tokens)}; every member passes the handles of all members, its own included (an old handle: "
            f"handles change after every reconfigure, take fresh ones with dist._get_reconfigure_handle())"
        )
    slots = [h.slot if h.slot >= 0 else i for i, h in enumerate(parsed_list)]
    for i, s in enumerate(slots):
        if slots.index(s) != i:
            j = slots.index(s)
            raise ConfigError(
                f"hetcomm reconfigure (rank {rank}): new ranks {j} ({parsed_list[j].describe()}) and {i} "
                f"({parsed_list[i].describe()}) both stand for cluster rank {s}; order the handle list so that a "
                f"joining process takes the place of the one that left"
            )
    members = json.dumps({"op": "reconfigure", "uuid": int(uuid), "tokens": tokens, "slots": slots})
    return Change("reconfigure", f"reconfigure/{int(uuid)}", tokens.index(mine.token), len(tokens), slots,
                  [f"new rank {i} ({h.describe()})" for i, h in enumerate(parsed_list)], members)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def agree_change(store, change: Change, timeout: timedelta) -> None:
    """Publish this rank's view of ``change`` and wait for every new rank's; raise unless all agree.

    Raises:
        PeerTimeout: a new rank did not answer within ``timeout`` (named by ``change.labels``;
            ``peer`` is its new rank).
        ConfigError: the ranks computed different memberships (every rank raises the same).
    """
    if change.size <= 1:
        return
    base = f"hetcomm/membership/{change.key}/agree"
    store.set(f"{base}/{change.rank}", change.members)
    keys = [f"{base}/{r}" for r in range(change.size)]
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.002
    while True:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            break
        if time.monotonic() > deadline:
            who = ", ".join(change.labels[r] for r in missing)
            raise PeerTimeout(
                f"{change.op}: {who} did not answer within {timeout.total_seconds():g} s (dead, hung, or not "
                f"calling {change.op} with the same arguments); exclude it too, or raise the timeout",
                op=change.op, rank=change.rank, peer=missing[0],
            )
        time.sleep(pause)
        pause = min(0.05, pause * 2)
    views = [store.get(k).decode() for k in keys]
    if len(set(views)) > 1:
        by_view: dict = {}
        for r, v in enumerate(views):
            by_view.setdefault(v, []).append(r)
        parts = "; ".join(f"{', '.join(change.labels[r] for r in rs)}: {v} (#{_digest(v)})" for v, rs in by_view.items())
        raise ConfigError(
            f"hetcomm {change.op} (new rank {change.rank}): the members computed different memberships: {parts}. "
            f"Every member must pass the same arguments (the same ranks_to_exclude; the same handles in the same order)",
            key="membership",
        )


def change_communicator(store, change: Change, timeout: timedelta, options, group_id: str,
                        group_ref: Callable[[], Any], default_group: bool):
    """Agree on ``change`` and build the communicator of the new membership (steps 2 and 3 of
    the module docstring). The old communicator is untouched: the caller closes it.

    Args:
        store: the group's store (c10d's prefixed store, the same object the group was built on).
        options: the old group's :class:`~hetcomm.backends.options.HetcommOptions` (its explicit
            fields; ``HETCOMM_*`` fill the rest, and the new members agree on them again).
        default_group: whether the group is the job's default group (its communicator runs the
            heartbeat; a shrunk default group stays the default group).

    Returns:
        The new :class:`~hetcomm.backends.communicator.Communicator`.
    """
    import torch.distributed as dist

    from hetcomm.backends.communicator import Communicator

    agree_change(store, change, timeout)
    sub = dist.PrefixStore(f"hetcomm/membership/{change.key}/comm/", store)
    # The slots go in as global ranks: the cluster file places each new rank by the slot it
    # stands for (a subgroup's rule: the file may have more ranks than the new membership).
    return Communicator._for_backend(sub, change.rank, change.size, timeout, options, change.slots,
                                     group_id, group_ref, watch_peers=default_group)


class Members:
    """A hetcomm group's membership and what a change rebuilds from (one per group lineage).

    Args:
        store: the group's store (c10d's, prefixed per group): every change's keys live under it,
            so a process that joins must create its group over the same store and group name.
        rank / size: this process in the group as created.
        options: the explicit ``pg_options`` (None: ``HETCOMM_*`` and defaults), reused by every change.
        global_ranks: the group's global ranks (empty: the default group, cluster slot = rank).
        group_id: c10d's id of the group (for logs).
    """

    def __init__(self, store, rank: int, size: int, options, global_ranks: List[int], group_id: str) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.options = options
        self.slots: List[int] = list(global_ranks) or list(range(size))
        self.group_id = group_id
        #: Changes this group's lineage has seen (a shrunk group continues its parent's count).
        self.generation = 0
        self._handle: Optional[Handle] = None
        self._uuids: set = set()

    def handle(self, comm) -> Handle:
        """This process's handle until the next change (``comm`` None: not configured, no slot)."""
        if self._handle is None:
            self._handle = new_handle(self.slots[self.rank] if comm is not None else -1)
        return self._handle

    def reconfigure_change(self, opts, comm) -> Change:
        """The change torch's ``ReconfigureOptions`` ask of this process (checked, not agreed).

        Raises:
            UsageError: a ``uuid`` this group used before, or bad handles (:func:`reconfigure_change`).
        """
        uuid = int(opts.uuid)
        if uuid in self._uuids:
            raise UsageError(
                f"hetcomm reconfigure (rank {self.rank}): uuid {uuid} was used by an earlier reconfigure of this "
                f"group; pass a fresh uuid on every reconfigure (the same one on every member)"
            )
        return reconfigure_change(opts.handles, self.handle(comm), uuid, self.rank)

    def shrink_change(self, ranks_to_exclude: Sequence[int]) -> Change:
        """The change ``shrink(ranks_to_exclude)`` asks of this process (checked, not agreed)."""
        return shrink_change(self.rank, self.size, ranks_to_exclude, self.slots, self.generation)

    def moved(self, change: Change) -> "Members":
        """This lineage after ``change`` (a new object: the old group keeps describing itself)."""
        m = Members(self.store, change.rank, change.size, self.options, list(change.slots), self.group_id)
        m.generation = self.generation + 1
        m._uuids = set(self._uuids) | ({int(change.key.split("/")[1])} if change.op == "reconfigure" else set())
        return m


class NotConfigured:
    """Stands in for the collectives of a group without a communicator: created with
    ``enable_reconfigure=True`` and not configured yet, or moved to a new ProcessGroup by a
    reconfigure. Every call raises naming the fix."""

    def __init__(self, rank: int, why: str = "") -> None:
        self._rank = rank
        self._why = why or ("this group was created with enable_reconfigure=True and has no members yet; call "
                            "dist._reconfigure(uuid, handles, group) on every member first")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise UsageError(f"hetcomm {name} (rank {self._rank}): {self._why}")


def done_work():
    """A completed ``dist.Work`` (a membership change is done when the call returns)."""
    import torch

    from hetcomm.backends.work import FutureWork

    fut: "torch.futures.Future" = torch.futures.Future()
    fut.set_result([])
    return FutureWork(fut)


def _c10d():
    import torch.distributed as dist

    return dist.distributed_c10d


def shrink_backend(face, ranks_to_exclude: Sequence[int]):
    """``Backend.shrink`` of a :class:`~hetcomm.backends.process_group.HetcommBackend`: agree, build
    the survivors' communicator, and return a new backend serving it. c10d then wraps it in a
    new ProcessGroup and destroys the old group (whose communicator closes then); the new
    communicator finds that group at its first use (:class:`~hetcomm.backends.communicator.LateGroupRef`).

    Raises:
        UsageError / PeerTimeout / ConfigError: as :func:`shrink_change` and :func:`agree_change`;
            the old group is untouched.
    """
    from hetcomm.backends.communicator import LateGroupRef

    members = face._members
    if face.communicator is None:
        raise UsageError(f"hetcomm shrink_group (rank {members.rank}): this group has no members yet "
                         f"(enable_reconfigure=True); reconfigure it first")
    change = members.shrink_change(list(ranks_to_exclude))
    old_pg = face._pg_ref()
    default = old_pg is not None and old_pg is _c10d()._world.default_pg
    box: List[Any] = []  # the new backend, weakly (it holds the reference: no cycle)
    late = LateGroupRef(lambda pg: _face_serves(pg, box))
    comm = change_communicator(members.store, change, face._timeout, members.options, members.group_id, late, default)
    new = type(face)._adopt(comm, members.moved(change), face._timeout, members.group_id, late)
    box.append(weakref.ref(new))
    return new


def _face_serves(pg, box: List[Any]) -> bool:
    if not box or box[0]() is None:
        return False
    try:
        return pg._get_backend(_cpu()) is box[0]()
    except Exception:  # noqa: BLE001 - a group without a CPU backend, or one being destroyed
        return False


def _cpu():
    import torch

    return torch.device("cpu")


def reconfigure_group(face, opts):
    """``reconfigure(opts)`` of a hetcomm face: agree, build the new membership's communicator, serve it.

    Where the new membership keeps this process's rank and the group's size (a group created
    with ``enable_reconfigure=True`` configured with the same ranks, or a membership renewed),
    the group object serves it in place. Otherwise c10d's ``ProcessGroup`` cannot follow: it
    reads a Python backend's rank and size once, from fields only C++ backends can change. The
    default group is then replaced: a new ProcessGroup (named ``hetcomm-reconfigure-<uuid>`` on
    every member) with a new backend serving the new communicator becomes the default group, so
    ``dist.get_rank()``, ``dist.get_world_size()`` and every call with ``group=None`` (or
    ``dist.group.WORLD``) follow; the old ProcessGroup object raises, naming the new one. A
    non-default group whose rank or size would change is refused (:class:`UsageError`): there
    is no name by which its callers would find the new group; shrink it or create a new group.

    Returns:
        A completed ``dist.Work`` (the change is done, or raised, when this returns).

    Raises:
        UsageError / PeerTimeout / ConfigError: bad handles, a silent member, differing views;
            the group keeps its membership.
    """
    import torch.distributed as dist

    members = face._members
    old = face.communicator
    change = members.reconfigure_change(opts, old)
    timeout = opts.timeout if opts.timeout is not None else face._timeout
    pg = face._pg_ref()
    c10d = _c10d()
    default = pg is not None and pg is c10d._world.default_pg
    uuid = int(change.key.split("/")[1])
    if (change.rank, change.size) == (members.rank, members.size):
        comm = change_communicator(members.store, change, timeout, members.options, members.group_id, face._pg_ref, default)
        face._members = members.moved(change)
        _swap(face, comm)
        return done_work()
    if not default:
        raise UsageError(
            f"hetcomm reconfigure (rank {members.rank} of {members.size}): this is not the default group, and the "
            f"new membership gives this process rank {change.rank} of {change.size}; c10d cannot renumber a Python "
            f"backend's group in place (torch >= 2.14 reads its rank and size once). Use dist.shrink_group to "
            f"shrink it, or create a new group with the new members"
        )
    name = f"hetcomm-reconfigure-{uuid}"
    backend_name, c10d_store = c10d._world.pg_map[pg]
    new_pg = dist.ProcessGroup(dist.PrefixStore(f"{name}/", c10d_store.clone()), change.rank, change.size)
    ref = weakref.ref(new_pg)
    comm = change_communicator(members.store, change, timeout, members.options, members.group_id, ref, True)
    new = type(face)._adopt(comm, members.moved(change), face._timeout, members.group_id, ref)
    for device in pg._device_types or [_cpu()]:  # where c10d registered the old backend
        new_pg._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, new)
    new_pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    new_pg._set_group_name(name)
    new_pg._set_group_desc("default:reconfigured")
    if getattr(pg, "bound_device_id", None) is not None:
        new_pg.bound_device_id = pg.bound_device_id
    config = c10d._world.pg_backend_config.get(pg, "")
    # As shrink_group does for the default group: the other groups were numbered by the old one.
    c10d._destroy_all_other_groups(exclude_group=pg)
    c10d._cleanup_process_group_global_state(pg)
    c10d._update_default_pg(new_pg)
    c10d._register_pg_in_world(pg=new_pg, backend_name=backend_name, store=c10d_store, group_name=name,
                               backend_config=config, rank_mapping={r: r for r in range(change.size)})
    _swap(face, None, why=f"a reconfigure moved this group to a new ProcessGroup ({name!r}, rank {change.rank} "
                          f"of {change.size}); use dist.group.WORLD or group=None")
    face._closed = True
    return done_work()


def _swap(face, comm, why: str = "") -> None:
    """Serve ``comm`` from ``face`` and close the communicator it served before."""
    old = face._release()
    face._install(comm, why)
    if old is not None:
        old.close()
