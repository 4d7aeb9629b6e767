"""Parsers for Huawei Ascend ``npu-smi`` output (and the Ascend lines of plain ``lspci``).

Formats (names as in :data:`FORMATS`):

- ``npu-smi-topo``: ``npu-smi info -t topo``, an ``NPU0 .. NPUn`` matrix like nvidia-smi's, with
  ``HCCS`` / ``PIX`` / ``PXB`` / ``PHB`` / ``SYS`` / ``NA`` cells and a ``CPU Affinity`` column.
- ``npu-smi-info``: the ``npu-smi info`` box table (NPU id, Name, Health, Bus-Id, HBM usage).
- ``npu-smi-board``: the key/value views ``npu-smi info -t board`` / ``-t usages`` /
  ``-t health`` and the ``npu-smi info -m`` chip list.
- ``lspci-ascend``: plain ``lspci`` lines of Huawei accelerators (``Device d801``). ``lspci``
  order is not ``npu-smi`` order, so these become facts (``ascend_pci``), not devices.

Devices are named ``NPU<id>`` after npu-smi's NPU id (vendor ``ascend``). Ascend PCI device ids
(``19e5:d100`` 310, ``d500`` 310P, ``d801`` 910A, ``d802`` 910B, ``d803`` 910_93) come from
topology-notes §2.3; Ascend ids are not in pci.ids.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

from hetcomm.errors import TopologyParseError, TruncatedCaptureError
from hetcomm.topo.bandwidth import nominal_gbps
from hetcomm.topo.model import Device, Link, LinkClass, Topology, Vendor
from hetcomm.topo.pci_ids import ASCEND_IDS
from hetcomm.topo.parse._text import numbered_lines

__all__ = [
    "FORMATS",
    "sniff_npusmi_topo",
    "parse_npusmi_topo",
    "sniff_npusmi_info",
    "parse_npusmi_info",
    "sniff_npusmi_board",
    "parse_npusmi_board",
    "sniff_lspci_ascend",
    "parse_lspci_ascend",
]

# PCI device id (vendor 19e5) -> model family (topology-notes §2.3). d803 is sold as 910_93
# ("A3"); we call it 910C so that bandwidth.canonical_model does not read it as a 910A.

# npu-smi topo tokens -> class. SIO (die-to-die inside one A3 chip) and HCCS_SW (through an HCCS
# switch, A3 SuperPoD) are at least as close as HCCS; the model has no finer class, and `raw`
# keeps the token so a report can tell them apart.
_TOPO_CLASSES = {
    "HCCS": LinkClass.HCCS,
    "HCCS_SW": LinkClass.HCCS,
    "SIO": LinkClass.HCCS,
    "PIX": LinkClass.PCIE_PIX,
    "PXB": LinkClass.PCIE_PXB,
    "PHB": LinkClass.PCIE_PHB,
    "NODE": LinkClass.PCIE_NODE,
    "SYS": LinkClass.PCIE_SYS,
    "NA": LinkClass.UNKNOWN,
}

_NPU_NAME = re.compile(r"^NPU(\d+)$")
_TOPO_HEADER = re.compile(r"^\s*NPU\d+(\s+NPU\d+)*(\s+\S.*)?$")
_TOPO_ROW = re.compile(r"^\s*NPU\d+\s+(X|HCCS|HCCS_SW|SIO|PIX|PXB|PHB|NODE|SYS|NA)(\s|$)")
_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_NPU_SMI_BANNER = re.compile(r"^\s*\|?\s*npu-smi\s+\S+\s+Version:", re.IGNORECASE)
_INFO_HEADER = re.compile(r"^\s*\|\s*NPU\s+Name\s*\|\s*Health\s*\|")
_KV = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 ()%/._-]*?)\s*:\s*(.*?)\s*$")
_CHIP_LIST_HEADER = re.compile(r"^\s*NPU ID\s+Chip ID\s+Chip Logic ID\s+Chip Name\s*$")
_CHIP_LIST_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+|-)\s+(\S.*?)\s*$")
_NPU_SMI_CMD = re.compile(r"npu-smi\s+info\b(?P<args>.*)$")
_LSPCI_ASCEND = re.compile(
    r"^\s*(?P<bdf>(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+"
    r"(?P<cls>[^:]*?)(?:\s*\[[0-9a-fA-F]{4}\])?:\s*Huawei Technologies Co\., Ltd\.\s+"
    r"(?:Device\s+(?P<dev>[0-9a-fA-F]{4})|.*?\[19e5:(?P<dev2>[0-9a-fA-F]{4})\])"
)
# Keys of the npu-smi key/value views we read; other `key : value` lines in a mixed capture
# (hccn_tool optical info, version files) are not npu-smi's and are left alone.
_BOARD_KEYS = {
    "NPU ID",
    "Chip ID",
    "Chip Type",
    "Chip Name",
    "PCIe Bus Info",
    "PCI Vendor ID",
    "PCI Device ID",
    "HBM Capacity(MB)",
    "Health Status",
    "Error Code",
}


def _start(fmt: str, path: str) -> Topology:
    topo = Topology()
    topo.facts["formats"] = [fmt]
    topo.facts["sources"] = [path]
    return topo


def _warn(topo: Topology, path: str, line: Optional[int], message: str) -> None:
    where = f"{path}:{line}" if line is not None else path
    topo.facts.setdefault("parse_warnings", []).append(f"{where}: {message}")


def _model_from_name(name: str, num_chips: int = 1) -> Optional[str]:
    """The model of an npu-smi name: ``Ascend 910A`` / ``910B3`` -> ``910A`` / ``910B3``.

    A bare ``Ascend910`` is kept whole: shortened to ``910`` it would read as the first
    generation. It *is* the first generation (910A) on a one-chip card, but the A3 generation
    (910_93, sold as 910C) on a card with two chips, where npu-smi repeats the NPU row per chip;
    that one is written ``Ascend910 (910C)`` so that
    :func:`~hetcomm.topo.bandwidth.canonical_model` tells 910, 910B and 910C apart.
    """
    name = name.strip()
    if not name or name.upper() in ("NA", "N/A", "MCU"):
        return None
    short = re.sub(r"^Ascend\s*", "", name, flags=re.IGNORECASE)
    if short == "910":
        return f"{name} (910C)" if num_chips >= 2 else name
    return short or None


_CANN_CFG = re.compile(r"^\s*(?:runtime|toolkit)_running_version=\[[^:\]]*:([^\]]+)\]")
_CANN_INFO = re.compile(r"^\s*version=(\d+\.\d+\.\w+)\s*$")


def _cann_version(lines: List[Tuple[int, str]]) -> Optional[str]:
    """The CANN release a capture shows: ``version.cfg``'s ``runtime_running_version=[7.5.0.1.129:
    8.0.RC3]`` or ``ascend_toolkit_install.info``'s ``version=8.2.RC1`` after
    ``package_name=Ascend-cann-toolkit`` (what ``collect_env`` and env-check scripts paste)."""
    toolkit = False
    for _, line in lines:
        m = _CANN_CFG.match(line)
        if m:
            return m.group(1).strip()
        if "package_name=Ascend-cann-toolkit" in line:
            toolkit = True
        m = _CANN_INFO.match(line)
        if m and toolkit:
            return m.group(1)
    return None


# -- npu-smi info -t topo ------------------------------------------------------------------------


def sniff_npusmi_topo(text: str) -> bool:
    """True when ``text`` holds an ``npu-smi info -t topo`` matrix (an ``NPU0`` header + rows)."""
    if "NPU0" not in text:  # cheap guard: sniffers run on every input, logs can be large
        return False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _TOPO_HEADER.match(line) and "NPU0" in line.split():
            return any(_TOPO_ROW.match(ln) for ln in lines[i + 1 : i + 4])
    return False


def _split_header(line: str) -> Tuple[List[str], List[str]]:
    """NPU column names and the trailing column names (``CPU Affinity``) of a topo header."""
    npus: List[str] = []
    end = 0
    for m in re.finditer(r"\S+", line):
        if not _NPU_NAME.match(m.group()):
            break
        npus.append(m.group())
        end = m.end()
    # Trailing names contain single spaces ("CPU Affinity"); columns are tabs or 2+ spaces apart.
    extra = [c.strip() for c in re.split(r"\t|\s{2,}", line[end:]) if c.strip()]
    return npus, extra


def parse_npusmi_topo(text: str, path: str = "<text>") -> Topology:
    """Parse ``npu-smi info -t topo``.

    Returns:
        A :class:`Topology` with devices ``NPU0..`` (vendor ``ascend``, ``cpu_affinity``) and one
        link per NPU pair: ``HCCS`` -> ``HCCS`` (56 GB/s nominal, 910B), ``PIX``/``PXB``/``PHB``/
        ``SYS`` -> ``PCIE_*``, ``NA`` -> ``UNKNOWN``.

    Raises:
        TopologyParseError: no matrix, a row with fewer cells than NPU columns, or an ``X`` off the
            diagonal.
    """
    topo = _start("npu-smi-topo", path)
    lines = numbered_lines(text)
    header_at = None
    for idx, (_, line) in enumerate(lines):
        if _TOPO_HEADER.match(line) and "NPU0" in line.split():
            header_at = idx
            break
    if header_at is None:
        first = lines[0][0] if lines else 1
        raise TopologyParseError(
            "no 'npu-smi info -t topo' matrix found: expected a header line 'NPU0 NPU1 ... "
            "CPU Affinity' followed by one row per NPU",
            path=path,
            line=first,
        )
    header_no, header = lines[header_at]
    npus, extra = _split_header(header)
    num = len(npus)
    affinity_col = next((i for i, c in enumerate(extra) if c.lower() == "cpu affinity"), None)
    seen_rows: Dict[str, int] = {}
    pending: Dict[Tuple[str, str], Tuple[str, int]] = {}
    for line_no, line in lines[header_at + 1 :]:
        tokens = line.split()
        if not tokens:
            if seen_rows:
                break
            continue
        if not _NPU_NAME.match(tokens[0]):
            if seen_rows:
                break  # "Legend:" or the next command's output
            continue
        name = tokens[0]
        if name not in npus:
            raise TopologyParseError(
                f"row {name} is not one of the header's columns ({', '.join(npus)})",
                path=path,
                line=line_no,
            )
        cells = tokens[1 : 1 + num]
        if len(cells) < num:
            raise TruncatedCaptureError(
                f"row {name} has {len(cells)} cells, expected {num} (one per NPU column); "
                "the matrix looks truncated — capture the whole 'npu-smi info -t topo' output",
                path=path,
                line=line_no,
            )
        trailing = tokens[1 + num :]
        row_idx = npus.index(name)
        index = int(_NPU_NAME.match(name).group(1))
        affinity = None
        if affinity_col is not None and len(trailing) > affinity_col:
            affinity = trailing[affinity_col]
        elif trailing and affinity_col is None and re.match(r"^[\d,-]+$", trailing[0]):
            affinity = trailing[0]
        topo.add_device(
            Device(name=name, vendor=Vendor.ASCEND.value, index=index, cpu_affinity=affinity)
        )
        seen_rows[name] = line_no
        for col_idx, cell in enumerate(cells):
            peer = npus[col_idx]
            if cell == "X":
                if col_idx != row_idx:
                    raise TopologyParseError(
                        f"row {name} has 'X' (self) in column {peer}; X belongs on the diagonal",
                        path=path,
                        line=line_no,
                    )
                continue
            if col_idx == row_idx:
                _warn(topo, path, line_no, f"{name}: diagonal cell is {cell!r}, expected 'X'")
                continue
            link_class = _TOPO_CLASSES.get(cell)
            if link_class is None:
                _warn(
                    topo,
                    path,
                    line_no,
                    f"{name}-{peer}: unknown npu-smi topo token {cell!r}; recorded as UNKNOWN",
                )
                link_class = LinkClass.UNKNOWN
            key = (name, peer) if name < peer else (peer, name)
            if key in pending:
                other, other_line = pending.pop(key)
                if other != cell:
                    _warn(
                        topo,
                        path,
                        line_no,
                        f"{name}-{peer} is {cell!r} here but {other!r} on line {other_line}; "
                        "kept the first",
                    )
                continue
            pending[key] = (cell, line_no)
            gbps = None if link_class == LinkClass.UNKNOWN else nominal_gbps(link_class, "910B")
            topo.add_link(Link(name, peer, link_class, raw=cell, gbps=gbps, source=path))
    missing = [n for n in npus if n not in seen_rows]
    if missing:
        last = max(seen_rows.values()) if seen_rows else header_no
        raise TruncatedCaptureError(
            f"matrix has no row for {', '.join(missing)} (header lists {num} NPUs); the output "
            "looks truncated",
            path=path,
            line=last,
        )
    return topo


# -- npu-smi info (box table) --------------------------------------------------------------------


def sniff_npusmi_info(text: str) -> bool:
    """True for the ``npu-smi info`` table (``npu-smi X Version: X`` banner or NPU/Name/Health)."""
    if "npu-smi" not in text and "Health" not in text:
        return False
    return any(_NPU_SMI_BANNER.match(ln) or _INFO_HEADER.match(ln) for ln in text.splitlines())


def _cells(line: str) -> List[str]:
    """The ``|``-separated cells of a table row, stripped (no leading/trailing empty cells)."""
    parts = line.strip().split("|")
    if parts and parts[0] == "":
        parts = parts[1:]
    if parts and parts[-1] == "":
        parts = parts[:-1]
    return [p.strip() for p in parts]


def parse_npusmi_info(text: str, path: str = "<text>") -> Topology:
    """Parse the ``npu-smi info`` table.

    Each NPU takes two rows: ``| <id> <name> | <health> | power temp hugepages |`` then
    ``| <chip> [phy-id] | <bus-id> | aicore memory hbm |``. A card with several chips (310P,
    910_93) has one chip row per chip; a one-chip NPU is named ``NPU<id>``, chip ``c`` of a
    multi-chip NPU ``NPU<id>-<c>``.

    Returns:
        Devices with ``model`` (``910B3``) and ``pci_bus_id``; facts ``npu_health``
        (``{"NPU0": "OK"}``), ``npu_hbm_mb`` (``{"NPU0": 65536}``, total HBM) and
        ``npu_smi_version``.

    Raises:
        TopologyParseError: no NPU row found.
    """
    topo = _start("npu-smi-info", path)
    lines = numbered_lines(text)
    health: Dict[str, str] = {}
    hbm: Dict[str, int] = {}
    hbm_in_chip_row = True
    current: Optional[Tuple[int, str, str, int]] = None  # (npu id, name, health, line)
    chips: List[Tuple[str, str, str, int]] = []  # (chip id, bus id, usage cell, line)
    chip_health: List[str] = []  # health cell of each chip's NPU row
    phy_ids: Dict[str, int] = {}
    found = 0

    def flush() -> None:
        nonlocal current, chips, found
        if current is None:
            return
        npu_id, model, state, line_no = current
        if not chips:
            _warn(topo, path, line_no, f"NPU {npu_id} has no chip row (Bus-Id); output truncated?")
            chips = [("0", "", "", line_no, None)]
        for k, (chip_id, bus, usage, _, phy) in enumerate(chips):
            name = f"NPU{npu_id}" if len(chips) == 1 else f"NPU{npu_id}-{chip_id}"
            topo.add_device(
                Device(
                    name=name,
                    vendor=Vendor.ASCEND.value,
                    model=_model_from_name(model, len(chips)),
                    index=npu_id,
                    pci_bus_id=_normal_bus_id(bus) if bus else None,
                )
            )
            health[name] = chip_health[k] if k < len(chip_health) else state
            if phy is not None:
                phy_ids[name] = phy
            pairs = re.findall(r"(\d+)\s*/\s*(\d+)", usage)
            if pairs and hbm_in_chip_row:
                hbm[name] = int(pairs[-1][1])
            found += 1
        current, chips, chip_health[:] = None, [], []

    for line_no, line in lines:
        m = _NPU_SMI_BANNER.match(line)
        if m:
            v = re.search(r"Version:\s*(\S+)", line)
            if v:
                topo.facts["npu_smi_version"] = v.group(1)
            continue
        if not line.strip().startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) < 2:
            continue
        if re.match(r"^Chip\b", cells[0]) and len(cells) >= 3:
            hbm_in_chip_row = "HBM" in cells[2]
            continue
        first = cells[0].split()
        if (
            len(first) >= 2
            and first[0].isdigit()
            and re.match(r"^[A-Za-z][A-Za-z_ ]*$", cells[1])
            and cells[1] != "Health"
        ):
            if current is not None and int(first[0]) == current[0] and chips:
                # A3 / 910C: a card with two chips repeats its NPU row before each chip row.
                chip_health.append(cells[1])
                continue
            flush()
            current = (int(first[0]), " ".join(first[1:]), cells[1], line_no)
            chip_health = [cells[1]]
            continue
        if current is not None and first and first[0].isdigit() and _BUS_ID.match(cells[1]):
            # `| <chip> [<phy-id or device>] | <bus> | ...`: the second number is the Phy-ID
            # (A3) or the device id (310P), the id ASCEND_RT_VISIBLE_DEVICES and -t topo use.
            phy = int(first[1]) if len(first) >= 2 and first[1].isdigit() else None
            chips.append((first[0], cells[1], cells[2] if len(cells) > 2 else "", line_no, phy))
            continue
        if current is not None and cells[0].startswith("NPU") and "Process" in line:
            flush()  # the process table follows the device table
    flush()
    if not found:
        first = lines[0][0] if lines else 1
        raise TopologyParseError(
            "no NPU rows found in 'npu-smi info' output: expected rows like "
            "'| 0     910B3 | OK | ...' followed by '| 0 | 0000:C1:00.0 | ...'",
            path=path,
            line=first,
        )
    topo.facts["npu_health"] = health
    cann = _cann_version(lines)
    if cann:
        topo.facts["cann_version"] = cann
    if any("-" in name for name in phy_ids):
        topo.facts["npu_phy_ids"] = phy_ids
    if hbm:
        topo.facts["npu_hbm_mb"] = hbm
    return topo


def _normal_bus_id(bus: str) -> str:
    """``0000:C1:00.0`` -> ``0000:c1:00.0`` (lower case, 4-digit domain, as sysfs writes it)."""
    bus = bus.strip().lower()
    if re.match(r"^[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", bus):
        return "0000:" + bus
    m = re.match(r"^([0-9a-f]+):([0-9a-f]{2}:[0-9a-f]{2}\.[0-7])$", bus)
    if m:
        return f"{int(m.group(1), 16):04x}:{m.group(2)}"
    return bus


# -- npu-smi info -t board / -t usages / -t health / -m ------------------------------------------


def sniff_npusmi_board(text: str) -> bool:
    """True for ``npu-smi info -t board|usages|health`` key/value output or ``npu-smi info -m``."""
    if not any(k in text for k in ("NPU ID", "PCI Device ID", "Health Status", "Chip Name")):
        return False
    for line in text.splitlines():
        if _CHIP_LIST_HEADER.match(line):
            return True
        m = _KV.match(line)
        if m and m.group(1) in ("NPU ID", "PCI Device ID", "Health Status", "Chip Name"):
            if m.group(1) != "NPU ID" or m.group(2).strip().isdigit():
                return True
    return False


def parse_npusmi_board(text: str, path: str = "<text>") -> Topology:
    """Parse ``npu-smi info -t board`` / ``-t usages`` / ``-t health`` and ``npu-smi info -m``.

    The NPU a key/value line belongs to comes from the last ``NPU ID : <n>`` line or, for views
    that do not print it (``-t health``), from the ``-i <n>`` of the last ``npu-smi info``
    command line in the capture.

    Returns:
        Devices ``NPU<id>`` with model (``Chip Name``, or from ``PCI Device ID``: ``0xD801`` ->
        ``910A``, ``0xD802`` -> ``910B``), ``pci_bus_id`` and ``pci_device_id`` (``19e5:d801``);
        facts ``npu_health`` and ``npu_hbm_mb``.

    Raises:
        TopologyParseError: nothing attributable to an NPU was found.
    """
    topo = _start("npu-smi-board", path)
    lines = numbered_lines(text)
    current: Optional[int] = None
    vendor_id = "19e5"
    health: Dict[str, str] = {}
    hbm: Dict[str, int] = {}
    in_chip_list = False
    touched = 0

    def device(npu: int) -> Device:
        return topo.add_device(Device(name=f"NPU{npu}", vendor=Vendor.ASCEND.value, index=npu))

    for line_no, line in lines:
        cmd = _NPU_SMI_CMD.search(line)
        if cmd:
            in_chip_list = False
            i = re.search(r"-i\s+(\d+)", cmd.group("args"))
            current = int(i.group(1)) if i else None
            continue
        if _CHIP_LIST_HEADER.match(line):
            in_chip_list = True
            continue
        if in_chip_list:
            row = _CHIP_LIST_ROW.match(line)
            if row:
                npu, _chip, logic, chip_name = row.groups()
                if logic != "-" and chip_name.strip().lower() != "mcu":
                    d = device(int(npu))
                    d.model = d.model or _model_from_name(chip_name)
                    touched += 1
                continue
            if line.strip():
                in_chip_list = False
            continue
        kv = _KV.match(line)
        if not kv or kv.group(1) not in _BOARD_KEYS:
            continue
        key, value = kv.group(1), kv.group(2)
        if key == "NPU ID":
            if value.isdigit():
                current = int(value)
            continue
        if current is None:
            _warn(topo, path, line_no, f"'{key}' appears before any 'NPU ID' line; skipped")
            continue
        d = device(current)
        touched += 1
        if key == "Chip Name":
            d.model = _model_from_name(value) or d.model
        elif key == "PCIe Bus Info" and _BUS_ID.match(value):
            d.pci_bus_id = _normal_bus_id(value)
        elif key == "PCI Vendor ID" and re.match(r"^0x[0-9a-fA-F]{4}$", value):
            vendor_id = value[2:].lower()
        elif key == "PCI Device ID" and re.match(r"^0x[0-9a-fA-F]{4}$", value):
            dev_id = value[2:].lower()
            d.pci_device_id = f"{vendor_id}:{dev_id}"
            family = ASCEND_IDS.get(dev_id)
            if family and not (d.model and d.model.startswith(family)):
                d.model = family
        elif key == "HBM Capacity(MB)" and value.isdigit():
            hbm[d.name] = int(value)
        elif key == "Health Status":
            health[d.name] = value
    if not touched:
        first = lines[0][0] if lines else 1
        raise TopologyParseError(
            "no NPU found in npu-smi key/value output: expected 'NPU ID : <n>' blocks "
            "('npu-smi info -t board -i <n>') or the 'npu-smi info -m' chip list",
            path=path,
            line=first,
        )
    if health:
        topo.facts["npu_health"] = health
    if hbm:
        topo.facts["npu_hbm_mb"] = hbm
    return topo


# -- lspci (Huawei accelerators) -----------------------------------------------------------------


def sniff_lspci_ascend(text: str) -> bool:
    """True when ``text`` has an ``lspci`` line of a Huawei accelerator (``Device d801``)."""
    if "Huawei" not in text:
        return False
    return any(_LSPCI_ASCEND.match(ln) for ln in text.splitlines())


def parse_lspci_ascend(text: str, path: str = "<text>") -> Topology:
    """Parse the Huawei accelerator lines of ``lspci`` / ``lspci -nn``.

    ``lspci`` lists devices in bus order while npu-smi numbers NPUs its own way, so no device
    is created; the result is ``facts["ascend_pci"]``: ``[{"pci_bus_id": "0000:3d:00.0",
    "pci_device_id": "19e5:d801", "model": "910A"}, ...]``.

    Raises:
        TopologyParseError: no Huawei accelerator line.
    """
    topo = _start("lspci-ascend", path)
    found = []
    for _, line in numbered_lines(text):
        m = _LSPCI_ASCEND.match(line)
        if not m:
            continue
        dev = (m.group("dev") or m.group("dev2")).lower()
        found.append(
            {
                "pci_bus_id": _normal_bus_id(m.group("bdf")),
                "pci_device_id": f"19e5:{dev}",
                "model": ASCEND_IDS.get(dev),
            }
        )
    if not found:
        raise TopologyParseError(
            "no Huawei accelerator in lspci output (expected lines like '3d:00.0 Processing "
            "accelerators: Huawei Technologies Co., Ltd. Device d801')",
            path=path,
            line=1,
        )
    topo.facts["ascend_pci"] = found
    return topo


FORMATS = [
    ("npu-smi-topo", sniff_npusmi_topo, parse_npusmi_topo),
    ("npu-smi-info", sniff_npusmi_info, parse_npusmi_info),
    ("npu-smi-board", sniff_npusmi_board, parse_npusmi_board),
    ("lspci-ascend", sniff_lspci_ascend, parse_lspci_ascend),
]


def join_ascend_chips(topo: Topology) -> None:
    """Name ``npu-smi info -t topo`` NPUs after their chip (``NPU<card>-<chip>``) on A3 cards.

    ``-t topo`` names an NPU by its Phy-ID (``NPU0`` .. ``NPU15`` on an 8-card A3 box), the
    ``npu-smi info`` table by card and chip. With both captured (same file or several inputs),
    ``facts["npu_phy_ids"]`` joins them: the matrix device ``NPU<phy>`` becomes the chip device
    (its NUMA and CPU affinity move over) and its links are renamed. Without the table, the
    matrix keeps npu-smi's own names. No-op on one-chip cards.
    """
    phy_ids = topo.facts.get("npu_phy_ids") or {}
    if not phy_ids:
        return
    rename = {f"NPU{phy}": chip for chip, phy in phy_ids.items()}
    if not any(topo.device(old) is not None for old in rename if old not in phy_ids):
        return
    kept = []
    for d in topo.devices:
        new = rename.get(d.name)
        if new is None or d.name in phy_ids or d.vendor != Vendor.ASCEND.value:
            kept.append(d)
            continue
        chip = topo.device(new)
        if chip is None:
            d.name = new
            kept.append(d)
            continue
        chip.numa = chip.numa if chip.numa is not None else d.numa
        chip.cpu_affinity = chip.cpu_affinity or d.cpu_affinity
    topo.devices[:] = kept

    def _n(name: str) -> str:
        new = rename.get(name)
        return new if new is not None and name not in phy_ids else name

    topo.links = [dataclasses.replace(ln, a=_n(ln.a), b=_n(ln.b)) for ln in topo.links]
