"""The start-up memory check: the planner's peak per rank against the machine, refused in one sentence that names
the layout moe-plan would run instead."""

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from data_pipeline.loader import DataConfig
from moe import ModelConfig
from moe.ledger import sharding_transient_bytes, training_state_bytes_per_rank
from moe_platform.config import ConfigError, DistributedConfig, FSDPConfig, TrainConfig, TrainerConfig, validate_launch
from moe_platform.launch.compose import conf_dir
from moe_platform.launch.memory import Memory, check_memory_fits, fitting_plans, memory_demand
from moe_platform.plan.layouts import Layout, apply_layout
from moe_platform.plan.memory import rank_memory
from moe_platform.testing import BIN, subprocess_env

GB = 1e9


def preset(model: str, strategy: str = "single", zero_stage: int = 0, precision: str = "fp32", **dist) -> TrainConfig:
    yaml = OmegaConf.load(conf_dir() / "model" / f"{model}.yaml")
    model_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml))
    return TrainConfig(
        model=model_config,
        distributed=DistributedConfig(strategy=strategy, zero_stage=zero_stage, **dist),
        trainer=TrainerConfig(precision=precision),
        # A batch wide enough for the layouts a refusal may name: up to 128 data-parallel ranks of micro-batch 8.
        data=DataConfig(global_batch_size=1024),
    )


def cpu(host_gb: float) -> Memory:
    return Memory(None, host_gb * GB, host_gb * GB)


def gpu(free_gb: float, host_gb: float) -> Memory:
    return Memory("NVIDIA H100 80GB HBM3", free_gb * GB, host_gb * GB)


def refusal(config: TrainConfig, world: int, local: int, memory: Memory) -> str:
    with pytest.raises(ConfigError) as excinfo:
        check_memory_fits(config, world, local, memory)
    message = str(excinfo.value)
    assert "\n" not in message and "distributed.check_memory=false" in message
    return message


NAMED = re.compile(
    r"run (?P<overrides>distributed=\S+(?: \S+=\S+)*?) instead"
    r"|launch (?P<nodes>\d+) nodes? like this one with (?P<overrides2>distributed=\S+(?: \S+=\S+)*?),"
)


