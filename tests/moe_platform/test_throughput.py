"""MFU only against a real peak: one datasheet figure per exact card name and precision, none guessed."""

import pytest

from moe_platform.monitor.throughput import GPU_PEAK_TFLOPS, Throughput, device_peak_flops


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
        ("NVIDIA H100 PCIe", "bf16", 756.5),  # not the SXM figure
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200", "fp32", 67.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A10", "bf16", 125.0),
    ],
)
def test_known_cards_get_their_datasheet_peak_for_the_precision(name: str, precision: str, tflops: float) -> None:
    peak, source = device_peak_flops(None, precision, name)
    assert peak == tflops * 1e12 and name in source and precision in source


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA H100", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090"])
def test_an_unknown_card_gets_no_guessed_peak(name: str) -> None:
    """Substring matching once gave an A10G the A10's peak and every H100 variant the SXM's."""
    peak, source = device_peak_flops(None, "bf16", name)
    assert peak is None and name in source


def test_fp32_is_read_against_the_fp32_peak_not_bf16() -> None:
    """An fp32 run on an H100 read ~15× too low against the bf16 peak."""
    bf16, _ = device_peak_flops(None, "bf16", "NVIDIA H100 80GB HBM3")
    fp32, _ = device_peak_flops(None, "fp32", "NVIDIA H100 80GB HBM3")
    assert 14 < bf16 / fp32 < 16
    for name, _ in GPU_PEAK_TFLOPS:
        assert GPU_PEAK_TFLOPS[(name, "bf16")] > GPU_PEAK_TFLOPS[(name, "fp32")], name


def test_a_configured_peak_wins_and_mfu_is_flops_over_it() -> None:
    throughput = Throughput(flops_per_token=6e9, num_devices=2, configured_tflops=100.0, precision="bf16")
    record = throughput.record(tokens_per_s=10_000.0)
    assert record["model_tflops_per_device"] == pytest.approx(30.0)
    assert record["mfu"] == pytest.approx(0.3) and "model_flops_vs_matmul_probe" not in record
    assert "logging.peak_tflops" in throughput.describe()
