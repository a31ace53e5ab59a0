"""ZeRO-3 builds the model already partitioned, never whole on a rank, and with exactly the weights of a plain build;
every other strategy builds the plain model.

One process group of 2 real Accelerate/DeepSpeed ranks (gloo on 127.0.0.1) builds every case. `build_model` reads
the strategy from the config; the accelerator matters only under ZeRO-3 (its DeepSpeed config) and for the rank, so
the one ZeRO-3 Accelerator serves the other strategies' builds too. The reference is a plain `Transformer(config.model)`
built in the test process after the same seeding.
"""

import os
from dataclasses import replace

import pytest
import torch

from moe import Transformer
from moe_platform.config import TrainConfig, validate_launch
from moe_platform.launch.compose import train_config
from moe_platform.testing import FAST, run_distributed
from moe_platform.train.model_build import build_model, full_shape
from moe_platform.train.optimizers import param_groups
from moe_platform.train.seeding import seed_initial_weights

pytestmark = pytest.mark.slow
WORLD = 2
ZERO3_VARIANTS = ("moe_tiny", "tied_shared_dense", "moe_tiny_bf16")
OTHER_STRATEGIES = ("ddp", "zero1", "zero2")


def compose_config(*overrides: str) -> TrainConfig:
    return train_config([*FAST, "trainer.seed=3", *overrides])


def zero3_variants() -> dict[str, TrainConfig]:
    """moe_tiny as it is; with tied embeddings, learned positions, a dense first layer and shared experts (every
    init that runs after a sub-module is split: the model's reset_parameters, the shared experts'); moe_tiny in bf16
    (the precision is the config's: zero.Init always builds in fp32, whatever the DeepSpeed config says)."""
    config = compose_config("distributed=zero3")
    model = config.model
    moe = replace(model.moe, num_shared_experts=1, first_dense_layers=1)
    tied = replace(model, tie_embeddings=True, pos_encoding="learned", moe=moe)
    return {
        "moe_tiny": config,
        "tied_shared_dense": replace(config, model=tied),
        "moe_tiny_bf16": replace(config, trainer=replace(config.trainer, precision="bf16")),
    }


def plain_model(config: TrainConfig) -> Transformer:
    seed_initial_weights(config.trainer.seed)
    return Transformer(config.model)


def plain_weights(config: TrainConfig) -> dict[str, torch.Tensor]:
    """The small-scale reference: the whole model in one process; bf16 rounds the parameters as the engine does."""
    model = plain_model(config)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    dtype = torch.bfloat16 if config.trainer.precision == "bf16" else torch.float32
    return {name: t.to(dtype) if name in params else t for name, t in model.state_dict().items()}


def build_every_case_on_this_rank(
    rank: int, world_size: int, zero3: dict[str, TrainConfig], others: dict[str, TrainConfig]
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Each case built by build_model on this rank. ZeRO-3: what the rank holds during and after the build, and
    the weights gathered from all ranks; other strategies: the weights, and whether any parameter is partitioned."""
    import deepspeed

    from moe_platform.parallel.accelerator import build_accelerator

    # The variables torchrun would have set; the gloo group itself is run_distributed's.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    config = zero3["moe_tiny"]
    accelerator = build_accelerator(config, validate_launch(config, world_size, has_gpu=False), world_size)

    held: list[torch.nn.Parameter] = []
    peak = [0]

    def on_new_parameter(module, name, param):  # the moments a rank's memory for weights grows
        if param is not None:
            held.append(param)
            peak[0] = max(peak[0], sum(p.data.numel() for p in held))  # whole tensors; a shard lives in ds_tensor

    built = {}
    for variant, config in zero3.items():
        held.clear()
        peak[0] = 0
        hook = torch.nn.modules.module.register_module_parameter_registration_hook(on_new_parameter)
        try:
            model = build_model(config, accelerator)
        finally:
            hook.remove()
        params = list(model.parameters())
        built[variant] = {
            "full": sum(p.ds_numel for p in params),
            "shard": sum(p.ds_tensor.numel() for p in params),
            "tensors": len(params),
            "whole": sum(p.data.numel() for p in params),
            "peak_whole_during_build": peak[0],
            "shapes": {name: full_shape(p) for name, p in model.named_parameters()},
            "decay_groups": [len(g["params"]) for g in param_groups(model, config.optim)],
            "shard_dtypes": {p.ds_tensor.dtype for p in params},
            "tied": model.lm_head.weight is model.embed.weight,
        }
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            built[variant]["weights"] = {name: t.clone() for name, t in model.state_dict().items()}

    plain = {}
    for strategy, config in others.items():
        model = build_model(config, accelerator)
        plain[strategy] = {
            "weights": model.state_dict(),
            "partitioned": any(hasattr(p, "ds_id") for p in model.parameters()),
        }
    return built, plain


@pytest.fixture(scope="module")
def builds() -> tuple[dict[str, TrainConfig], list[tuple[dict, dict]]]:
    zero3 = zero3_variants()
    others = {strategy: compose_config(f"distributed={strategy}") for strategy in OTHER_STRATEGIES}
    ranks = run_distributed(build_every_case_on_this_rank, WORLD, zero3, others, timeout=300)
    return {**zero3, **others}, ranks


@pytest.mark.parametrize("variant", ZERO3_VARIANTS)
def test_zero3_build_equals_the_plain_build_bit_for_bit(builds, variant: str) -> None:
    configs, ranks = builds
    expected = plain_weights(configs[variant])
    for rank, (built, _) in enumerate(ranks):
        gathered = built[variant]["weights"]
        assert gathered.keys() == expected.keys()
        for name, tensor in expected.items():
            assert gathered[name].dtype == tensor.dtype, (rank, name)
            assert torch.equal(gathered[name], tensor), (rank, name)
        assert built[variant]["tied"] == configs[variant].model.tie_embeddings


@pytest.mark.parametrize("variant", ZERO3_VARIANTS)
def test_zero3_ranks_hold_only_their_shard_during_and_after_the_build(builds, variant: str) -> None:
    configs, ranks = builds
    config = configs[variant]
    full = config.model.num_params()
    plain = plain_model(config)
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in plain.modules())
    dtype = torch.bfloat16 if config.trainer.precision == "bf16" else torch.float32
    for built, _ in ranks:
        held = built[variant]
        assert held["full"] == full
        assert held["whole"] == 0, "after the build no parameter is whole on any rank"
        # 1/world of every parameter, each rounded up to a multiple of the world size.
        assert full / WORLD <= held["shard"] <= full / WORLD + held["tensors"]
        assert held["shard_dtypes"] == {dtype}
        # While building, a rank holds at most one module's parameters whole: the one being constructed.
        assert held["peak_whole_during_build"] == largest_module < full / 4
        # Shapes, for code that looks at them before training (weight-decay groups), come from full_shape.
        assert held["shapes"] == {name: p.shape for name, p in plain.named_parameters()}
        assert held["decay_groups"] == [len(g["params"]) for g in param_groups(plain, config.optim)]


@pytest.mark.parametrize("strategy", OTHER_STRATEGIES)
def test_other_strategies_build_the_plain_model(builds, strategy: str) -> None:
    configs, ranks = builds
    expected = plain_weights(configs[strategy])
    for _, plain in ranks:
        assert not plain[strategy]["partitioned"], "only ZeRO-3 builds partitioned"
        weights = plain[strategy]["weights"]
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[name], expected[name]) for name in expected)
