"""bench/gpu_mfu.py runs end to end in its tiny configuration on CPU: the code a GPU session runs is exercised."""

import json
import math
from pathlib import Path

import pytest
import torch


def test_tiny_run_reports_both_models_with_peak_memory_near_the_ledger(load_bench, tmp_path: Path) -> None:
    """fp32: CPU bf16 grouped_mm takes ~0.1 s per call here, whatever the size; the bf16 master-weight path is the
    GPU run's and is covered by `test_master_weights_step_matches_fp32_adamw`."""
    if torch.cuda.is_available():
        pytest.skip("the tiny configuration is the CPU test; on a GPU run the bench itself")
    bench = load_bench("gpu_mfu")
    out = tmp_path / "mfu.json"
    results = bench.main(["--tiny", "--dtype", "fp32", "--json", str(out)])
    assert [r.name for r in results] == ["moe", "dense"]
    moe, dense = results
    # The dense twin has the MoE's active parameters, less each MoE layer's router (E·D).
    config = bench.moe_1b(tiny=True)
    routers = config.n_layers * config.moe.num_experts * config.d_model
    assert dense.active_params == moe.active_params - routers
    assert moe.total_params > moe.active_params
    for r in results:
        assert r.tokens_per_s > 0 and math.isfinite(r.final_loss)
        assert r.mfu is None  # a CPU has no datasheet peak
        assert 0.8 <= r.peak_gib / r.predicted_gib <= 1.2, r
    assert [row["name"] for row in json.loads(out.read_text())] == ["moe", "dense"]


def test_dense_twin_keeps_everything_but_the_ffn(load_bench) -> None:
    bench = load_bench("gpu_mfu")
    moe = bench.moe_1b(tiny=False)
    dense = bench.dense_twin(moe)
    assert dense.moe is None and dense.d_ff == moe.moe.top_k * moe.moe.expert_d_ff
    assert (dense.d_model, dense.n_layers, dense.n_heads, dense.vocab_size) == (2048, 16, 16, 32000)
    assert 1.0e9 < moe.num_params() < 1.2e9


def test_master_weights_step_matches_fp32_adamw(load_bench) -> None:
    """bf16 weights + fp32 masters: after a step the weights are the fp32 AdamW result rounded to bf16."""
    bench = load_bench("gpu_mfu")
    torch.manual_seed(0)
    reference = torch.nn.Linear(8, 4)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(model.weight.float())
        reference.bias.copy_(model.bias.float())
    x = torch.randn(5, 8)
    optimizer = bench.MasterWeightsAdamW(model, lr=0.1, fused=False)
    fp32 = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1)
    model(x.bfloat16()).float().square().sum().backward()
    # The same gradient in fp32, so only the weights' rounding differs.
    reference.weight.grad = model.weight.grad.float().clone()
    reference.bias.grad = model.bias.grad.float().clone()
    optimizer.step()
    fp32.step()
    assert torch.equal(model.weight, reference.weight.to(torch.bfloat16))
    assert torch.equal(model.bias, reference.bias.to(torch.bfloat16))
