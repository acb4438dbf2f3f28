"""The GPU catalogue: each product by its exact name with the vendor's datasheet peaks.

Apart from `devices` (which adds the measured CPU and the planner's cost model) so that layout
rules (bf16 needs a device with bfloat16) can read a DeviceSpec without importing the planner's
arithmetic. A GPU is recognised only by the exact name `torch.cuda.get_device_name()` reports
(`PRODUCTS`): product lines share fragments ("L4" is in "L40S", an H100 PCIe is not an H100 SXM, a
MIG slice is not the whole GPU), so anything else is unknown rather than guessed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["GiB", "DeviceSpec", "DEVICES", "PRODUCTS", "device_for_product", "catalogue_device"]

GiB = 2 ** 30


@dataclass(frozen=True)
class DeviceSpec:
    """Published peaks (dense, no sparsity) and link bandwidths per device, bytes/s one direction.

    `latency` is the cost of one hop of a collective (a ring all-reduce over n ranks takes 2(n−1)
    hops, an all-gather, reduce-scatter or all-to-all n−1, a send 1); `efficiency` is the fraction
    of peak large training matmuls reach; `half_tokens` the
    microbatch token count at which they reach half of that; `overlap` the fraction of backward
    compute that can hide data-parallel communication; `layer_overhead` the host time to run one
    layer's forward and backward ops for one microbatch (kernel launches, framework), hidden
    behind the device's work when launches are asynchronous (GPUs), added to it on a CPU;
    `wrapper_overhead` the extra host time per layer pass of each wrapper that is on ("tp":
    DTensor tensor parallel, "fsdp": zero 2/3, "cp": ring / Ulysses attention);
    `core_share` < 1 when more CPU engines than cores take turns (an idle rank lends its core);
    `process_memory` the bytes a rank's process holds before any model (counted in a CPU engine's
    peak; a GPU's CUDA context and NCCL buffers sit in the 10 % the capacity leaves free);
    `collective_bandwidth` the bus bandwidth within a node per collective where it was measured
    ("all_reduce", "all_gather", "reduce_scatter": gloo on CPU reaches different rates for each,
    all below the raw link); a collective not named there runs at `intra_bandwidth`; `kind` "gpu"
    or "cpu".
    """

    name: str
    memory: float
    peak_flops: Mapping[str, float]
    hbm_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    host_bandwidth: float
    latency: float = 5e-6
    efficiency: float = 0.6
    half_tokens: int = 256
    overlap: float = 0.9
    layer_overhead: float = 100e-6
    wrapper_overhead: Mapping[str, float] = field(default_factory=dict)
    async_launch: bool = True
    core_share: float = 1.0
    process_memory: float = 0.0
    collective_bandwidth: Mapping[str, float] = field(default_factory=dict)
    kind: str = "gpu"  # "cpu": the measured CPU, where torch runs bfloat16 whatever the ISA has

    @property
    def bf16(self) -> bool:
        """A bfloat16 peak is listed: the device is priced (and `plan` chooses) bf16 at its speed."""
        return "bf16" in self.peak_flops

    @property
    def runs_bf16(self) -> bool:
        """bf16 layouts run here: a GPU with bfloat16 (Ampere or newer), or any CPU (priced at its
        fp32 peak when no bf16 figure is measured)."""
        return self.bf16 or self.kind == "cpu"


# ---- GPUs: the vendors' datasheets ---------------------------------------------------------------
# Peaks are dense (NVIDIA lists BF16 tensor-core figures with 2:4 sparsity; dense is half): BF16
# tensor core and plain FP32. Memory bandwidth as listed; intra-node bandwidth one direction:
# NVLink per GPU (SXM boards), else the PCIe link (no NVLink bridge assumed); host bandwidth the
# PCIe link one direction. Inter-node bandwidth is not the GPU's but the network such nodes
# usually have per GPU: 400 Gb/s InfiniBand for Hopper, 200 Gb/s for A100, 100 Gb/s Ethernet for
# the inference cards.
# - H100 SXM5 / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet
#   (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet): BF16
#   1,979 / 1,513 / 1,671 TFLOPS with sparsity, FP32 67 / 51 / 60, 3.35 / 2.0 / 3.9 TB/s,
#   NVLink 900 / 600 (bridge) / 600 GB/s, PCIe Gen5 128 GB/s.
# - H200 SXM / NVL: https://www.nvidia.com/en-us/data-center/h200/: BF16 1,979 / 1,671 TFLOPS with
#   sparsity, FP32 67 / 60, 141 GB, 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
# - A100 SXM4 and PCIe, 40 and 80 GB: NVIDIA A100 datasheet
#   (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):
#   BF16 312 TFLOPS dense, FP32 19.5; 1,555 GB/s (40 GB), 2,039 (80 GB SXM), 1,935 (80 GB PCIe);
#   NVLink 600 GB/s (SXM), PCIe Gen4 64 GB/s.
# - L4: https://www.nvidia.com/en-us/data-center/l4/ datasheet: BF16 242 TFLOPS with sparsity,
#   FP32 30.3, 24 GB, 300 GB/s, PCIe Gen4 x16 64 GB/s.
# - L40S: https://www.nvidia.com/en-us/data-center/l40s/ datasheet: BF16 733 TFLOPS with sparsity
#   (362.05 dense), FP32 91.6, 48 GB, 864 GB/s, PCIe Gen4 x16 64 GB/s.
# - T4: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf:
#   FP32 8.1 TFLOPS, no bfloat16, 16 GB, 320 GB/s, PCIe Gen3 x16 32 GB/s.
DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    DeviceSpec("H100-80GB", 80 * GiB, {"bf16": 989.5e12, "fp32": 67e12}, 3.35e12, 450e9, 50e9, 64e9),
    DeviceSpec("H100-PCIe", 80 * GiB, {"bf16": 756.5e12, "fp32": 51e12}, 2.0e12, 64e9, 50e9, 64e9),
    DeviceSpec("H100-NVL", 94e9, {"bf16": 835.5e12, "fp32": 60e12}, 3.9e12, 300e9, 50e9, 64e9),
    DeviceSpec("H200", 141e9, {"bf16": 989.5e12, "fp32": 67e12}, 4.8e12, 450e9, 50e9, 64e9),
    DeviceSpec("H200-NVL", 141e9, {"bf16": 835.5e12, "fp32": 60e12}, 4.8e12, 450e9, 50e9, 64e9),
    DeviceSpec("A100-40GB", 40 * GiB, {"bf16": 312e12, "fp32": 19.5e12}, 1.555e12, 300e9, 25e9, 32e9),
    DeviceSpec("A100-80GB", 80 * GiB, {"bf16": 312e12, "fp32": 19.5e12}, 2.039e12, 300e9, 25e9, 32e9),
    DeviceSpec("A100-PCIe-40GB", 40 * GiB, {"bf16": 312e12, "fp32": 19.5e12}, 1.555e12, 32e9, 25e9, 32e9),
    DeviceSpec("A100-PCIe-80GB", 80 * GiB, {"bf16": 312e12, "fp32": 19.5e12}, 1.935e12, 32e9, 25e9, 32e9),
    DeviceSpec("L4", 24 * GiB, {"bf16": 121e12, "fp32": 30.3e12}, 300e9, 32e9, 12.5e9, 32e9),
    DeviceSpec("L40S", 48 * GiB, {"bf16": 362.05e12, "fp32": 91.6e12}, 864e9, 32e9, 12.5e9, 32e9),
    DeviceSpec("T4", 16 * GiB, {"fp32": 8.1e12}, 320e9, 16e9, 12.5e9, 16e9),
)}

PRODUCTS: dict[str, str] = {
    "NVIDIA H100 80GB HBM3": "H100-80GB", "NVIDIA H100 PCIe": "H100-PCIe", "NVIDIA H100 NVL": "H100-NVL",
    "NVIDIA H200": "H200", "NVIDIA H200 NVL": "H200-NVL",
    "NVIDIA A100-SXM4-40GB": "A100-40GB", "NVIDIA A100-SXM4-80GB": "A100-80GB",
    "NVIDIA A100-PCIE-40GB": "A100-PCIe-40GB", "NVIDIA A100 80GB PCIe": "A100-PCIe-80GB",
    "NVIDIA L4": "L4", "NVIDIA L40S": "L40S", "Tesla T4": "T4",
}
"""`torch.cuda.get_device_name()` of each product (what nvidia-smi prints too) -> catalogue entry."""

_ALIASES = {"h100": "H100-80GB", "a100": "A100-80GB"}


def device_for_product(product_name: str) -> DeviceSpec | None:
    """The catalogue entry of the GPU `torch.cuda.get_device_name()` names, or None for any name
    that is not exactly one of `PRODUCTS` (another product, a MIG slice, a renamed virtual GPU)."""
    name = PRODUCTS.get(product_name.strip())
    return None if name is None else DEVICES[name]


def catalogue_device(name: str) -> DeviceSpec | None:
    """The catalogue entry a name means (a catalogue name in any case, an alias such as "h100",
    or an exact product name), or None."""
    by_lower = {entry.lower(): entry for entry in DEVICES}
    entry = by_lower.get(name.lower()) or _ALIASES.get(name.lower()) or PRODUCTS.get(name.strip())
    return None if entry is None else DEVICES[entry]
