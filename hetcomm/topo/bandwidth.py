"""Nominal per-direction bandwidths, in Gb/s, by device model and link class.

These are datasheet numbers, not measurements: the cost model starts from them and
``hetcomm bench`` output can calibrate them. Every number carries its source. Where a source
quotes GB/s, the value here is ×8 (Gb/s); "bidir" figures are halved to one direction.
"""

from __future__ import annotations

import re
from typing import Optional

from hetcomm.topo.model import LinkClass

__all__ = [
    "NVLINK_GBPS_PER_LINK",
    "nvlink_links_for_model",
    "nominal_gbps",
    "canonical_model",
    "vendor_of_model",
    "is_sxm_model",
]

# One NVLink (NVLink2/3/4) moves 25 GB/s per direction: `nvidia-smi nvlink -s` prints
# "Link N: 25 GB/s" on A100-SXM4 (gpud testdata, fixture nvsmi_nvlink_status_a100_sxm4_8gpu).
NVLINK_GBPS_PER_LINK = 25 * 8
# NVLink5 (Blackwell) doubles the per-link rate: 18 links x 50 GB/s = 900 GB/s/dir (NVIDIA B200
# datasheet; NVML_NVLINK_VERSION_5_0).
NVLINK5_GBPS_PER_LINK = 50 * 8

# Links per GPU for SXM parts (topology-notes §5.1 and §6 row 1):
#   V100 SXM2: 6 links (DGX-1 hybrid cube mesh: NV1/NV2 to four peers, 6 in total).
#   A100 SXM4: NV12 = 12 x 25 = 300 GB/s/dir (600 bidir), DGX A100 fixture shows NV12.
#   A800/H800 SXM: NV8 = 8 x 25 = 200 GB/s/dir (export cap), H800 fixture shows NV8.
#   H100/H200/H20 SXM: NV18 = 18 x 25 = 450 GB/s/dir, H100 fixture shows NV18.
#   B200/B300: NV18 at 50 GB/s per link.
_NVLINK_LINKS = {
    # V100 SXM2: 6 NVLink2 links x 25 GB/s/dir (NVIDIA V100 datasheet: "NVLink 300 GB/s" bidir).
    "V100": 6,
    "A100": 12,
    "A800": 8,
    "H800": 8,
    "H100": 18,
    "H200": 18,
    "H20": 18,
    "B200": 18,
    "B300": 18,
}

# HCCS on Ascend 910B: 56 GB/s per NPU pair, full mesh of 8 (ArthurChiao, gpu-advanced-notes-2
# and gpu-data-sheets). 910A: HCCS ring of 4, no public number (hiascend dl_affinity) -> we use
# the 910B figure as an optimistic placeholder and say so in reports.
HCCS_GBPS_910B = 56 * 8

# PCIe x16 per direction: Gen3 ~16 GB/s (NCCL models 12: `PCI_BW 12.0 // PCI Gen3 x16` in
# src/graph/topo.h), Gen4 ~32 GB/s, Gen5 ~64 GB/s (ArthurChiao gpu-data-sheets).
PCIE_GBPS = {3: 16 * 8, 4: 32 * 8, 5: 64 * 8}
# Which PCIe generation a model's host link runs at (NVIDIA/Huawei datasheets): A100/A800 and
# 910B are Gen4, Hopper/L40S/Blackwell are Gen5, V100 is Gen3.
_PCIE_GEN = {
    "V100": 3,
    "A100": 4,
    "A800": 4,
    "A10": 4,
    "910A": 4,
    "910B": 4,
    "H100": 5,
    "H800": 5,
    "H200": 5,
    "H20": 5,
    "L40S": 4,
    "B200": 5,
    "B300": 5,
}
# Crossing sockets caps PCIe traffic at the CPU interconnect: NCCL's SYS model uses 22 GB/s for
# Sapphire Rapids and 24 GB/s for Zen3/4 (src/graph/topo.h); we take 22 GB/s.
SYS_GBPS = 22 * 8
# NCCL's SHM transport bounces through host memory: roughly half the PCIe rate (topology-notes
# §8.1 "HOST_SHM ~PCIe via host memory, roughly halved").
SHM_FRACTION = 0.5


