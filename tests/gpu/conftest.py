"""The GPU tests' device: CUDA where there is one; without one they are skipped with the reason, unless
MOE_GPU_SMOKE=1 (bench/gpu_check.sh --cpu-smoke) runs the same code on CPU, so that the check is known to work
before any GPU time is spent."""

import os

import pytest
import torch

SMOKE = os.environ.get("MOE_GPU_SMOKE") == "1"


@pytest.fixture
def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if SMOKE:
        return torch.device("cpu")
    pytest.skip("no CUDA device: bench/gpu_check.sh runs these on a GPU (MOE_GPU_SMOKE=1 runs them on CPU)")


@pytest.fixture
def low_precision(device: torch.device) -> torch.dtype:
    """bf16 on the GPU, the dtype its kernels are for; fp32 on the CPU smoke run, whose bf16 matmuls are slow."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
