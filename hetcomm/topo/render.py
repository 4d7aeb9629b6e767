"""Human-readable output of topologies and audits: text tables, and an optional PNG heat map.

Text goes to a terminal, so every table is plain ASCII with fixed-width columns. The heat map
needs matplotlib, an optional extra (``pip install 'hetcomm[plot]'``), imported only when a plot
is asked for.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from hetcomm.errors import UsageError
from hetcomm.topo.audit import FINDING_CODES, AuditReport, format_bytes
from hetcomm.topo.model import Finding, LinkClass, Topology

__all__ = [
    "CLASS_SHORT",
    "CLASS_MEANING",
    "render_topology",
    "render_findings",
    "render_answers",
    "render_audit",
    "label_summary",
    "plot_heatmap",
    "MAX_MATRIX",
]

# Matrix cell per class, close to the tools' own tokens (NV#/PIX/... from nvidia-smi).
CLASS_SHORT: Dict[LinkClass, str] = {
    LinkClass.NVLINK: "NVL",
    LinkClass.HCCS: "HCCS",
    LinkClass.PCIE_PIX: "PIX",
    LinkClass.PCIE_PXB: "PXB",
    LinkClass.PCIE_PHB: "PHB",
    LinkClass.PCIE_NODE: "NODE",
    LinkClass.PCIE_SYS: "SYS",
    LinkClass.P2P: "P2P",
    LinkClass.SHM: "SHM",
    LinkClass.NET_IB_GDR: "IB+G",
    LinkClass.NET_IB: "IB",
    LinkClass.NET_ROCE_GDR: "RoCE+G",
    LinkClass.NET_ROCE: "RoCE",
    LinkClass.NET_EFA: "EFA",
    LinkClass.NET_SOCKET: "SOCK",
    LinkClass.HOST_BRIDGE: "BRIDGE",
    LinkClass.UNKNOWN: "?",
}
CLASS_MEANING: Dict[LinkClass, str] = {
    LinkClass.NVLINK: "NVLink (NV# = bonded links), direct or through NVSwitch",
    LinkClass.HCCS: "Huawei HCCS between Ascend NPUs",
    LinkClass.PCIE_PIX: "PCIe, at most one switch",
    LinkClass.PCIE_PXB: "PCIe, several switches, no host bridge",
    LinkClass.PCIE_PHB: "PCIe through a host bridge (CPU root complex)",
    LinkClass.PCIE_NODE: "PCIe across host bridges within one NUMA node",
    LinkClass.PCIE_SYS: "PCIe plus the inter-socket link (QPI/UPI/xGMI)",
    LinkClass.P2P: "GPU peer access seen by NCCL (NVLink or PCIe)",
    LinkClass.SHM: "staged through host shared memory",
    LinkClass.NET_IB_GDR: "InfiniBand with GPUDirect RDMA",
    LinkClass.NET_IB: "InfiniBand through host memory",
    LinkClass.NET_ROCE_GDR: "RoCE with GPUDirect RDMA",
    LinkClass.NET_ROCE: "RoCE through host memory",
    LinkClass.NET_EFA: "AWS EFA / libfabric",
    LinkClass.NET_SOCKET: "TCP sockets",
    LinkClass.HOST_BRIDGE: "cross-vendor path staged through host memory",
    LinkClass.UNKNOWN: "unknown",
}
# Beyond this many endpoints a matrix no longer fits a terminal: print per-class counts instead.
MAX_MATRIX = 24
_MATRIX_TOKEN = re.compile(r"^(NV\d+|PIX|PXB|PHB|NODE|SYS|HCCS)$")


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]], indent: str = "  ") -> str:
    """Fixed-width columns, left-aligned, ``-`` for None."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, v in enumerate(row):
            widths[i] = max(widths[i], len(v))
    lines = [indent + "  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for row in cells:
        lines.append(indent + "  ".join(v.ljust(widths[i]) for i, v in enumerate(row)).rstrip())
    return "\n".join(lines)


def _gbps(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:g} Gb/s ({value / 8:g} GB/s)"


def _cell(link) -> str:
    if (
        link.link_class == LinkClass.NVLINK
        and link.raw
        and _MATRIX_TOKEN.match(link.raw.strip().upper())
    ):
        return link.raw.strip().upper()
    return CLASS_SHORT[link.link_class]


def label_summary(topology: Topology) -> Optional[str]:
    """One sentence naming the device kinds that are labels here, or None when there are none."""
    counts: Dict[str, int] = defaultdict(int)
    for d in topology.devices:
        if d.label_only:
            counts[d.model or d.vendor] += 1
    if not counts:
        return None
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    return (
        f"device kinds that are labels on this machine: {kinds} -- CPU processes stand for "
        "them; the transports between processes are real, the device kinds are not."
    )


def render_topology(topology: Topology, *, title: str = "Topology") -> str:
    """Devices, NICs, the link matrix (or per-class summary) and a legend, as text."""
    facts = topology.facts
    out: List[str] = [title]
    sources = facts.get("sources") or []
    if sources:
        out.append(f"  sources: {', '.join(map(str, sources))}")
    formats = facts.get("formats") or []
    if formats:
        out.append(f"  formats: {', '.join(map(str, formats))}")
    host = facts.get("host")
    if isinstance(host, dict):
        mem = host.get("memory_bytes")
        out.append(
            f"  host: {host.get('hostname') or '?'}, {host.get('cpus') or '?'} CPUs"
            f" ({host.get('cpu_model') or 'model unknown'}), {host.get('numa_nodes') or '?'} NUMA "
            f"node(s), {format_bytes(mem) if mem else '? B'} memory"
        )
    labels = label_summary(topology)
    if labels:
        out.append(f"  note: {labels}")

    out.append("")
    out.append(f"Devices ({len(topology.devices)})")
    if topology.devices:
        out.append(
            _table(
                ["name", "vendor", "model", "numa", "cpu affinity", "pci", "host", "label"],
                [
                    [
                        d.name,
                        d.vendor,
                        d.model,
                        d.numa,
                        d.cpu_affinity,
                        d.pci_bus_id,
                        d.host,
                        "label" if d.label_only else "",
                    ]
                    for d in topology.devices
                ],
            )
        )
    else:
        out.append("  (none)")

    out.append("")
    out.append(f"NICs ({len(topology.nics)})")
    if topology.nics:
        out.append(
            _table(
                ["name", "link layer", "rate", "state", "numa", "gdr", "netdev", "host"],
                [
                    [
                        n.name,
                        n.link_layer,
                        f"{n.rate_gbps:g} Gb/s" if n.rate_gbps else None,
                        n.state,
                        n.numa,
                        {True: "yes", False: "no"}.get(n.gdr) if n.gdr is not None else None,
                        n.netdev,
                        n.host,
                    ]
                    for n in topology.nics
                ],
            )
        )
    else:
        out.append("  (none)")

    out.append("")
    out.append(f"Links ({len(topology.links)})")
    used: List[LinkClass] = sorted({ln.link_class for ln in topology.links})
    if not topology.links:
        out.append("  (none: a single device, or no input describes paths)")
    else:
        endpoints: List[str] = []
        for name in [d.name for d in topology.devices] + [n.name for n in topology.nics]:
            if any(name in (ln.a, ln.b) for ln in topology.links) and name not in endpoints:
                endpoints.append(name)
        for ln in topology.links:  # endpoints a parser named but did not list
            for name in (ln.a, ln.b):
                if name not in endpoints:
                    endpoints.append(name)
        if len(endpoints) <= MAX_MATRIX:
            out.append(_matrix(topology, endpoints))
        else:
            out.append(f"  {len(endpoints)} endpoints: too many for a matrix; pairs per class:")
            out.append(_class_summary(topology))
        out.extend(_fabric_summary(topology))
        out.append("")
        out.append("Legend")
        out.append(
            _table(
                ["cell", "class", "meaning", "nominal (per direction)"],
                [
                    [
                        CLASS_SHORT[c] if c != LinkClass.NVLINK else "NV#",
                        c.name,
                        CLASS_MEANING[c],
                        _gbps_range(topology, c),
                    ]
                    for c in used
                ],
            )
        )
    notes = facts.get("probe_notes")
    if notes:
        out.append("")
        out.append("Probe notes")
        out.extend(f"  - {n}" for n in notes)
    warnings = facts.get("parse_warnings")
    if warnings:
        out.append("")
        out.append("Parse warnings")
        out.extend(f"  - {w}" for w in warnings)
    return "\n".join(out)


def _fabric_summary(topology: Topology) -> List[str]:
    """Device-fabric groups (NVLink/HCCS domains) and each device's nearest NIC (its rail)."""
    devices = {d.name for d in topology.devices}
    nics = {n.name for n in topology.nics}
    parent = {name: name for name in devices}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    fabric = [
        ln
        for ln in topology.links
        if ln.link_class.is_device_fabric and ln.a in devices and ln.b in devices
    ]
    for ln in fabric:
        parent[find(ln.a)] = find(ln.b)
    groups: Dict[str, List[str]] = defaultdict(list)
    for d in topology.devices:
        if any(d.name in (ln.a, ln.b) for ln in fabric):
            groups[find(d.name)].append(d.name)
    out: List[str] = []
    for members in groups.values():
        member_set = set(members)
        links = [ln for ln in fabric if ln.a in member_set]
        total = len(members) * (len(members) - 1) // 2
        tokens = "/".join(sorted({(ln.raw or CLASS_SHORT[ln.link_class]) for ln in links}))
        classes = "/".join(sorted({ln.link_class.name for ln in links}))
        coverage = f"all {total} pairs" if len(links) == total else f"{len(links)} of {total} pairs"
        out.append(
            f"  {classes} group of {len(members)} ({tokens} on {coverage}): {', '.join(members)}"
        )
    rails = []
    for d in topology.devices:
        if d.vendor not in ("nvidia", "ascend"):
            continue
        to_nic = [
            ln
            for ln in topology.links
            if d.name in (ln.a, ln.b) and (ln.b if ln.a == d.name else ln.a) in nics
        ]
        if not to_nic:
            continue
        best = min(ln.link_class for ln in to_nic)
        nearest = [ln.b if ln.a == d.name else ln.a for ln in to_nic if ln.link_class == best]
        rails.append([d.name, ", ".join(nearest), CLASS_SHORT[best]])
    if out or rails:
        out.insert(0, "")
        out.insert(1, "Fabric and rails")
    if rails:
        out.append("  nearest NIC per device (its rail):")
        out.append(_table(["device", "nearest NIC", "path"], rails, indent="    "))
    return out


def _gbps_range(topology: Topology, cls: LinkClass) -> str:
    values = sorted(
        {ln.gbps for ln in topology.links if ln.link_class == cls and ln.gbps is not None}
    )
    if not values:
        return "-"
    if len(values) == 1:
        return _gbps(values[0])
    return f"{values[0]:g}-{values[-1]:g} Gb/s"


def _matrix(topology: Topology, names: List[str]) -> str:
    index = {ln.key: ln for ln in topology.links}
    rows = []
    for a in names:
        row: List[object] = [a]
        for b in names:
            if a == b:
                row.append("X")
                continue
            link = index.get((a, b) if a <= b else (b, a))
            row.append(_cell(link) if link is not None else ".")
        rows.append(row)
    return _table([""] + names, rows)


def _class_summary(topology: Topology) -> str:
    groups: Dict[LinkClass, List] = defaultdict(list)
    for ln in topology.links:
        groups[ln.link_class].append(ln)
    rows = []
    for cls in sorted(groups):
        links = groups[cls]
        rows.append(
            [cls.name, len(links), _gbps_range(topology, cls), f"{links[0].a}-{links[0].b}"]
        )
    return _table(["class", "pairs", "nominal", "example"], rows)


def render_findings(findings: Sequence[Finding]) -> str:
    """Each finding: severity, code, subject, message, the code's meaning and the fix."""
    if not findings:
        return "Findings\n  none: no misconfiguration signature matched the inputs."
    counts = defaultdict(int)
    for f in findings:
        counts[f.severity] += 1
    summary = ", ".join(f"{counts[s]} {s}" for s in ("error", "warning", "info") if counts[s])
    out = [f"Findings ({summary})"]
    for f in findings:
        spec = FINDING_CODES.get(f.code)
        out.append(f"  [{f.severity.upper()}] {f.code}: {f.subject}")
        out.append(f"      {f.message}")
        if spec is not None:
            out.append(f"      means: {spec.meaning}")
        if f.fix:
            out.append(f"      fix: {f.fix}")
    return "\n".join(out)


def render_answers(report: AuditReport) -> str:
    """The three buyer questions, answered as text."""
    a = report.alltoall
    out = [
        f"(a) Expected all-to-all time, {format_bytes(a.size_bytes)} per rank "
        f"({a.size_bytes} B), alpha-beta model from nominal bandwidths"
    ]
    if not a.rows:
        out.append(f"  {a.notes[0] if a.notes else 'no connected devices'}")
    else:
        out.append(
            f"  {a.num_ranks} ranks; each rank sends S/n = "
            f"{format_bytes(a.size_bytes / a.num_ranks)} to every peer"
        )
        out.append(
            _table(
                ["class", "pairs", "peers", "bytes sent", "bandwidth", "alpha", "time"],
                [
                    [
                        r.link_class.name,
                        r.num_pairs,
                        r.num_peers,
                        format_bytes(r.bytes_per_rank),
                        _gbps(r.gbps),
                        f"{r.alpha_us:g} us",
                        f"{r.time_us:,.1f} us" if r.time_us is not None else "unknown",
                    ]
                    for r in a.rows
                ],
            )
        )
        if a.time_us is not None:
            out.append(
                f"  expected: {a.time_us:,.1f} us (bounded by {a.bottleneck.name}); "  # type: ignore[union-attr]
                f"algbw {a.algbw_gbs:,.2f} GB/s, busbw {a.busbw_gbs:,.2f} GB/s; "
                f"no-overlap bound {a.serial_time_us:,.1f} us"
                if a.model == "alpha-beta"
                else f"  expected: {a.time_us:,.1f} us (the cost model of `hetcomm simulate`, flat "
                f"plan); algbw {a.algbw_gbs:,.2f} GB/s, busbw {a.busbw_gbs:,.2f} GB/s; the alpha-beta "
                f"table above gives {a.alpha_beta_time_us or 0:,.1f} us"
            )
        out.append(
            "  (peers, bytes sent, bandwidth: of the rank that takes longest over the class)"
        )
        out.append(
            "  model: t_c = alpha_c + max_i(k_i,c * S/n / B_i,c); t = max_c t_c (docs/TOPOLOGY.md)"
        )
        for note in a.notes:
            out.append(f"  note: {note}")
    out.append("")
    out.append("(b) Cross-vendor path (NVIDIA <-> Ascend)")
    out.append(f"  {report.cross_vendor.message}")
    out.append("")
    out.append("(c) Measured all-to-all (nccl-tests style)")
    rows = report.measurements
    if not rows:
        out.append(
            "  no measurements in the inputs: pass an nccl-tests alltoall_perf output (or "
            "the table `hetcomm bench alltoall` prints) with --input."
        )
    else:
        out.append(_measurement_table(rows))
    return "\n".join(out)


def _measurement_table(rows: Sequence[Dict[str, object]]) -> str:
    """nccl-tests' layout: one line per size, out-of-place then in-place columns, per run."""
    runs: Dict[Tuple, Dict[int, Dict[bool, Dict[str, object]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for r in rows:
        key = (r["op"], r["num_ranks"], r["source"])
        runs[key][int(r["size_bytes"])][bool(r["in_place"])] = r  # type: ignore[arg-type]
    out = []
    for (op, ranks, source), sizes in runs.items():
        name = os.path.basename(str(source)) if source else "?"
        out.append(f"  {op}, {ranks if ranks else '?'} ranks, from {name}")
        table_rows = []
        for size in sorted(sizes):
            cells: List[object] = [size]
            first = sizes[size].get(False) or sizes[size].get(True)
            cells += [first.get("count"), first.get("dtype")]  # type: ignore[union-attr]
            for in_place in (False, True):
                r = sizes[size].get(in_place)
                if r is None:
                    cells += [None] * 4
                    continue
                cells += [
                    f"{r['time_us']:g}",
                    f"{r['algbw_gbps']:.2f}",
                    f"{r['busbw_gbps']:.2f}",
                    "N/A" if r["wrong"] is None else r["wrong"],
                ]
            table_rows.append(cells)
        out.append(
            _table(
                [
                    "size (B)",
                    "count",
                    "type",
                    "time (us)",
                    "algbw",
                    "busbw",
                    "#wrong",
                    "in-place time",
                    "algbw",
                    "busbw",
                    "#wrong",
                ],
                table_rows,
                indent="    ",
            )
        )
    out.append("  (out-of-place, then in-place; algbw/busbw in GB/s as nccl-tests prints them)")
    return "\n".join(out)


def render_audit(report: AuditReport) -> str:
    """The whole ``hetcomm audit`` text report."""
    return (
        "\n\n".join(
            [
                render_topology(report.topology, title="Topology"),
                render_findings(report.findings),
                render_answers(report),
            ]
        )
        + "\n"
    )


def plot_heatmap(topology: Topology, path: str) -> None:
    """Write a PNG heat map of link classes (rows/columns = endpoints, colour = class).

    Raises:
        UsageError: matplotlib is not installed (install the ``plot`` extra), or the topology
            has no links to draw.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
        from matplotlib.colors import BoundaryNorm, ListedColormap
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'hetcomm[plot]'") from None
    if not topology.links:
        raise UsageError(f"--plot {path}: the topology has no links to draw")
    names: List[str] = []
    for name in [d.name for d in topology.devices] + [n.name for n in topology.nics]:
        if any(name in (ln.a, ln.b) for ln in topology.links):
            names.append(name)
    pos = {n: i for i, n in enumerate(names)}
    size = len(names)
    # One colour per class present, in class order (closest = darkest): contrast between the
    # classes that matter here instead of a scale over all seventeen.
    used = sorted({ln.link_class for ln in topology.links})
    slot = {c: i for i, c in enumerate(used)}
    grid = [[float("nan")] * size for _ in range(size)]
    for ln in topology.links:
        if ln.a in pos and ln.b in pos:
            grid[pos[ln.a]][pos[ln.b]] = grid[pos[ln.b]][pos[ln.a]] = slot[ln.link_class]
    colours = plt.get_cmap("viridis")([i / max(1, len(used) - 1) for i in range(len(used))])
    cmap = ListedColormap(colours)
    norm = BoundaryNorm([i - 0.5 for i in range(len(used) + 1)], cmap.N)
    side = max(4.0, min(24.0, 0.35 * size + 3))
    fig, ax = plt.subplots(figsize=(side + 2, side))
    try:
        image = ax.imshow(grid, cmap=cmap, norm=norm)
        ax.set_xticks(range(size), names, rotation=90, fontsize=7)
        ax.set_yticks(range(size), names, fontsize=7)
        ax.set_title("hetcomm: link classes (closest = darkest)")
        bar = fig.colorbar(image, ax=ax, ticks=range(len(used)))
        bar.ax.set_yticklabels([c.name for c in used])
        fig.tight_layout()
        try:
            fig.savefig(path, format="png", dpi=100)
        except OSError as e:
            raise UsageError(f"--plot {path}: cannot write the PNG ({e.strerror or e})") from None
    finally:
        plt.close(fig)
