"""`init.from_path` / `init.upcycle`: a run starts from a checkpoint's weights exactly, under every strategy."""

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from moe import ModelConfig, Transformer
from moe.moe_config import MoEConfig
from moe_platform.checkpoint.catalog import latest_checkpoint
from moe_platform.checkpoint.consolidate import export_fp32_state_dict
from moe_platform.config import ConfigError, InitConfig, TrainConfig, load_run_config
from moe_platform.interop.init_from import initial_state_dict
from moe_platform.testing import (
    FAST,
    PRESTARTED,
    first_batch_loss,
    lm_loss_on_the_first_batch,
    moe_train,
    read_metrics,
    subprocess_env,
)

# moe_tiny with experts as wide as dense_tiny's FFN: the exact upcycling case (interop/upcycle.py), dropless by default.
UPCYCLE = ["model=moe_tiny", "model.moe.expert_d_ff=256", "init.upcycle=true"]


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("dense")
    moe_train(run_dir, "model=dense_tiny", "trainer.save_final=true")
    return run_dir


@pytest.fixture(scope="module")
def source_loss(dense_run) -> float:
    return first_batch_loss(dense_run)


def _losses(run_dir: Path) -> list[float]:
    train, _ = read_metrics(run_dir)
    return [train[step]["loss"] for step in sorted(train)]


def test_init_from_a_checkpoint_starts_at_its_loss(dense_run, source_loss, tmp_path):
    moe_train(tmp_path, "model=dense_tiny", f"init.from_path={dense_run}", "trainer.max_steps=1")
    assert _losses(tmp_path)[0] == pytest.approx(source_loss, rel=1e-6)


def test_upcycled_run_starts_at_the_dense_loss_and_trains(dense_run, source_loss, tmp_path):
    moe_train(tmp_path, *UPCYCLE, f"init.from_path={dense_run}", "trainer.max_steps=20")
    losses = _losses(tmp_path)
    assert len(losses) == 20
    assert losses[0] == pytest.approx(source_loss, rel=1e-6)  # step 1's loss is taken before its update
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["model=dense_tiny", "distributed=ddp"],
        ["model=dense_tiny", "distributed=zero3"],
        [*UPCYCLE, "distributed=zero3"],
        [*UPCYCLE, "distributed=ddp", "distributed.expert_parallel_size=2"],
    ],
    ids=["ddp", "zero3", "upcycle_zero3", "upcycle_ep2"],
)
def test_init_from_under_two_ranks_starts_at_the_source_loss(dense_run, source_loss, tmp_path, overrides):
    moe_train(tmp_path, *overrides, f"init.from_path={dense_run}", "trainer.max_steps=2", nproc=2)
    assert _losses(tmp_path)[0] == pytest.approx(source_loss, rel=1e-6)


def _moe_train_without_model_choice(run_dir: Path, *overrides: str):
    """moe-train with testing.FAST's settings but no `model=...`, so that init.from_path supplies the model; forked
    from the prestarted moe-train as `moe_train` runs it (which always passes FAST's model=)."""
    args = [a for a in FAST if not a.startswith("model=")] + [*overrides, f"hydra.run.dir={run_dir}"]
    return PRESTARTED.run(args, 1, subprocess_env(), timeout=300)


