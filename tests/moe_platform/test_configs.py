"""Every option of every config group composes, validates and builds; bad configs fail with one sentence."""

import itertools
import json
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from data_pipeline import DataError, build_loaders, prepare
from moe import Transformer
from moe_platform.config import (
    ConfigError,
    OptimConfig,
    TrainConfig,
    load_run_config,
    validate_launch,
)
from moe_platform.launch.compose import conf_dir, train_config
from moe_platform.parallel.accelerator import deepspeed_config

GROUPS = ("model", "data", "optim", "distributed", "logging", "experiment")
# Overrides that make an option runnable beside the defaults of the other groups.
COMPANIONS = {
    ("data", "hf_hub"): ["model=moe_small"],  # seq_len 1024 needs a longer max_seq_len than moe_tiny's
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def compose_config(overrides: list[str]) -> TrainConfig:
    return train_config(overrides)


def fitting_world_size(config: TrainConfig) -> int:
    """1 for a single process; otherwise the largest of 8, 4, 2 ranks whose micro-batches tile the global batch."""
    if config.distributed.strategy == "single":
        return 1
    micro_batches = config.data.global_batch_size // config.trainer.micro_batch_size
    fitting = [world for world in (8, 4, 2) if micro_batches % world == 0]
    assert fitting, f"global batch {config.data.global_batch_size} cannot be split over 2, 4 or 8 ranks"
    return fitting[0]


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_validates_and_builds(group: str, option: str) -> None:
    config = compose_config([f"{group}={option}", *COMPANIONS.get((group, option), [])])
    assert isinstance(config, TrainConfig)
    # Build the model: on the meta device (no memory) so the Mixtral/DeepSeek-sized shapes build too.
    with torch.device("meta"):
        model = Transformer(config.model)
    assert config.model.num_params() == sum(p.numel() for p in model.parameters())
    # Every option reaches the launch checks. Offloading parameters needs a GPU, so that option is checked as
    # the GPU machine it is written for would see it (validate_launch takes has_gpu as an argument).
    world = fitting_world_size(config)
    accum = validate_launch(config, world, has_gpu=config.distributed.offload_params)
    assert config.data.global_batch_size == config.trainer.micro_batch_size * accum * world
    dist = config.distributed
    if dist.strategy == "deepspeed":
        ds = deepspeed_config(config, accum, world)
        assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * accum * world
        assert ds["gradient_accumulation_steps"] == accum
        zero = ds["zero_optimization"]
        assert zero["stage"] == dist.zero_stage
        assert ("offload_optimizer" in zero) == dist.offload_optimizer
        assert ("offload_param" in zero) == dist.offload_params
        assert ds["bf16"]["enabled"] == (config.trainer.precision == "bf16")
    if dist.strategy == "fsdp":  # FSDP2's layout as the ledger and parallel/fsdp.py's meshes take it
        shape = config.run_shape(world)
        assert shape.fsdp and shape.zero_stage == 0 and shape.replicate_size == dist.fsdp.replicate_size
        assert world % dist.fsdp.replicate_size == 0


def test_every_distributed_option_reaches_the_deepspeed_or_fsdp_assertions() -> None:
    """The guard this file once had skipped them all with the default batch; name each option that must reach them."""
    reached = {"deepspeed": set(), "fsdp": set()}
    for option in options("distributed"):
        config = compose_config([f"distributed={option}"])
        world = fitting_world_size(config)
        accum = validate_launch(config, world, has_gpu=config.distributed.offload_params)
        if config.distributed.strategy == "deepspeed":
            assert deepspeed_config(config, accum, world)["zero_optimization"]["stage"] == config.distributed.zero_stage
        if config.distributed.strategy in reached:
            reached[config.distributed.strategy].add((option, config.distributed.fsdp.replicate_size))
    assert reached == {
        "deepspeed": {("zero1", 1), ("zero2", 1), ("zero3", 1), ("zero3_offload", 1)},
        "fsdp": {("fsdp", 1), ("hsdp", 2)},  # HSDP: 2 replicas of a shard over W/2 ranks
    }


def test_a_bug_while_building_the_config_keeps_its_traceback(monkeypatch) -> None:
    """Only users' config mistakes become one sentence; a programming error must not pass for one."""
    import moe.config

    def broken_post_init(self) -> None:
        raise KeyError("a bug, not a config mistake")

    monkeypatch.setattr(moe.config.ModelConfig, "__post_init__", broken_post_init)
    with pytest.raises(KeyError, match="a bug"):
        compose_config([])

    def type_bug(self) -> None:
        raise TypeError("another bug")

    monkeypatch.setattr(moe.config.ModelConfig, "__post_init__", type_bug)
    with pytest.raises(Exception, match="another bug") as excinfo:
        compose_config([])
    assert not isinstance(excinfo.value, ConfigError)


def test_the_default_is_the_tiny_moe_on_synthetic_data() -> None:
    config = compose_config([])
    assert config.model.moe is not None and config.data.source == "synthetic"
    assert config.distributed.strategy == "single" and config.resume == "none"


def test_shapes_of_the_named_presets() -> None:
    mixtral = compose_config(["model=mixtral_like"]).model
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.n_kv_heads) == (8, 2, 8)
    assert 46e9 < mixtral.num_params() < 47.5e9 and 12.5e9 < mixtral.num_active_params() < 13.5e9
    deepseek = compose_config(["model=deepseek_like"]).model
    assert deepseek.moe.num_shared_experts == 2 and not deepseek.is_moe_layer(0) and deepseek.is_moe_layer(1)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model.n_kv_heads=3"], "model.n_kv_heads=3"),
        (["model.moe.top_k=9"], "moe.top_k=9 exceeds moe.num_experts=4"),
        (["data.seq_len=1000"], "data.seq_len=1000 exceeds model.max_seq_len"),
        (["data.global_batch_size=30", "trainer.micro_batch_size=4"], "not a multiple of trainer.micro_batch_size"),
        (["optim.schedule=step"], "optim.schedule='step'"),
        (["trainer.precision=fp16"], "trainer.precision='fp16'"),
        (["distributed=ddp", "distributed.zero_stage=2"], "need distributed.strategy=deepspeed"),
        (["distributed=zero2", "distributed.offload_params=true"], "offload_params needs distributed.zero_stage=3"),
        (["trainer.stop_at=999"], "trainer.stop_at=999"),
        (["model.moe.first_dense_layers=4"], "moe.first_dense_layers=4 leaves no MoE layer in a 4-layer model"),
        (["distributed=ddp", "distributed.expert_parallel_size=3"], "does not divide model.moe.num_experts=4"),
        (["model=dense_tiny", "distributed=ddp", "distributed.expert_parallel_size=2"], "this model is dense"),
        (["distributed=zero3", "distributed.expert_parallel_size=2"], "does not work with ZeRO-3"),
        (["distributed.expert_parallel_size=2"], "needs several ranks"),
        (["distributed=ddp", "distributed.expert_parallel_size=0"], "must be >= 1"),
        (["distributed=fsdp", "distributed.expert_parallel_size=3"], "does not divide model.moe.num_experts=4"),
        (["distributed=hsdp", "distributed.fsdp.replicate_size=0"], "replicate_size=0 must be >= 1"),
        (
            ["distributed=fsdp", "distributed.zero_stage=3", "distributed.offload_params=true"],
            "distributed.zero_stage=3 and distributed.offload_params=true are DeepSpeed's",
        ),
        (
            ["distributed=zero2", "distributed.fsdp.reshard_after_forward=false"],
            "distributed.fsdp.reshard_after_forward=false sets FSDP2 up but distributed.strategy='deepspeed'",
        ),
    ],
)
def test_bad_configs_fail_with_one_sentence(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        compose_config(overrides)
    assert needle in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_unknown_keys_are_rejected_at_composition() -> None:
    with pytest.raises(ConfigCompositionException, match=r"model\.n_head"):
        compose_config(["model.n_head=4"])


@pytest.mark.parametrize(
    ("overrides", "world", "needle"),
    [
        ([], 2, "distributed=single but the launcher started 2 processes"),
        (["distributed=ddp", "data.global_batch_size=32", "trainer.micro_batch_size=8"], 3, "× world size"),
        (["distributed=zero3_offload"], 2, "there is no GPU"),
        (
            ["distributed=ddp", "distributed.expert_parallel_size=4", "data.global_batch_size=48"],
            6,
            "does not divide the 6 ranks",
        ),
        (
            ["distributed=hsdp", "distributed.expert_parallel_size=4", "data.global_batch_size=48"],
            6,
            "expert_parallel_size=4 does not divide the 6 ranks",
        ),
        (["distributed=hsdp", "data.global_batch_size=48"], 3, "replicate_size=2 does not divide the 3 ranks"),
        (["distributed=fsdp", "distributed.fsdp.cpu_offload=true"], 2, "distributed.fsdp.cpu_offload=true"),
    ],
)
def test_launch_checks(overrides: list[str], world: int, needle: str) -> None:
    config = compose_config(overrides)
    with pytest.raises(ConfigError, match=needle):
        validate_launch(config, world, has_gpu=False)


def test_global_batch_fixes_the_accumulation_for_any_world_size() -> None:
    config = compose_config(["distributed=zero2", "data.global_batch_size=64", "trainer.micro_batch_size=4"])
    for world, accum in ((1, 16), (2, 8), (4, 4), (16, 1)):
        assert validate_launch(config, world, has_gpu=False) == accum
        assert deepspeed_config(config, accum, world)["train_batch_size"] == 64


def test_deepspeed_config_is_derived_from_ours() -> None:
    config = compose_config(["distributed=zero3", "trainer.precision=bf16", "optim.grad_clip=0.5"])
    ds = deepspeed_config(config, grad_accum=2, world_size=2)
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["gradient_clipping"] == 0.5 and ds["zero_optimization"]["stage"] == 3
    assert ds["gradient_accumulation_steps"] == 2


def test_learning_rate_schedules() -> None:
    cosine = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert cosine.lr_at(0, 100) == pytest.approx(0.1) and cosine.lr_at(9, 100) == pytest.approx(1.0)
    assert cosine.lr_at(10, 100) == pytest.approx(1.0) and cosine.lr_at(100, 100) == pytest.approx(0.1)
    assert cosine.lr_at(55, 100) == pytest.approx(0.55)  # halfway through the decay: midpoint of [0.1, 1]
    linear = OptimConfig(lr=2.0, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert linear.lr_at(50, 100) == pytest.approx(1.0)
    constant = OptimConfig(lr=3.0, warmup_steps=2, schedule="constant")
    assert [constant.lr_at(s, 10) for s in (0, 1, 2, 9)] == pytest.approx([1.5, 3.0, 3.0, 3.0])
    lrs = [cosine.lr_at(s, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(lrs)), "decay is monotone"


def test_every_data_option_builds_its_loaders(tmp_path: Path) -> None:
    """synthetic, hf_local and tokenized (hf_local's corpus, prepared) build real loaders; hf_hub, offline here, fails
    with a DataError, not a trace."""
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(2000)))
    synthetic = compose_config(["data=synthetic"])
    hf_local = compose_config(["data=hf_local", f"data.hf.data_files=[{corpus}]", "data.seq_len=64",
                               "data.global_batch_size=8", f"data.hf.cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    prepare(hf_local.data.hf, hf_local.data.tokenizer, str(tmp_path / "shards"), progress=False)
    tokenized = compose_config(["data=tokenized", f"data.tokenized.path={tmp_path / 'shards'}", "data.seq_len=64",
                                "data.global_batch_size=8"])  # fmt: skip
    for config in (synthetic, hf_local, tokenized):
        loaders = build_loaders(config.data, 0, 1, config.trainer.micro_batch_size,
                                model_vocab_size=config.model.vocab_size)  # fmt: skip
        batch = next(iter(loaders.train))
        assert batch["input_ids"].shape == (config.trainer.micro_batch_size, config.data.seq_len)
        assert int(batch["input_ids"].max()) < config.model.vocab_size
    hub = compose_config(["data=hf_hub", "model=moe_small", f"data.hf.cache_dir={tmp_path / 'hub'}"])
    with pytest.raises(DataError):
        build_loaders(hub.data, 0, 1, hub.trainer.micro_batch_size, model_vocab_size=hub.model.vocab_size)


def test_one_knob_sets_how_much_each_evaluation_reads(tmp_path: Path) -> None:
    """data.val.max_batches alone: the trainer's old second knob is gone, and old saved configs are moved onto it."""
    with pytest.raises(ConfigCompositionException, match="eval_batches"):
        compose_config(["trainer.eval_batches=2"])
    assert compose_config(["data=hf_hub", "model=moe_small"]).data.val.max_batches == 8
    assert compose_config([]).data.val.max_batches == 4
    old = tmp_path / "config.yaml"
    saved = OmegaConf.to_container(OmegaConf.structured(compose_config([])))
    saved["trainer"]["eval_batches"] = 2
    saved["data"]["val"]["max_batches"] = None
    old.write_text(OmegaConf.to_yaml(saved))
    assert load_run_config(old).data.val.max_batches == 2
