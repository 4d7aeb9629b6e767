"""The compute model: how fast each device model multiplies matrices, and how fast it reads memory.

An MoE step is communication *and* expert compute; on a mixed cluster the second differs by 3x
or more between ranks (an H800 against an A100 or a 910B3), so a placement that gives every rank
the same number of experts leaves the fast ranks waiting for the slow one. This table is what
placement (experts per rank in proportion to throughput, replica holders = fastest ranks), the
simulator (each rank's expert compute for a routing) and the emulator (a CPU share per node)
read.

Numbers are **dense** (no 2:4 sparsity) tensor-core FP16 and BF16 peak TFLOPS and peak memory
bandwidth in GB/s, from the vendor's datasheet where one exists; vendors print the sparse figure
first for Ampere/Hopper/Ada (``1,979 TFLOPS*`` for H100 SXM BF16, "* with sparsity"), and the
dense value is half of it. Each entry names its sources. Huawei publishes no per-variant
datasheet for the 910B family; those rows cite the public reports they come from and say so.
A peak is not what a GEMM reaches; ``hetcomm bench compute`` measures the real rate on a device.

A cluster YAML can override a node group's number (``node_groups[].device.tflops``): that is how
an emulated cluster states "this node computes at half the speed of the others", and how a user
records a measured rate instead of the datasheet's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from hetcomm.errors import ConfigError
from hetcomm.topo.bandwidth import canonical_model

if TYPE_CHECKING:  # pragma: no cover
    from hetcomm.topo.cluster import Cluster

__all__ = [
    "DeviceSpec",
    "DEVICE_SPECS",
    "device_spec",
    "find_device_spec",
    "throughput_tflops",
    "rank_tflops",
    "rank_speeds",
    "relative_speed",
    "strong_by_throughput",
    "STRONG_FRACTION",
]

#: A rank is "strong" (may hold replicas of hot experts) when its throughput is at least this
#: fraction of the fastest rank's: replicas exist to take load off slow ranks, so only ranks
#: clearly faster than the slowest should hold them.
STRONG_FRACTION = 0.5

_NV_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_NV_A800 = "https://www.nvidia.com/en-us/design-visualization/a800/ (A800 40GB Active) and NVIDIA A800 SXM4/PCIe product brief (same GA100 compute as A100; NVLink capped at 400 GB/s)"
_NV_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 SXM/PCIe/NVL table; FP16/BF16 1,979 TFLOPS SXM with sparsity)"
_NV_H800 = "NVIDIA H800 product brief (H100 compute with NVLink capped at 400 GB/s); GH100 SXM5 rates as in the H100 datasheet"
_NV_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (FP16/BF16 1,979 TFLOPS with sparsity, 4.8 TB/s, 141 GB)"
_NV_H20 = "NVIDIA H20 spec as published by resellers and https://willitrunai.com/es/gpus/h20-96gb (148 TFLOPS FP16 dense, 96 GB HBM3 at 4.0 TB/s); NVIDIA publishes no public H20 datasheet"
_NV_L40S = "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 (FP16/BF16 Tensor 733 TFLOPS with sparsity -> 366 dense; 864 GB/s GDDR6)"
_NV_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf (Tensor 125 TFLOPS SXM2, 112 PCIe; 900 GB/s)"
_HW_910 = "Huawei Ascend 910 launch (2019-08-23, https://www.huawei.com/en/news/2019/8/huawei-ascend-910-most-powerful-ai-processor): 256 TFLOPS FP16; HBM2 1.2 TB/s per Huawei Atlas 300T training card spec"
_HW_910B = (
    "no public Huawei per-variant datasheet; 910B FP16 ~320 TFLOPS, 64 GB HBM2e as summarised at "
    "https://boardor.com/blog/huawei-ascend-910b-outperforms-h20-910c-approaches-h100 ; variant split "
    "(910B1 414 / 910B2 376 / 910B3 313 / 910B4 280 TFLOPS FP16; 1.6 TB/s, 910B4 0.8 TB/s) from public "
    "Atlas 800T A2 / 300T A2 reseller spec sheets"
)
_HW_910C = "https://www.besthub.dev/articles/huawei-ascend-ai-chip-detailed-specs-comparison-2025-2028-roadmap-a247a4760c30 (910C: 800 TFLOPS FP16, two 910B dies); bandwidth 3.2 TB/s from the same roadmap summaries"
_CPU = (
    "not a datasheet number: a placeholder of the order a 2-socket server CPU reaches in FP32 GEMM "
    "without AMX; measure the real rate with `hetcomm bench compute`"
)


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of one device model (dense; per device, not per node).

    Attributes:
        model: the table key (``A100-SXM4``, ``H800``, ``910B3``, ``cpu``).
        vendor: ``nvidia``, ``ascend`` or ``cpu``.
        fp16_tflops: dense tensor FP16 peak, TFLOPS.
        bf16_tflops: dense tensor BF16 peak, TFLOPS.
        mem_bw_gbs: memory bandwidth, GB/s (bytes, not bits).
        sources: where each number comes from.
    """

    model: str
    vendor: str
    fp16_tflops: float
    bf16_tflops: float
    mem_bw_gbs: float
    sources: Tuple[str, ...]

    @property
    def tflops(self) -> float:
        """The rate placement uses: dense FP16/BF16, whichever is lower (they are equal on all
        tensor-core parts in the table)."""
        return min(self.fp16_tflops, self.bf16_tflops)


