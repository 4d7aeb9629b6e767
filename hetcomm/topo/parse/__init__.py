"""Parse captured tool output into a :class:`~hetcomm.topo.model.Topology`, whatever the tool.

One entry point for every format hetcomm reads (``nvidia-smi topo -m``, ``npu-smi info -t topo``,
``ibstat``, NCCL logs, ...)::

    from hetcomm.topo.parse import parse_file
    topo = parse_file("node7-topo.txt")          # format detected from the content
    topo = parse_file("ibstat.txt", fmt="ibstat")  # or named

**Files holding several tools' outputs.** People paste whatever they ran into one file (the
H100 fixture has ``ip -br a``, ``ibdev2netdev`` and ``nvidia-smi topo -m``; the 910A fixture has
``npu-smi``, ``lspci`` and ``hccn_tool``). The dispatcher therefore runs *every* format whose
sniffer matches the text and merges the results with :meth:`Topology.merge`, in the priority
order of :data:`FORMAT_NAMES` (for links, the first format to report a pair wins). Each parser
skips the lines that are not its own. When one matched format fails to parse but another
succeeds, the failure is kept as a ``facts["parse_warnings"]`` entry instead of an exception (a
sniffer can match a stray line of another tool); when every matched format fails, the first
error is raised. A :class:`~hetcomm.errors.TruncatedCaptureError` (a capture that ends inside a
record: a matrix without its last rows, an ``nvlink -s`` block or ``lspci`` line cut short) is
always raised, whatever else parsed.

Format modules are imported lazily, on first use; one that fails to import raises (they are
all ours: a missing one is a bug, never a format silently unknown). Every module follows the
parser contract: ``FORMATS = [(name, sniff_fn, parse_fn), ...]``, most specific first.

**Prefixes.** Launcher and log prefixes (``srun -l``'s ``N: ``, OpenMPI's ``[r,c]<stdout>:``,
torchrun's ``[rank0]:``, RFC 3339 / Kubernetes timestamps, pdsh host tags) are stripped before
any format is recognised (:mod:`hetcomm.topo.parse.prefixes`); ``facts["line_prefixes"]`` names
the families removed.
"""

from __future__ import annotations

import difflib
import importlib
import warnings
import zlib
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from hetcomm._input import CAPTURE_CAP_ENV, capture_cap, decode_text, read_bounded
from hetcomm.errors import TopologyParseError, TruncatedCaptureError, UsageError
from hetcomm.topo.model import Topology
from hetcomm.topo.parse._text import numbered_lines, strip_source_header
from hetcomm.topo.parse.prefixes import strip_prefixes

__all__ = [
    "FORMAT_NAMES",
    "MODULES",
    "detect_format",
    "detect_formats",
    "format_tools",
    "load_errors",
    "parse_file",
    "parse_files",
    "parse_text",
]

#: Format modules in priority order (most specific first): an nccl-tests run with NCCL_DEBUG=INFO
#: is "nccl-tests" before "nccl-log"; a topo matrix file with ibdev2netdev lines is "nvsmi-topo"
#: before "ibdev2netdev"; Ascend before NVIDIA so that an NPU matrix is never read as a GPU one.
MODULES: Tuple[str, ...] = (
    "nccl_xml",
    "nccl_tests",
    "nccl_log",
    "npusmi",
    "nvsmi",
    "lspci",
    "rdma",
    "lsmod",
    "hccn",
    "envreport",
)

