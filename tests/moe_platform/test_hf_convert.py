"""Hugging Face conversion: exact logits and greedy tokens both ways, bit-exact round trips, one-sentence refusals.

Every model is tiny, random and made here (transformers' own config classes, `save_pretrained` into tmp_path);
nothing is downloaded.
"""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from moe import ModelConfig, MoEConfig, Transformer
from moe.moe_config import RouterConfig
from moe_platform.interop.export import load_exported_model
from moe_platform.interop.export import main as moe_export
from moe_platform.interop.hf import ConversionError, from_hf, hf_architecture, to_hf
from moe_platform.testing import moe_train, subprocess_env

VOCAB, ATOL = 96, 1e-5
SMALL = dict(vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64)


def moe(**kwargs) -> MoEConfig:
    return MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_d_ff": 24, **kwargs})


EXPORT_CASES = {
    "llama": (ModelConfig(n_layers=2, attention_bias=True, ffn_bias=True, **SMALL), "LlamaForCausalLM"),
    "llama_tied_head_dim": (ModelConfig(n_layers=2, tie_embeddings=True, head_dim=16, **SMALL), "LlamaForCausalLM"),
    # Training-time capacity and jitter do not exist at inference (eval is dropless here): still exact.
    "mixtral": (
        ModelConfig(n_layers=2, **SMALL, moe=moe(capacity_factor=1.0, router=RouterConfig(jitter_eps=0.1))),
        "MixtralForCausalLM",
    ),
    "mixtral_softmax_after_topk": (
        ModelConfig(n_layers=2, **SMALL, moe=moe(router=RouterConfig(softmax_after_topk=True))),
        "MixtralForCausalLM",
    ),
    "qwen2_moe_interleaved": (ModelConfig(n_layers=4, **SMALL, moe=moe(moe_layer_interval=2)), "Qwen2MoeForCausalLM"),
    "qwen2_moe_shared": (
        ModelConfig(n_layers=3, **SMALL, moe=moe(num_shared_experts=2, first_dense_layers=1)),
        "Qwen2MoeForCausalLM",
    ),
    "qwen2_moe_top1_unnormalised": (
        ModelConfig(n_layers=2, **SMALL, moe=moe(top_k=1, router=RouterConfig(renormalize_topk=False))),
        "Qwen2MoeForCausalLM",
    ),
}


def inference_view(config: ModelConfig) -> ModelConfig:
    """`config` without what HF configs do not hold because inference never reads it: training-time capacity,
    jitter, z-loss, the softmax-after-top-k spelling of renormalised gates, and the unused dense d_ff of an
    all-MoE model."""
    if config.moe is None:
        return config
    router = RouterConfig(renormalize_topk=config.moe.router.renormalize_topk or config.moe.router.softmax_after_topk)
    moe_view = replace(config.moe, capacity_factor=None, z_loss_coef=0.0, router=router)
    every_layer_moe = all(config.is_moe_layer(i) for i in range(config.n_layers))
    return replace(config, moe=moe_view, d_ff=1 if every_layer_moe else config.d_ff)


def randomize(module: torch.nn.Module, std: float = 0.2) -> None:
    """Every parameter (biases and norm gains included) random, so no mapping error hides behind zeros or ones."""
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, std)


