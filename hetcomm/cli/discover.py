"""``hetcomm discover``: the cluster this job runs on, as observed, with its audit findings.

Alone it probes this host (one rank). Under ``torchrun`` every rank joins: each host is probed
once, the ranks exchange their facts through the job's store, and rank 0 prints the assembled
cluster YAML and the findings and writes the YAML (``--out``). With a cluster file
(``--cluster`` or ``$HETCOMM_CLUSTER``) it also reports where the file contradicts the probe
(``cluster-mismatch``). ``$HETCOMM_PROBE_DIR`` (``{rank}`` is replaced by the rank) makes a
rank read a directory of captured tool outputs instead of its machine.

Exit codes: 0 ok, 1 error findings, 2 unreadable input, 3 a rank did not answer in time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "discover",
        help="probe every host of the job and print the observed cluster YAML + findings",
        description=(
            "Probe each host once (or read $HETCOMM_PROBE_DIR captures), exchange facts between "
            "the ranks (under torchrun) and print the cluster YAML the job observed, plus the audit "
            "findings and, with a cluster file, where it contradicts the probe."
        ),
    )
    p.add_argument("--out", default="discovered-cluster.yaml", help="where rank 0 writes the YAML (default: %(default)s; '-' = do not write)")
    p.add_argument("--cluster", default=None, help="cluster YAML to check against the probe (default: $HETCOMM_CLUSTER)")
    p.add_argument("--name", default="detected", help="name of the written cluster (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the other ranks (default: %(default)s)")
    return p


def _store_and_rank(timeout: timedelta):
    """The job's store, rank and size under torchrun; an in-process store for a lone process."""
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
        # The default group's store, under a prefix of our own so no key meets c10d's.
        store = dist.PrefixStore("hetcomm-discover-cli", dist.distributed_c10d._get_default_store())
        return store, dist.get_rank(), dist.get_world_size(), True
    return dist.HashStore(), 0, 1, False


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from hetcomm import settings
    from hetcomm.topo.cluster import load_cluster
    from hetcomm.topo.discover import compare_with_cluster, discover_cluster

    timeout = timedelta(seconds=args.timeout)
    cluster_path = args.cluster or settings.CLUSTER.get()
    declared = load_cluster(cluster_path) if cluster_path else None  # bad YAML: exit 2 before any exchange
    store, rank, world, joined = _store_and_rank(timeout)
    try:
        found = discover_cluster(store, rank, world, timeout, name=args.name)
        if declared is not None:
            compare_with_cluster(found, declared)
        errors = [f for f in found.findings if f.severity == "error"]
        if rank == 0:
            text = found.to_yaml()
            if args.out and args.out != "-":
                with open(args.out, "w", encoding="utf-8") as f:
                    f.write(f"# written by `hetcomm discover`: {found.summary()}\n")
                    for line in found.notes:
                        f.write(f"# note: {line}\n")
                    for finding in found.findings:
                        f.write(f"# finding [{finding.severity}] {finding.code}: {finding.subject}: {finding.message}\n")
                    f.write(text)
            if args.json:
                doc = {
                    "summary": found.summary(),
                    "cluster_yaml": text,
                    "ranks": [
                        {"rank": r, "host": found.rank_hosts[r], "device": found.rank_devices[r],
                         "model": found.cluster.rank(r).model, "node": found.cluster.rank(r).node.name}
                        for r in range(found.cluster.num_ranks)
                    ],
                    "pair_classes": {f"{a}-{b}": c.name for (a, b), c in sorted(found.pair_classes.items())},
                    "probes": found.probes,
                    "findings": [vars(f) for f in found.findings],
                    "notes": found.notes,
                    "written": None if args.out == "-" else args.out,
                }
                print(json.dumps(doc, indent=2))
            else:
                print(f"hetcomm discover: {found.summary()}")
                print(f"probes per host: {', '.join(f'{h}={n}' for h, n in found.probes.items())}")
                print()
                print(text, end="")
                print()
                for line in found.notes:
                    print(f"note: {line}")
                print(f"Findings ({len(errors)} error, {len(found.findings) - len(errors)} other)")
                for finding in found.findings:
                    print(f"  [{finding.severity.upper()}] {finding.code}: {finding.subject}")
                    print(f"      {finding.message}")
                    if finding.fix:
                        print(f"      fix: {finding.fix}")
                if args.out and args.out != "-":
                    print(f"\nwrote {args.out}", file=sys.stderr)
        # Every rank assembled the same findings; rank 0 alone reports them, so it alone fails.
        return 1 if errors and rank == 0 else 0
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()
