"""plan/calibrate.py: the calibration file's round trip and refusals, the CPU cluster it describes, and the gloo
half of the probe on two real processes."""

import dataclasses
import json
from pathlib import Path

import pytest

from moe_platform.plan import calibrate
from moe_platform.plan.calibrate import Calibration

# Figures of the order this 2-core VM measured; the functions under test only pass them on or scale them.
CAL = Calibration(
    matmul_flops={"fp32": 1.8e11, "bf16": 1.1e12},
    memory_bandwidth=1.5e10,
    all_reduce_bandwidth=8e8,
    all_to_all_bandwidth=1e9,
    reduce_scatter_bandwidth=3.2e8,
    all_gather_bandwidth=6.4e8,
    send_recv_bandwidth=2.5e9,
    collective_latency_s=2.3e-4,
    dp_overlap=0.5,
    per_layer_overhead_s=1.3e-3,
    optimizer_passes=3.1,
    cores=2,
    memory_bytes=24 * 2**30,
    torch_version="2.13.0+cpu",
    measured_on="2026-12-02",
)


def test_a_saved_calibration_loads_back_equal(tmp_path: Path) -> None:
    path = calibrate.save(CAL, tmp_path / "deep" / "cal.json")
    assert path == tmp_path / "deep" / "cal.json"
    assert calibrate.load(path) == CAL


def test_the_default_path_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(calibrate.ENV_VAR, raising=False)
    assert calibrate.default_path() == Path("~/.cache/moe-platform/calibration.json").expanduser()
    monkeypatch.setenv(calibrate.ENV_VAR, str(tmp_path / "mine.json"))
    assert calibrate.save(CAL) == tmp_path / "mine.json"
    assert calibrate.load() == CAL


def _written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cal.json"
    path.write_text(text)
    return path


def _json_with(**changes) -> str:
    return json.dumps({**dataclasses.asdict(CAL), **changes})


@pytest.mark.parametrize(
    "text, words",
    [
        (None, "no calibration file at"),
        ("{not json", "is not readable JSON"),
        (_json_with(version=calibrate.VERSION + 1), f"is of version {calibrate.VERSION + 1}"),
        ("[1, 2]", "is of version None"),
        (json.dumps({k: v for k, v in dataclasses.asdict(CAL).items() if k != "dp_overlap"}), "lacks ['dp_overlap']"),
        (_json_with(cores=0), "cores=0, not a positive number"),
        (_json_with(matmul_flops={"bf16": 1e12}), "no fp32 matmul rate"),
        (_json_with(matmul_flops=[1e12]), "matmul_flops=[1000000000000.0], not rates by dtype"),
        (_json_with(collective_latency_s="fast"), "collective_latency_s='fast'"),
        (_json_with(block_flops={"fp32": -1.0}), "block_flops={'fp32': -1.0}, not positive rates"),
        (_json_with(optimizer_passes=0), "optimizer_passes=0, not a positive number"),
    ],
)
def test_a_missing_corrupt_or_foreign_file_is_refused_in_one_sentence(tmp_path: Path, text, words: str) -> None:
    path = tmp_path / "cal.json" if text is None else _written(tmp_path, text)
    with pytest.raises(ValueError) as err:
        calibrate.load(path)
    message = str(err.value)
    assert words in message and str(path) in message
    assert "rerun `moe-plan --calibrate`" in message and "\n" not in message


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_ranks_share_the_machines_cores(ranks: int) -> None:
    cluster = calibrate.this_machine_cluster(CAL, ranks)
    gpu = cluster.gpu
    assert (cluster.nodes, cluster.gpus_per_node, cluster.world_size) == (1, ranks, ranks)
    # One thread per rank: never more than a core each, and all of them together never more than the cores.
    share = min(1.0, CAL.cores / ranks)
    for dtype, rate in CAL.matmul_flops.items():
        assert gpu.peak(dtype) == pytest.approx(rate * share)
        assert ranks * gpu.peak(dtype) == pytest.approx(rate * min(ranks, CAL.cores))
    assert gpu.memory_bandwidth == pytest.approx(CAL.memory_bandwidth * share)
    assert ranks * gpu.memory_bytes == pytest.approx(CAL.memory_bytes)
    # One node: every group, of any size or stride, talks over gloo's loopback.
    for group, stride in [(2, 1), (ranks, 1), (2, max(1, ranks // 2))]:
        assert cluster.group_bandwidth(group, stride) in (float("inf"), cluster.intra_node_bandwidth)
    link = CAL.all_reduce_bandwidth * share
    assert cluster.intra_node_bandwidth == cluster.inter_node_bandwidth == pytest.approx(link)


def test_no_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one process"):
        calibrate.this_machine_cluster(CAL, 0)


def test_the_assumptions_take_the_measured_rates_as_achieved() -> None:
    a = calibrate.this_machine_assumptions(CAL)
    assert (a.matmul_efficiency, a.memory_efficiency, a.comm_efficiency) == (1.0, 1.0, 1.0)
    assert (a.collective_latency_s, a.per_layer_overhead_s, a.dp_overlap) == (2.3e-4, 1.3e-3, 0.5)
    assert (a.optimizer_passes, a.activation_passes) == (3.1, 3.0)
    assert (a.reduce_scatter_speed, a.all_gather_speed) == pytest.approx((0.4, 0.8))  # relative to the all-reduce


def test_measured_blocks_replace_the_gemm_rate_and_what_their_time_holds() -> None:
    """A block's measured time holds its elementwise work and per-op cost: neither is added on top again."""
    with_blocks = dataclasses.replace(CAL, block_flops={"fp32": 9e10, "bf16": 1e11}, block_model="D 512")
    for ranks in (1, 2, 4):
        gpu = calibrate.this_machine_cluster(with_blocks, ranks).gpu
        assert gpu.peak("fp32") == pytest.approx(9e10 * min(1.0, CAL.cores / ranks))
    a = calibrate.this_machine_assumptions(with_blocks)
    assert (a.activation_passes, a.per_layer_overhead_s, a.optimizer_passes) == (0.0, 0.0, 3.1)


def test_the_block_probe_times_real_blocks_on_every_core_at_once() -> None:
    from moe_platform.launch.compose import train_config

    config = train_config(["model=moe_tiny", "data.seq_len=32", "trainer.micro_batch_size=2"])
    rates = calibrate.loaded_block_rates(config, processes=2, repeats=1)
    assert set(rates) == {"fp32", "bf16"} and all(0 < rate < 1e13 for rate in rates.values())
    described = calibrate.block_model(config)  # the file says which blocks its rate is of
    assert f"D {config.model.d_model}," in described and "64 tokens a micro-batch" in described


def test_adamw_moves_its_state_at_least_once() -> None:
    passes = calibrate.optimizer_passes(calibrate.memory_bandwidth(repeats=1), repeats=1)
    assert passes > 1.0, "reading and writing weights, gradients, m and v cannot take less than one pass"


def test_the_gloo_probe_measures_two_real_processes() -> None:
    figures = calibrate.gloo_figures(repeats=1)
    assert set(figures) == {
        "all_reduce_bandwidth", "all_to_all_bandwidth", "send_recv_bandwidth", "collective_latency_s", "dp_overlap",
        "reduce_scatter_bandwidth", "all_gather_bandwidth",
    }  # fmt: skip
    assert all(figures[k] > 0 for k in figures if k != "dp_overlap")
    assert 0 <= figures["dp_overlap"] <= 1
