"""conf/model/deepseek_v3_like.yaml is DeepSeek-V3's shape: our analytic parameter count equals the real module and
transformers' `DeepseekV3ForCausalLM` built from the same full-size config (both on the meta device: no memory, no
download), and lands on the paper's 671B total / 37B active for the main model. The multi-token-prediction (MTP)
module, which ours builds (model.mtp.depth=1) and transformers' causal LM does not, is counted apart
(`ParameterCount.mtp_total`) and checked against the MTP layer transformers builds for speculative decoding.

DeepSeek-V3 (arXiv 2412.19437, §2.2): one MTP module of a projection M [2D → D] over [RMSNorm(h) ; RMSNorm(Emb(t))],
one transformer block (MLA + MoE), and the main model's embedding and output head (shared, not counted again).
The Hugging Face checkpoint (layer 61) also stores the final norm before that shared head, and copies of the
embedding and head.
"""

from pathlib import Path

import pytest
import torch
import transformers
import yaml

from moe import ModelConfig, MoEConfig, Transformer, count_parameters
from moe.model import Block
from moe.moe_config import RouterConfig
from moe.mtp_config import MTPConfig

PRESET = Path(__file__).parents[2] / "conf" / "model" / "deepseek_v3_like.yaml"
PUBLISHED_TOTAL, PUBLISHED_ACTIVE = 671e9, 37e9  # the paper's rounded figures


def preset_config() -> ModelConfig:
    fields = yaml.safe_load(PRESET.read_text())
    moe = fields.pop("moe")
    router, mtp = RouterConfig(**moe.pop("router")), MTPConfig(**fields.pop("mtp"))
    return ModelConfig(**fields, moe=MoEConfig(**moe, router=router), mtp=mtp)


def hf_config(config: ModelConfig) -> object:
    """DeepSeek-V3's config.json fields, written out here from our config (not through moe_platform.interop's
    conversion, so the mapping is checked, not reused); num_mtp_layers=0: the main model only."""
    mla, moe = config.mla, config.moe
    return transformers.DeepseekV3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        moe_intermediate_size=moe.expert_d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        n_shared_experts=moe.num_shared_experts,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        first_k_dense_replace=moe.first_dense_layers,
        n_group=moe.router.n_group,
        topk_group=moe.router.topk_group,
        routed_scaling_factor=moe.router.routed_scaling_factor,
        norm_topk_prob=moe.router.renormalize_topk,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        num_mtp_layers=0,
    )


def num_params(module: torch.nn.Module) -> int:
    """Parameters only: the routers' selection bias is a buffer on both sides (e_score_correction_bias in HF)."""
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return preset_config()


def test_preset_count_lands_on_the_papers_671b_total_and_37b_active(config: ModelConfig) -> None:
    """The paper's figures are the main model's; the preset also trains one MTP module (the paper's D = 1)."""
    params = count_parameters(config)
    assert config.mtp.depth == 1
    assert params.main_total == pytest.approx(PUBLISHED_TOTAL, rel=1e-3)
    assert params.main_active == pytest.approx(PUBLISHED_ACTIVE, rel=0.02)
    assert params.total == params.main_total + params.mtp_total


def test_analytic_count_equals_our_module_and_transformers_on_meta(config: ModelConfig) -> None:
    """Three independent counts agree exactly: the formula, our Transformer (MTP module included), and HF's
    DeepseekV3ForCausalLM, which builds the main model only."""
    with torch.device("meta"):
        ours = Transformer(config)
        theirs = transformers.DeepseekV3ForCausalLM(hf_config(config))
    # transformers builds no MTP layer from a config (only generation's MtpModel adds one); check, not assume.
    assert not any(name.startswith(f"model.layers.{config.n_layers}.") for name, _ in theirs.named_parameters())
    assert len(theirs.model.layers) == config.n_layers
    params = count_parameters(config)
    assert num_params(ours) == params.total
    assert num_params(ours.mtp) == params.mtp_total
    assert num_params(theirs) == params.main_total


def mtp_num_params(config: ModelConfig) -> int:
    """One MTP module without the shared embedding and head: two RMSNorms (2·D) + M (2D·D) + one MoE block + the
    final RMSNorm before the shared head (D), which the HF checkpoint stores as shared_head.norm."""
    with torch.device("meta"):
        block = Block(config, layer_idx=config.n_layers - 1)  # a MoE layer: DeepSeek's MTP block is MLA + MoE
    D = config.d_model
    return 2 * D + 2 * D * D + num_params(block) + D


def test_mtp_module_count_matches_transformers_mtp_layer(config: ModelConfig) -> None:
    """The MTP module: the ledger's count, written out from our block here, and the MTP layer transformers appends
    for speculative decoding (enorm, hnorm, eh_proj, the decoder layer, post_norm) agree exactly."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    hf = hf_config(config)
    with torch.device("meta"):
        layer = MtpLayer(hf, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, config.n_layers)
    assert num_params(layer) == mtp_num_params(config) == count_parameters(config).mtp_total
    # With the checkpoint's copies of the embedding and head, main model + MTP is the Hub's ≈ 685B.
    stored = count_parameters(config).total + 2 * config.vocab_size * config.d_model
    assert stored == pytest.approx(685e9, rel=2e-3)