def _spec(model, vendor, fp16, bf16, bw, *sources) -> DeviceSpec:
    return DeviceSpec(model, vendor, float(fp16), float(bf16), float(bw), tuple(sources))


#: The table, keyed by model; :func:`device_spec` maps the names tools print onto these keys.
DEVICE_SPECS: Dict[str, DeviceSpec] = {
    s.model: s
    for s in (
        # A100: FP16/BF16 Tensor 312 TFLOPS dense (624 sparse), 40GB 1,555 GB/s, 80GB SXM 2,039,
        # 80GB PCIe 1,935 GB/s (datasheet table).
        _spec("A100-SXM4-80GB", "nvidia", 312, 312, 2039, _NV_A100),
        _spec("A100-SXM4-40GB", "nvidia", 312, 312, 1555, _NV_A100),
        _spec("A100-PCIE-80GB", "nvidia", 312, 312, 1935, _NV_A100),
        _spec("A100-PCIE-40GB", "nvidia", 312, 312, 1555, _NV_A100),
        _spec("A800-SXM4-80GB", "nvidia", 312, 312, 2039, _NV_A800),
        _spec("A800-PCIE-80GB", "nvidia", 312, 312, 1935, _NV_A800),
        # H100 SXM5: 1,979 sparse -> 989.5 dense, 3.35 TB/s; PCIe 1,513 -> 756, 2.0 TB/s;
        # NVL 1,671 -> 835.5, 3.9 TB/s.
        _spec("H100-SXM", "nvidia", 989.5, 989.5, 3350, _NV_H100),
        _spec("H100-PCIE", "nvidia", 756, 756, 2000, _NV_H100),
        _spec("H100-NVL", "nvidia", 835.5, 835.5, 3900, _NV_H100),
        _spec("H800-SXM", "nvidia", 989.5, 989.5, 3350, _NV_H800, _NV_H100),
        _spec("H800-PCIE", "nvidia", 756, 756, 2000, _NV_H800, _NV_H100),
        _spec("H200", "nvidia", 989.5, 989.5, 4800, _NV_H200),
        _spec("H20", "nvidia", 148, 148, 4000, _NV_H20),
        _spec("L40S", "nvidia", 366, 366, 864, _NV_L40S),
        _spec("V100-SXM2", "nvidia", 125, 125, 900, _NV_V100),
        _spec("V100-PCIE", "nvidia", 112, 112, 900, _NV_V100),
        # Ascend: 910 (910A) 256 TFLOPS FP16; the 910B family by variant. BF16 equals FP16 on
        # the 910B cube unit (the 910A has no BF16: recorded as 0 there).
        _spec("910A", "ascend", 256, 0, 1200, _HW_910),
        _spec("910B", "ascend", 320, 320, 1600, _HW_910B),
        _spec("910B1", "ascend", 414, 414, 1600, _HW_910B),
        _spec("910B2", "ascend", 376, 376, 1600, _HW_910B),
        _spec("910B3", "ascend", 313, 313, 1600, _HW_910B),
        _spec("910B4", "ascend", 280, 280, 800, _HW_910B),
        _spec("910C", "ascend", 800, 800, 3200, _HW_910C),
        _spec("cpu", "cpu", 2.0, 2.0, 200, _CPU),
    )
}


