"""Parse ``nvidia-smi`` text: ``topo -m``/``-mp``/``-p2p``, ``nvlink -s`` and the identity views.

One capture often holds several of these (a support bundle runs ``nvidia-smi``, ``-L``,
``nvlink -s`` and ``topo -m`` in a row, sometimes with ``ibdev2netdev`` and shell prompts in
between), so every ``parse_*`` function here reads *all* the nvidia-smi sections it finds in the
text and merges them; each one only insists that its own section is present.

``topo -m`` matrix (topology-notes §1)::

            GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
    GPU0     X      NV8     PIX     0-55,112-167    0               N/A
    GPU1    NV8      X      NODE    0-55,112-167    0               N/A
    NIC0    PIX     NODE     X

    NIC Legend:

      NIC0: mlx5_0

- Cells are split on whitespace (tabs and runs of spaces both occur; the self cell is `` X ``).
  Trailing columns (``CPU Affinity``, ``NUMA Affinity``, ``GPU NUMA ID``) vary by driver and are
  empty on NIC rows.
- ``NV#`` -> :attr:`LinkClass.NVLINK` with ``#`` bonded links; ``PIX/PXB/PHB/NODE/SYS`` -> the
  ``PCIE_*`` classes (``SOC`` is the pre-2017 spelling of ``SYS``).
- NIC columns are ``mlx5_N`` on old drivers, ``NICn`` plus a ``NIC Legend`` on new ones; links and
  :class:`Nic` entries use the legend names.
- ``topo -mp`` prints the same matrix for PCIe paths only; it sets ``facts["pcie_view"] = True``
  so that the audit does not call an NVLink box PCIe-only. It is recognised by the command line
  (``nvidia-smi topo -mp``) in the capture, or by calling :func:`parse_nvsmi_topo_mp`.
- ``topo -p2p r|w|n|a|p`` prints a GPU matrix of ``OK/CNS/GNS/TNS/NS/DR/U`` ->
  ``facts["p2p"]`` (``"GPU0-GPU1" -> status``; when several p2p matrices disagree on a pair, the
  status that is not ``OK`` is kept, as P2P is only usable if every capability is).

``ibdev2netdev`` lines (``mlx5_0 port 1 ==> ens108np0 (Up)``) fill ``Nic.netdev`` and
``Nic.state`` (``Up`` is printed for an ACTIVE port, so it becomes ``Active``).

Identity views: the ``nvidia-smi`` table (model, bus id, ``Persistence-M`` ->
``facts["persistence_mode"]``, ``MIG M.`` -> ``facts["mig"]``, power cap ->
``facts["power_limit_w"]``), ``nvidia-smi -L`` lines, ``--query-gpu ... --format csv`` and
``nvidia-smi nvlink -s`` (``facts["nvlink_active"]`` = active links per GPU,
``facts["nvlink_gbps_per_link"]`` = GB/s per link as printed). A ``GPU NUMA ID`` other than
``N/A`` (Grace and other coherent systems) goes to ``facts["gpu_numa_id"]``.

Link bandwidth: ``NV#`` gives ``# x 25 GB/s`` and PCIe classes the Gen4 rate, unless the same
capture also names the GPU model (table, ``-L``, csv), in which case the model's per-link NVLink
rate and PCIe generation are used (``NV18`` is 450 GB/s on Hopper, 900 GB/s on Blackwell).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from hetcomm.errors import TopologyParseError, TruncatedCaptureError
from hetcomm.topo.bandwidth import nominal_gbps, nvlink_links_for_model
from hetcomm.topo.model import Device, Link, LinkClass, Nic, Topology, Vendor
from hetcomm.topo.parse._text import numbered_lines, strip_source_header
from hetcomm.topo.parse.lspci import normalize_bus_id

__all__ = [
    "TOPO_TOKENS",
    "P2P_STATUSES",
    "sniff_nvsmi_topo",
    "parse_nvsmi_topo",
    "sniff_nvsmi_topo_mp",
    "parse_nvsmi_topo_mp",
    "sniff_nvsmi_topo_p2p",
    "parse_nvsmi_topo_p2p",
    "sniff_nvsmi_nvlink",
    "parse_nvsmi_nvlink",
    "sniff_nvsmi",
    "parse_nvsmi",
    "FORMATS",
]

#: ``topo -m`` path tokens and their classes (topology-notes §1.1; ``SOC`` is the old ``SYS``).
TOPO_TOKENS: Dict[str, LinkClass] = {
    "PIX": LinkClass.PCIE_PIX,
    "PXB": LinkClass.PCIE_PXB,
    "PHB": LinkClass.PCIE_PHB,
    "NODE": LinkClass.PCIE_NODE,
    "SYS": LinkClass.PCIE_SYS,
    "SOC": LinkClass.PCIE_SYS,
}
#: ``topo -p2p`` statuses (NVML ``nvmlGpuP2PStatus_t``; legend in topology-notes §1.1).
P2P_STATUSES = {
    "OK": "Status Ok",
    "CNS": "Chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "Topology not supported",
    "NS": "Not supported",
    "DR": "Disabled by regkey",
    "U": "Unknown",
}
from hetcomm.topo.parse._nvsmi_common import (  # noqa: E402  (shared patterns)
    DRIVER_VERSION,
    _ANSI,
    _CAPS_TOKEN,
    _COMMAND,
    _CSV_HEADER,
    _GPU_TITLE,
    _IBDEV2NETDEV,
    _LEGEND_ENTRY,
    _MATRIX_HEADER,
    _NV,
    _NVLINK_ALL_INACTIVE,
    _NVLINK_COMMAND,
    _NVLINK_CUT,
    _NVLINK_OTHER,
    _NVLINK_RATE,
    _SMI_BANNER,
    _SMI_LAST_CELL,
    _SMI_NO_DRIVER,
    _SMI_POWER,
    _SMI_ROW,
    _TRAILING_START,
    _WANT_EXAMPLE,
    _WANT_HELP,
    _csv_columns,
    _sniff_text,
    _strip_vendor,
)


# -- the topo matrices -----------------------------------------------------------------------------


@dataclass
class _Matrix:
    header_line: int
    columns: List[str]
    trailing: List[str]
    rows: List[Tuple[int, str, List[str], List[str]]] = field(default_factory=list)
    kind: str = "topo"  # "topo" or "p2p"
    mode: Optional[str] = None  # "-m", "-mp" or the p2p capability, when a command line says


def _split_header(line: str) -> Tuple[List[str], List[str]]:
    """Device column names and trailing column names of a matrix header line."""
    columns: List[str] = []
    for tok in line.split():
        if tok in _TRAILING_START:
            break
        columns.append(tok)
    # The trailing names contain single spaces ("GPU NUMA ID"); they are separated from each
    # other by tabs or runs of spaces, so split the rest of the line on those.
    idx = 0
    for col in columns:
        idx = line.index(col, idx) + len(col)
    trailing = [t.strip() for t in re.split(r"\t+|\s{2,}", line[idx:]) if t.strip()]
    return columns, trailing


def _split_row(
    line: str, num_columns: int, num_trailing: int
) -> Tuple[str, List[str], Optional[List[Optional[str]]]]:
    """Name, device cells and trailing values (None = empty) of a matrix row.

    Tab-separated rows keep their empty cells, which matters: a CPU Affinity can be empty, and
    nvidia-smi prints an extra empty cell before ``GPU NUMA ID`` (``0-191<TAB>0<TAB><TAB>N/A``).
    Rows re-printed with spaces lose empty cells; there the values are right-aligned, since the
    column that goes empty is CPU Affinity (NUMA Affinity and GPU NUMA ID print ``N/A``).
    Trailing values are None when the row has more cells than the header can hold.
    """
    if "\t" in line:
        parts = [p.strip() for p in line.split("\t")]
        while parts and not parts[0]:
            parts.pop(0)
        name, cells, rest = parts[0], parts[1 : 1 + num_columns], parts[1 + num_columns :]
        while rest and not rest[-1]:
            rest.pop()
        if len(rest) == num_trailing + 1 and num_trailing >= 1 and rest[-2] == "":
            rest = rest[:-2] + rest[-1:]
        if len(rest) > num_trailing:
            return name, cells, None
        values: List[Optional[str]] = [v or None for v in rest] + [None] * (
            num_trailing - len(rest)
        )
        return name, cells, values
    tokens = line.split()
    name, cells, rest = tokens[0], tokens[1 : 1 + num_columns], tokens[1 + num_columns :]
    if len(rest) > num_trailing:
        return name, cells, None
    return name, cells, [None] * (num_trailing - len(rest)) + list(rest)


def _cell_error(
    path: str, lineno: int, row: str, col: str, cell: str, kind: str
) -> TopologyParseError:
    expected = (
        "NV#, PIX, PXB, PHB, NODE, SYS or X"
        if kind == "topo"
        else "OK, CNS, GNS, TNS, NS, DR, U or X"
    )
    return TopologyParseError(
        f"row {row}, column {col}: cell {cell!r} is not a topology token (expected {expected}); "
        "the row is misaligned or truncated",
        path=path,
        line=lineno,
    )


def _find_matrices(lines: List[Tuple[int, str]], path: str) -> List[_Matrix]:
    """Every ``nvidia-smi topo`` matrix in ``lines``, validated cell by cell."""
    matrices: List[_Matrix] = []
    mode: Optional[str] = None
    i = 0
    n = len(lines)
    while i < n:
        lineno, line = lines[i]
        cmd = _COMMAND.search(line)
        if cmd:
            flag = cmd.group(1)
            if flag.startswith("-p2p") or flag == "--p2pstatus":
                mode = cmd.group(2) or "p2p"
            else:
                mode = "-mp" if flag in ("-mp", "--matrix_pci") else "-m"
            i += 1
            continue
        if not _MATRIX_HEADER.match(line):
            i += 1
            continue
        tokens = line.split()
        # A header line names columns; the first row repeats the first column name and then
        # has the self cell "X" under it (or a path token in a later position).
        j = i + 1
        while j < n and not lines[j][1].strip():
            j += 1
        if (
            len(tokens) < 2
            or tokens[1] == "X"
            or j >= n
            or not lines[j][1].split()
            or lines[j][1].split()[0] != tokens[0]
        ):
            i += 1
            continue
        columns, trailing = _split_header(line)
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        if repeated:
            raise TopologyParseError(
                f"matrix header names {', '.join(repeated)} more than once; each device column "
                "must be unique (is the header damaged?)",
                path=path,
                line=lineno,
            )
        matrix = _Matrix(header_line=lineno, columns=columns, trailing=trailing, mode=mode)
        names = set(columns)
        k = j
        while k < n:
            rlineno, rline = lines[k]
            rtokens = rline.split()
            if not rtokens or rtokens[0] not in names:
                break
            name, cells, extra = _split_row(rline, len(columns), len(trailing))
            if len(cells) < len(columns):
                raise TruncatedCaptureError(
                    f"matrix row {name} has {len(cells)} cells but the header at line "
                    f"{lineno} names {len(columns)} columns ({', '.join(columns)}); "
                    "the output is truncated or a cell is missing",
                    path=path,
                    line=rlineno,
                )
            if extra is None:
                raise TopologyParseError(
                    f"matrix row {name} has more cells than the header at line {lineno} names: "
                    f"{len(columns)} device columns and {len(trailing)} trailing columns "
                    f"({', '.join(trailing) or 'none'})",
                    path=path,
                    line=rlineno,
                )
            own = columns.index(name)
            if cells[own] != "X":
                raise TopologyParseError(
                    f"matrix row {name} should have the self cell X under column {name} "
                    f"(cell {own + 1}) but has {cells[own]!r}; the row is misaligned",
                    path=path,
                    line=rlineno,
                )
            matrix.rows.append((rlineno, name, cells, extra))
            k += 1
        if len(matrix.rows) < len(columns):
            seen = {r[1] for r in matrix.rows}
            missing = [c for c in columns if c not in seen]
            last = matrix.rows[-1][0] if matrix.rows else lineno
            raise TruncatedCaptureError(
                f"matrix with header at line {lineno} has no row for {', '.join(missing)}; "
                "the output is truncated (every column needs a row)",
                path=path,
                line=last + 1 if k >= n else lines[k][0],
            )
        # Decide what the cells mean and validate every one of them.
        all_cells = [c for _, _, cells, _ in matrix.rows for c in cells if c != "X"]
        p2p_only = set(P2P_STATUSES) - {"U"}
        matrix.kind = "p2p" if any(c in p2p_only for c in all_cells) else "topo"
        for rlineno, name, cells, _ in matrix.rows:
            for col, cell in zip(columns, cells):
                if cell == "X":
                    continue
                ok = (
                    cell in P2P_STATUSES or _CAPS_TOKEN.match(cell)
                    if matrix.kind == "p2p"
                    else cell in TOPO_TOKENS or _NV.match(cell) or _CAPS_TOKEN.match(cell)
                )
                if not ok:
                    raise _cell_error(path, rlineno, name, col, cell, matrix.kind)
        matrices.append(matrix)
        i = k
    return matrices


def _nic_legend(lines: List[Tuple[int, str]], path: str) -> Dict[str, str]:
    """``{"NIC0": "mlx5_0", ...}`` from every ``NIC Legend:`` block.

    Raises:
        TopologyParseError: two NIC columns are given the same name (a damaged legend).
    """
    legend: Dict[str, str] = {}
    owner: Dict[str, str] = {}
    in_legend = False
    for lineno, line in lines:
        if line.strip().lower().startswith("nic legend"):
            in_legend = True
            continue
        if not in_legend or not line.strip():
            continue
        m = _LEGEND_ENTRY.match(line)
        if not m:
            in_legend = False
            continue
        column, name = m.group(1), m.group(2)
        if owner.get(name, column) != column:
            raise TopologyParseError(
                f"NIC legend names both {owner[name]} and {column} {name!r}; every NIC column "
                "needs its own device name (is the legend cut or edited?)",
                path=path,
                line=lineno,
            )
        owner[name] = column
        legend[column] = name
    return legend


def _int_or_none(value: Optional[str]) -> Optional[int]:
    if value is None:
        return None
    value = value.strip()
    return int(value) if re.fullmatch(r"-?\d+", value) else None


def _topo_link(a: str, b: str, cell: str, path: str) -> Link:
    nv = _NV.match(cell)
    if nv:
        num = int(nv.group(1))
        return Link(
            a,
            b,
            LinkClass.NVLINK,
            raw=cell,
            gbps=nominal_gbps(LinkClass.NVLINK, num_nvlinks=num),
            source=path,
        )
    cls = TOPO_TOKENS.get(cell, LinkClass.UNKNOWN)
    return Link(a, b, cls, raw=cell, gbps=nominal_gbps(cls), source=path)


def _add_matrix(topo: Topology, matrix: _Matrix, legend: Dict[str, str], path: str) -> None:
    """Fold one validated matrix into ``topo``."""
    names = {c: legend.get(c, c) for c in matrix.columns}
    cell_at = {
        (name, col): cell
        for _, name, cells, _ in matrix.rows
        for col, cell in zip(matrix.columns, cells)
    }
    trailing_idx = {t.lower(): i for i, t in enumerate(matrix.trailing)}
    for _, col, _, extra in matrix.rows:
        if re.fullmatch(r"GPU\d+", col):
            value = {key: extra[i] for key, i in trailing_idx.items()}
            cpu = value.get("cpu affinity")
            numa = value.get("numa affinity")
            topo.add_device(
                Device(
                    name=col,
                    vendor=Vendor.NVIDIA.value,
                    index=int(col[3:]),
                    numa=_int_or_none(numa),
                    cpu_affinity=cpu if cpu and cpu.upper() != "N/A" else None,
                )
            )
            gpu_numa = _int_or_none(value.get("gpu numa id"))
            if gpu_numa is not None:
                topo.facts.setdefault("gpu_numa_id", {})[col] = gpu_numa
        elif matrix.kind == "topo":
            topo.add_nic(Nic(name=names[col]))
    cols = matrix.columns
    if matrix.kind == "p2p":
        p2p = topo.facts.setdefault("p2p", {})
        for i in range(len(cols)):
            for j in range(i + 1, len(cols)):
                forward, backward = cell_at[(cols[i], cols[j])], cell_at[(cols[j], cols[i])]
                status = forward if forward != "OK" else backward
                key = f"{cols[i]}-{cols[j]}"
                if p2p.get(key, "OK") == "OK":
                    p2p[key] = status
        return
    replace = matrix.mode != "-mp"  # a full matrix outranks a PCIe-only view of the same pair
    for i in range(len(cols)):
        for j in range(i + 1, len(cols)):
            link = _topo_link(names[cols[i]], names[cols[j]], cell_at[(cols[i], cols[j])], path)
            existing = topo.link(link.a, link.b)
            if existing is None or (replace and existing.link_class != LinkClass.NVLINK):
                topo.add_link(link, replace=True)


def _add_ibdev2netdev(topo: Topology, lines: List[Tuple[int, str]]) -> bool:
    found = False
    for _, line in lines:
        m = _IBDEV2NETDEV.match(line)
        if not m:
            continue
        found = True
        dev, port, netdev, state = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        # ibdev2netdev prints "Up" for a port whose IB state is ACTIVE and "Down" otherwise.
        state = "Active" if state.lower() == "up" else state.capitalize()
        name = dev if port == 1 else f"{dev}:{port}"
        topo.add_nic(Nic(name=name, port=port, netdev=netdev, state=state))
    return found


# -- identity views and nvlink -s ------------------------------------------------------------------


def _only_a_cut_line(rest: List[Tuple[int, str]]) -> bool:
    """True when ``rest`` (what follows a block) is nothing, or one line that is the start of a
    ``Link N: ...`` line cut short — the file ends inside the block."""
    tail = [line for _, line in rest if line.strip()]
    return not tail or (len(tail) == 1 and bool(_NVLINK_CUT.match(tail[0])))


def _check_nvlink_block_complete(
    lines: List[Tuple[int, str]],
    i: int,
    k: int,
    gpu: str,
    model: Optional[str],
    link_lines: Dict[str, int],
    path: str,
) -> None:
    """Raise if the ``nvlink -s`` block of ``gpu`` (title at ``i``, its lines up to ``k``) ends
    the file with fewer Link lines than the GPUs before it, or than its SXM model has links.

    nvidia-smi prints one line for *every* link of a GPU, active or not (``Link 3: <inactive>``),
    so one model's GPUs have blocks of equal length; a last block that is shorter at the end of
    the file was cut (``head -n 44``), and reading it would report NVLinks down that are fine.
    """
    block = [line for _, line in lines[i + 1 : k]]
    if any(_NVLINK_ALL_INACTIVE.search(line) for line in block) or not _only_a_cut_line(lines[k:]):
        return
    have = sum(1 for line in block if _NVLINK_OTHER.match(line))
    expected = max(list(link_lines.values()) + [nvlink_links_for_model(model) or 0])
    if have >= expected:
        return
    raise TruncatedCaptureError(
        f"the `nvidia-smi nvlink -s` output ends inside {gpu}'s block: {have} Link line(s) where "
        f"{'the GPUs before it have' if link_lines else f'every {model} has'} {expected}; the capture "
        f"is cut short, which is not the same as links being down. Capture the whole output "
        f"again: nvidia-smi nvlink -s > nvlink.txt",
        path=path,
        line=lines[k - 1][0],
    )


def _add_identity(topo: Topology, lines: List[Tuple[int, str]], path: str) -> Dict[str, bool]:
    """Read the nvidia-smi table, ``-L``, ``--query-gpu`` CSV and ``nvlink -s`` sections."""
    found = {"table": False, "list": False, "csv": False, "nvlink": False}
    facts = topo.facts
    has_mig_column = any("MIG M." in line for _, line in lines)
    n = len(lines)
    nvlink_context = False
    current: Optional[str] = None
    link_lines: Dict[str, int] = {}  # GPU -> Link lines of its complete nvlink -s block
    previous_was_nvlink = False  # the last GPU title began an nvlink -s block
    i = 0
    while i < n:
        line = lines[i][1]
        if _NVLINK_COMMAND.search(line):
            nvlink_context = True
        elif re.search(r"nvidia-smi\b", line) and not _NVLINK_COMMAND.search(line):
            nvlink_context = False
        row = _SMI_ROW.match(line)
        if row:
            found["table"] = True
            idx = int(row.group(1))
            name = f"GPU{idx}"
            topo.add_device(
                Device(
                    name=name,
                    vendor=Vendor.NVIDIA.value,
                    model=_strip_vendor(row.group(2)),
                    index=idx,
                    pci_bus_id=normalize_bus_id(row.group(4)),
                )
            )
            if row.group(3) in ("On", "Off"):  # Windows prints the driver model (WDDM/TCC) here
                facts.setdefault("persistence_mode", {})[name] = row.group(3)
            if i + 1 < n:
                power = _SMI_POWER.search(lines[i + 1][1])
                if power:
                    facts.setdefault("power_limit_w", {})[name] = int(power.group(2))
            # The MIG M. value is the last cell of the third line of the GPU's block.
            if has_mig_column and i + 2 < n and lines[i + 2][1].startswith("|"):
                mig = _SMI_LAST_CELL.search(lines[i + 2][1])
                if mig and mig.group(1):
                    facts.setdefault("mig", {})[name] = mig.group(1)
            i += 1
            continue
        title = _GPU_TITLE.match(line)
        if title:
            idx = int(title.group(1))
            current = f"GPU{idx}"
            topo.add_device(
                Device(
                    name=current,
                    vendor=Vendor.NVIDIA.value,
                    model=_strip_vendor(title.group(2)),
                    index=idx,
                )
            )
            # Look ahead: Link lines or the all-inactive message make this an nvlink -s block.
            links: List[float] = []
            k = i + 1
            while k < n:
                rate = _NVLINK_RATE.match(lines[k][1])
                other = _NVLINK_OTHER.match(lines[k][1])
                if rate:
                    links.append(float(rate.group(2)))
                elif other:
                    pass  # "<inactive>" or "Not Supported": a link that carries nothing
                elif not _NVLINK_ALL_INACTIVE.search(lines[k][1]):
                    break
                k += 1
            # A bare title that ends the file right after an nvlink -s block is that block's
            # next GPU, cut before its first Link line (not an `nvidia-smi -L` entry).
            cut_title = k == i + 1 and previous_was_nvlink and _only_a_cut_line(lines[k:])
            previous_was_nvlink = k > i + 1 or nvlink_context or cut_title
            if previous_was_nvlink:
                model = _strip_vendor(title.group(2))
                _check_nvlink_block_complete(lines, i, k, current, model, link_lines, path)
                if not any(_NVLINK_ALL_INACTIVE.search(ln) for _, ln in lines[i + 1 : k]):
                    link_lines[current] = sum(1 for _, ln in lines[i + 1 : k] if _NVLINK_OTHER.match(ln))
                found["nvlink"] = True
                facts.setdefault("nvlink_active", {})[current] = len(links)
                if links:
                    facts.setdefault("nvlink_gbps_per_link", {})[current] = min(links)
            else:
                found["list"] = True
            i = k
            continue
        cols = _csv_columns(line)
        if cols:
            k = i + 1
            order = 0
            while k < n and lines[k][1].count(",") >= len(cols) - 1 and lines[k][1].strip():
                values = [v.strip() for v in lines[k][1].split(",")]
                record = dict(zip(cols, values))
                idx = _int_or_none(record.get("index"))
                idx = order if idx is None else idx
                bus = record.get("pci.bus_id")
                topo.add_device(
                    Device(
                        name=f"GPU{idx}",
                        vendor=Vendor.NVIDIA.value,
                        model=_strip_vendor(record.get("name", "")) or None,
                        index=idx,
                        pci_bus_id=normalize_bus_id(bus) if bus else None,
                    )
                )
                found["csv"] = True
                order += 1
                k += 1
            i = k
            continue
        i += 1
    return found


def _refine_gbps(topo: Topology) -> None:
    """Recompute nominal Gb/s of matrix links once the capture has also named the GPU models.

    ``NV18`` is 450 GB/s on Hopper but 900 GB/s on Blackwell, and the PCIe rate depends on the
    generation; ``topo -m`` alone knows neither, the identity views in the same capture do.
    """
    models = {d.name: d.model for d in topo.devices if d.model}
    if not models:
        return
    for link in topo.links:
        model = models.get(link.a) or models.get(link.b)
        if model is None:
            continue
        nv = _NV.match(link.raw)
        num = int(nv.group(1)) if nv else None
        gbps = nominal_gbps(link.link_class, model, num_nvlinks=num)
        if gbps is not None:
            link.gbps = gbps


# -- public entry points ---------------------------------------------------------------------------


def _parse(text: str, path: str, want: str) -> Topology:
    lines = [(lineno, _ANSI.sub("", line)) for lineno, line in numbered_lines(text)]
    if not any(line.strip() for _, line in lines):
        raise TopologyParseError(
            f"empty input; expected the output of {_WANT_HELP[want]}", path=path, line=1
        )
    topo = Topology()
    formats: List[str] = []
    matrices = _find_matrices(lines, path)
    legend = _nic_legend(lines, path)
    topo_matrices = [m for m in matrices if m.kind == "topo"]
    if want == "nvsmi-topo-mp":
        for m in topo_matrices:
            if m.mode is None:
                m.mode = "-mp"
    # Full matrices first so their NV# links win over a -mp view of the same pairs.
    for m in sorted(topo_matrices, key=lambda m: m.mode == "-mp"):
        _add_matrix(topo, m, legend, path)
        name = "nvsmi-topo-mp" if m.mode == "-mp" else "nvsmi-topo"
        if name not in formats:
            formats.append(name)
    if topo_matrices:
        topo.facts["pcie_view"] = all(m.mode == "-mp" for m in topo_matrices)
    for m in matrices:
        if m.kind == "p2p":
            _add_matrix(topo, m, legend, path)
            if "nvsmi-topo-p2p" not in formats:
                formats.append("nvsmi-topo-p2p")
    if _add_ibdev2netdev(topo, lines):
        formats.append("ibdev2netdev")
    found = _add_identity(topo, lines, path)
    _refine_gbps(topo)
    if found["nvlink"]:
        formats.append("nvsmi-nvlink")
    if found["table"] or found["list"] or found["csv"]:
        formats.append("nvsmi")
    # A -mp capture is still a topo matrix: parse_nvsmi_topo accepts it (pcie_view says which).
    accepted = {want, "nvsmi-topo-mp"} if want == "nvsmi-topo" else {want}
    if not accepted & set(formats):
        for lineno, line in lines:
            failed = _SMI_NO_DRIVER.search(line)
            if failed:
                raise TopologyParseError(
                    f"nvidia-smi could not reach the driver ({failed.group(0).strip()!r}), so the "
                    "capture holds no GPU information; load the NVIDIA driver (check `lsmod | grep "
                    "nvidia` and dmesg) and capture again",
                    path=path,
                    line=lineno,
                )
        raise TopologyParseError(
            f"no {_WANT_HELP[want]} output found; {_WANT_EXAMPLE[want]}",
            path=path,
            line=lines[0][0] if lines else 1,
        )
    topo.facts["formats"] = formats
    topo.facts["sources"] = [path]
    for _, line in lines:  # the driver version, for the known-bad-version rule
        v = DRIVER_VERSION.search(line)
        if v:
            topo.facts.setdefault("nvidia_driver_version", v.group(1))
            break
    return topo


def sniff_nvsmi_topo(text: str) -> bool:
    """True when ``text`` holds an ``nvidia-smi topo -m`` matrix (header then ``GPU0  X  ...``)."""
    text = _sniff_text(text)
    if re.search(r"(?m)^[ \t]*GPU0[ \t]+X[ \t]+(NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)\b", text):
        return True
    # A single-GPU box has no path cell: "GPU0  X  0-63  0" under a "... CPU Affinity" header.
    return bool(re.search(r"(?m)^[ \t]*GPU0[ \t]+X\b", text)) and bool(
        re.search(r"(?m)^[ \t]*GPU0\b.*\bCPU Affinity", text)
    )


def sniff_nvsmi_topo_mp(text: str) -> bool:
    """True for a ``topo -m``-style matrix captured with its ``nvidia-smi topo -mp`` command."""
    text = _sniff_text(text)
    # (a provenance header may quote the command, hence the stripping above)
    return bool(re.search(r"nvidia-smi\s+topo\s+(-mp|--matrix_pci)\b", text)) and sniff_nvsmi_topo(
        text
    )


def sniff_nvsmi_topo_p2p(text: str) -> bool:
    """True when ``text`` holds an ``nvidia-smi topo -p2p`` matrix (``GPU0  X  OK ...``)."""
    text = _sniff_text(text)
    return bool(re.search(r"(?m)^[ \t]*GPU0[ \t]+X[ \t]+(OK|CNS|GNS|TNS|NS|DR|U)\b", text))


def sniff_nvsmi_nvlink(text: str) -> bool:
    """True for ``nvidia-smi nvlink -s`` output (a GPU title followed by Link lines or the
    all-links-inactive message)."""
    text = _sniff_text(text)
    return bool(
        re.search(
            r"(?m)^\s*GPU \d+: .+\n\s*(Link \d+: |NVML: Unable to retrieve NVLink information)",
            text,
        )
    )


def sniff_nvsmi(text: str) -> bool:
    """True for the ``nvidia-smi`` table, ``nvidia-smi -L`` lines or ``--query-gpu`` CSV."""
    text = _sniff_text(text)
    return bool(
        _SMI_BANNER.search(text)
        or _SMI_NO_DRIVER.search(text)
        # `-L` lines; a title followed by Link lines is nvlink -s output instead.
        or re.search(
            r"(?m)^[ \t]*GPU \d+: .+ \(UUID: GPU-[^)\n]*\)[ \t]*(\n(?![ \t]*(Link \d+:|NVML: ))|\Z)",
            text,
        )
        or any(_csv_columns(line) for line in text.splitlines() if "," in line)
    )


def parse_nvsmi_topo(text: str, path: str = "<text>") -> Topology:
    """Parse ``nvidia-smi topo -m`` output (and any other nvidia-smi sections in the capture).

    Args:
        text: captured text; a provenance header, shell prompts, ``ip -br a`` and legend lines
            are skipped.
        path: file name used in errors and ``facts["sources"]``.

    Returns:
        A :class:`Topology` with GPUs ``GPU0..`` (NUMA node, CPU affinity), NICs (legend names),
        and one link per unordered pair among all matrix columns (GPU-GPU, GPU-NIC, NIC-NIC).

    Raises:
        TopologyParseError: empty input, no matrix, a row with the wrong number of cells, a row
            missing (truncated output), or a cell that is not a topology token — naming the line.
    """
    return _parse(text, path, "nvsmi-topo")


def parse_nvsmi_topo_mp(text: str, path: str = "<text>") -> Topology:
    """Parse ``nvidia-smi topo -mp`` (PCIe-only view): like :func:`parse_nvsmi_topo`, and
    ``facts["pcie_view"] = True`` unless the capture also holds a full ``topo -m`` matrix."""
    return _parse(text, path, "nvsmi-topo-mp")


def parse_nvsmi_topo_p2p(text: str, path: str = "<text>") -> Topology:
    """Parse ``nvidia-smi topo -p2p r|w|n|a|p`` into ``facts["p2p"]`` (``"GPU0-GPU1" -> "OK"``).

    Raises:
        TopologyParseError: as :func:`parse_nvsmi_topo`.
    """
    return _parse(text, path, "nvsmi-topo-p2p")


def parse_nvsmi_nvlink(text: str, path: str = "<text>") -> Topology:
    """Parse ``nvidia-smi nvlink -s``: GPU models, ``facts["nvlink_active"]`` (active links per
    GPU; 0 for "all links are inActive") and ``facts["nvlink_gbps_per_link"]`` (GB/s as printed,
    the slowest active link when they differ).

    Raises:
        TopologyParseError: empty input or no ``GPU N: ...`` block followed by link lines.
    """
    return _parse(text, path, "nvsmi-nvlink")


def parse_nvsmi(text: str, path: str = "<text>") -> Topology:
    """Parse the ``nvidia-smi`` table / ``-L`` / ``--query-gpu`` CSV: GPU models and bus ids,
    ``facts["persistence_mode"]`` (``On``/``Off``), ``facts["mig"]`` (``Enabled``/``Disabled``,
    when the table has the ``MIG M.`` column) and ``facts["power_limit_w"]`` (the power cap).

    Raises:
        TopologyParseError: empty input or none of these views in ``text``.
    """
    return _parse(text, path, "nvsmi")


FORMATS: List[Tuple[str, Callable[[str], bool], Callable[..., Topology]]] = [
    ("nvsmi-topo-p2p", sniff_nvsmi_topo_p2p, parse_nvsmi_topo_p2p),
    ("nvsmi-topo-mp", sniff_nvsmi_topo_mp, parse_nvsmi_topo_mp),
    ("nvsmi-topo", sniff_nvsmi_topo, parse_nvsmi_topo),
    ("nvsmi-nvlink", sniff_nvsmi_nvlink, parse_nvsmi_nvlink),
    ("nvsmi", sniff_nvsmi, parse_nvsmi),
]
