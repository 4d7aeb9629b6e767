"""Parser for Ascend ``hccn_tool`` output: the RoCE NIC built into each NPU.

``hccn_tool -i <npu> -<verb> -g`` prints one view of NPU ``<npu>``'s NIC; captures usually hold
many views for many NPUs, each after its command line (topology-notes §2.4). The NPU a line is
about comes from the last ``hccn_tool -i N`` command line, or from a ``[devid N]`` prefix.

Format name: ``hccn_tool``. NICs are named ``npu<N>-roce`` (link layer Ethernet). Verbs read:
``-status`` / ``-speed`` (``Speed: 200000Mb/s`` -> 200 Gb/s), ``-link`` (``link status: UP``),
``-net_health`` (``net health status: Success``), ``-ip``, ``-link_stat`` (link up count and
change records), ``-optical`` (``Rx Los Flag``, ``present``), ``-stat`` (``roce_*_err_pkt_num``),
and ``/etc/hccn.conf`` (``address_N=``).

Facts: ``hccn_health`` (``{"npu0-roce": "Socket failed"}``) and ``hccn`` (per NIC, every value
read: ``ip``, ``netmask``, ``link``, ``link_up_count``, ``link_changes``, ``rx_los_flag``,
``optical_present``, ``roce_rx_err_pkt_num`` ...).
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional

from hetcomm.errors import TopologyParseError
from hetcomm.topo.model import Nic, Topology
from hetcomm.topo.parse._text import numbered_lines

__all__ = ["FORMATS", "hccn_nic_name", "sniff_hccn", "parse_hccn"]

_CMD = re.compile(r"hccn_tool\s+-i\s+(\d+)\s+-(\w+)")
_DEVID = re.compile(r"^\s*\[devid\s+(\d+)\]\s*(.*)$")
# A command line of another tool ends the current hccn_tool view.
_OTHER_CMD = re.compile(
    r"^\s*(?:\S*[$#]\s*)?(?:/\S*/)?(?:npu-smi|lspci|cat|pip|ls|ip|ibstat|lsmod|dmesg)\b"
)
# hccn_tool `key: value` lines we read, by lower-cased key.
_FIELDS = {
    "speed": "speed",
    "link status": "link",
    "net health status": "net_health",
    "ipaddr": "ip",
    "netmask": "netmask",
    "link up count": "link_up_count",
    "link change records": "link_changes",
    "rx los flag": "rx_los_flag",
    "present": "optical_present",
    "fec mode": "fec",
}
_CONF = re.compile(r"^\s*(address|netmask|gateway|netdetect)_(\d+)\s*=\s*(\S+)\s*$")


def hccn_nic_name(npu: int) -> str:
    """The NIC name of NPU ``npu``'s built-in RoCE port: ``npu3-roce``."""
    return f"npu{npu}-roce"


def sniff_hccn(text: str) -> bool:
    """True for ``hccn_tool`` output (its command lines, ``[devid N]`` lines, ``hccn.conf``)."""
    if not any(k in text for k in ("hccn_tool", "[devid", "address_")):
        return False  # cheap guard: sniffers run on every input, logs can be large
    for line in text.splitlines():
        if _CMD.search(line) or _DEVID.match(line) or _CONF.match(line):
            return True
    return False


def _kv(line: str):
    m = re.match(r"^\s*([A-Za-z][\w ()/.-]*?)\s*:\s*(.*?)\s*$", line)
    return (m.group(1).strip(), m.group(2)) if m else (None, None)


def parse_hccn(text: str, path: str = "<text>") -> Topology:
    """Parse ``hccn_tool`` captures and ``/etc/hccn.conf``.

    Returns:
        One :class:`Nic` ``npu<N>-roce`` per NPU seen (``rate_gbps`` from ``Speed``, ``state``
        ``Up``/``Down`` from ``-link``); facts ``hccn_health`` and ``hccn``.

    Raises:
        TopologyParseError: nothing attributable to an NPU.
    """
    topo = Topology()
    topo.facts["formats"] = ["hccn_tool"]
    topo.facts["sources"] = [path]
    info: Dict[str, Dict[str, Any]] = {}
    health: Dict[str, str] = {}
    npu: Optional[int] = None
    verb: Optional[str] = None

    def nic(n: int) -> Nic:
        name = hccn_nic_name(n)
        info.setdefault(name, {})
        return topo.add_nic(Nic(name=name, link_layer="Ethernet"))

    for _, line in numbered_lines(text):
        cmd = _CMD.search(line)
        if cmd:
            npu, verb = int(cmd.group(1)), cmd.group(2).lower()
            continue
        if _OTHER_CMD.match(line):
            npu, verb = None, None  # another tool's output follows
            continue
        conf = _CONF.match(line)
        if conf:
            key, n, value = conf.groups()
            nic(int(n))
            info[hccn_nic_name(int(n))]["conf_" + key] = value
            continue
        d = _DEVID.match(line)
        body = line
        if d:
            npu, body = int(d.group(1)), d.group(2)
        if npu is None or not body.strip():
            continue
        key, value = _kv(body)
        field = _FIELDS.get(key.lower()) if key else None
        if field is None:
            if key and key.lower().startswith("roce_") and value.isdigit():
                nic(npu)
                info[hccn_nic_name(npu)][key.lower()] = int(value)
            continue
        if field == "optical_present" and verb != "optical":
            continue
        n = nic(npu)
        rec = info[n.name]
        if field == "speed":
            m = re.match(r"^(\d+)\s*Mb/s", value)
            if m:
                n.rate_gbps = int(m.group(1)) / 1000.0
        elif field == "link":
            rec["link"] = value
            n.state = value.capitalize()
        elif field == "net_health":
            health[n.name] = value
        elif field == "link_up_count":
            if value.isdigit():
                rec[field] = int(value)
        elif field == "link_changes":
            rec.setdefault("link_changes", 0)
        else:
            rec[field] = value
    # `[devid N]   <date>  LINK UP|DOWN` rows under "link change records"
    for _, line in numbered_lines(text):
        d = _DEVID.match(line)
        if d and re.search(r"\bLINK (UP|DOWN)\s*$", d.group(2)):
            rec = info.setdefault(hccn_nic_name(int(d.group(1))), {})
            rec["link_changes"] = rec.get("link_changes", 0) + 1
    if not info:
        lines = numbered_lines(text)
        raise TopologyParseError(
            "no hccn_tool data found: expected 'hccn_tool -i <npu> -<verb> -g' command lines "
            "followed by their output, '[devid N]' lines, or /etc/hccn.conf 'address_N=' lines",
            path=path,
            line=lines[0][0] if lines else 1,
        )
    if health:
        topo.facts["hccn_health"] = health
    topo.facts["hccn"] = info
    return topo


FORMATS = [("hccn_tool", sniff_hccn, parse_hccn)]
