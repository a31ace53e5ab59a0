"""Bad configs fail at construction with one sentence that names the field and the fix."""

import pytest

from moe import ModelConfig


@pytest.mark.parametrize(
    ("overrides", "field", "fix"),
    [
        ({"n_heads": 6, "n_kv_heads": 4, "d_model": 96}, "n_kv_heads", "divides n_heads"),
        ({"n_heads": 4, "n_kv_heads": 8}, "n_kv_heads", "MHA"),
        ({"n_kv_heads": 0}, "n_kv_heads", "MQA"),
        ({"d_model": 130, "n_heads": 4}, "d_model", "head_dim"),
        ({"pos_encoding": "sinusoidal"}, "pos_encoding", "rope"),
        ({"norm": "batchnorm"}, "norm", "rmsnorm"),
        ({"activation": "relu"}, "activation", "swiglu"),
        ({"head_dim": 7, "pos_encoding": "rope"}, "head_dim", "even"),
        ({"dropout": 1.0}, "dropout", "[0, 1)"),
        ({"init_std": 0.0}, "init_std", "positive"),
        ({"vocab_size": 0}, "vocab_size", "positive"),
        ({"n_layers": -1}, "n_layers", "positive"),
        ({"rope_theta": -1.0}, "rope_theta", "positive"),
        ({"norm_eps": 0.0}, "norm_eps", "positive"),
        ({"attention": "linear"}, "attention", "mla"),
        ({"attention": "mla", "pos_encoding": "alibi"}, "attention=mla", "pos_encoding=rope"),
        ({"attention": "mla", "pos_encoding": "learned"}, "attention=mla", "pos_encoding=rope"),
        ({"attention": "mla", "n_heads": 4, "n_kv_heads": 2}, "n_kv_heads", "leave n_kv_heads unset"),
        ({"attention": "mla", "mla": {"qk_rope_head_dim": 5}}, "mla.qk_rope_head_dim", "even"),
        ({"attention": "mla", "mla": {"kv_lora_rank": 0}}, "mla.kv_lora_rank", "positive"),
        ({"attention": "mla", "mla": {"q_lora_rank": -4}}, "mla.q_lora_rank", "null for a full-rank query"),
        ({"mla": {"kv_lora_rank": 64}}, "mla", "set model.attention=mla"),
    ],
)
def test_bad_config_names_field_and_fix(overrides: dict, field: str, fix: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        ModelConfig(**overrides)
    message = str(excinfo.value)
    assert f"model.{field}" in message
    assert fix in message
    assert message.count("\n") == 0, "one sentence, not a trace"


def test_defaults_resolve_heads() -> None:
    config = ModelConfig(d_model=64, n_heads=8)
    assert config.n_kv_heads == 8 and config.head_dim == 8 and config.group_size == 1
    gqa = ModelConfig(d_model=64, n_heads=8, n_kv_heads=2)
    assert gqa.group_size == 4
