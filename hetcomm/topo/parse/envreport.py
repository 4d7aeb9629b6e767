"""Environment reports: the GPU model lines of ``python -m sglang.check_env`` and
``python -m torch.utils.collect_env`` (also vLLM's ``collect_env``, which prints the same).

These reports are what issue threads carry most often, and they are usually the only place that
names the GPUs: the ``nvidia-smi topo -m`` matrix they embed (parsed by ``nvsmi``, as the
dispatcher runs every matching format on a file) has links but no models. Two spellings::

    GPU 0,1,2,3,4,5,6,7: NVIDIA H800                      # sglang.check_env
    GPU models and configuration:                           # torch collect_env
    GPU 0: NVIDIA A100-SXM4-80GB
    GPU 1: NVIDIA A100-SXM4-80GB

The result is one device per GPU index (``GPU<i>``, vendor nvidia, the model without the
``NVIDIA`` prefix, as NVML names it), merged with the matrix's devices of the same name.
"""

from __future__ import annotations

import re

from hetcomm.errors import TopologyParseError
from hetcomm.topo.model import Device, Topology
from hetcomm.topo.parse._text import numbered_lines

__all__ = ["FORMATS", "sniff_envreport", "parse_envreport"]

# "GPU 0,1,2,3: NVIDIA H800" / "GPU 0: NVIDIA A100-SXM4-80GB" / "GPU 0: Tesla V100-SXM2-32GB"
_GPU_LINE = re.compile(r"^\s*GPU\s+(\d+(?:\s*,\s*\d+)*)\s*:\s*(.+?)\s*$")
_MARKERS = re.compile(r"^(CUDA available:|GPU models and configuration:|Is CUDA available:|CUDA_HOME:|Nvidia driver version:)", re.MULTILINE)
# Lines that also start "GPU <n>:" but are not model names.
_NOT_MODEL = re.compile(r"Compute Capability|^\s*$|^\d+(\.\d+)?$", re.IGNORECASE)


def sniff_envreport(text: str) -> bool:
    """True when ``text`` holds an environment report with at least one GPU model line."""
    if not _MARKERS.search(text):
        return False
    return any(_GPU_LINE.match(line) and not _NOT_MODEL.search(_GPU_LINE.match(line).group(2)) for line in text.splitlines())


def parse_envreport(text: str, path: str = "<text>") -> Topology:
    """The GPUs an environment report names.

    Raises:
        TopologyParseError: no GPU model line (a report from a machine without CUDA).
    """
    topo = Topology()
    for lineno, line in numbered_lines(text):
        match = _GPU_LINE.match(line)
        if not match or _NOT_MODEL.search(match.group(2)):
            continue
        model = re.sub(r"^(NVIDIA|Tesla)\s+", "", match.group(2).strip()).strip()
        if not model or model.lower().startswith(("n/a", "none")):
            continue
        for idx in match.group(1).split(","):
            i = int(idx)
            topo.add_device(Device(name=f"GPU{i}", vendor="nvidia", model=model, index=i))
    if not topo.devices:
        raise TopologyParseError(
            "environment report names no GPU ('GPU <n>: <model>' lines); capture it on a machine "
            "where CUDA sees the GPUs",
            path=path,
        )
    topo.facts["sources"] = [path]
    topo.facts["formats"] = ["env-report"]
    return topo


FORMATS = [("env-report", sniff_envreport, parse_envreport)]