def save_and_load(model: transformers.PreTrainedModel, directory: Path) -> transformers.PreTrainedModel:
    model.save_pretrained(directory)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def assert_same_predictions(ours: Transformer, theirs: transformers.PreTrainedModel) -> float:
    """Logits to ATOL on random tokens, and the same greedy tokens; returns the max abs logit difference."""
    ids_BT = torch.randint(0, ours.config.vocab_size, (2, 12))
    with torch.no_grad():
        ours_BTV, theirs_BTV = ours.eval()(ids_BT).logits, theirs(ids_BT).logits
    diff = (ours_BTV - theirs_BTV).abs().max().item()
    assert diff <= ATOL, diff
    prompt_BT = ids_BT[:, :5]
    expected_BT = ours.generate(prompt_BT, max_new_tokens=8, temperature=0)
    got_BT = theirs.generate(prompt_BT, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(expected_BT, got_BT)
    return diff


@pytest.mark.parametrize("name", EXPORT_CASES)
def test_export_matches_transformers_and_round_trips(name, tmp_path):
    config, architecture = EXPORT_CASES[name]
    assert hf_architecture(config) == architecture
    ours = Transformer(config)
    randomize(ours)
    hf_config, hf_state = to_hf(config, ours.state_dict())
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    theirs.load_state_dict(hf_state, strict=True)
    theirs = save_and_load(theirs, tmp_path)
    assert type(theirs).__name__ == architecture
    diff = assert_same_predictions(ours, theirs)
    print(f"{name}: max |Δlogit| = {diff:.2e}")

    # ours -> HF -> ours is bit-exact in the weights; the config comes back up to what inference never reads.
    back_config, back_state = from_hf(theirs.config, theirs.state_dict())
    assert inference_view(back_config) == inference_view(config)
    ours_state = ours.state_dict()
    assert back_state.keys() == ours_state.keys()
    for key, tensor in ours_state.items():
        assert torch.equal(back_state[key], tensor), key


def _qwen2_moe_zero_shared_gate(model: transformers.PreTrainedModel) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("shared_expert_gate.weight"):
                param.zero_()


HF_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
IMPORT_CASES = {
    "llama": lambda: transformers.LlamaConfig(
        intermediate_size=48,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        **HF_COMMON,
    ),
    "qwen2_qkv_bias": lambda: transformers.Qwen2Config(intermediate_size=48, tie_word_embeddings=True, **HF_COMMON),
    "mixtral": lambda: transformers.MixtralConfig(
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **HF_COMMON
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[0],
        **HF_COMMON,
    ),
}


@pytest.mark.parametrize("name", IMPORT_CASES)
def test_import_matches_transformers(name, tmp_path):
    made = transformers.AutoModelForCausalLM.from_config(IMPORT_CASES[name](), dtype=torch.float32)
    randomize(made)
    _qwen2_moe_zero_shared_gate(made)
    theirs = save_and_load(made, tmp_path)
    config, state = from_hf(tmp_path)  # the directory alone, as init.from_path gives it
    ours = Transformer(config)
    ours.load_state_dict(state, strict=True)
    diff = assert_same_predictions(ours, theirs)
    print(f"import {name}: max |Δlogit| = {diff:.2e}")


def refuse(config: ModelConfig, needle: str) -> None:
    with pytest.raises(ConversionError, match=needle) as info:
        hf_architecture(config)
    assert str(info.value).count(". ") == 0  # one sentence


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (dict(pos_encoding="learned"), "model.pos_encoding=.learned. has no exact equivalent"),
        (dict(norm="layernorm"), "model.norm='layernorm'"),
        (dict(activation="gelu"), "model.activation='gelu'"),
        (dict(moe=moe(router=RouterConfig(score_fn="sigmoid"))), "score_fn='sigmoid'"),
        (dict(moe=moe(router=RouterConfig(bias_update_rate=1e-3))), "aux-loss-free balancing"),
        (dict(moe=moe(eval_capacity_factor=1.25)), "drops tokens at inference"),
        (dict(ffn_bias=True, moe=moe(first_dense_layers=1)), "ffn_bias=True in the dense layers"),
    ],
)
def test_unrepresentable_config_is_refused(overrides, needle):
    refuse(ModelConfig(n_layers=2, **{**SMALL, **overrides}), needle)


def test_nonzero_attention_output_bias_is_refused_for_qwen2_moe():
    config = ModelConfig(n_layers=2, attention_bias=True, **SMALL, moe=moe(num_shared_experts=1))
    ours = Transformer(config)
    randomize(ours)
    with pytest.raises(ConversionError, match="non-zero attention output bias"):
        to_hf(config, ours.state_dict())


@pytest.mark.parametrize(
    ("name", "edit", "needle"),
    [
        ("qwen2_moe", "gate", "shared_expert_gate is not zero"),
        ("mixtral", "top1", "top-1 routing"),
        ("mixtral", "sliding", "sliding-window attention"),
        ("qwen2_moe", "odd_shared", "not a multiple of moe_intermediate_size"),
    ],
)
def test_unrepresentable_import_is_refused(name, edit, needle):
    hf_config = IMPORT_CASES[name]()
    if edit == "top1":
        hf_config.num_experts_per_tok = 1
    elif edit == "sliding":
        hf_config.sliding_window = 16
    elif edit == "odd_shared":
        hf_config.shared_expert_intermediate_size = 24
    made = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize(made)
    with pytest.raises(ConversionError, match=needle):
        from_hf(made.config, made.state_dict())


