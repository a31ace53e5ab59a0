"""Activation checkpointing recomputes instead of keeping: same numbers, fewer saved bytes, side effects once."""

import dataclasses

import pytest
import torch

from moe.config import ModelConfig
from moe.mla_config import MLAConfig
from moe.model import Transformer
from moe.moe_config import MoEConfig, RouterConfig

CONFIG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32, dropout=0.1,
    moe=MoEConfig(
        num_experts=4, top_k=2, expert_d_ff=32, capacity_factor=1.0, num_shared_experts=1, first_dense_layers=1,
        router=RouterConfig(jitter_eps=0.1, bias_update_rate=1e-3),
    ),
)  # fmt: skip
# DeepSeek-V3's routing (group-limited sigmoid choice with the balancing bias, routed scaling), with MLA attention
# (both latents) or with ALiBi biases on GQA: recomputation must replay them as exactly as the plain model.
V3_MOE = dataclasses.replace(
    CONFIG.moe, num_experts=8,
    router=RouterConfig(
        jitter_eps=0.1, score_fn="sigmoid", bias_update_rate=1e-3, n_group=4, topk_group=2, routed_scaling_factor=2.5
    ),
)  # fmt: skip
MLA = MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
CONFIGS = {
    "gqa": CONFIG,
    "mla_v3": dataclasses.replace(CONFIG, n_kv_heads=None, attention="mla", mla=MLA, moe=V3_MOE),
    "alibi_v3": dataclasses.replace(CONFIG, pos_encoding="alibi", moe=V3_MOE),
}


def train_forward_backward(mode: str, attention_mask_BT: torch.Tensor | None = None, config: ModelConfig = CONFIG):
    """One training forward+backward from the same weights and noise seed; dropout, jitter and capacity drops on."""
    torch.manual_seed(0)
    model = Transformer(config).train()
    model.set_activation_checkpointing(mode)
    input_ids_BT = torch.randint(0, CONFIG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    saved_bytes = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved_bytes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        output = model(input_ids_BT, attention_mask_BT)
    loss = output.logits.logsumexp(-1).mean() + output.aux_loss
    loss.backward()
    counts = [block.ffn.router.load_since_update.clone() for block in model.blocks[1:]]
    grads = {name: p.grad for name, p in model.named_parameters()}
    return output.logits.detach(), grads, counts, sum(saved_bytes)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_recomputation_gives_bit_identical_logits_gradients_and_router_counts(padded: bool, config: str) -> None:
    mask_BT = None
    if padded:
        mask_BT = torch.ones(4, 32, dtype=torch.long)
        mask_BT[1, :5] = 0
        mask_BT[3, :17] = 0
    logits, grads, counts, _ = train_forward_backward("none", mask_BT, CONFIGS[config])
    for mode in ("moe", "full"):
        logits_m, grads_m, counts_m, _ = train_forward_backward(mode, mask_BT, CONFIGS[config])
        assert torch.equal(logits_m, logits), mode
        for name, grad in grads.items():
            assert torch.equal(grads_m[name], grad), (mode, name)
        # The balancing counts grow once per forward, not again when backward recomputes the layer.
        for c_m, c in zip(counts_m, counts, strict=True):
            assert torch.equal(c_m, c), mode


def test_checkpointing_keeps_fewer_bytes_for_backward() -> None:
    """What autograd keeps between forward and backward: full < moe < none."""
    saved = {mode: train_forward_backward(mode)[3] for mode in ("none", "moe", "full")}
    assert saved["full"] < saved["moe"] < saved["none"], saved


def test_eval_and_decoding_do_not_recompute() -> None:
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    prompt_BT = torch.randint(0, CONFIG.vocab_size, (2, 5))
    expected = model.generate(prompt_BT, max_new_tokens=6, temperature=0)
    model.set_activation_checkpointing("full")
    assert torch.equal(model.generate(prompt_BT, max_new_tokens=6, temperature=0), expected)
    # An unknown mode is refused once, at start-up (trainer.activation_checkpointing: test_bad_inputs.py's corpus).
