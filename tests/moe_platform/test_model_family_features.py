"""The training features that predate MLA, ALiBi and DeepSeek-V3's routing, each with them: torch.compile of a block,
the NaN guard naming an MLA sub-module, and `init.upcycle` from a dense MLA run. (Document masks and padding are
checked with these models in tests/moe/test_document_mask.py and test_attention_variants.py; activation
checkpointing, expert parallelism and upcycling's exactness in tests/moe/test_checkpointing.py,
tests/moe/test_expert_parallel.py and tests/moe_platform/test_upcycle.py; ZeRO-2 training and resume in
test_resume.py.)"""

import dataclasses
from pathlib import Path

import pytest
import torch

from moe import ModelConfig, Transformer
from moe.mla_config import MLAConfig
from moe.moe_config import MoEConfig, RouterConfig
from moe_platform.testing import first_batch_loss, moe_train, read_metrics

# DeepSeek-V3's routing: sigmoid scores plus the balancing bias choose top-2 inside the best 2 of 4 groups of 2
# experts; the gates are renormalised, then scaled by 2.5; one shared expert; the first layer dense.
V3_MOE = MoEConfig(
    num_experts=8, top_k=2, expert_d_ff=16, num_shared_experts=1, first_dense_layers=1,
    router=RouterConfig(score_fn="sigmoid", bias_update_rate=1e-3, n_group=4, topk_group=2, routed_scaling_factor=2.5),
)  # fmt: skip
BASE = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32, moe=V3_MOE)
MODELS = {
    "mla": dataclasses.replace(
        BASE, attention="mla",
        mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    ),
    "alibi": dataclasses.replace(BASE, n_kv_heads=2, pos_encoding="alibi"),
}  # fmt: skip


def tiny_model(name: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(MODELS[name]).double().eval()
    with torch.no_grad():  # a bias that changes choices, as after some balancing
        for block in model.blocks[1:]:
            block.ffn.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8, dtype=torch.float64))
    return model


@pytest.mark.parametrize("name", MODELS)
def test_a_compiled_block_traces_and_computes_the_eager_logits_and_gradients(name: str) -> None:
    """`trainer.compile` compiles block by block (train/model_build.py). TorchDynamo must trace an MLA block and an
    ALiBi block with group-limited routing (graph breaks allowed); the "eager" backend runs the captured graphs as they
    are, so logits and gradients equal the uncompiled block's. Inductor's code generation is left to
    test_training_options (minutes on CPU)."""
    ids_BT = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    results = []
    for compiled in (False, True):
        model = tiny_model(name).float().train()
        if compiled:
            model.blocks[1].compile(backend="eager")
        logits = model(ids_BT).logits
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch._dynamo.reset()
    (eager_logits, eager_grads), (compiled_logits, compiled_grads) = results
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-6, atol=1e-7)
    for param, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[param], grad, rtol=1e-5, atol=1e-7, msg=param)


def test_the_nan_guard_names_the_mla_sub_module_where_a_nan_first_appears(tmp_path: Path) -> None:
    """deepseek_v3_like_tiny with a NaN injected into layer 1's KV latent norm: the run halts at that step naming
    `blocks.1.attn.kv_norm` (its sub-modules are hooked like any other), not the attention or a later module."""
    every_step = ["trainer.save_every=1", "trainer.max_steps=3"]
    fault = {"MOE_FAULTS": "nan@blocks.1.attn.kv_norm:step=2"}
    result = moe_train(tmp_path, "model=deepseek_v3_like_tiny", *every_step, env=fault, check=False)
    assert result.returncode == 4, result.stderr[-3000:]
    assert (
        "non-finite loss at step 2: it first appears in the output of blocks.1.attn.kv_norm (rank 0, micro-batch 0)"
    ) in result.stderr


def test_a_dense_mla_run_upcycles_into_deepseek_v3_like_tiny_at_its_loss(tmp_path: Path) -> None:
    """init.upcycle from a dense deepseek_v3_like_tiny (model.moe=null) checkpoint: every MLA weight is carried over
    and the experts of width d_ff/2 beside one shared expert are the exact case (interop/upcycle.py), with the routed
    share divided by routed_scaling_factor=2.5, so step 1's loss (taken before its update) is the dense model's."""
    dense = tmp_path / "dense"
    moe_train(dense, "model=deepseek_v3_like_tiny", "model.moe=null", "trainer.max_steps=1", "trainer.save_final=true")

    upcycled = tmp_path / "upcycled"
    upcycle = [f"init.from_path={dense}", "init.upcycle=true", "model.moe.expert_d_ff=64", "trainer.max_steps=1"]
    moe_train(upcycled, "model=deepseek_v3_like_tiny", *upcycle)
    train, _ = read_metrics(upcycled)
    assert train[1]["loss"] == pytest.approx(first_batch_loss(dense), rel=1e-6)