def find_device_spec(model: Optional[str]) -> Optional[DeviceSpec]:
    """The table entry for a model name as any tool prints it, or None when unknown.

    ``"NVIDIA A100-SXM4-80GB"``, ``"A100 80GB PCIe"``, ``"NVIDIA H800"``, ``"H100 80GB HBM3"``,
    ``"910B3"``, ``"Ascend910B2C"``, ``"cpu"`` all resolve; a bare family name takes its SXM
    part (the form the family is sold as in training servers).
    """
    if model is None:
        return None
    text = model.strip()
    if text.lower() in ("cpu", "") or text.lower().startswith("cpu"):
        return DEVICE_SPECS["cpu"]
    fam = canonical_model(text)
    if fam is None:
        return None
    up = text.upper()
    pcie = "PCIE" in up or "PCI-E" in up
    if fam.startswith("910"):
        match = re.search(r"910B([1-4])", up)
        if fam == "910B" and match:
            return DEVICE_SPECS[f"910B{match.group(1)}"]
        return DEVICE_SPECS.get(fam)
    if fam in ("A100", "A800"):
        if pcie:
            return DEVICE_SPECS[f"{fam}-PCIE-80GB"] if ("80G" in up or fam == "A800") else DEVICE_SPECS["A100-PCIE-40GB"]
        return DEVICE_SPECS["A100-SXM4-40GB"] if "40G" in up else DEVICE_SPECS[f"{fam}-SXM4-80GB"]
    if fam in ("H100", "H800"):
        if "NVL" in up and fam == "H100":
            return DEVICE_SPECS["H100-NVL"]
        return DEVICE_SPECS[f"{fam}-PCIE" if pcie else f"{fam}-SXM"]
    if fam == "V100":
        return DEVICE_SPECS["V100-PCIE" if pcie else "V100-SXM2"]
    return DEVICE_SPECS.get(fam)


def device_spec(model: str) -> DeviceSpec:
    """Like :func:`find_device_spec`, but an unknown model is an error.

    Raises:
        ConfigError: the model is not in the table (the message lists the known models).
    """
    spec = find_device_spec(model)
    if spec is None:
        raise ConfigError(
            f"no compute figures for device model {model!r}; known models: "
            f"{', '.join(DEVICE_SPECS)}; give the node group a measured 'device.tflops' instead",
            key="device.model",
        )
    return spec


def throughput_tflops(model: str) -> float:
    """Dense FP16/BF16 peak TFLOPS of ``model`` (see :func:`device_spec`)."""
    return device_spec(model).tflops


def rank_tflops(cluster: "Cluster", rank: int) -> float:
    """TFLOPS of global ``rank``: its group's ``device.tflops`` when set, else the table's."""
    group = cluster.node_of(rank).group
    if group.tflops is not None:
        return float(group.tflops)
    spec = find_device_spec(group.model)
    # A model the table lacks counts as the slowest known accelerator rather than failing a
    # job that only wanted placement: say so where the cluster is loaded (hetcomm discover).
    return spec.tflops if spec is not None else DEVICE_SPECS["cpu"].tflops


def rank_speeds(cluster: "Cluster", ranks: Optional[Sequence[int]] = None) -> List[float]:
    """TFLOPS of each of ``ranks`` (default: every rank of the cluster), in that order."""
    ranks = range(cluster.num_ranks) if ranks is None else ranks
    return [rank_tflops(cluster, r) for r in ranks]


def relative_speed(cluster: "Cluster") -> Dict[str, float]:
    """Node name -> its devices' TFLOPS divided by the fastest node's (1.0 = fastest).

    What ``hetcomm emulate`` turns into CPU shares: a node at 0.5 gets half the CPU time.
    """
    per_node = {node.name: rank_tflops(cluster, node.first_rank) for node in cluster.nodes}
    top = max(per_node.values())
    return {name: value / top for name, value in per_node.items()}


def strong_by_throughput(speeds: Sequence[float], fraction: float = STRONG_FRACTION) -> List[int]:
    """Indices whose speed is at least ``fraction`` of the fastest (the replica holders)."""
    if not speeds:
        return []
    top = max(speeds)
    return [i for i, s in enumerate(speeds) if s >= fraction * top]