def canonical_model(model: Optional[str]) -> Optional[str]:
    """The family key of a model name: ``"NVIDIA A100-SXM4-80GB"`` -> ``"A100"``.

    Recognises NVIDIA data-center names (A100, A800, H100, H800, H200, H20, B200, B300, V100,
    L40S, A10) and Ascend (``910B3`` -> ``910B``, ``Ascend910A`` -> ``910A``).
    """
    if not model:
        return None
    m = model.upper().replace("NVIDIA", "").replace("ASCEND", "").strip()
    if re.search(r"910_?93|910C", m):  # Ascend 910_93 (A3 generation) is marketed as 910C
        return "910C"
    match = re.search(r"910([A-C])?", m)
    if match:  # a bare "910" is the first generation, sold as 910A
        return "910" + (match.group(1) or "A")
    for key in ("H800", "H200", "H100", "H20", "A800", "A100", "B300", "B200", "V100", "L40S", "A10"):
        if re.search(rf"(^|[^A-Z0-9]){key}($|[^0-9])", m):
            return key
    return None


def vendor_of_model(model: Optional[str]) -> str:
    """``ascend`` for 910/310 parts, ``cpu`` for ``cpu``/None, else ``nvidia``."""
    if model is None or model.strip().lower() in ("", "cpu"):
        return "cpu"
    fam = canonical_model(model)
    if fam and fam.startswith("910") or re.search(r"\b310", model):
        return "ascend"
    return "nvidia"


def is_sxm_model(model: Optional[str]) -> bool:
    """True for models sold as SXM (NVLink expected): A100/A800/H100/H800/H20/H200/B200/B300.

    A name that says ``PCIE`` is never SXM, whatever its family.
    """
    if not model or "PCIE" in model.upper():
        return False
    return canonical_model(model) in _NVLINK_LINKS


def nvlink_links_for_model(model: Optional[str]) -> Optional[int]:
    """How many NVLinks an SXM part of this model has (A100 -> 12, H800 -> 8), else None."""
    if not is_sxm_model(model):
        return None
    return _NVLINK_LINKS[canonical_model(model)]


def nominal_gbps(
    link_class: LinkClass,
    model: Optional[str] = None,
    *,
    num_nvlinks: Optional[int] = None,
    nic_gbps: Optional[float] = None,
) -> Optional[float]:
    """Nominal per-direction bandwidth in Gb/s of one link, or None when nothing applies.

    Args:
        link_class: the class of the link.
        model: the device model at the endpoints (for NVLink/HCCS/PCIe generation).
        num_nvlinks: bonded NVLink count from ``NV#`` (overrides the model's count).
        nic_gbps: port rate for network classes (the NIC's own rate).
    """
    fam = canonical_model(model)
    if link_class == LinkClass.NVLINK:
        links = num_nvlinks or (_NVLINK_LINKS.get(fam) if fam else None)
        if links is None:
            return None
        per_link = NVLINK5_GBPS_PER_LINK if fam in ("B200", "B300") else NVLINK_GBPS_PER_LINK
        return float(links * per_link)
    if link_class == LinkClass.HCCS:
        return float(HCCS_GBPS_910B)
    if link_class.is_pcie or link_class in (LinkClass.P2P, LinkClass.SHM):
        gen = _PCIE_GEN.get(fam or "", 4)
        pcie = float(PCIE_GBPS[gen])
        if link_class == LinkClass.PCIE_SYS:
            return min(pcie, float(SYS_GBPS))
        if link_class == LinkClass.SHM:
            return pcie * SHM_FRACTION
        return pcie
    if link_class.is_network or link_class == LinkClass.HOST_BRIDGE:
        return float(nic_gbps) if nic_gbps is not None else None
    return None
