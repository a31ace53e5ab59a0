"""The start-up memory check: the ledger's training state against the machine, refused in one sentence."""

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moe import ModelConfig
from moe.ledger import training_state_bytes
from moe_platform.config import ConfigError, DistributedConfig, TrainConfig, TrainerConfig
from moe_platform.launch.compose import conf_dir
from moe_platform.launch.memory import Memory, check_training_state_fits
from moe_platform.testing import BIN, subprocess_env

GB = 1e9


def preset(model: str, strategy: str = "single", zero_stage: int = 0, precision: str = "fp32", **dist) -> TrainConfig:
    yaml = OmegaConf.load(conf_dir() / "model" / f"{model}.yaml")
    model_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml))
    return TrainConfig(
        model=model_config,
        distributed=DistributedConfig(strategy=strategy, zero_stage=zero_stage, **dist),
        trainer=TrainerConfig(precision=precision),
    )


def cpu(host_gb: float) -> Memory:
    return Memory(None, host_gb * GB, host_gb * GB)


def gpu(free_gb: float, host_gb: float) -> Memory:
    return Memory("NVIDIA H100 80GB HBM3", free_gb * GB, host_gb * GB)


def refusal(config: TrainConfig, world: int, local: int, memory: Memory) -> str:
    with pytest.raises(ConfigError) as excinfo:
        check_training_state_fits(config, world, local, memory)
    message = str(excinfo.value)
    assert "\n" not in message and "distributed.check_memory=false" in message
    return message


def test_mixtral_on_a_small_cpu_machine_is_refused_with_both_numbers() -> None:
    config = preset("mixtral_like")
    needed = training_state_bytes(config.model.num_params(), "fp32", 0, 1).total
    message = refusal(config, 1, 1, cpu(24.0))
    assert f"{needed / GB:,.1f} GB" in message and "24.0 GB available" in message
    assert "model=moe_small" in message
    assert "zero3" not in message, "every rank builds the whole fp32 model, so sharding cannot make it fit here"


def test_the_suggested_number_of_zero3_gpus_is_the_smallest_that_fits() -> None:
    config = preset("mixtral_like", "deepspeed", 3, "bf16")
    memory = gpu(free_gb=80.0, host_gb=4000.0)
    message = refusal(config, 8, 8, memory)
    gpus = int(re.search(r"zero3 over at least (\d+) GPUs", message).group(1))
    assert "per GPU" in message and "distributed=zero3_offload" in message
    check_training_state_fits(config, gpus, 8, memory)  # fits
    with pytest.raises(ConfigError):
        check_training_state_fits(config, gpus - 1, 8, memory)


def test_offload_moves_bytes_from_the_gpu_to_host_memory() -> None:
    on_gpu = preset("mixtral_like", "deepspeed", 3, "bf16")
    offloaded = preset("mixtral_like", "deepspeed", 3, "bf16", offload_optimizer=True, offload_params=True)
    memory = gpu(free_gb=40.0, host_gb=3000.0)
    refusal(on_gpu, 16, 8, memory)
    check_training_state_fits(offloaded, 16, 8, memory)
    # The offloaded state needs host memory: on 2 ranks each holds half the weights and optimizer state (327 GB),
    # more than the 187 GB fp32 build, so 2 × 327 GB must fit the host.
    message = refusal(offloaded, 2, 2, gpu(free_gb=80.0, host_gb=600.0))
    assert "host memory for its training state on each of the 2 ranks of this node" in message
    assert "zero3 over at least 3 GPUs" in message
    check_training_state_fits(offloaded, 2, 2, gpu(free_gb=80.0, host_gb=700.0))


def test_building_the_whole_fp32_model_on_every_rank_counts_against_host_memory() -> None:
    config = preset("mixtral_like", "deepspeed", 3, "bf16")
    message = refusal(config, 64, 8, gpu(free_gb=80.0, host_gb=1000.0))  # 8 × 187 GB of fp32 weights
    assert "fp32 weights while it is built" in message and "fewer ranks per node" in message


def test_a_model_that_fits_passes_and_the_override_silences_the_check() -> None:
    check_training_state_fits(preset("moe_small"), 1, 1, cpu(24.0))
    config = preset("mixtral_like")
    config = dataclasses.replace(config, distributed=DistributedConfig(check_memory=False))
    check_training_state_fits(config, 1, 1, cpu(24.0))


def test_moe_train_refuses_a_model_this_machine_cannot_hold_in_seconds(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(BIN / "moe-train"), "model=mixtral_like", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert re.search(r"config error: this model \(46\.\d\d B parameters, fp32\) needs [\d,.]+ GB", result.stderr)
    assert "Traceback" not in result.stderr


def test_deepseek_v3_preset_is_refused_with_its_671b_parameters_and_the_gpus_it_needs() -> None:
    """The full-size MLA + group-routed preset, loaded as Hydra loads it: 671,026,404,352 parameters at 16 B each
    (bf16 mixed precision) need ⌈10.7 TB / 80 GB⌉ = 135 ZeRO-3 GPUs of this kind."""
    config = preset("deepseek_v3_like", "deepspeed", 3, "bf16")
    assert config.model.num_params() == 671_026_404_352
    message = refusal(config, 8, 8, gpu(free_gb=80.0, host_gb=4000.0))
    assert "671.03 B parameters" in message
    assert "zero3 over at least 135 GPUs" in message
