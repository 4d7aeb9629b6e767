"""Patterns and small helpers shared by the ``nvidia-smi`` parsers (:mod:`.nvsmi`).

Kept apart so that :mod:`hetcomm.topo.parse.nvsmi` stays one job (the matrices and the identity
views) and under the 800-line module limit.
"""

from __future__ import annotations

import re
from typing import List, Optional

from hetcomm.topo.parse._text import strip_source_header

__all__: List[str] = []

_NV = re.compile(r"^NV(\d+)$")
# Current drivers underline the matrix header on a terminal (ESC[4m ... ESC[0m); copies pasted
# from a web page often keep "[4m" without the ESC byte.
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|\[[0-9;]{1,5}m")
# Any other all-caps token in a matrix cell is kept as UNKNOWN (a newer driver's path name);
# anything else (a CPU list, a number) means the row is misaligned or truncated.
_CAPS_TOKEN = re.compile(r"^[A-Z][A-Z0-9]*$")
_MATRIX_HEADER = re.compile(r"^\s*GPU\d+(\s|$)")
_TRAILING_START = {"CPU", "NUMA", "GPU"}  # first word of CPU Affinity / NUMA Affinity / GPU NUMA ID
_LEGEND_ENTRY = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_IBDEV2NETDEV = re.compile(r"^\s*(\S+)\s+port\s+(\d+)\s+==>\s+(\S+)\s+\((\w+)\)\s*$")
_COMMAND = re.compile(
    r"nvidia-smi\s+topo\s+(-mp\b|--matrix_pci\b|-m\b|--matrix\b|-p2p\s+(\w+)|--p2pstatus)"
)

# Identity views.
_GPU_TITLE = re.compile(r"^\s*GPU (\d+): (.+?)(?: \(UUID: ([^)]*)\))?\s*$")
_NVLINK_RATE = re.compile(r"^\s*Link (\d+): ([0-9.]+) GB/s\s*$")
_NVLINK_OTHER = re.compile(r"^\s*Link (\d+): (.*?)\s*$")
# The start of a "Link N: 25 GB/s" line, cut anywhere after its indentation.
_NVLINK_CUT = re.compile(r"^\s+L(?:i(?:n(?:k(?:\s.*)?)?)?)?$")
_NVLINK_ALL_INACTIVE = re.compile(
    r"Unable to retrieve NVLink information as all links are inActive", re.I
)
_NVLINK_COMMAND = re.compile(r"nvidia-smi\s+nvlink\b")
_SMI_ROW = re.compile(
    r"^\|\s+(\d+)\s+(.+?)\s+(On|Off|N/A|WDDM|TCC)\s+\|\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])"
    r"\s+(\S+)\s+\|"
)
_SMI_POWER = re.compile(r"(\d+)W\s*/\s*(\d+)W")
_SMI_LAST_CELL = re.compile(r"\|\s*([^|]*?)\s*\|\s*$")
_SMI_BANNER = re.compile(r"NVIDIA-SMI \d+\.\d+")
# What nvidia-smi prints instead of any table when the driver is missing or not loaded.
_SMI_NO_DRIVER = re.compile(
    r"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.*"
)
# `--query-gpu=... --format=csv` header: the queried field names, e.g. "index, name, pci.bus_id".
_CSV_HEADER = re.compile(r"^\s*[a-z_.]+(?: \[[^\]]*\])?(?:,\s*[a-z_.]+(?: \[[^\]]*\])?)+\s*$", re.I)


def _csv_columns(line: str) -> Optional[List[str]]:
    """The field names of a ``--query-gpu`` CSV header naming the GPU (``name`` or
    ``pci.bus_id``), else None."""
    if not _CSV_HEADER.match(line):
        return None
    cols = [re.sub(r"\s*\[.*\]$", "", c.strip().lower()) for c in line.split(",")]
    if len(set(cols)) != len(cols):
        return None
    # "name" alone is too common a CSV column; pair it with a field only nvidia-smi queries.
    gpu_fields = {"index", "uuid", "driver_version", "memory.total", "compute_cap", "vbios_version"}
    return cols if "pci.bus_id" in cols or ("name" in cols and gpu_fields & set(cols)) else None


def _sniff_text(text: str) -> str:
    """``text`` as the sniffers read it: no provenance header (it may quote a command), no ANSI
    escapes, ``\\n`` line ends."""
    return _ANSI.sub("", strip_source_header(text)).replace("\r\n", "\n")


def _strip_vendor(name: str) -> str:
    """``NVIDIA A100-SXM4-80GB`` -> ``A100-SXM4-80GB`` (Device.model keeps the part name)."""
    name = name.strip()
    if name.endswith("..."):  # old drivers truncate long names in the table
        name = name[:-3].rstrip()
    return re.sub(r"^NVIDIA\s+", "", name)


#: ``NVIDIA-SMI 470.82.01    Driver Version: 470.82.01`` (table banner), ``Driver Version : X``
#: (``nvidia-smi -q``), ``driver_version`` CSV column values are read separately.
DRIVER_VERSION = re.compile(r"Driver Version\s*:\s*(\d+\.\d+(?:\.\d+)?)")

_WANT_HELP = {
    "nvsmi-topo": "`nvidia-smi topo -m`",
    "nvsmi-topo-mp": "`nvidia-smi topo -mp`",
    "nvsmi-topo-p2p": "`nvidia-smi topo -p2p r|w|n|a|p`",
    "nvsmi-nvlink": "`nvidia-smi nvlink -s`",
    "nvsmi": "`nvidia-smi` (table, -L or --query-gpu csv)",
}
_WANT_EXAMPLE = {
    "nvsmi-topo": (
        "expected a header line of device columns ('GPU0 GPU1 ... CPU Affinity') followed by "
        "one row per column ('GPU0  X  NV8 ...')"
    ),
    "nvsmi-topo-mp": (
        "expected a header line of device columns ('GPU0 GPU1 ...') followed by one row per "
        "column ('GPU0  X  PIX ...')"
    ),
    "nvsmi-topo-p2p": "expected a GPU matrix of OK/CNS/GNS/TNS/NS cells ('GPU0  X  OK ...')",
    "nvsmi-nvlink": "expected 'GPU 0: <name> (UUID: ...)' lines, each followed by 'Link N: 25 GB/s'",
    "nvsmi": (
        "expected the nvidia-smi table ('|   0  NVIDIA A100-PCIE-40GB  Off |  00000000:12:00.0 "
        "Off | ...') or 'GPU 0: <name> (UUID: ...)' lines"
    ),
}