# The command behind each format, for error messages and `hetcomm topo --help`.
_TOOLS: Dict[str, str] = {
    "nccl-xml": "an NCCL topology XML (NCCL_TOPO_DUMP_FILE)",
    "nccl-tests": "nccl-tests (alltoall_perf, all_reduce_perf, ...)",
    "nccl-log": "an NCCL_DEBUG=INFO log",
    "npu-smi-topo": "npu-smi info -t topo",
    "npu-smi-info": "npu-smi info",
    "npu-smi-board": "npu-smi info -t board / -m",
    "lspci-ascend": "lspci (Huawei accelerators)",
    "nvsmi-topo": "nvidia-smi topo -m",
    "nvsmi-topo-mp": "nvidia-smi topo -mp",
    "nvsmi-topo-p2p": "nvidia-smi topo -p2p",
    "nvsmi-nvlink": "nvidia-smi nvlink -s",
    "nvsmi": "nvidia-smi",
    "lspci": "lspci -nn",
    "fabricmanager-log": "the nv-fabricmanager log",
    "ibv_devinfo": "ibv_devinfo",
    "show_gids": "show_gids",
    "ibstat": "ibstat",
    "ib-sysfs": "a /sys/class/infiniband dump",
    "ibdev2netdev": "ibdev2netdev",
    "lsmod": "lsmod",
    "hccn_tool": "hccn_tool",
    "env-report": "python -m sglang.check_env / torch.utils.collect_env (GPU model lines)",
}

Format = Tuple[str, Callable[[str], bool], Callable[..., Topology]]

_registry: Optional[List[Format]] = None
_load_errors: Dict[str, str] = {}


