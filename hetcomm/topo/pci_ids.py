"""PCI ids of the accelerators and switches hetcomm recognises (one table, used by the lspci
parser, the live sysfs probe and the audit).

Ids come from pci.ids (github.com/pciutils/pciids @c1c1254) as collected in
``topology-notes`` §6 row 1 and §2.3.
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["NVIDIA_GPU_IDS", "NVSWITCH_IDS", "ASCEND_IDS", "PCI_VENDOR_NVIDIA", "PCI_VENDOR_HUAWEI"]

PCI_VENDOR_NVIDIA = "10de"
PCI_VENDOR_HUAWEI = "19e5"

# NVIDIA device id -> (model, form factor). Names follow NVML's spelling where it has one
# (``A100-SXM4-80GB``, ``A100-PCIE-40GB``) so that bandwidth.canonical_model / is_sxm_model read
# them. Ids from pci.ids (github.com/pciutils/pciids @c1c1254), as collected in topology-notes §6
# row 1; that note warns that third-party docs mislabel 20b0 and 20b5, so only pci.ids is trusted.
NVIDIA_GPU_IDS: Dict[str, Tuple[str, str]] = {
    "20b0": ("A100-SXM4-40GB", "SXM"),
    "20b2": ("A100-SXM4-80GB", "SXM"),
    "20b3": ("A100-SXM-64GB", "SXM"),
    "20b1": ("A100-PCIE-40GB", "PCIe"),
    "20f1": ("A100-PCIE-40GB", "PCIe"),
    "20b5": ("A100-PCIE-80GB", "PCIe"),
    "20bd": ("A800-SXM4-40GB", "SXM"),
    "20f3": ("A800-SXM4-80GB", "SXM"),
    "20f5": ("A800-PCIE-80GB", "PCIe"),
    "20f6": ("A800-PCIE-40GB", "PCIe"),
    "2330": ("H100-SXM5-80GB", "SXM"),
    "2331": ("H100-PCIE-80GB", "PCIe"),
    "2321": ("H100-NVL", "PCIe"),
    "2324": ("H800-SXM5-80GB", "SXM"),
    "2322": ("H800-PCIE", "PCIe"),
    "2335": ("H200-SXM-141GB", "SXM"),
    "2329": ("H20", "SXM"),
    "2901": ("B200", "SXM"),
    "26b9": ("L40S", "PCIe"),
    "2684": ("GeForce RTX 4090", "PCIe"),
    "2b85": ("GeForce RTX 5090", "PCIe"),
    # Volta, for DGX-1/DGX-2 era captures (pci.ids GV100GL entries).
    "1db1": ("V100-SXM2-16GB", "SXM"),
    "1db5": ("V100-SXM2-32GB", "SXM"),
    "1db4": ("V100-PCIE-16GB", "PCIe"),
    "1db6": ("V100-PCIE-32GB", "PCIe"),
}

# NVSwitch bridges: 1af1 = A100-era (DGX/HGX A100), 22a3 = H100-era, 22b1 = GB200-era bridge
# (topology-notes §6 row 11; gpud detect_nvswitch.go keys on the same ids).
NVSWITCH_IDS: Dict[str, str] = {
    "1af1": "NVSwitch (A100)",
    "22a3": "NVSwitch (H100)",
    "22b1": "NVSwitch (GB200)",
}

# Huawei Ascend (vendor 19e5), topology-notes §2.3. d803 is the A3 part npu-smi calls 910_93 and
# Huawei markets as 910C.
ASCEND_IDS: Dict[str, str] = {
    "d100": "310",
    "d500": "310P",
    "d801": "910A",
    "d802": "910B",
    "d803": "910C",
}
