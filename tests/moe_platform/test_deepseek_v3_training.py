"""`moe-train model=deepseek_v3_like_tiny` (MLA, group-limited sigmoid routing with the balancing bias, routed scaling,
a shared expert, a first dense layer) trains under ZeRO-2 on 2 gloo ranks and resumes exactly: stopped after step 3
and resumed with resume=auto, every step is logged once and the losses equal the uninterrupted run's bit for bit
(fp32 on CPU), and the router's balancing bias (a buffer, not a parameter: no optimizer holds it) comes back too."""

from pathlib import Path

import pytest
import torch

from moe_platform.testing import assert_stopped_once_and_resumes_exactly, moe_train, read_metrics

pytestmark = pytest.mark.slow
# 6 steps of the FAST defaults (moe_platform.testing); the final checkpoint holds the bias after the last step.
RUN = ["model=deepseek_v3_like_tiny", "distributed=zero2", "trainer.save_final=true"]


def _expert_biases(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every router's `expert_bias` from the ZeRO-2 module state that rank 0 saved at `step`."""
    (states,) = (run_dir / "checkpoints" / f"step_{step:08d}").rglob("mp_rank_00_model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    return {name: tensor for name, tensor in module.items() if name.endswith("router.expert_bias")}


def test_deepseek_v3_like_tiny_trains_under_zero2_and_resumes_exactly(tmp_path: Path) -> None:
    straight, sliced = tmp_path / "straight", tmp_path / "sliced"
    result = moe_train(straight, *RUN, nproc=2)
    assert "2 rank(s), DEEPSPEED, model wrapped as DeepSpeedEngine" in result.stdout
    moe_train(sliced, *RUN, "trainer.stop_at=3", nproc=2)
    assert assert_stopped_once_and_resumes_exactly(sliced, straight, *RUN, nproc=2) == 3

    train, _ = read_metrics(straight)
    assert all(torch.isfinite(torch.tensor(train[step]["loss"])) for step in train)
    assert train[6]["loss"] < train[1]["loss"], "it trains"
    # Layer 0 is dense (first_dense_layers=1); layers 1 and 2 route.
    assert set(train[6]) >= {"moe/layer_1/tokens_per_expert", "moe/layer_2/tokens_per_expert"}

    final, resumed = _expert_biases(straight, 6), _expert_biases(sliced, 6)
    assert sorted(final) == ["blocks.1.ffn.router.expert_bias", "blocks.2.ffn.router.expert_bias"]
    for name, bias in final.items():
        assert bias.abs().sum() > 0, f"{name}: the bias moved during training, so restoring it is tested"
        assert torch.equal(resumed[name], bias), f"{name}: the resumed run's bias equals the uninterrupted run's"
    stopped = _expert_biases(sliced, 3)
    assert any(not torch.equal(stopped[name], final[name]) for name in final), "the bias kept moving after resume"
