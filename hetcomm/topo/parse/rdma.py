"""Parsers for RDMA NIC state: ``ibstat``, ``ibv_devinfo``, ``show_gids``, ``/sys/class/infiniband``
dumps and ``ibdev2netdev``.

Formats (names as in :data:`FORMATS`): ``ibv_devinfo``, ``show_gids``, ``ibstat``,
``ib-sysfs``, ``ibdev2netdev``.

Every port becomes one :class:`~hetcomm.topo.model.Nic`, named after the HCA (``mlx5_0``); a
port other than 1 is ``mlx5_0:2``. ``link_layer`` is what tells InfiniBand from RoCE: mlx5
devices report ``transport: InfiniBand (0)`` in both modes, and only ``link_layer: Ethernet``
means RoCE (topology-notes §3.1). Rates are per port in Gb/s.

Facts written (see the report for new keys): ``hca_type`` ({hca: ``MT4129``}),
``ib_phys_state`` ({nic: ``LinkUp``}), ``roce_gids`` ({hca: [{index, ver, ipv4, gid, port,
netdev}]}), ``netdev_state`` ({netdev: ``Up``}), ``parse_warnings``.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

from hetcomm.errors import TopologyParseError
from hetcomm.topo.model import Nic, Topology
from hetcomm.topo.parse._text import numbered_lines

__all__ = [
    "FORMATS",
    "nic_name",
    "sniff_ibstat",
    "parse_ibstat",
    "sniff_ibv_devinfo",
    "parse_ibv_devinfo",
    "sniff_show_gids",
    "parse_show_gids",
    "sniff_ib_sysfs",
    "parse_ib_sysfs",
    "sniff_ibdev2netdev",
    "parse_ibdev2netdev",
]

_CA = re.compile(r"^\s*CA\s+'([^']+)'\s*$")
_IBSTAT_PORT = re.compile(r"^\s*Port\s+(\d+)\s*:\s*$")
_KV = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 _]*?)\s*:\s*(.*?)\s*$")
_HCA_ID = re.compile(r"^\s*hca_id\s*:\s*(\S+)\s*$")
_DEVINFO_PORT = re.compile(r"^\s*port\s*:\s*(\d+)\s*$")
_GIDS_HEADER = re.compile(r"^\s*DEV\s+PORT\s+INDEX\s+GID\s+IPv4\s+VER\s+DEV\s*$")
_GID = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}$")
_SYSFS = re.compile(
    r"^(?:==>\s*)?/sys/class/infiniband/(?P<dev>[^/\s]+)/(?P<attr>[\w/]+?)\s*(?:<==\s*$|:\s?(?P<value>.*)$)"
)
_SYSFS_SNIFF = re.compile(
    r"/sys/class/infiniband/[^/\s]+/ports/\d+/(rate|state|link_layer|phys_state)\b"
)
_IBDEV2NETDEV = re.compile(
    r"^\s*(?P<dev>[\w.-]+)\s+port\s+(?P<port>\d+)\s+==>\s+(?P<netdev>\S+)\s+\((?P<state>\w+)\)\s*$"
)
# ibv_devinfo port states (enum ibv_port_state) -> the ibstat spelling used in Nic.state.
_PORT_STATES = {
    "PORT_NOP": "Nop",
    "PORT_DOWN": "Down",
    "PORT_INIT": "Init",
    "PORT_ARMED": "Armed",
    "PORT_ACTIVE": "Active",
    "PORT_ACTIVE_DEFER": "ActiveDefer",
}


def nic_name(hca: str, port: int) -> str:
    """The NIC name of an HCA port: ``mlx5_0`` for port 1, ``mlx5_0:2`` for port 2."""
    return hca if port == 1 else f"{hca}:{port}"


def _start(fmt: str, path: str) -> Topology:
    topo = Topology()
    topo.facts["formats"] = [fmt]
    topo.facts["sources"] = [path]
    return topo


def _warn(topo: Topology, path: str, line: Optional[int], message: str) -> None:
    where = f"{path}:{line}" if line is not None else path
    topo.facts.setdefault("parse_warnings", []).append(f"{where}: {message}")


def _number(text: str) -> Optional[float]:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)", text)
    return float(m.group(1)) if m else None


def _state_word(value: str) -> str:
    """``4: ACTIVE`` -> ``Active``; ``PORT_ACTIVE (4)`` -> ``Active``; ``Active`` -> ``Active``."""
    value = value.strip()
    m = re.match(r"^(PORT_\w+)", value)
    if m:
        return _PORT_STATES.get(m.group(1), m.group(1))
    m = re.match(r"^\d+\s*:\s*(\S+)", value)
    word = m.group(1) if m else value
    if word.isupper():  # sysfs spells states in capitals; ibstat capitalises the first letter
        word = word.capitalize().replace("_defer", "Defer")
    return word


def _elided(value: str) -> bool:
    """True for values a human elided from a pasted capture (``...``) or empty ones."""
    return value.strip() in ("", "...", "…")


def _no_data(fmt: str, path: str, lines, expected: str) -> TopologyParseError:
    first = lines[0][0] if lines else 1
    return TopologyParseError(f"no {fmt} data found: expected {expected}", path=path, line=first)


# -- ibstat --------------------------------------------------------------------------------------


def sniff_ibstat(text: str) -> bool:
    """True for ``ibstat`` output: a ``CA 'mlx5_0'`` line followed by ``CA type:``/``Port N:``."""
    if "CA '" not in text:  # cheap guard: sniffers run on every input, logs can be large
        return False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _CA.match(line):
            return any(
                re.match(r"^\s*(CA type|Number of ports|Port \d+)\s*:", ln)
                for ln in lines[i + 1 : i + 8]
            )
    return False


def parse_ibstat(text: str, path: str = "<text>") -> Topology:
    """Parse ``ibstat`` (all CAs, all ports).

    A capture that stops early (a pasted excerpt, or ``ibpanic`` when a device vanished) keeps
    every port parsed so far; each missing piece is listed in ``facts["parse_warnings"]`` with
    its file:line.

    Returns:
        One :class:`Nic` per port: ``link_layer`` (``InfiniBand``/``Ethernet``), ``rate_gbps``,
        ``state`` (``Active``/``Down``/...), ``port``; facts ``hca_type`` and ``ib_phys_state``.

    Raises:
        TopologyParseError: no ``CA '<name>'`` block with at least one port.
    """
    topo = _start("ibstat", path)
    lines = numbered_lines(text)
    hca_type: Dict[str, str] = {}
    phys: Dict[str, str] = {}
    ca: Optional[str] = None
    ca_line = 0
    num_ports: Optional[int] = None
    ports_seen: List[int] = []
    port: Optional[int] = None
    port_line = 0
    fields: Dict[str, str] = {}
    num_ok = 0

    def close_port(end_line: int) -> None:
        nonlocal port, fields, num_ok
        if ca is None or port is None:
            return
        name = nic_name(ca, port)
        missing = [k for k in ("State", "Rate", "Link layer") if k not in fields]
        if missing:
            _warn(
                topo,
                path,
                end_line,
                f"CA '{ca}' port {port} (line {port_line}) ends without "
                f"{', '.join(missing)}; kept the fields present",
            )
        if not fields:
            port, fields = None, {}
            return
        rate = fields.get("Rate")
        topo.add_nic(
            Nic(
                name=name,
                link_layer=fields.get("Link layer"),
                rate_gbps=_number(rate) if rate else None,
                state=_state_word(fields["State"]) if "State" in fields else None,
                port=port,
            )
        )
        if "Physical state" in fields:
            phys[name] = fields["Physical state"]
        num_ok += 1
        port, fields = None, {}

    def close_ca(end_line: int) -> None:
        nonlocal ca, ports_seen, num_ports
        close_port(end_line)
        if ca is not None:
            if not ports_seen:
                _warn(topo, path, end_line, f"CA '{ca}' (line {ca_line}) has no 'Port N:' section")
            elif num_ports is not None and len(ports_seen) < num_ports:
                _warn(
                    topo,
                    path,
                    end_line,
                    f"CA '{ca}' says {num_ports} ports but only {len(ports_seen)} are listed",
                )
        ca, ports_seen, num_ports = None, [], None

    last_line = lines[-1][0] if lines else 1
    for line_no, line in lines:
        m = _CA.match(line)
        if m:
            close_ca(line_no)
            ca, ca_line = m.group(1), line_no
            continue
        if line.strip().startswith("ibpanic:") or line.strip().startswith("ibwarn:"):
            close_ca(line_no)
            _warn(topo, path, line_no, f"ibstat aborted: {line.strip()}")
            continue
        if ca is None:
            continue
        m = _IBSTAT_PORT.match(line)
        if m:
            close_port(line_no)
            port, port_line = int(m.group(1)), line_no
            ports_seen.append(port)
            continue
        kv = _KV.match(line)
        if not kv:
            if line.strip():
                close_ca(line_no)  # another tool's output follows
            continue
        key, value = kv.group(1), kv.group(2)
        if _elided(value):
            continue
        if port is None:
            if key == "CA type":
                hca_type[ca] = value
            elif key == "Number of ports" and value.isdigit():
                num_ports = int(value)
        else:
            fields[key] = value
    close_ca(last_line)
    if not num_ok:
        raise _no_data("ibstat", path, lines, "\"CA 'mlx5_0'\" blocks with 'Port 1:' sections")
    if hca_type:
        topo.facts["hca_type"] = hca_type
    if phys:
        topo.facts["ib_phys_state"] = phys
    return topo


# -- ibv_devinfo ---------------------------------------------------------------------------------


def sniff_ibv_devinfo(text: str) -> bool:
    """True for ``ibv_devinfo`` output (``hca_id: <name>`` then ``transport:``/``port:`` lines)."""
    if "hca_id" not in text:
        return False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _HCA_ID.match(line):
            return any(
                re.match(r"^\s*(transport|fw_ver|port|node_guid)\s*:", ln)
                for ln in lines[i + 1 : i + 6]
            )
    return False


def _width_lanes(value: str) -> Optional[int]:
    m = re.match(r"^\s*(\d+)X\b", value)
    return int(m.group(1)) if m else None


def parse_ibv_devinfo(text: str, path: str = "<text>") -> Topology:
    """Parse ``ibv_devinfo`` and ``ibv_devinfo -v``.

    ``state: PORT_ACTIVE (4)`` -> ``Active``; ``link_layer`` as printed (``Ethernet`` = RoCE);
    the rate is ``active_width`` lanes x ``active_speed`` per lane when ``-v`` printed both
    (``4X`` x ``50.0 Gbps`` = 200).

    Returns:
        One :class:`Nic` per port; facts ``hca_type`` (``MT<vendor_part_id>``).

    Raises:
        TopologyParseError: no ``hca_id:`` block with a ``port:`` section.
    """
    topo = _start("ibv_devinfo", path)
    lines = numbered_lines(text)
    hca_type: Dict[str, str] = {}
    hca: Optional[str] = None
    port: Optional[int] = None
    fields: Dict[str, str] = {}
    num_ok = 0

    def close_port() -> None:
        nonlocal port, fields, num_ok
        if hca is None or port is None:
            return
        lanes = _width_lanes(fields.get("active_width", ""))
        per_lane = _number(fields.get("active_speed", ""))
        rate = lanes * per_lane if lanes and per_lane else None
        state = fields.get("state")
        topo.add_nic(
            Nic(
                name=nic_name(hca, port),
                link_layer=fields.get("link_layer"),
                rate_gbps=rate,
                state=_state_word(state) if state else None,
                port=port,
            )
        )
        num_ok += 1
        port, fields = None, {}

    for _, line in lines:
        m = _HCA_ID.match(line)
        if m:
            close_port()
            hca = m.group(1)
            continue
        if hca is None:
            continue
        m = _DEVINFO_PORT.match(line)
        if m:
            close_port()
            port = int(m.group(1))
            continue
        kv = _KV.match(line)
        if not kv:
            if line.strip() and not line.startswith((" ", "\t")):
                close_port()
                hca = None  # the next command's output
            continue
        key, value = kv.group(1).strip(), kv.group(2)
        if port is None:
            if key == "vendor_part_id" and value.isdigit():
                hca_type[hca] = f"MT{value}"
        else:
            fields[key] = value
    close_port()
    if not num_ok:
        raise _no_data("ibv_devinfo", path, lines, "'hca_id: mlx5_0' blocks with 'port: 1'")
    if hca_type:
        topo.facts["hca_type"] = hca_type
    return topo


# -- show_gids -----------------------------------------------------------------------------------


def sniff_show_gids(text: str) -> bool:
    """True for ``show_gids`` output (the ``DEV PORT INDEX GID IPv4 VER DEV`` header)."""
    if "GID" not in text:
        return False
    return any(_GIDS_HEADER.match(ln) for ln in text.splitlines())


def parse_show_gids(text: str, path: str = "<text>") -> Topology:
    """Parse the ``show_gids`` table (Mellanox OFED script).

    Returns:
        NICs with ``netdev`` and ``port``; ``facts["roce_gids"]``: ``{"mlx5_0": [{"index": 3,
        "ver": "v2", "ipv4": "10.99.91.39", "gid": "0000:...", "port": 1, "netdev":
        "ens108np0"}, ...]}`` (``ipv4`` None for link-local GIDs). The v2 + IPv4 index is the
        one ``NCCL_IB_GID_INDEX`` should name for RoCE.

    Raises:
        TopologyParseError: a row that is not ``DEV PORT INDEX GID [IPv4] VER [DEV]``, or no rows.
    """
    topo = _start("show_gids", path)
    lines = numbered_lines(text)
    gids: Dict[str, List[dict]] = {}
    in_table = False
    for line_no, line in lines:
        if _GIDS_HEADER.match(line):
            in_table = True
            continue
        if not in_table:
            continue
        tokens = line.split()
        if not tokens or set(line.strip()) <= set("- \t"):
            continue
        if tokens[0].startswith("n_gids_found") or not re.match(r"^[\w.-]+$", tokens[0]):
            in_table = False
            continue
        if len(tokens) < 5 or not tokens[1].isdigit() or not tokens[2].isdigit():
            raise TopologyParseError(
                f"show_gids row has {len(tokens)} fields; expected 'DEV PORT INDEX GID [IPv4] "
                "VER [DEV]'",
                path=path,
                line=line_no,
            )
        if not _GID.match(tokens[3]):
            raise TopologyParseError(
                f"show_gids row: {tokens[3]!r} is not a GID (8 groups of 4 hex digits)",
                path=path,
                line=line_no,
            )
        rest = tokens[4:]
        ipv4 = rest.pop(0) if rest and re.match(r"^\d+\.\d+\.\d+\.\d+$", rest[0]) else None
        ver = rest.pop(0) if rest and re.match(r"^v\d$", rest[0]) else None
        netdev = rest.pop(0) if rest else None
        hca, port = tokens[0], int(tokens[1])
        gids.setdefault(hca, []).append(
            {
                "index": int(tokens[2]),
                "ver": ver,
                "ipv4": ipv4,
                "gid": tokens[3].lower(),
                "port": port,
                "netdev": netdev,
            }
        )
        topo.add_nic(Nic(name=nic_name(hca, port), port=port, netdev=netdev))
    if not gids:
        raise _no_data("show_gids", path, lines, "rows under the 'DEV PORT INDEX GID' header")
    topo.facts["roce_gids"] = gids
    return topo


# -- /sys/class/infiniband dump ------------------------------------------------------------------


def sniff_ib_sysfs(text: str) -> bool:
    """True for a dump of ``/sys/class/infiniband/*/ports/*/{rate,state,link_layer,phys_state}``."""
    return bool(_SYSFS_SNIFF.search(text))


def parse_ib_sysfs(text: str, path: str = "<text>") -> Topology:
    """Parse a dump of ``/sys/class/infiniband``.

    Two layouts: ``<path>: <value>`` / ``<path>:<value>`` lines (``grep . /sys/class/infiniband/
    */ports/*/*``), and ``==> <path> <==`` headers with the value on the next line (``head``/
    ``tail`` of several files). Attributes read: ``ports/N/{rate,state,phys_state,link_layer}``,
    ``hca_type`` and ``device/numa_node``; ``rate`` ``400 Gb/sec (4X NDR)`` -> 400,
    ``state`` ``4: ACTIVE`` -> ``Active``.

    Raises:
        TopologyParseError: no port attribute found.
    """
    topo = _start("ib-sysfs", path)
    lines = numbered_lines(text)
    ports: Dict[Tuple[str, int], Dict[str, str]] = {}
    hca_attrs: Dict[str, Dict[str, str]] = {}
    pending: Optional[Tuple[str, str, int]] = None  # a `==> path <==` waiting for its value
    for line_no, line in lines:
        m = _SYSFS.match(line.strip())
        if m and m.group("value") is None:
            pending = (m.group("dev"), m.group("attr"), line_no)
            continue
        if m:
            dev, attr, value = m.group("dev"), m.group("attr"), m.group("value")
            pending = None
        elif pending is not None and line.strip():
            dev, attr, _ = pending
            value = line.strip()
            pending = None
        else:
            continue
        value = value.strip()
        pm = re.match(r"^ports/(\d+)/(\w+)$", attr)
        if pm:
            ports.setdefault((dev, int(pm.group(1))), {})[pm.group(2)] = value
        else:
            hca_attrs.setdefault(dev, {})[attr] = value
    if not ports:
        raise _no_data(
            "/sys/class/infiniband",
            path,
            lines,
            "lines like '/sys/class/infiniband/mlx5_0/ports/1/rate: 400 Gb/sec (4X NDR)'",
        )
    hca_type: Dict[str, str] = {}
    phys: Dict[str, str] = {}
    for (dev, port), attrs in sorted(ports.items()):
        name = nic_name(dev, port)
        rate = attrs.get("rate")
        numa = hca_attrs.get(dev, {}).get("device/numa_node")
        topo.add_nic(
            Nic(
                name=name,
                link_layer=attrs.get("link_layer") or None,
                rate_gbps=_number(rate) if rate else None,
                state=_state_word(attrs["state"]) if attrs.get("state") else None,
                numa=int(numa) if numa and re.match(r"^\d+$", numa) else None,
                port=port,
            )
        )
        if attrs.get("phys_state"):
            phys[name] = _state_word(attrs["phys_state"])
    for dev, attrs in hca_attrs.items():
        if attrs.get("hca_type"):
            hca_type[dev] = attrs["hca_type"]
    if hca_type:
        topo.facts["hca_type"] = hca_type
    if phys:
        topo.facts["ib_phys_state"] = phys
    return topo


# -- ibdev2netdev --------------------------------------------------------------------------------


def sniff_ibdev2netdev(text: str) -> bool:
    """True for ``ibdev2netdev`` lines (``mlx5_0 port 1 ==> ens108np0 (Up)``)."""
    if "==>" not in text:
        return False
    return any(_IBDEV2NETDEV.match(ln) for ln in text.splitlines())


def parse_ibdev2netdev(text: str, path: str = "<text>") -> Topology:
    """Parse ``ibdev2netdev``: HCA port -> Linux netdev.

    The ``(Up)``/``(Down)`` is the netdev's state, not the IB port state, so it goes to
    ``facts["netdev_state"]`` (``{"ens108np0": "Up"}``) and ``Nic.state`` is left to ibstat/sysfs.

    Raises:
        TopologyParseError: no ``<hca> port <n> ==> <netdev> (<state>)`` line.
    """
    topo = _start("ibdev2netdev", path)
    lines = numbered_lines(text)
    states: Dict[str, str] = {}
    for _, line in lines:
        m = _IBDEV2NETDEV.match(line)
        if not m:
            continue
        port = int(m.group("port"))
        topo.add_nic(Nic(name=nic_name(m.group("dev"), port), port=port, netdev=m.group("netdev")))
        states[m.group("netdev")] = m.group("state")
    if not states:
        raise _no_data("ibdev2netdev", path, lines, "lines like 'mlx5_0 port 1 ==> ens108np0 (Up)'")
    topo.facts["netdev_state"] = states
    return topo


FORMATS = [
    ("ibv_devinfo", sniff_ibv_devinfo, parse_ibv_devinfo),
    ("show_gids", sniff_show_gids, parse_show_gids),
    ("ibstat", sniff_ibstat, parse_ibstat),
    ("ib-sysfs", sniff_ib_sysfs, parse_ib_sysfs),
    ("ibdev2netdev", sniff_ibdev2netdev, parse_ibdev2netdev),
]
