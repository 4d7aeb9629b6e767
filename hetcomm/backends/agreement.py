"""Agreement: every rank of a group checks that the settings that must match do match.

Chunk sizes, rails, ring sizes, checks, plans and wire dtypes decide how many transfers each pair
posts and how a shared segment is laid out; both ends must decide the same. They come from
per-rank sources (``pg_options``, ``HETCOMM_*`` variables, a cluster file, a calibration cache),
so at construction every rank publishes what it decided through the group's store, reads
everybody's, and compares. Every rank reads the same entries, so on a mismatch *every* rank
raises the same :class:`~hetcomm.errors.ConfigError` naming each differing field, the ranks and
their values (with where each value came from), before any data collective. A rank that never
publishes makes the others raise :class:`~hetcomm.errors.PeerTimeout` naming it, within the group
timeout.

Values are published as short text (hashes for the cluster and the placement), so that the error
can show both values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from datetime import timedelta
from typing import Dict, List, Mapping, Optional, Tuple

from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.placement import Placement
from hetcomm.errors import ConfigError, PeerTimeout

__all__ = ["settings_of", "agree", "AGREED_OPTIONS"]

#: Option fields that must be equal on every rank (``nic_ifnames`` are per host: only whether
#: they are set must agree; ``cluster`` is compared by content, not by path).
AGREED_OPTIONS = ("rails", "chunk_bytes", "ring_bytes", "check_splits", "plan", "wire_dtype")

#: Where a user changes each field (for the message).
_FIX = {
    "rails": "HETCOMM_RAILS / HetcommOptions.rails",
    "chunk_bytes": "HETCOMM_CHUNK_BYTES / HetcommOptions.chunk_bytes",
    "ring_bytes": "HETCOMM_SHM_RING_BYTES / HetcommOptions.ring_bytes",
    "check_splits": "HETCOMM_CHECK / HetcommOptions.check_splits",
    "plan": "HETCOMM_PLAN / HetcommOptions.plan",
    "wire_dtype": "HETCOMM_WIRE_DTYPE / HetcommOptions.wire_dtype",
    "nic_ifnames": "HETCOMM_IFNAMES (set it on every rank or on none)",
    "cluster": "HETCOMM_CLUSTER / cluster= (the same cluster file on every rank)",
    "placement": "the cluster file and the launch (WORLD_SIZE, rank order)",
}


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def cluster_digest(cluster) -> str:
    """``name#hash`` of a cluster's content (not its path: ranks may load copies), or ``none``."""
    if cluster is None:
        return "none"
    return f"{cluster.name}#{_digest(repr(dataclasses.replace(cluster, path=None)))}"


def placement_digest(placement: Placement) -> str:
    """Hash of who is where as this rank sees it (node, vendor, model of every rank)."""
    return _digest(repr([(p.group_rank, p.global_rank, p.node, p.host, p.vendor, p.model) for p in placement.ranks]))


def settings_of(
    options: HetcommOptions, placement: Placement, extra: Optional[Mapping[str, str]] = None
) -> Dict[str, Tuple[str, str]]:
    """``field -> (value text, source)`` of every setting that must agree.

    Args:
        options: the effective options (their :meth:`~HetcommOptions.source` per field).
        placement: the group's placement (with its cluster).
        extra: more settings (e.g. ``rails.calibrated``), already as text.
    """
    out: Dict[str, Tuple[str, str]] = {}
    for name in AGREED_OPTIONS:
        value = getattr(options, name)
        out[name] = (",".join(value) if isinstance(value, tuple) else str(value), options.source(name))
    out["nic_ifnames"] = ("set" if options.nic_ifnames else "unset", options.source("nic_ifnames"))
    out["cluster"] = (cluster_digest(placement.cluster), options.source("cluster"))
    out["placement"] = (placement_digest(placement), "placement")
    for k, v in (extra or {}).items():
        out[k] = (v, "calibration" if k.startswith("rails.") else "communicator")
    return out


def agree(
    store,
    rank: int,
    size: int,
    settings: Mapping[str, Tuple[str, str]],
    timeout: timedelta,
    what: str = "hetcomm group",
    key: str = "hetcomm/agree",
) -> None:
    """Publish this rank's settings, read every rank's, raise on any difference.

    Args:
        store: the group's store.
        settings: from :func:`settings_of`.
        timeout: how long to wait for the other ranks' entries.
        key: store prefix (one per agreement round).

    Raises:
        ConfigError: a setting differs between ranks (same error on every rank; ``key`` is the
            first differing field).
        PeerTimeout: a rank did not publish within ``timeout`` (named).
    """
    if size <= 1:
        return
    store.set(f"{key}/{rank}", json.dumps({k: list(v) for k, v in settings.items()}, sort_keys=True))
    keys = [f"{key}/{r}" for r in range(size)]
    _wait_all(store, keys, rank, timeout, what)
    every = [json.loads(store.get(k).decode()) for k in keys]
    problems: List[Tuple[str, str]] = []
    fields = sorted({f for s in every for f in s}, key=lambda f: (f not in AGREED_OPTIONS, f))
    for f in fields:
        values = [tuple(s.get(f, ["<absent>", "-"])) for s in every]
        if len({v[0] for v in values}) <= 1:
            continue
        by_value: Dict[str, List[int]] = {}
        for r, (v, _) in enumerate(values):
            by_value.setdefault(v, []).append(r)
        parts = []
        for v, ranks in by_value.items():
            src = sorted({values[r][1] for r in ranks})
            parts.append(f"{_ranks(ranks)} = {v} (from {', '.join(src)})")
        problems.append((f, f"{f}: " + "; ".join(parts) + f" [set it with {_FIX.get(f, f)}]"))
    if problems:
        raise ConfigError(
            f"{what} (rank {rank}): settings that must be equal on every rank differ: "
            + " | ".join(p for _, p in problems)
            + ". Give every rank the same value, before any data moves.",
            key=problems[0][0],
        )


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _wait_all(store, keys: List[str], rank: int, timeout: timedelta, what: str) -> None:
    """Wait for every key, naming the ranks whose key is missing at the deadline."""
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.002
    while True:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise PeerTimeout(
                f"{what}: timed out: {_ranks(missing)} did not publish their settings within "
                f"{timeout.total_seconds():.0f} s (not started, hung, or not creating this group)",
                op="init", rank=rank, peer=missing[0],
            )
        time.sleep(pause)
        pause = min(0.05, pause * 2)
