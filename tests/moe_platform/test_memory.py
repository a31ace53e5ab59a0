"""The start-up memory check: the ledger's training state against the machine, refused in one sentence."""

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moe import ModelConfig
from moe.ledger import sharding_transient_bytes, training_state_bytes, training_state_bytes_per_rank
from moe_platform.config import ConfigError, DistributedConfig, FSDPConfig, TrainConfig, TrainerConfig
from moe_platform.launch.compose import conf_dir
from moe_platform.launch.memory import Memory, check_training_state_fits, training_state_demand
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
    # FSDP and ZeRO-3 build the model a block at a time, so sharding over machines like this one can make it fit.
    assert_names_the_fewest_ranks_that_fit(config, message, 1, cpu(24.0))


NAMED = re.compile(
    r"shard it with (distributed=(\w+)(?: distributed\.expert_parallel_size=(\d+))?) over at least (\d+) "
)


def layout(config: TrainConfig, strategy: str, ep: int, cpu_offload: bool = False) -> TrainConfig:
    """`config` under a named layout: distributed=zero3, or distributed=fsdp with `ep` expert-parallel ranks."""
    if strategy == "zero3":
        distributed = DistributedConfig(strategy="deepspeed", zero_stage=3)
    else:
        distributed = DistributedConfig(
            strategy="fsdp", expert_parallel_size=ep, fsdp=FSDPConfig(cpu_offload=cpu_offload)
        )
    return dataclasses.replace(config, distributed=distributed)


def fits(config: TrainConfig, world: int, local: int, memory: Memory) -> bool:
    try:
        check_training_state_fits(config, world, local, memory)
    except ConfigError:
        return False
    return True


def assert_names_the_fewest_ranks_that_fit(config: TrainConfig, message: str, local: int, memory: Memory) -> str:
    """The layout the refusal names fits on the ranks it names, and neither it nor any other sharded layout (ZeRO-3,
    FSDP at every EP size) fits on fewer. Returns the layout's overrides."""
    overrides, strategy, ep, ranks = NAMED.search(message).groups()
    ep, ranks = int(ep or 1), int(ranks)
    assert fits(layout(config, strategy, ep), ranks, local, memory), message
    experts = config.model.moe.num_experts if config.model.moe else 1
    others = [("zero3", 1)] + [("fsdp", e) for e in range(1, experts + 1) if experts % e == 0]
    for other, other_ep in others:
        fewer = (ranks - 1) // other_ep * other_ep  # the most ranks below `ranks` the layout can run on
        if fewer >= 1:
            assert not fits(layout(config, other, other_ep), fewer, local, memory), (other, other_ep, fewer, message)
    return overrides


@pytest.mark.parametrize(
    ("model", "strategy", "stage", "precision"),
    [("mixtral_like", "deepspeed", 3, "bf16"), ("mixtral_like", "fsdp", 0, "fp32"), ("moe_small", "ddp", 0, "fp32")],
)
def test_the_named_layout_is_the_smallest_that_fits(model: str, strategy: str, stage: int, precision: str) -> None:
    config = preset(model, strategy, stage, precision)
    memory = gpu(free_gb=80.0 if model != "moe_small" else 1.0, host_gb=4000.0)
    message = refusal(config, 8, 8, memory)
    assert "per GPU" in message
    assert_names_the_fewest_ranks_that_fit(config, message, 8, memory)
    offload = "distributed.fsdp.cpu_offload=true" if strategy == "fsdp" else "distributed=zero3_offload"
    assert offload in message


def test_fsdp_demand_is_the_ledgers_shards_plus_what_it_gathers_and_offload_moves_only_the_shards() -> None:
    for ep in (1, 8):
        config = layout(preset("mixtral_like", precision="bf16"), "fsdp", ep)
        run = config.run_shape(16)
        state = training_state_bytes_per_rank(config.model, run).total
        transient = sharding_transient_bytes(config.model, run).total
        assert training_state_demand(config, 16, has_gpu=True).device_bytes == pytest.approx(state + transient)
        offloaded = training_state_demand(layout(config, "fsdp", ep, cpu_offload=True), 16, has_gpu=True)
        assert offloaded.device_bytes == pytest.approx(transient) and offloaded.host_bytes == pytest.approx(state)
        # Built shard by shard: a rank's host memory holds at most one fp32 block, not the model.
        assert offloaded.build_host_bytes < config.model.num_params() * 4 / config.model.n_layers * 2
    hsdp = dataclasses.replace(
        config, distributed=DistributedConfig(strategy="fsdp", fsdp=FSDPConfig(replicate_size=2))
    )
    assert training_state_demand(hsdp, 16, True).device_bytes > training_state_demand(config, 16, True).device_bytes


def test_offload_moves_bytes_from_the_gpu_to_host_memory() -> None:
    on_gpu = preset("mixtral_like", "deepspeed", 3, "bf16")
    offloaded = preset("mixtral_like", "deepspeed", 3, "bf16", offload_optimizer=True, offload_params=True)
    memory = gpu(free_gb=40.0, host_gb=3000.0)
    refusal(on_gpu, 16, 8, memory)
    check_training_state_fits(offloaded, 16, 8, memory)
    # The offloaded state needs host memory: on 2 ranks each holds half of the bf16 weights, fp32 gradient partitions,
    # fp32 master and m, v (18 B/param: 420 GB), so 2 × 420 GB must fit the host.
    message = refusal(offloaded, 2, 2, gpu(free_gb=80.0, host_gb=600.0))
    assert "host memory for its training state on each of the 2 ranks of this node" in message
    assert "zero3 over at least 3 GPUs" in message
    check_training_state_fits(offloaded, 2, 2, gpu(free_gb=80.0, host_gb=850.0))


def test_building_the_whole_fp32_model_on_every_rank_counts_against_host_memory() -> None:
    """ZeRO-2 builds the whole model on every rank (8 × 187 GB of fp32 weights); FSDP and ZeRO-3 build a block at a
    time, so they are named, unless even a block per rank is too much for the host."""
    config = preset("mixtral_like", "deepspeed", 2, "bf16")
    memory = gpu(free_gb=200.0, host_gb=1000.0)
    message = refusal(config, 64, 8, memory)
    assert "fp32 weights while it is built" in message
    assert_names_the_fewest_ranks_that_fit(config, message, 8, memory)
    message = refusal(config, 64, 8, gpu(free_gb=200.0, host_gb=40.0))
    assert "fewer ranks per node" in message and "shard it" not in message


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
    """The full-size MLA + group-routed preset, loaded as Hydra loads it: 671,026,404,352 parameters. ZeRO-3 (18 B
    each in bf16) would gather a whole 256-expert MoE layer and its gradients, 2 × 22.6 GB; FSDP2 with EP gathers
    E/EP of them, so it is FSDP + EP that fits on the fewest GPUs."""
    config = preset("deepseek_v3_like", "deepspeed", 3, "bf16")
    assert config.model.num_params() == 671_026_404_352
    memory = gpu(free_gb=80.0, host_gb=4000.0)
    message = refusal(config, 8, 8, memory)
    assert "671.03 B parameters" in message
    overrides = assert_names_the_fewest_ranks_that_fit(config, message, 8, memory)
    assert overrides.startswith("distributed=fsdp distributed.expert_parallel_size="), message