def compose_named(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """`config` under the layout a refusal names, applied as its overrides say (plan/layouts.py's Layout fields)."""
    values = dict(o.split("=", 1) for o in overrides)
    strategy = values["distributed"]
    layout = Layout(
        strategy=strategy,
        expert_parallel_size=int(values.get("distributed.expert_parallel_size", 1)),
        pipeline_parallel_size=int(values.get("distributed.pipeline_parallel_size", 1)),
        schedule=values.get("distributed.pipeline.schedule", "1f1b"),
        micro_batch_size=int(values["trainer.micro_batch_size"]),
        checkpointing=values["trainer.activation_checkpointing"],
        replicate_size=int(values.get("distributed.fsdp.replicate_size", 1)),
    )
    assert layout.overrides() == overrides
    return apply_layout(config, layout)


def assert_the_named_layout_fits(config: TrainConfig, message: str, world: int, local: int, memory: Memory) -> None:
    """The layout a refusal names passes start-up validation and this check, on these ranks or on the nodes it says;
    when it says more nodes, no layout fits on half as many (nodes double)."""
    found = NAMED.search(message)
    assert found is not None, message
    overrides = (found.group("overrides") or found.group("overrides2")).split()
    nodes = int(found.group("nodes")) if found.group("nodes") else None
    ranks = world if nodes is None else nodes * local
    named = compose_named(config, overrides)
    validate_launch(named, ranks, has_gpu=memory.gpu is not None)
    check_memory_fits(named, ranks, local, memory)
    if nodes is None:  # the fastest of those that fit these ranks
        assert overrides == fitting_plans(config, world, local, memory)[0].layout.overrides()
    elif nodes > 1:
        assert not fitting_plans(config, nodes // 2 * local, local, memory)


def layout(config: TrainConfig, strategy: str, ep: int, cpu_offload: bool = False) -> TrainConfig:
    """`config` under distributed=fsdp with `ep` expert-parallel ranks (and FSDP's CPU offload)."""
    assert strategy == "fsdp"
    distributed = DistributedConfig(strategy="fsdp", expert_parallel_size=ep, fsdp=FSDPConfig(cpu_offload=cpu_offload))
    return dataclasses.replace(config, distributed=distributed)


def test_mixtral_on_a_small_cpu_machine_is_refused_with_both_numbers() -> None:
    config = preset("mixtral_like")
    needed = memory_demand(config, 1, has_gpu=False)
    message = refusal(config, 1, 1, cpu(24.0))
    assert f"{max(needed.host_bytes, needed.build_host_bytes) / GB:,.1f} GB" in message
    assert "24.0 GB available" in message and "model=moe_small" in message
    # FSDP and PP build the model a block at a time, so enough machines like this one can hold it.
    assert_the_named_layout_fits(config, message, 1, 1, cpu(24.0))


@pytest.mark.parametrize(
    ("model", "strategy", "stage", "precision", "free_gb"),
    [("mixtral_like", "deepspeed", 3, "bf16", 80.0), ("mixtral_like", "fsdp", 0, "fp32", 80.0),
     ("moe_small", "ddp", 0, "fp32", 1.0)],
)  # fmt: skip
def test_a_refusal_names_the_plan_that_fits(model: str, strategy: str, stage: int, precision: str, free_gb) -> None:
    config = preset(model, strategy, stage, precision)
    memory = gpu(free_gb=free_gb, host_gb=4000.0)
    message = refusal(config, 8, 8, memory)
    assert "per GPU at its peak" in message
    assert_the_named_layout_fits(config, message, 8, 8, memory)


def test_demand_is_the_planners_peak_and_offload_moves_its_part_to_host_memory() -> None:
    for ep in (1, 8):
        config = layout(preset("mixtral_like", precision="bf16"), "fsdp", ep)
        peak = rank_memory(config, 16)
        run = config.run_shape(16)
        state = training_state_bytes_per_rank(config.model, run).total
        transient = sharding_transient_bytes(config.model, run).total
        assert memory_demand(config, 16, has_gpu=True).device_bytes == pytest.approx(peak.total)
        assert peak.total >= state + transient  # and activations, and buffers
        offloaded = memory_demand(layout(config, "fsdp", ep, cpu_offload=True), 16, has_gpu=True)
        assert offloaded.device_bytes < peak.total and offloaded.host_bytes > 0
        assert offloaded.device_bytes + offloaded.host_bytes == pytest.approx(peak.total, rel=0.01)
        # Built shard by shard: a rank's host memory holds at most one fp32 block, not the model.
        assert offloaded.build_host_bytes < config.model.num_params() * 4 / config.model.n_layers * 2


def test_offload_moves_bytes_from_the_gpu_to_host_memory() -> None:
    on_gpu = preset("mixtral_like", "deepspeed", 3, "bf16")
    offloaded = preset("mixtral_like", "deepspeed", 3, "bf16", offload_optimizer=True, offload_params=True)
    memory = gpu(free_gb=40.0, host_gb=3000.0)
    refusal(on_gpu, 16, 8, memory)
    check_memory_fits(offloaded, 16, 8, memory)
    # The offloaded state needs host memory: on 2 ranks each holds half of it, ~420 GB, so 2 × that must fit.
    message = refusal(offloaded, 2, 2, gpu(free_gb=80.0, host_gb=600.0))
    assert "host memory for its offloaded state on each of the 2 ranks of this node" in message
    check_memory_fits(offloaded, 2, 2, gpu(free_gb=80.0, host_gb=900.0))


def test_building_the_whole_fp32_model_on_every_rank_counts_against_host_memory() -> None:
    """ZeRO-2 builds the whole model on every rank (8 × 187 GB of fp32 weights); the layout named instead builds a
    block at a time; and when even that is too much for the host, nothing is named."""
    config = preset("mixtral_like", "deepspeed", 2, "bf16")
    memory = gpu(free_gb=200.0, host_gb=1000.0)
    message = refusal(config, 64, 8, memory)
    assert "fp32 weights while it is built" in message
    assert_the_named_layout_fits(config, message, 64, 8, memory)
    message = refusal(config, 64, 8, gpu(free_gb=200.0, host_gb=40.0))
    assert "instead" not in message and "launch" not in message


def test_a_model_that_fits_passes_and_the_override_silences_the_check() -> None:
    check_memory_fits(preset("moe_small"), 1, 1, cpu(24.0))
    config = preset("mixtral_like")
    config = dataclasses.replace(config, distributed=DistributedConfig(check_memory=False))
    check_memory_fits(config, 1, 1, cpu(24.0))


def test_moe_train_refuses_a_model_this_machine_cannot_hold_in_seconds(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(BIN / "moe-train"), "model=mixtral_like", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert re.search(r"config error: this model \(46\.\d\d B parameters, fp32\) needs [\d,.]+ GB", result.stderr)
    assert "Traceback" not in result.stderr


def test_deepseek_v3_preset_is_refused_with_its_671b_parameters_and_the_gpus_it_needs() -> None:
    """The full-size MLA + group-routed preset, loaded as Hydra loads it: 682,636,472,320 parameters (671,026,404,352
    and the MTP module's), far more than 8 GPUs hold in any layout, so the refusal names the fewest nodes (doubling)
    on which moe-plan finds one."""
    config = preset("deepseek_v3_like", "deepspeed", 3, "bf16")
    assert config.model.num_params() == 682_636_472_320
    memory = gpu(free_gb=80.0, host_gb=4000.0)
    message = refusal(config, 8, 8, memory)
    assert "682.64 B parameters" in message
    assert_the_named_layout_fits(config, message, 8, 8, memory)
