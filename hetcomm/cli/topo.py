"""``hetcomm topo``: print the topology of this machine, of captured tool output, or of a cluster.

::

    hetcomm topo                                   # live probe of this machine
    hetcomm topo --input topo.txt --input ibstat.txt   # parse captured outputs, merged
    hetcomm topo --cluster configs/clusters/mixed-mini.yaml --json

With no ``--input`` the machine is probed (``hetcomm.topo.probe``). ``--cluster`` adds the
cluster's ranks (``rank0`` ..) and their declared links; device kinds this machine does not have
are marked as labels. ``--json`` prints exactly one JSON document (``Topology.to_dict()``).
The input helpers here are shared with ``hetcomm audit``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import List, Optional, Tuple

from hetcomm.errors import HetcommError, TopologyParseError, UsageError
from hetcomm.topo.model import Topology

__all__ = ["add_parser", "run", "add_input_arguments", "load_topology", "write_stdout"]


def add_input_arguments(p: argparse.ArgumentParser) -> None:
    """``--input FILE`` (repeatable), ``--format FMT`` and ``--cluster YAML``."""
    p.add_argument(
        "--input",
        "-i",
        action="append",
        default=[],
        metavar="FILE",
        help="captured tool output to parse (nvidia-smi topo -m, ibstat, NCCL log, ...); repeat "
        "to merge several; '-' reads stdin. Without any, this machine is probed live.",
    )
    p.add_argument(
        "--format",
        "-f",
        metavar="FMT",
        default=None,
        help="format of every --input (default: detected from the content of each file)",
    )
    p.add_argument(
        "--cluster",
        "-c",
        metavar="YAML",
        default=None,
        help="cluster description (configs/clusters/*.yaml) whose ranks to add",
    )


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "topo",
        help="print the topology (devices, NICs, link classes)",
        description="Print the topology of this machine (live probe), of captured tool outputs "
        "(--input), and/or of a cluster file (--cluster).",
    )
    add_input_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    return p


def _progress(message: str) -> None:
    # Interactive runs only: pipelines and tests get clean stderr.
    if sys.stderr.isatty():
        print(f"hetcomm: {message}", file=sys.stderr, flush=True)


def _parse_one(path: str, fmt: Optional[str]) -> Topology:
    """Parse one input, turning every failure into an error that names the file."""
    try:
        from hetcomm.topo.parse import parse_file
    except ImportError as e:
        raise UsageError(
            f"the tool-output parsers are not available ({e}); reinstall hetcomm"
        ) from None
    if path != "-":
        if not os.path.exists(path):
            raise UsageError(f"{path}: no such file; check the --input path")
        if os.path.isdir(path):
            raise UsageError(f"{path}: is a directory; pass the captured output file itself")
    return _guard(lambda: parse_file(path, fmt), "<stdin>" if path == "-" else path)


def _guard(parse, path: str) -> Topology:
    try:
        return parse()
    except HetcommError:
        raise
    except UnicodeDecodeError as e:
        raise TopologyParseError(
            f"not a text file (byte {e.start} is not UTF-8); pass the tool's text output", path=path
        ) from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # a parser bug must still not print a traceback at the user
        raise TopologyParseError(
            f"the parser failed unexpectedly ({type(e).__name__}: {e}); this is a hetcomm bug, "
            "please report it with the input file",
            path=path,
        ) from None


def load_topology(args: argparse.Namespace) -> Tuple[Topology, object]:
    """The topology the arguments describe, and the loaded cluster (or None).

    Inputs are parsed and merged in order; without inputs, this machine is probed. The cluster's
    ranks are added last, marked as labels where this machine lacks their device kind.

    Raises:
        UsageError / TopologyParseError / ConfigError: bad arguments or unreadable input (the
        CLI maps them to exit code 2).
    """
    inputs: List[str] = list(args.input or [])
    if args.format is not None and not inputs:
        raise UsageError("--format applies to --input files; give at least one --input")
    topo = Topology()
    if inputs:
        for k, path in enumerate(inputs, start=1):
            _progress(f"parsing {path} ({k}/{len(inputs)})")
            topo.merge(_parse_one(path, args.format))
        from hetcomm.topo.parse import join_ascend_chips

        join_ascend_chips(topo)  # A3: -t topo's NPU<phy> named after the info table's chips
    else:
        from hetcomm.topo.probe import probe_local

        _progress("probing this machine (sysfs, NVML, npu-smi)")
        topo.merge(probe_local())
    cluster = None
    if args.cluster:
        from hetcomm.topo.cluster import load_cluster
        from hetcomm.topo.probe import local_vendors

        if not os.path.exists(args.cluster):
            raise UsageError(f"{args.cluster}: no such cluster file; see configs/clusters/")
        _progress(f"loading cluster {args.cluster}")
        cluster = load_cluster(args.cluster)
        here = local_vendors()
        ctopo = cluster.to_topology()
        for d in ctopo.devices:
            d.label_only = d.vendor not in here and d.vendor != "cpu"
        clash = [d.name for d in ctopo.devices if topo.device(d.name) is not None]
        if clash:
            topo.facts.setdefault("parse_warnings", []).append(
                f"{len(clash)} rank(s) ({clash[0]}..{clash[-1]}) are both in the inputs (e.g. an "
                f"NCCL log) and in {args.cluster}: the inputs' observations are kept, the cluster "
                "file only fills what they do not say"
            )
        _merge_large(topo, ctopo)
    return topo, cluster


def _merge_large(topo: Topology, other: Topology) -> None:
    """``topo.merge(other)`` with an index of link pairs: a cluster of n ranks has n(n-1)/2
    links, and ``Topology.add_link`` scans every link per call. Same rule: first link per pair
    wins."""
    links = other.links
    other.links = []
    try:
        topo.merge(other)
    finally:
        other.links = links
    seen = {ln.key for ln in topo.links}
    for link in links:
        if link.key not in seen:
            seen.add(link.key)
            topo.links.append(dataclasses.replace(link))


def write_stdout(text: str) -> None:
    """Write the whole output at once; a reader that goes away (``| head``) is not an error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        finally:
            os.close(devnull)


def run(args: argparse.Namespace) -> int:
    from hetcomm.topo.render import render_topology

    topo, _ = load_topology(args)
    if args.json:
        write_stdout(json.dumps(topo.to_dict(), indent=2) + "\n")
    else:
        write_stdout(render_topology(topo) + "\n")
    return 0
