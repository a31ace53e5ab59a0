"""The GPUs and links a plan runs on: datasheet peaks, memory and bandwidths, each overridable on moe-plan's command
line. Figures are the vendors' dense (no structured sparsity) numbers for the SXM/OAM parts unless the name says
PCIe; bandwidths are per GPU and per direction, in bytes/s (NVLink's "900 GB/s" is both directions: 450 one way).

Where a figure comes from is said beside it; nothing here is fitted to a measured run. How much of a peak a real
step reaches is the time model's business (time_model.py's `Assumptions`), not the catalog's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_platform.config import ConfigError
from moe_platform.monitor.throughput import GPU_PEAK_TFLOPS

TERA, GIGA = 1e12, 1e9
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """One accelerator: its memory, dense matmul peak by compute dtype, HBM bandwidth and NVLink bandwidth."""

    name: str
    memory_bytes: float
    # Dense matmul FLOP/s by the dtype a GEMM runs in. "fp32" is plain FP32, not TF32: torch leaves TF32 off for
    # matmuls unless asked (as monitor/throughput.py measures MFU).
    peak_flops: dict[str, float]
    memory_bandwidth: float  # HBM bytes/s: what elementwise work and the optimizer step move
    nvlink_bandwidth: float  # bytes/s one way between GPUs of a node (PCIe parts: the PCIe link)
    torch_name: str = ""  # what torch.cuda.get_device_name() reports for it

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(
                f"the {self.name} has no {dtype} matmul peak in the catalog (it has {sorted(self.peak_flops)}): "
                "pick a precision it runs, or give --peak-tflops"
            )
        return self.peak_flops[dtype]


def _gpu(name: str, torch_name: str, memory_gb: float, fp8: float | None, hbm_tbps: float, link_gbs: float) -> Gpu:
    """The bf16 and fp32 peaks are monitor/throughput.py's (the figures a run's MFU is measured against, keyed by the
    name torch reports), so a plan's MFU and a run's are the same ratio; FP8 is planning-only."""
    peaks = {dtype: GPU_PEAK_TFLOPS[(torch_name, dtype)] * TERA for dtype in ("bf16", "fp32")}
    peaks.update({"fp8": fp8 * TERA} if fp8 else {})
    return Gpu(name, memory_gb * GIB, peaks, hbm_tbps * TERA, link_gbs * GIGA, torch_name)


# name, torch's device name, memory GiB (2^30 B, as nvidia-smi counts), dense FP8 TFLOP/s, HBM TB/s, NVLink GB/s
# one way (vendors' datasheets)
GPUS: dict[str, Gpu] = {
    gpu.name: gpu
    for gpu in (
        _gpu("H100-SXM", "NVIDIA H100 80GB HBM3", 80, 1979, 3.35, 450),  # NVLink 4: 900 GB/s both ways
        _gpu("H100-PCIe", "NVIDIA H100 PCIe", 80, 1513, 2.0, 64),  # PCIe Gen5 x16 (the NVLink bridge pairs only 2)
        _gpu("H200", "NVIDIA H200", 141, 1979, 4.8, 450),  # H200 SXM: H100's compute, HBM3e
        _gpu("H800", "NVIDIA H800", 80, 1979, 3.35, 200),  # H100's compute, NVLink cut to 400 GB/s both ways
        _gpu("A100-40GB", "NVIDIA A100-SXM4-40GB", 40, None, 1.555, 300),  # NVLink 3: 600 GB/s both ways
        _gpu("A100-80GB", "NVIDIA A100-SXM4-80GB", 80, None, 2.039, 300),
        _gpu("B200", "NVIDIA B200", 180, 4500, 8.0, 900),  # HGX B200 per GPU; NVLink 5: 1.8 TB/s both ways
        _gpu("L40S", "NVIDIA L40S", 48, 733, 0.864, 32),  # PCIe Gen4 x16, no NVLink
    )
}
# A CPU "GPU" for ranking layouts on a machine moe-plan has not calibrated: one rank's order of speed (a few cores'
# fp32 matmuls, DRAM, gloo over loopback). Only the order of layouts depends on it; `moe-plan --calibrate` measures.
NOMINAL_CPU = Gpu("CPU (nominal)", 16 * GIB, {"fp32": 1e11, "bf16": 1e11}, 2e10, 2e9, "")
ALIASES = {"H100": "H100-SXM", "A100": "A100-80GB", "H200-SXM": "H200", "H800-SXM": "H800"}
# A node's GPUs reach other nodes through their own NIC: 400 Gb/s InfiniBand NDR (or RoCE) per GPU on current
# H100/H200/B200 clusters, 200 Gb/s HDR on A100 ones; one way, in bytes/s.
INTER_NODE_BANDWIDTH = {"A100-40GB": 25 * GIGA, "A100-80GB": 25 * GIGA}
DEFAULT_INTER_NODE_BANDWIDTH = 50 * GIGA


def gpu_of_device(torch_name: str) -> Gpu | None:
    """The catalog's GPU torch reports by this name, or None for one the catalog does not hold."""
    return next((gpu for gpu in GPUS.values() if gpu.torch_name == torch_name), None)