def _export_and_compare(checkpoint: Path, out: Path) -> transformers.PreTrainedModel:
    moe_export([str(checkpoint), str(out), "--format", "hf", "--max-shard-size", "100KB"])
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1  # sharded past the limit
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    diff = assert_same_predictions(load_exported_model(checkpoint), theirs)
    print(f"cli {checkpoint}: max |Δlogit| = {diff:.2e}")
    return theirs


def test_cli_exports_a_trained_checkpoint(tmp_path):
    moe_train(tmp_path / "run", "trainer.save_final=true", "trainer.max_steps=2")
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    theirs = _export_and_compare(checkpoint, tmp_path / "hf")
    assert theirs.generation_config.eos_token_id == 256 and theirs.generation_config.pad_token_id == 257
    assert not (tmp_path / "hf" / "tokenizer.json").exists()  # byte-level: there is no HF tokenizer to ship
    # The default format still writes one state dict.
    moe_export([str(checkpoint), str(tmp_path / "model.pt")])
    assert (
        torch.load(tmp_path / "model.pt", weights_only=True).keys()
        == load_exported_model(checkpoint).state_dict().keys()
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "sharded", [["distributed=zero3"], ["distributed=ddp", "distributed.expert_parallel_size=2"]], ids=["zero3", "ep2"]
)
def test_cli_exports_a_sharded_checkpoint_whole(tmp_path, sharded):
    """ZeRO-3 partitions every parameter over the ranks, EP splits the experts: the HF export holds the whole model,
    the same as the consolidated one a 1-process run's checkpoint gives."""
    moe_train(tmp_path / "run", "trainer.save_final=true", "trainer.max_steps=2", *sharded, nproc=2)
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    theirs = _export_and_compare(checkpoint, tmp_path / "hf")
    assert theirs.config.num_local_experts == load_exported_model(checkpoint).config.moe.num_experts


def test_cli_ships_the_runs_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"w{i}": i for i in range(200)} | {"UNK": 200, "EOS": 201}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="UNK"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rows = ({"text": " ".join(f"w{(7 * i + j) % 200}" for j in range(120)), "id": i} for i in range(400))
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    subprocess.run(
        [
            str(Path(sys.executable).parent / "moe-train"),
            "model=moe_tiny",
            "data=hf_local",
            "data.seq_len=32",
            "data.global_batch_size=8",
            "trainer.micro_batch_size=2",
            "trainer.max_steps=1",
            "trainer.eval_every=0",
            "trainer.save_final=true",
            "logging.progress_bar=false",
            f"data.hf.data_files=[{tmp_path / 'corpus.jsonl'}]",
            f"data.hf.cache_dir={tmp_path / 'cache'}",
            f"data.tokenizer.name_or_path={tmp_path / 'tokenizer.json'}",
            "data.tokenizer.eos_token=EOS",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        check=True,
        capture_output=True,
        env=subprocess_env(),
        timeout=300,
    )
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    theirs = _export_and_compare(checkpoint, tmp_path / "hf")
    shipped = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert shipped.eos_token == "EOS" and theirs.generation_config.eos_token_id == 201
    assert shipped("w3 w17 w199", add_special_tokens=False).input_ids == [3, 17, 199]


def test_cli_refuses_an_unrepresentable_checkpoint_in_one_sentence(tmp_path, capsys):
    moe_train(tmp_path / "run", "trainer.save_final=true", "trainer.max_steps=1", "model.moe.router.score_fn=sigmoid")
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    with pytest.raises(SystemExit) as info:
        moe_export([str(checkpoint), str(tmp_path / "hf"), "--format", "hf"])
    assert info.value.code == 2
    assert "moe.router.score_fn='sigmoid' routing has no exact equivalent" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()  # refused before anything is written