def test_the_model_config_is_read_from_the_source(dense_run, source_loss, tmp_path):
    result = _moe_train_without_model_choice(
        tmp_path / "adopted", f"init.from_path={dense_run}", "model.dropout=0.0", "trainer.max_steps=1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(tmp_path / "adopted")[0] == pytest.approx(source_loss, rel=1e-6)
    model = load_run_config(tmp_path / "adopted" / "config.yaml").model
    assert (model.moe, model.d_ff) == (None, 256)  # dense_tiny's, not the default model=moe_tiny
    upcycled = _moe_train_without_model_choice(
        tmp_path / "upcycled", f"init.from_path={dense_run}", "init.upcycle=true", "model.moe.expert_d_ff=256",
        "trainer.max_steps=1",
    )  # fmt: skip
    assert upcycled.returncode == 0, upcycled.stderr[-3000:]
    assert _losses(tmp_path / "upcycled")[0] == pytest.approx(source_loss, rel=1e-6)
    assert load_run_config(tmp_path / "upcycled" / "config.yaml").model.moe.num_experts == 4  # the default model's
    refused = _moe_train_without_model_choice(tmp_path / "refused", f"init.from_path={dense_run}", "model.d_ff=128")
    assert refused.returncode != 0
    assert "config error: model.d_ff=128 contradicts 256 in init.from_path's config" in refused.stderr


@pytest.mark.slow
def test_an_moe_checkpoint_of_zero2_with_expert_parallelism_starts_a_single_process_run(tmp_path):
    moe_train(
        tmp_path / "moe", "trainer.save_final=true", "distributed=zero2", "distributed.expert_parallel_size=2", nproc=2
    )
    moe_train(tmp_path / "single", f"init.from_path={tmp_path / 'moe'}", "trainer.max_steps=1")
    assert _losses(tmp_path / "single")[0] == pytest.approx(first_batch_loss(tmp_path / "moe"), rel=1e-6)


def _config(model: ModelConfig, from_path: Path, upcycle: bool = False) -> TrainConfig:
    return TrainConfig(model=model, init=InitConfig(from_path=str(from_path), upcycle=upcycle))


def test_a_contradicting_model_override_is_refused_naming_the_key(dense_run):
    saved = load_run_config(latest_checkpoint(dense_run) / "config.yaml").model
    for change, key in (({"d_ff": 128}, "model.d_ff=128"), ({"n_kv_heads": 4}, "model.n_kv_heads=4")):
        with pytest.raises(ConfigError, match=f"{key} contradicts") as err:
            initial_state_dict(_config(dataclasses.replace(saved, **change), dense_run))
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"add init.upcycle=true"):
        initial_state_dict(_config(dataclasses.replace(saved, moe=MoEConfig(4, 2, 256)), dense_run))
    # dropout and init_std shape no weight: a run may change them
    assert initial_state_dict(_config(dataclasses.replace(saved, dropout=0.1), dense_run)) is not None


def test_a_hugging_face_dir_loads_exactly_and_upcycles(dense_run, tmp_path):
    from moe_platform.interop.hf import to_hf

    saved = load_run_config(latest_checkpoint(dense_run) / "config.yaml").model
    state = export_fp32_state_dict(latest_checkpoint(dense_run))
    hf_config, hf_state = to_hf(saved, state)
    llama = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    llama.load_state_dict(hf_state, strict=True)
    llama.save_pretrained(tmp_path / "hf")
    loaded = initial_state_dict(_config(saved, tmp_path / "hf"))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    moe_tiny = dataclasses.replace(saved, moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=256))
    Transformer(moe_tiny).load_state_dict(initial_state_dict(_config(moe_tiny, tmp_path / "hf", upcycle=True)))


def test_an_exported_pt_loads_and_upcycles(dense_run, tmp_path):
    saved = load_run_config(latest_checkpoint(dense_run) / "config.yaml").model
    state = export_fp32_state_dict(latest_checkpoint(dense_run))
    torch.save(state, tmp_path / "dense.pt")
    loaded = initial_state_dict(_config(saved, tmp_path / "dense.pt"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    moe_tiny = dataclasses.replace(saved, moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=256))
    upcycled = initial_state_dict(_config(moe_tiny, tmp_path / "dense.pt", upcycle=True))
    Transformer(moe_tiny).load_state_dict(upcycled, strict=True)


def test_upcycle_needs_a_source_and_an_moe_model():
    dense = ModelConfig()
    with pytest.raises(ConfigError, match=r"init.upcycle=true needs a dense model to upcycle"):
        InitConfig(upcycle=True)
    with pytest.raises(ConfigError, match=r"init.upcycle=true turns dense FFNs into experts but model.moe is null"):
        _config(dense, Path("x"), upcycle=True)


def test_a_missing_source_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        initial_state_dict(_config(ModelConfig(), tmp_path / "nope"))


def test_a_hugging_face_deepseek_v3_dir_is_adopted_and_starts_at_its_loss(tmp_path):
    """No `model=...`: the run takes MLA, sigmoid group-limited routing and the selection bias from the HF dir's
    config, loads its weights exactly, and its first loss is transformers' own loss on that batch. An override of
    the source's own MLA settings (absorb_decode, a free field) applies on top of the adopted model."""

    hf_config = transformers.DeepseekV3Config(
        vocab_size=258, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64, num_mtp_layers=0,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in theirs.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    theirs.save_pretrained(tmp_path / "hf")
    result = _moe_train_without_model_choice(
        tmp_path / "run", f"init.from_path={tmp_path / 'hf'}", "trainer.max_steps=1", "model.mla.absorb_decode=false"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = load_run_config(tmp_path / "run" / "config.yaml")
    assert (config.model.attention, config.model.mla.kv_lora_rank) == ("mla", 16)
    assert config.model.mla.absorb_decode is False
    assert config.model.moe.router.n_group == 4 and config.model.moe.router.bias_update_rate > 0
    hf_loss = lm_loss_on_the_first_batch(lambda input_ids: theirs(input_ids).logits, config)
    assert _losses(tmp_path / "run")[0] == pytest.approx(hf_loss, rel=1e-5)