def gpu_named(name: str) -> Gpu:
    """The catalog's GPU by name, case and separators ignored (h100, H100-SXM, h100_sxm, a100-80gb …)."""

    def key(text: str) -> str:
        return text.lower().replace("_", "").replace("-", "").replace(" ", "")

    wanted = key(ALIASES.get(name.upper(), name))
    for gpu_name, gpu in GPUS.items():
        if key(gpu_name) == wanted:
            return gpu
    known = ", ".join([*GPUS, *ALIASES])
    raise ConfigError(f"--gpu {name} is not in the catalog ({known}): pick one, or give --gpu-memory and --peak-tflops")


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical GPUs: a node's GPUs talk over NVLink (or PCIe), nodes over one NIC per GPU."""

    nodes: int
    gpus_per_node: int
    gpu: Gpu
    intra_node_bandwidth: float  # bytes/s one way, per GPU
    inter_node_bandwidth: float  # bytes/s one way, per GPU

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--nodes {self.nodes} --gpus-per-node {self.gpus_per_node}: both must be at least 1")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def group_bandwidth(self, group_size: int, stride: int = 1) -> float:
        """The one-way bandwidth per rank of a collective over `group_size` ranks `stride` apart (consecutive ranks
        fill a node first, as slurm/launch.sh places them): NVLink if the group stays inside one node, else the
        NIC, which a ring or all-to-all crossing nodes waits on."""
        if group_size <= 1:
            return float("inf")
        span = (group_size - 1) * stride + 1
        return self.intra_node_bandwidth if span <= self.gpus_per_node else self.inter_node_bandwidth

    def with_changes(self, **changes) -> Cluster:
        return dataclasses.replace(self, **changes)


def cluster_of(
    nodes: int,
    gpus_per_node: int,
    gpu: str,
    *,
    memory_gb: float | None = None,
    peak_tflops: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
) -> Cluster:
    """moe-plan's cluster: the catalog's GPU with any of its figures overridden. Link figures on the command line
    are in Gbit/s, as NICs are sold (400 Gb/s NDR); NVLink's 450 GB/s one way is 3600 Gbit/s."""
    base = gpu_named(gpu)
    changes = {}
    if memory_gb is not None:
        changes["memory_bytes"] = memory_gb * GIB
    if peak_tflops is not None:
        changes["peak_flops"] = {dtype: peak_tflops * TERA for dtype in base.peak_flops}
    card = dataclasses.replace(base, **changes)
    intra = base.nvlink_bandwidth if intra_node_gbps is None else intra_node_gbps * GIGA / 8
    default_inter = INTER_NODE_BANDWIDTH.get(base.name, DEFAULT_INTER_NODE_BANDWIDTH)
    inter = default_inter if inter_node_gbps is None else inter_node_gbps * GIGA / 8
    return Cluster(nodes, gpus_per_node, card, intra, inter)
