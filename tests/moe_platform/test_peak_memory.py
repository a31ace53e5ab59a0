"""Measured peak memory of a training step against the ledger's prediction, and the measurement itself."""

import threading

import pytest
import torch
import torch.nn.functional as F

from moe import ModelConfig, MoEConfig, RunShape, Transformer
from moe.mla_config import MLAConfig
from moe_platform.monitor.peak_memory import (
    PeakMemoryProbe,
    PeakPrediction,
    measure_peak,
    predict_peak,
    storage_bytes,
    training_tensors,
)
from moe_platform.testing import run_distributed

TINY = dict(vocab_size=258, d_model=96, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256)
MOE_TINY = ModelConfig(**TINY, moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=128, capacity_factor=None))
CASES = {
    "moe_tiny": (MOE_TINY, "none"),
    "dense_tiny": (ModelConfig(**TINY), "none"),
    "moe_shared_gelu_capacity": (
        ModelConfig(
            **{**TINY, "activation": "gelu", "norm": "layernorm", "vocab_size": 2048},
            moe=MoEConfig(
                num_experts=8, top_k=2, expert_d_ff=64, num_shared_experts=1, capacity_factor=1.25, first_dense_layers=1
            ),
        ),
        "none",
    ),
    "moe_tiny_full_checkpointing": (MOE_TINY, "full"),
    # DeepSeek-V3's attention in small: both latents, v ≠ n + r (SDPA's math path on CPU, S×S probabilities kept).
    "mla_moe_tiny": (
        ModelConfig(
            **{**TINY, "n_kv_heads": None, "attention": "mla"},
            mla=MLAConfig(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
            moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=128, capacity_factor=None, first_dense_layers=1),
        ),
        "none",
    ),
    # ALiBi: one float (1, H, S, S) bias for every layer, on SDPA's fused path.
    "alibi_moe_tiny": (ModelConfig(**{**TINY, "pos_encoding": "alibi"}, moe=MOE_TINY.moe), "none"),
}


def test_cpu_measurement_sees_a_transient_allocation() -> None:
    """8 MiB allocated and freed inside the block raise the peak by 8 MiB (and by little else)."""
    with measure_peak("cpu") as peak:
        buffer = torch.ones(2**21)  # 8 MiB of fp32
        del buffer
    assert 8 * 2**20 <= peak.peak_bytes - peak.start_bytes < 9 * 2**20
    assert "profiler" in peak.method


def test_cpu_measurement_counts_a_block_another_thread_freed_once_its_address_is_reused() -> None:
    """A gloo worker dropping a collective buffer's last reference frees it where the profiler does not look. Twenty
    64 KiB blocks, one live at a time, each freed by a thread: counted as all held (20 blocks) before, now the
    allocator's reuse of their addresses takes them out (2-5 blocks measured)."""
    block = 2**16
    with measure_peak("cpu") as peak:
        for _ in range(20):
            box = [torch.ones(block // 4)]
            freeing = threading.Thread(target=box.clear)  # the thread drops the last reference
            freeing.start()
            freeing.join()
    assert block <= peak.peak_bytes - peak.start_bytes < 8 * block


def training_step(model: Transformer, optimizer: torch.optim.Optimizer, input_ids_BT: torch.Tensor) -> None:
    """One step as the trainer runs it: forward, cross-entropy in fp32, backward, AdamW, gradients set to None."""
    output = model(input_ids_BT)
    loss = F.cross_entropy(output.logits.float().flatten(0, 1), input_ids_BT.flatten()) + output.aux_loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("case", CASES)
def test_measured_peak_is_within_20_percent_of_the_ledger(case: str) -> None:
    """One steady training step (optimizer state already built), as the trainer runs it: forward, cross-entropy
    in fp32, backward, fused AdamW, gradients set to None."""
    config, checkpointing = CASES[case]
    B, S = 4, 64
    model = Transformer(config)
    model.set_activation_checkpointing(checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    input_ids_BT = torch.randint(0, config.vocab_size, (B, S))

    training_step(model, optimizer, input_ids_BT)
    # What the step starts from, counted directly: this test process still holds other tests' tensors.
    with measure_peak("cpu", storage_bytes(training_tensors(model, optimizer))) as peak:
        training_step(model, optimizer, input_ids_BT)
    predicted = predict_peak(
        config, RunShape(micro_batch_size=B, seq_len=S, precision="fp32", checkpointing=checkpointing)
    )
    assert peak.peak_bytes == pytest.approx(predicted.total, rel=0.2)


def test_probe_measures_only_the_second_step_and_says_so() -> None:
    probe = PeakMemoryProbe("cpu")
    prediction = PeakPrediction(state_bytes=2**20, activation_bytes=2**20)
    with probe.around_step():
        pass
    assert probe.result is None and "not measured" in probe.describe(prediction)
    with probe.around_step():
        kept = torch.ones(2**18)  # 1 MiB held to the end of the step
    first = probe.result
    with probe.around_step():
        pass
    assert probe.result is first and first.peak_bytes - first.start_bytes >= 2**20
    line = probe.describe(prediction)
    assert "measured" in line and "predicted 2.0 MiB" in line
    del kept


def _fsdp_step_peak(rank: int, world_size: int, ep_size: int) -> tuple[float, PeakPrediction]:
    """One rank of an FSDP2 (+ EP) run of MOE_TINY: its second step's measured peak and the ledger's prediction."""
    from torch.distributed.tensor import DTensor

    from moe_platform.parallel import fsdp

    torch.manual_seed(0)
    model = Transformer(MOE_TINY)
    fsdp.shard_model(model, fsdp.build_meshes("cpu", 1, ep_size), fsdp.ShardingPolicy(True, False, False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    B, S = 4, 64
    input_ids_BT = torch.randint(0, MOE_TINY.vocab_size, (B, S))

    training_step(model, optimizer, input_ids_BT)
    held = [t.to_local() if isinstance(t, DTensor) else t for t in training_tensors(model, optimizer)]
    with measure_peak("cpu", storage_bytes(held)) as peak:
        training_step(model, optimizer, input_ids_BT)
    run = RunShape(micro_batch_size=B, seq_len=S, dp_size=world_size, ep_size=ep_size, fsdp=True)
    return peak.peak_bytes, predict_peak(MOE_TINY, run)


@pytest.mark.slow
def test_fsdp_step_peak_is_bounded_by_the_shards_activations_and_what_fsdp_gathers() -> None:
    """2 gloo ranks, experts over EP=2 (one spawn, ~17 s; EP=1 measures alike): the prediction adds to the shards
    and activations what FSDP2 gathers (the root, two blocks), their unsharded gradients and the reduce-scatter
    input, each at its worst moment, so it bounds the measured peak from above, and not by much (measured 0.80-0.86
    of it; without the transient 0.90-0.98)."""
    for peak, predicted in run_distributed(_fsdp_step_peak, 2, 2):
        assert predicted.transient_bytes > 0
        assert 0.75 * predicted.total <= peak <= predicted.total, (peak, predicted)
