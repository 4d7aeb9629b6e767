"""Parse ``lspci -nn`` (GPU/NPU/NIC inventory by PCI id) and the nv-fabricmanager log.

``lspci -nn`` prints one line per PCI function::

    0001:00:00.0 3D controller [0302]: NVIDIA Corporation GA100 [A100 SXM4 80GB] [10de:20b2] (rev a1)
    0005:00:00.0 Bridge [0680]: NVIDIA Corporation Device [10de:1af1] (rev a1)

The ``[vendor:device]`` pair is what matters: the marketing name in the middle depends on the age of
the local ``pci.ids`` database (``Device 20b2`` on old ones), while the id says exactly which part is
installed — in particular whether an A100/H100 is the SXM module (NVLink expected) or the PCIe card.
That is the first thing the audit checks (topology-notes §6 row 1).

What the parser produces:

- NVIDIA GPUs (class ``0300`` VGA / ``0302`` 3D controller) as devices ``GPU0, GPU1, ...`` in the
  order lspci lists them (bus order, which is also nvidia-smi's default order), with
  ``pci_bus_id``, ``pci_device_id`` and the model from :data:`NVIDIA_GPU_IDS`;
  ``facts["form_factor"]`` says ``SXM`` or ``PCIe`` per GPU when the id is known.
- Ascend NPUs (``19e5:d100/d500/d801/d802/d803``) as devices ``NPU0, ...`` (vendor ``ascend``).
- NVSwitch bridges counted into ``facts["nvswitch_count"]`` (set whenever the capture shows NVIDIA
  GPUs or switches, so 0 means "lspci saw GPUs and no switch").
- Mellanox (``15b3``) and AWS EFA (``1d0f:efa*``) functions as :class:`Nic` entries named by their
  PCI address (lspci does not know the ``mlx5_N`` name); link layer from the PCI class
  (``0207`` Infiniband controller, ``0200`` Ethernet controller); ``facts["nic_models"]`` gives
  the part (``ConnectX-6 VF``).

The fabric-manager log (``/var/log/fabricmanager.log``) sets ``facts["fabric_manager"]``:
``running`` when it shows a successful start or the daemon serving requests, ``not-running`` when
its last lifecycle message is a failure or exit, ``unknown`` otherwise; error lines go to
``facts["fabric_manager_errors"]``.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

from hetcomm.errors import TopologyParseError, TruncatedCaptureError
from hetcomm.topo.model import Device, Nic, Topology, Vendor
from hetcomm.topo.pci_ids import ASCEND_IDS, NVIDIA_GPU_IDS, NVSWITCH_IDS
from hetcomm.topo.parse._text import numbered_lines, strip_source_header

__all__ = [
    "NVIDIA_GPU_IDS",
    "NVSWITCH_IDS",
    "ASCEND_IDS",
    "MELLANOX_IDS",
    "gpu_model_for_id",
    "normalize_bus_id",
    "sniff_lspci",
    "parse_lspci",
    "sniff_fabricmanager_log",
    "parse_fabricmanager_log",
    "FORMATS",
]

# Mellanox device ids (pci.ids; topology-notes §3.1). Unknown 15b3 parts are still NICs.
MELLANOX_IDS: Dict[str, str] = {
    "1016": "ConnectX-4 Lx VF",
    "1017": "ConnectX-5",
    "1018": "ConnectX-5 VF",
    "101b": "ConnectX-6",
    "101c": "ConnectX-6 VF",
    "101d": "ConnectX-6 Dx",
    "101e": "ConnectX-6 Dx VF",
    "101f": "ConnectX-6 Lx",
    "1021": "ConnectX-7",
    "1023": "ConnectX-8",
    "a2dc": "BlueField-3",
}

_LSPCI_LINE = re.compile(
    r"^(?P<bdf>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+"
    r"(?P<cls>[^\[:]+?)(?:\s+\[(?P<cc>[0-9a-fA-F]{4})\])?:\s+"
    r"(?P<desc>.*?)"
    r"(?:\s+\[(?P<ven>[0-9a-fA-F]{4}):(?P<dev>[0-9a-fA-F]{4})\])?"
    r"(?:\s+\(rev\s+[0-9a-fA-F]+\))?(?:\s+\(prog-if\s+[^)]*\))?\s*$"
)
# A line of lspci -nn output: a bus address, a class with its [code], and [vendor:device].
_SNIFF_NN = re.compile(
    r"(?m)^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]\s+[^\n\[]+\[[0-9a-fA-F]{4}\]:"
    r"[^\n]*\[(?:10de|19e5|15b3|1d0f):[0-9a-fA-F]{4}\]"
)
# Plain lspci (no -nn) names unknown parts "Device d801"; used when the ids are absent.
_PLAIN_DEVICE = re.compile(r"\bDevice\s+([0-9a-fA-F]{4})\b")
_BRACKET_NAME = re.compile(r"\[([^\]]+)\]\s*$")
_VENDOR_WORDS = (
    ("10de", re.compile(r"\bNVIDIA\b", re.IGNORECASE)),
    ("19e5", re.compile(r"\bHuawei\b", re.IGNORECASE)),
    ("15b3", re.compile(r"\bMellanox\b", re.IGNORECASE)),
    ("1d0f", re.compile(r"\bAmazon\b", re.IGNORECASE)),
)


def normalize_bus_id(bus_id: str) -> str:
    """A PCI address in the ``dddd:bb:dd.f`` form, lower case.

    nvidia-smi prints 8-digit domains (``00000000:12:00.0``), lspci omits the domain when it is 0
    (``17:00.0``) and NCCL writes ``0000:0f:00.0``; all three name the same function.
    """
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        return "0000:" + text
    if len(parts) == 3:
        domain = parts[0][-4:] if len(parts[0]) > 4 and set(parts[0][:-4]) <= {"0"} else parts[0]
        return f"{domain.zfill(4)}:{parts[1]}:{parts[2]}"
    return text


def gpu_model_for_id(device_id: str) -> Optional[Tuple[str, str]]:
    """``(model, form_factor)`` for an NVIDIA device id (``"20b2"``, ``"0x20B2"``), else None."""
    key = device_id.lower().replace("0x", "")[-4:]
    return NVIDIA_GPU_IDS.get(key)


def sniff_lspci(text: str) -> bool:
    """True when ``text`` has an ``lspci -nn`` line of an NVIDIA, Ascend, Mellanox or EFA part."""
    text = strip_source_header(text)  # the provenance header is not tool output
    return bool(_SNIFF_NN.search(text))


def _vendor_of(desc: str, ven: Optional[str]) -> Optional[str]:
    if ven:
        return ven.lower()
    for vendor_id, pattern in _VENDOR_WORDS:
        if pattern.search(desc):
            return vendor_id
    return None


_BDF_START = re.compile(r"^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]\b")
_NN_ID = re.compile(r"\[[0-9a-fA-F]{4}:[0-9a-fA-F]{4}\]")


def _check_last_line_complete(lines: List[Tuple[int, str]], path: str) -> None:
    """Raise when the capture's last line is an ``lspci -nn`` record cut short.

    ``lspci -nn`` ends every record with ``[vendor:device]`` (then an optional ``(rev ..)``); a
    last line that starts with a bus address but lacks the id while the other records have it
    was cut mid-line (``head -c``, a full disk): silently skipping it would count one device
    fewer. A capture cut at a line boundary cannot be told from a shorter listing.
    """
    content = [(no, line) for no, line in lines if line.strip()]
    if len(content) < 2:
        return
    last_no, last = content[-1]
    if not _BDF_START.match(last):
        return
    others = [line for _, line in content[:-1] if _BDF_START.match(line)]
    nn = sum(1 for line in others if _NN_ID.search(line))
    m = _LSPCI_LINE.match(last)
    # In -nn output the id must be the record's own [vendor:device] group: "[15b3:1016] (" or
    # "(rev 8" after it means the line was cut after the id.
    complete = m is not None and (not nn or m.group("ven") is not None)
    if not complete and others and (nn == len(others) or m is None):
        raise TruncatedCaptureError(
            f"the last lspci line ends mid-record ({last.strip()[:60]!r} has no "
            f"[vendor:device] id, which every other line has): the capture is cut short, and "
            f"the devices after it are missing. Capture the whole output again: lspci -nn > lspci.txt",
            path=path,
            line=last_no,
        )


def parse_lspci(text: str, path: str = "<text>") -> Topology:
    """Parse ``lspci -nn`` output (plain ``lspci`` lines are read too, with less detail).

    Args:
        text: the captured output; lines of other tools and indented ``-v`` detail lines are
            skipped.
        path: file name used in errors and ``facts["sources"]``.

    Returns:
        A :class:`Topology` with GPUs (``GPU0..``), Ascend NPUs (``NPU0..``), Mellanox/EFA NICs
        (named by PCI address) and ``facts["nvswitch_count"]``; no links (lspci has no paths).

    Raises:
        TopologyParseError: ``text`` is empty or holds no PCI line of a known vendor.
    """
    lines = numbered_lines(text)
    if not any(line.strip() for _, line in lines):
        raise TopologyParseError(
            "empty input; expected the output of `lspci -nn`", path=path, line=1
        )
    _check_last_line_complete(lines, path)
    topo = Topology()
    form_factor: Dict[str, str] = {}
    nic_models: Dict[str, str] = {}
    num_gpus = num_npus = num_switches = 0
    saw_nvidia = False
    for _, line in lines:
        if not line or line[0].isspace():
            continue  # `lspci -v` detail lines are indented
        m = _LSPCI_LINE.match(line)
        if m is None:
            continue
        desc = m.group("desc")
        vendor = _vendor_of(desc, m.group("ven"))
        device_id = (m.group("dev") or "").lower()
        if not device_id:
            plain = _PLAIN_DEVICE.search(desc)
            device_id = plain.group(1).lower() if plain else ""
        class_code = (m.group("cc") or "").lower()
        class_name = m.group("cls").strip().lower()
        bdf = normalize_bus_id(m.group("bdf"))
        pci_id = f"{vendor}:{device_id}" if vendor and device_id else None
        if vendor == "10de":
            saw_nvidia = True
            if (
                device_id in NVSWITCH_IDS
                or class_code == "0680"
                or (not class_code and class_name == "bridge")
            ):
                # NVIDIA's only "Bridge: other" functions are NVSwitches; unknown future ids count.
                num_switches += 1
                continue
            is_gpu = class_code in ("0300", "0302", "0380") or class_name in (
                "3d controller",
                "vga compatible controller",
            )
            if not is_gpu:
                continue  # the HD-audio / USB functions of GeForce cards
            known = gpu_model_for_id(device_id) if device_id else None
            if known:
                model, form = known
            else:
                bracket = _BRACKET_NAME.search(desc)
                model, form = (bracket.group(1) if bracket else None), None
            name = f"GPU{num_gpus}"
            topo.add_device(
                Device(
                    name=name,
                    vendor=Vendor.NVIDIA.value,
                    model=model,
                    index=num_gpus,
                    pci_bus_id=bdf,
                    pci_device_id=pci_id,
                )
            )
            if form:
                form_factor[name] = form
            num_gpus += 1
        elif vendor == "19e5":
            # Huawei also makes NICs and RAID cards; only the Ascend ids (class 1200) are NPUs.
            if device_id not in ASCEND_IDS:
                continue
            name = f"NPU{num_npus}"
            topo.add_device(
                Device(
                    name=name,
                    vendor=Vendor.ASCEND.value,
                    model=ASCEND_IDS[device_id],
                    index=num_npus,
                    pci_bus_id=bdf,
                    pci_device_id=pci_id,
                )
            )
            num_npus += 1
        elif vendor == "15b3" or (vendor == "1d0f" and device_id.startswith("efa")):
            if vendor == "15b3" and class_code not in ("0200", "0207", ""):
                continue  # BlueField's management/DMA functions are not ports
            if vendor == "1d0f":
                link_layer, part = None, "EFA"
            else:
                is_ib = class_code == "0207" or "infiniband" in class_name
                link_layer = "InfiniBand" if is_ib else "Ethernet"
                part = MELLANOX_IDS.get(device_id, "Mellanox")
            topo.add_nic(Nic(name=bdf, link_layer=link_layer, pci_bus_id=bdf))
            nic_models[bdf] = f"{part} ({pci_id})" if pci_id else part
    if num_gpus == 0 and num_npus == 0 and num_switches == 0 and not topo.nics:
        raise TopologyParseError(
            "no lspci line of an NVIDIA, Huawei Ascend, Mellanox or EFA device found; expected "
            "`lspci -nn` output such as '17:00.0 3D controller [0302]: NVIDIA ... [10de:20b2]'",
            path=path,
            line=lines[0][0] if lines else 1,
        )
    if saw_nvidia:
        topo.facts["nvswitch_count"] = num_switches
    if form_factor:
        topo.facts["form_factor"] = form_factor
    if nic_models:
        topo.facts["nic_models"] = nic_models
    topo.facts["formats"] = ["lspci"]
    topo.facts["sources"] = [path]
    return topo


# -- nv-fabricmanager log ------------------------------------------------------------------------

# Every fabric-manager log line starts "[Feb 25 2025 13:59:45] [INFO] [tid 1803] ...".
_FM_LINE = re.compile(
    r"^\[(?P<when>[A-Z][a-z]{2} +\d{1,2} \d{4} [\d:]+)\] \[(?P<level>[A-Z]+)\] "
    r"\[tid \d+\] (?P<msg>.*)$"
)
# A successful start (FM prints these once GPUs and switches are programmed) or evidence of the
# daemon serving GPU requests (inband/multicast handling only happens while it runs).
_FM_RUNNING = re.compile(
    r"successfully configured all the available GPUs and NVSwitches|"
    r"fabric manager .*is running|started fabric manager|"
    r"successfully setup multicast team|sending inband response",
    re.IGNORECASE,
)
_FM_STOPPED = re.compile(
    r"fabric manager .*(exit|exiting|terminat|stopp)|"
    r"failed to (start|initiali[sz]e)|fabric manager.*(failed|aborting)|"
    r"received (sigterm|sigint|signal)",
    re.IGNORECASE,
)
_FM_SNIFF = re.compile(r"(?m)^\[[A-Z][a-z]{2} +\d{1,2} \d{4} [\d:]+\] \[[A-Z]+\] \[tid \d+\] ")
_FM_WORDS = re.compile(r"NVSwitch|fabric ?manager|multicast|inband|NVLink", re.IGNORECASE)


def sniff_fabricmanager_log(text: str) -> bool:
    """True for an nv-fabricmanager log (``[date] [LEVEL] [tid N] ...`` lines about the fabric)."""
    text = strip_source_header(text)  # the provenance header is not tool output
    return bool(_FM_SNIFF.search(text)) and bool(_FM_WORDS.search(text))


def parse_fabricmanager_log(text: str, path: str = "<text>") -> Topology:
    """Read the fabric manager's state out of its log.

    Args:
        text: contents of ``/var/log/fabricmanager.log`` (or a part of it).
        path: file name for errors and ``facts["sources"]``.

    Returns:
        A :class:`Topology` with no devices and ``facts["fabric_manager"]`` set to ``running``,
        ``not-running`` or ``unknown`` (the last lifecycle evidence wins) and
        ``facts["fabric_manager_errors"]`` (``"path:line: message"`` for each ERROR/FATAL line).

    Raises:
        TopologyParseError: no fabric-manager log line in ``text``.
    """
    lines = numbered_lines(text)
    state = "unknown"
    errors: List[str] = []
    num_lines = 0
    for lineno, line in lines:
        m = _FM_LINE.match(line.strip())
        if m is None:
            continue
        num_lines += 1
        msg = m.group("msg")
        if _FM_STOPPED.search(msg):
            state = "not-running"
        elif _FM_RUNNING.search(msg):
            state = "running"
        if m.group("level") in ("ERROR", "FATAL", "CRITICAL"):
            errors.append(f"{path}:{lineno}: {msg.strip()}")
    if num_lines == 0:
        raise TopologyParseError(
            "no fabric-manager log line found; expected lines like "
            "'[Feb 25 2025 13:59:45] [INFO] [tid 1803] ...' from /var/log/fabricmanager.log",
            path=path,
            line=lines[0][0] if lines else 1,
        )
    topo = Topology()
    topo.facts["fabric_manager"] = state
    topo.facts["fabric_manager_errors"] = errors
    topo.facts["formats"] = ["fabricmanager-log"]
    topo.facts["sources"] = [path]
    return topo


FORMATS: List[Tuple[str, Callable[[str], bool], Callable[..., Topology]]] = [
    ("lspci", sniff_lspci, parse_lspci),
    ("fabricmanager-log", sniff_fabricmanager_log, parse_fabricmanager_log),
]
