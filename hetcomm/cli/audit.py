"""``hetcomm audit``: topology, findings (what each means, how to fix it) and three answers.

::

    hetcomm audit                                           # this machine
    hetcomm audit -i nvsmi_topo.txt -i lsmod.txt -i ibstat.txt --size 256M
    hetcomm audit --cluster configs/clusters/mixed-a100-h800-910b.yaml --json
    hetcomm audit -i topo.txt --plot links.png              # needs the 'plot' extra

Exit codes: 0 no error findings (warnings/info only), 1 at least one error finding, 2 bad usage
or unreadable input (the message names the file and line).
"""

from __future__ import annotations

import argparse
import json
import sys

from hetcomm.cli.main import EXIT_FINDINGS, EXIT_OK
from hetcomm.cli.topo import add_input_arguments, load_topology, write_stdout

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "audit",
        help="find topology misconfigurations and estimate all-to-all time",
        description="Audit a topology (this machine, captured tool outputs, a cluster file): "
        "findings with fixes, expected all-to-all time per link class, the "
        "cross-vendor path, and measured all-to-all results. Exit 1 on error findings.",
    )
    add_input_arguments(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document: the topology schema plus an 'answers' key",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="also write a heat map of link classes (needs: pip install 'hetcomm[plot]')",
    )
    p.add_argument(
        "--size",
        default="64M",
        metavar="BYTES",
        help="all-to-all size per rank for the estimate, e.g. 64M, 1G (default 64M)",
    )
    p.add_argument(
        "--bench",
        action="store_true",
        help="also measure all-to-all here with `hetcomm bench` (1M..16M per rank, local ranks: "
        "the cluster's rank count with --cluster, else 4) and answer question (c) from it",
    )
    return p


def _measure_alltoall(cluster_path, cluster) -> str:
    """Run ``hetcomm bench alltoall -b 1M -e 16M -f 4 -n 5`` on local ranks; the nccl-tests table."""
    from hetcomm.cli._benchlib import BenchConfig, format_table, run_local

    num_ranks = cluster.num_ranks if cluster is not None else 4
    config = BenchConfig(
        "alltoall", minbytes=1 << 20, maxbytes=16 << 20, stepfactor=4, iters=5, warmup_iters=1,
        cluster=cluster_path,
    )
    print(f"hetcomm audit: measuring all-to-all on {num_ranks} local ranks (hetcomm bench)...", file=sys.stderr)
    return format_table(run_local(config, num_ranks))


def run(args: argparse.Namespace) -> int:
    from hetcomm.topo.audit import parse_size, run_audit
    from hetcomm.topo.render import plot_heatmap, render_audit

    size_bytes = parse_size(args.size, what="--size")  # bad --size fails before any work
    topo, cluster = load_topology(args)
    if args.bench:
        from hetcomm.topo.parse import parse_text

        table = _measure_alltoall(args.cluster, cluster)
        measured = parse_text(table, "<hetcomm bench>", fmt="nccl-tests")
        for m in measured.measurements:
            m.source = "hetcomm bench (measured here)"
        topo.measurements.extend(measured.measurements)
    report = run_audit(topo, cluster, size_bytes=size_bytes)  # type: ignore[arg-type]
    if cluster is not None and args.cluster and report.alltoall.time_us is not None:
        # One prediction for one cluster and size: the scheduler's cost model, as `hetcomm
        # simulate` prints it (the alpha-beta table stays beside it).
        from hetcomm.cli.simulate import predict_alltoall_us
        from hetcomm.topo.estimate import with_predicted_time

        report.alltoall = with_predicted_time(
            report.alltoall,
            predict_alltoall_us(args.cluster, size_bytes),
            "expected time: hetcomm simulate's cost model, flat plan (same cluster, same size)",
        )
    if args.plot:
        plot_heatmap(topo, args.plot)
        print(f"hetcomm audit: wrote link-class heat map to {args.plot}", file=sys.stderr)
    if args.json:
        doc = topo.to_dict()
        doc["answers"] = report.answers_dict()
        write_stdout(json.dumps(doc, indent=2) + "\n")
    else:
        text = render_audit(report)
        if topo.facts.get("formats") == ["live-probe"] and not any(
            d.vendor in ("nvidia", "ascend") for d in topo.devices
        ):
            text += (
                "\nThis is a CPU-only host. To see a heterogeneous cluster's report, try:\n"
                "  hetcomm audit --cluster configs/clusters/mixed-mini.yaml\n"
            )
        write_stdout(text)
    return EXIT_FINDINGS if report.num_errors else EXIT_OK