def _formats() -> List[Format]:
    """Every known format, in priority order (modules imported on first use)."""
    global _registry
    if _registry is not None:
        return _registry
    formats: List[Format] = []
    seen: Dict[str, str] = {}
    for module_name in MODULES:
        full = f"{__name__}.{module_name}"
        # Our own modules: one that fails to import is a bug to see, never a silent gap.
        module = importlib.import_module(full)
        for entry in module.FORMATS:
            name, sniff, parse = entry
            if name in seen:
                warnings.warn(
                    f"hetcomm.topo.parse: format {name!r} defined by both {seen[name]} and "
                    f"{module_name}; using {seen[name]}'s",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            seen[name] = module_name
            formats.append((name, sniff, parse))
    _registry = formats
    return formats


def load_errors() -> Dict[str, str]:
    """Always empty: a format module that cannot be imported now raises (kept for callers)."""
    _formats()
    return dict(_load_errors)


def format_tools() -> Dict[str, str]:
    """Format name -> the command whose output it is, for every known format (priority order)."""
    return {name: _TOOLS.get(name, name) for name, _, _ in _formats()}


def __getattr__(name: str):
    # FORMAT_NAMES is computed on first access so that importing this package imports no parser.
    if name == "FORMAT_NAMES":
        return tuple(n for n, _, _ in _formats())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _first_line(text: str) -> int:
    """Line number of the first non-blank line after any provenance header (1 if none)."""
    for line_no, line in numbered_lines(text):
        if line.strip():
            return line_no
    return 1


def _is_empty(text: str) -> bool:
    return not any(line.strip() for _, line in numbered_lines(text))


def _expected() -> str:
    tools = list(dict.fromkeys(format_tools().values()))
    return ", ".join(tools)


def detect_formats(text: str, path: str = "<text>") -> List[str]:
    """Every format whose sniffer recognises ``text``, in priority order.

    Raises:
        TopologyParseError: ``text`` is empty (blank, or only a provenance header) or no format
            recognises it.
    """
    if _is_empty(text):
        raise TopologyParseError(
            "file is empty: expected the captured output of a topology tool", path=path, line=1
        )
    # Sniffers see tool output only: a provenance header may quote another tool's command, and
    # launcher prefixes are not part of any tool's output.
    content = strip_source_header(strip_prefixes(text)[0])
    found = []
    for name, sniff, _ in _formats():
        try:
            if sniff(content):
                found.append(name)
        except Exception as e:  # a broken sniffer must not hide the other formats
            warnings.warn(
                f"hetcomm.topo.parse: sniffer of {name!r} failed: {e!r}",
                RuntimeWarning,
                stacklevel=2,
            )
    if not found:
        raise TopologyParseError(
            f"could not recognise the format; expected output of {_expected()}. Name the "
            "format with fmt=/--format if it is one of these",
            path=path,
            line=_first_line(text),
        )
    return found


def detect_format(text: str, path: str = "<text>") -> str:
    """The highest-priority format that recognises ``text`` (see :func:`detect_formats`)."""
    return detect_formats(text, path)[0]


def _resolve(fmt: Union[str, Sequence[str]]) -> List[str]:
    names = [f.strip() for f in fmt.split(",")] if isinstance(fmt, str) else list(fmt)
    known = [n for n, _, _ in _formats()]
    for n in names:
        if n not in known:
            close = difflib.get_close_matches(n, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"unknown input format {n!r}{hint}; known formats: {', '.join(known)}")
    return names


def parse_text(
    text: str, path: str = "<text>", fmt: Union[None, str, Sequence[str]] = None
) -> Topology:
    """Parse captured tool output.

    Args:
        text: the output, as text (a provenance header line ``# source: ...`` is skipped).
        path: where it came from, for error messages and ``facts["sources"]``.
        fmt: a format name from :data:`FORMAT_NAMES`, several (a list or ``"a,b"``), or None /
            ``"auto"`` to run every format that recognises the text.

    Returns:
        The merged :class:`Topology`; ``facts["formats"]`` lists the formats that parsed and
        ``facts["sources"]`` is ``[path]``.

    Raises:
        TopologyParseError: empty or unrecognised text, or (every) matching parser failed; the
            message names the file and line.
        UsageError: ``fmt`` names an unknown format.
    """
    # Launcher and log prefixes (srun -l, mpirun --tag-output, torchrun, kubectl timestamps)
    # go before any format is recognised, so that every format reads prefixed captures.
    text, prefixes = strip_prefixes(text)
    if fmt is None or fmt == "auto":
        names = detect_formats(text, path)
    else:
        names = _resolve(fmt)
        if _is_empty(text):
            raise TopologyParseError(
                f"file is empty: expected the output of {format_tools()[names[0]]}",
                path=path,
                line=1,
            )
    by_name = {n: p for n, _, p in _formats()}
    merged = Topology()
    failures: List[Tuple[str, TopologyParseError]] = []
    parsed: List[str] = []
    for name in names:
        try:
            part = by_name[name](text, path)
        except TopologyParseError as e:
            failures.append((name, e))
            continue
        except Exception as e:  # a parser bug: still report file and format, keep the cause
            err = TopologyParseError(
                f"the {name} parser failed unexpectedly ({type(e).__name__}: {e}); this is a "
                "hetcomm bug, please report it with this file",
                path=path,
            )
            err.__cause__ = e
            failures.append((name, err))
            continue
        merged.merge(part)
        parsed.append(name)
    if not parsed:
        raise failures[0][1]
    for _, err in failures:
        # A record cut short is never a warning: the other formats' results would be read as
        # the whole machine (GPUs without their links, a matrix without its last rows).
        if isinstance(err, TruncatedCaptureError):
            raise err
    for name, err in failures:
        merged.facts.setdefault("parse_warnings", []).append(
            f"{err} (format {name} recognised the text but could not parse it; the other "
            f"formats' results are kept)"
        )
    # The detected formats first, in priority order; a format one parser reports on its own
    # (the topo -m parser also reads a -p2p matrix in the same file) after them.
    merged.facts["formats"] = list(dict.fromkeys(parsed + merged.facts.get("formats", [])))
    merged.facts["sources"] = list(dict.fromkeys(merged.facts.get("sources", []) + [path]))
    if prefixes:
        merged.facts["line_prefixes"] = list(
            dict.fromkeys(merged.facts.get("line_prefixes", []) + prefixes)
        )
    _join_ascend_pci(merged)
    join_ascend_chips(merged)
    return merged


def join_ascend_chips(topo: Topology) -> None:
    """See :func:`hetcomm.topo.parse.npusmi.join_ascend_chips` (imported on use)."""
    from hetcomm.topo.parse.npusmi import join_ascend_chips as join

    join(topo)


def _join_ascend_pci(topo: Topology) -> None:
    """Give npu-smi's NPUs the PCI ids of the ``lspci`` lines captured in the same file.

    Matched by bus address; when every Huawei accelerator in the capture has the same device id
    (a node of one NPU model), NPUs without an address get it too.
    """
    entries = topo.facts.get("ascend_pci")
    if not entries:
        return
    by_bus = {e["pci_bus_id"]: e for e in entries}
    ids = {e["pci_device_id"] for e in entries}
    for d in topo.devices:
        if d.vendor != "ascend":
            continue
        e = by_bus.get(d.pci_bus_id or "")
        if e is None and len(ids) == 1:
            e = entries[0]
        if e is None:
            continue
        d.pci_device_id = d.pci_device_id or e["pci_device_id"]
        d.model = d.model or e["model"]


def _gunzip(data: bytes, path: str, limit: int) -> bytes:
    """Decompress a gzip capture, refusing output beyond ``limit`` (a gzip bomb stops there)."""
    out = bytearray()
    stream = zlib.decompressobj(wbits=31)  # gzip framing; one member (what `gzip` writes)
    try:
        while data:
            out += stream.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise TopologyParseError(_too_big(limit, "decompressed capture"), path=path)
            data = stream.unconsumed_tail
            if stream.eof:
                break
    except zlib.error as e:
        raise TopologyParseError(f"corrupt gzip file ({e})", path=path) from None
    if not stream.eof:
        raise TopologyParseError("corrupt gzip file (it ends early: truncated download or copy?)", path=path)
    return bytes(out)


_CAP_HINT = (
    " from one input; keep only the tool's output (e.g. grep 'NCCL INFO' for a log, or one "
    f"rank's log) or raise the cap, e.g. {CAPTURE_CAP_ENV}=64M"
)


def _too_big(limit: int, what: str) -> str:
    from hetcomm.units import format_bytes

    return f"{what} is larger than the {format_bytes(limit)} hetcomm reads{_CAP_HINT}"


def _decode(data: bytes, path: str, limit: Optional[int] = None) -> str:
    """Bytes of a capture as text: UTF-8 (with or without BOM) or UTF-16 with a BOM; a gzip
    file (``nccl.log.gz``) is decompressed first, to at most ``limit`` bytes."""
    if data.startswith(b"\x1f\x8b"):
        data = _gunzip(data, path, capture_cap() if limit is None else limit)
    return decode_text(
        data,
        path,
        TopologyParseError,
        convert_hint="convert the capture first, e.g. 'iconv -f GBK -t UTF-8 in.txt > out.txt'",
    )


def parse_file(path: str, fmt: Union[None, str, Sequence[str]] = None) -> Topology:
    """Read ``path`` (``-`` for standard input; gzip is decompressed) and :func:`parse_text` it.

    At most ``$HETCOMM_MAX_INPUT_BYTES`` (default 16 MiB) is read, before and after gzip
    decompression; devices and sockets (``/dev/zero``) are refused, FIFOs and stdin read up to
    the cap (see ``docs/INPUT_FORMATS.md``).

    Raises:
        TopologyParseError: the file cannot be read, is not a regular file or FIFO, is larger
            than the cap, is binary or not UTF-8/UTF-16 text, or does not parse (see
            :func:`parse_text`).
        UsageError: ``fmt`` names an unknown format.
        SettingError: ``$HETCOMM_MAX_INPUT_BYTES`` is not a size (read through hetcomm.settings).
    """
    limit = capture_cap()
    data = read_bounded(path, limit=limit, error=TopologyParseError, what="capture", hint=_CAP_HINT)
    shown = "<stdin>" if path == "-" else path
    return parse_text(_decode(data, shown, limit), path=shown, fmt=fmt)


def parse_files(paths: Iterable[str], fmt: Union[None, str, Sequence[str]] = None) -> Topology:
    """Parse several captures (e.g. ``topo -m``, ``ibstat`` and ``lsmod`` of one node) into one
    :class:`Topology`, merged in the order given."""
    merged = Topology()
    for path in paths:
        merged.merge(parse_file(path, fmt=fmt))
    join_ascend_chips(merged)
    return merged
