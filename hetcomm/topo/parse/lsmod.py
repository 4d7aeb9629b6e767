"""Parser for ``lsmod``: is GPUDirect RDMA's peer-memory module bound to the RDMA core?

NCCL can DMA GPU memory straight to an RDMA NIC only when a peer-memory client is registered
with ``ib_core``: the in-driver ``nvidia_peermem`` (R470+/CUDA 11.4+) or the legacy out-of-tree
``nv_peer_mem``. Loaded is not enough; ``ib_core`` must list it in its used-by column
(topology-notes §3.2 and the gpud peermem check).

Format name: ``lsmod``. ``facts["peermem"]``: True when ``nvidia_peermem``/``nv_peer_mem`` is
loaded and in ``ib_core``'s used-by list, False when ``ib_core`` is loaded without it, absent when
``ib_core`` is not loaded (no RDMA stack, GDR not applicable).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from hetcomm.errors import TopologyParseError
from hetcomm.topo.model import Topology
from hetcomm.topo.parse._text import numbered_lines

__all__ = [
    "FORMATS",
    "LsmodSection",
    "PEERMEM_MODULES",
    "parse_lsmod_sections",
    "sniff_lsmod",
    "parse_lsmod",
]

#: Module names of a GPUDirect RDMA peer-memory client.
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")

_HEADER = re.compile(r"^\s*Module\s+Size\s+Used by\s*$")
# name, size, use count ("-" on some kernels), then an optional comma list and flags such as
# "[permanent]" or "(OE)" that some kernels append.
_ROW = re.compile(r"^\s*([A-Za-z0-9_]+)\s+(\d+)\s+(\d+|-)(?:\s+(.*?))?\s*$")
# A row only counts towards sniffing when it names a module of the GPU/RDMA stack, so that
# two-number lines in other tools' output ("eth0 1500 0") are not taken for lsmod.
_KNOWN = {"ib_core", "nvidia", "nvidia_uvm", "mlx5_core", "mlx5_ib", "ib_uverbs", "rdma_cm"}
_KNOWN.update(PEERMEM_MODULES)


@dataclass
class LsmodSection:
    """One contiguous ``lsmod`` listing.

    Attributes:
        first_line / last_line: 1-based line numbers of its first and last row.
        modules: module name -> (size_bytes, use count or None, used-by names).
    """

    first_line: int
    last_line: int
    modules: Dict[str, Tuple[int, Optional[int], List[str]]] = field(default_factory=dict)

    @property
    def peermem(self) -> Optional[bool]:
        """True/False as described in the module docstring; None when ``ib_core`` is absent."""
        ib_core = self.modules.get("ib_core")
        if ib_core is None:
            return None
        used_by = set(ib_core[2])
        return any(m in self.modules and m in used_by for m in PEERMEM_MODULES)

    @property
    def peermem_loaded(self) -> bool:
        """True when a peer-memory module is loaded at all (bound or not)."""
        return any(m in self.modules for m in PEERMEM_MODULES)


def _used_by(rest: Optional[str]) -> List[str]:
    if not rest:
        return []
    rest = re.sub(r"\[[^\]]*\]|\([^)]*\)", " ", rest)  # [permanent], (OE) flags
    names: List[str] = []
    for chunk in rest.split():
        names.extend(n for n in chunk.split(",") if n)
    return names


def parse_lsmod_sections(text: str) -> List[LsmodSection]:
    """Split ``text`` into its ``lsmod`` listings (runs of module rows, broken by other lines).

    A file may hold several listings (two hosts, before/after a ``modprobe``, or the two inputs
    of the gpud test in ``tests/fixtures``); each is judged on its own.
    """
    sections: List[LsmodSection] = []
    headed: List[bool] = []
    current: Optional[LsmodSection] = None
    after_header = False
    for line_no, line in numbered_lines(text):
        if _HEADER.match(line):
            current, after_header = None, True
            continue
        m = _ROW.match(line)
        if not m:
            current, after_header = None, after_header and not line.strip()
            continue
        name, size, count, rest = m.groups()
        if current is None:
            current = LsmodSection(first_line=line_no, last_line=line_no)
            sections.append(current)
            headed.append(after_header)
            after_header = False
        current.last_line = line_no
        current.modules[name] = (int(size), None if count == "-" else int(count), _used_by(rest))
    # Without the header, a run of "word number number" lines is only taken for lsmod when it
    # names a module of the GPU/RDMA stack (other tools print such lines too).
    return [s for s, h in zip(sections, headed, strict=True) if h or _KNOWN & set(s.modules)]


def sniff_lsmod(text: str) -> bool:
    """True for ``lsmod`` output: the ``Module Size Used by`` header or rows of RDMA/GPU modules."""
    if "Used by" not in text and not any(name in text for name in _KNOWN):
        return False  # cheap guard: sniffers run on every input, logs can be large
    for line in text.splitlines():
        if _HEADER.match(line):
            return True
        m = _ROW.match(line)
        if m and m.group(1) in _KNOWN:
            return True
    return False


def parse_lsmod(text: str, path: str = "<text>") -> Topology:
    """Parse ``lsmod`` into ``facts["peermem"]`` and ``facts["kernel_modules"]``.

    With several listings in one file, ``peermem`` is the worst case (False if any listing with
    ``ib_core`` lacks the binding), each listing's verdict is in ``facts["lsmod_sections"]``
    (``[{"lines": "3-5", "peermem": True}, ...]``), and a parse warning says so.

    Raises:
        TopologyParseError: no module row.
    """
    sections = parse_lsmod_sections(text)
    if not sections:
        raise TopologyParseError(
            "no lsmod rows found: expected lines like 'ib_core  434176  9 rdma_cm,nvidia_peermem'",
            path=path,
            line=1,
        )
    topo = Topology()
    topo.facts["formats"] = ["lsmod"]
    topo.facts["sources"] = [path]
    verdicts = [s.peermem for s in sections]
    known = [v for v in verdicts if v is not None]
    if known:
        topo.facts["peermem"] = all(known)
    names = sorted({m for s in sections for m in s.modules})
    topo.facts["kernel_modules"] = names
    if len(sections) > 1:
        topo.facts["lsmod_sections"] = [
            {"lines": f"{s.first_line}-{s.last_line}", "peermem": s.peermem} for s in sections
        ]
        topo.facts.setdefault("parse_warnings", []).append(
            f"{path}:{sections[1].first_line}: {len(sections)} separate lsmod listings; "
            f"peermem = {topo.facts.get('peermem')} is the worst case over them"
        )
    return topo


FORMATS = [("lsmod", sniff_lsmod, parse_lsmod)]
