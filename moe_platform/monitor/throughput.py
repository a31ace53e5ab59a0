"""Throughput: achieved model FLOP/s per device always, and MFU only against a real peak.

    model FLOP/s per device = training matmul FLOPs per token (the ledger's 3 × forward) × tokens/s ÷ ranks
    MFU = model FLOP/s per device ÷ the device's dense peak for the precision the run computes in

The peak comes from `logging.peak_tflops`, or from the vendor's datasheet for the exact card name torch reports and
the run's precision. An unknown card or precision gets no guessed peak: the run logs one line asking for
`logging.peak_tflops` and reports no MFU. A CPU has no datasheet peak; there the ratio to a measured fp32 matmul
rate is reported under its own name, `model_flops_vs_matmul_probe`, which is not an MFU and can exceed 1.
"""

import logging
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

# Dense (no structured sparsity) peak TFLOP/s per device from the vendors' datasheets, keyed by the name
# torch.cuda.get_device_name() returns and by trainer.precision. "fp32" is the plain FP32 rate, not TF32: PyTorch
# leaves TF32 off for matmuls unless asked. Names are matched exactly, because variants of one chip differ
# (H100 SXM / PCIe / NVL have different clocks and power; an A10G is not an A10).
GPU_PEAK_TFLOPS: dict[tuple[str, str], float] = {
    ("NVIDIA H200", "bf16"): 989.5,  # H200 SXM
    ("NVIDIA H200", "fp32"): 67.0,
    ("NVIDIA H200 NVL", "bf16"): 835.5,
    ("NVIDIA H200 NVL", "fp32"): 60.0,
    ("NVIDIA H100 80GB HBM3", "bf16"): 989.5,  # H100 SXM5
    ("NVIDIA H100 80GB HBM3", "fp32"): 67.0,
    ("NVIDIA H800", "bf16"): 989.5,  # H100 SXM's compute, export NVLink
    ("NVIDIA H800", "fp32"): 67.0,
    ("NVIDIA B200", "bf16"): 2250.0,  # HGX B200, per GPU
    ("NVIDIA B200", "fp32"): 75.0,
    ("NVIDIA H100 PCIe", "bf16"): 756.5,
    ("NVIDIA H100 PCIe", "fp32"): 51.0,
    ("NVIDIA H100 NVL", "bf16"): 835.5,
    ("NVIDIA H100 NVL", "fp32"): 60.0,
    ("NVIDIA A100-SXM4-80GB", "bf16"): 312.0,
    ("NVIDIA A100-SXM4-80GB", "fp32"): 19.5,
    ("NVIDIA A100-SXM4-40GB", "bf16"): 312.0,
    ("NVIDIA A100-SXM4-40GB", "fp32"): 19.5,
    ("NVIDIA A100 80GB PCIe", "bf16"): 312.0,
    ("NVIDIA A100 80GB PCIe", "fp32"): 19.5,
    ("NVIDIA A100-PCIE-40GB", "bf16"): 312.0,
    ("NVIDIA A100-PCIE-40GB", "fp32"): 19.5,
    ("NVIDIA L40S", "bf16"): 362.05,
    ("NVIDIA L40S", "fp32"): 91.6,
    ("NVIDIA L4", "bf16"): 121.0,
    ("NVIDIA L4", "fp32"): 30.3,
    ("NVIDIA A10", "bf16"): 125.0,
    ("NVIDIA A10", "fp32"): 31.2,
}


def device_peak_flops(
    configured_tflops: float | None, precision: str, gpu_name: str | None
) -> tuple[float | None, str]:
    """(dense peak FLOP/s of one device, where it came from); None when no real peak is known (no guessing)."""
    if configured_tflops is not None:
        return configured_tflops * 1e12, "logging.peak_tflops"
    if gpu_name is None:
        return None, "a CPU has no datasheet peak"
    tflops = GPU_PEAK_TFLOPS.get((gpu_name, precision))
    if tflops is None:
        return None, f"no datasheet peak is known here for {gpu_name!r} in {precision}"
    return tflops * 1e12, f"{gpu_name} {precision} dense datasheet peak"


class Throughput:
    """Turns tokens/s into the record's FLOP/s figures: model TFLOP/s per device, and MFU or the CPU probe ratio."""

    def __init__(self, flops_per_token: float, num_devices: int, configured_tflops: float | None, precision: str):
        self.flops_per_token, self.num_devices = flops_per_token, num_devices
        gpu_name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        self.peak_flops, self.peak_source = device_peak_flops(configured_tflops, precision, gpu_name)
        # Only a CPU without a configured peak gets the probe: there is nothing better to compare against.
        self.probe_flops = _cpu_matmul_probe() if self.peak_flops is None and gpu_name is None else None

    def record(self, tokens_per_s: float) -> dict[str, Any]:
        flops_per_device = self.flops_per_token * tokens_per_s / self.num_devices
        record: dict[str, Any] = {"model_tflops_per_device": flops_per_device / 1e12}
        if self.peak_flops is not None:
            record["mfu"] = flops_per_device / self.peak_flops
        elif self.probe_flops is not None:
            record["model_flops_vs_matmul_probe"] = flops_per_device / self.probe_flops
        return record

    def describe(self) -> str:
        """One line for the start of the run: what MFU is measured against, or why there is none."""
        if self.peak_flops is not None:
            return f"MFU against {self.peak_flops / 1e12:.1f} TFLOP/s per device ({self.peak_source})"
        line = f"no MFU: {self.peak_source}; set logging.peak_tflops to the device's dense peak to get one"
        if self.probe_flops is not None:
            line += (
                f" (model_flops_vs_matmul_probe compares with a measured fp32 matmul rate of "
                f"{self.probe_flops / 1e12:.3f} TFLOP/s instead)"
            )
        return line


def _cpu_matmul_probe(n: int = 512, repeats: int = 8) -> float:
    """Achieved fp32 matmul FLOP/s of this process on this CPU (a measurement, not a peak)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)
