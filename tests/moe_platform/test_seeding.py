"""Initial weights equal on every rank; dropout and router-jitter noise different on every rank."""

from pathlib import Path

import pytest
import torch

from moe import ModelConfig, MoEConfig, Transformer
from moe.moe_config import RouterConfig
from moe_platform.testing import moe_train, run_distributed
from moe_platform.train.seeding import noise_seed, seed_initial_weights, seed_noise_streams


def build_and_draw_noise(rank: int, world_size: int) -> tuple[dict, torch.Tensor]:
    """What a trainer rank does: seed, build the model, switch to this rank's noise stream, train (noise drawn)."""
    config = ModelConfig(
        vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=32, dropout=0.5,
        moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=8, router=RouterConfig(jitter_eps=0.1)),
    )  # fmt: skip
    seed_initial_weights(7)
    model = Transformer(config)
    seed_noise_streams(7, rank)
    logits = model.train()(torch.arange(12).view(1, 12)).logits  # dropout and jitter draw here
    return model.state_dict(), logits.detach()


@pytest.mark.slow
def test_ranks_start_from_the_same_weights_and_draw_different_noise() -> None:
    (weights_0, logits_0), (weights_1, logits_1) = run_distributed(build_and_draw_noise, 2)
    assert all(torch.equal(weights_0[name], weights_1[name]) for name in weights_0)
    assert not torch.allclose(logits_0, logits_1), "same weights and input: only the noise can differ"


def test_noise_seeds_differ_across_ranks_and_neighbouring_seeds() -> None:
    seeds = {noise_seed(seed, rank) for seed in range(8) for rank in range(64)}
    assert len(seeds) == 8 * 64


@pytest.mark.slow
def test_checkpointed_generator_states_differ_per_rank(tmp_path: Path) -> None:
    """The real trainer on 2 ranks, with dropout: each rank's saved torch generator is its own."""
    moe_train(tmp_path, "distributed=ddp", "model.dropout=0.1", "trainer.max_steps=2", "trainer.save_final=true",
              nproc=2)  # fmt: skip
    checkpoint = tmp_path / "checkpoints" / "step_00000002"
    states = [torch.load(checkpoint / f"random_states_{rank}.pkl", weights_only=False) for rank in range(2)]
    assert not torch.equal(states[0]["torch_manual_seed"], states[1]["torch_manual_seed"])
