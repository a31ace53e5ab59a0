"""Expert parallelism through the real trainer: 4 gloo ranks on 127.0.0.1 train exactly like 1 process holding
every expert, each rank stores only its expert block, and a run resumes at any EP size and world size."""

from pathlib import Path

import pytest
import torch

from moe_platform.checkpoint.catalog import latest_checkpoint
from moe_platform.interop.export import load_exported_model
from moe_platform.testing import moe_train, read_metrics

pytestmark = pytest.mark.slow
STEPS = range(1, 21)
# Capacity drops (a factor of 1 leaves no slack) and the aux-loss-free bias: the parts EP must not change.
ROUTING = [
    "trainer.max_steps=20",
    "model.moe.capacity_factor=1.0",
    "model.moe.min_capacity=1",
    "model.moe.router.bias_update_rate=0.001",
    "data.global_batch_size=16",
]


def ep(size: int) -> str:
    return f"distributed.expert_parallel_size={size}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[int, dict]:
    run_dir = tmp_path_factory.mktemp("one_process")
    moe_train(run_dir, *ROUTING)
    return read_metrics(run_dir)[0]


def assert_same_training(run_dir: Path, reference: dict[int, dict]) -> None:
    train, _ = read_metrics(run_dir)
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5, abs=1e-5), step
        assert train[step]["grad_norm"] == pytest.approx(reference[step]["grad_norm"], rel=1e-5), step
        assert train[step]["aux_loss"] == pytest.approx(reference[step]["aux_loss"], rel=1e-5, abs=1e-7), step
        for layer in range(4):
            key = f"moe/layer_{layer}/tokens_per_expert"
            assert train[step][key] == reference[step][key], (step, key)


@pytest.mark.parametrize(("strategy", "ep_size"), [("ddp", 2), ("ddp", 4), ("zero1", 4)])
def test_four_ranks_with_experts_split_train_like_one_process_holding_them_all(
    tmp_path: Path, one_process, strategy: str, ep_size: int
) -> None:
    result = moe_train(tmp_path, *ROUTING, f"distributed={strategy}", ep(ep_size), nproc=4)
    assert f"Expert parallelism (EP={ep_size} of W=4 ranks" in result.stdout, "the ledger prints the EP figures"
    assert_same_training(tmp_path, one_process)

    first = read_metrics(tmp_path)[0][1]
    assert first["memory/params_per_rank"] == [first["ledger/params_per_rank"]] * 4, "each rank holds its block"
    whole = one_process[1]["memory/params_per_rank"][0]
    assert first["ledger/params_per_rank"] < whole, "EP stores fewer parameters per rank"
    for held in first["memory/optimizer_state_bytes_per_rank"]:
        assert held == pytest.approx(first["ledger/optimizer_state_bytes_per_rank"], rel=0.01)


def test_a_run_resumes_across_ep_sizes_and_world_sizes_and_exports_whole(tmp_path: Path, one_process) -> None:
    """EP 2 on 4 ranks → EP 1 on 2 ranks → EP 4 on 4 ranks: the same losses as one uninterrupted process."""
    moe_train(tmp_path, *ROUTING, "distributed=ddp", ep(2), "trainer.stop_at=4", nproc=4)
    checkpoint = latest_checkpoint(tmp_path)
    assert sorted(p.name for p in (checkpoint / "experts").iterdir()) == [
        "experts_00000_00002.safetensors",
        "experts_00002_00004.safetensors",
    ], "experts are stored by global id, one file per EP block"
    moe_train(tmp_path, *ROUTING, "distributed=ddp", "resume=auto", "trainer.stop_at=9", nproc=2)
    moe_train(
        tmp_path, *ROUTING, "distributed=ddp", ep(4), "resume=auto", "trainer.save_final=true",
        "trainer.eval_every=20", nproc=4,
    )  # fmt: skip
    assert_same_training(tmp_path, one_process)

    # The consolidated export of the EP=4 checkpoint is the whole model: it reproduces the run's eval loss.
    model = load_exported_model(latest_checkpoint(tmp_path))
    assert model.blocks[0].ffn.experts.w_up.shape[0] == 4
    _, evals = read_metrics(tmp_path)
    assert evals[20]["eval/loss"] == pytest.approx(eval_loss(model, tmp_path), rel=1e-5)


def test_zero2_with_experts_split_resumes_at_any_ep_and_world_size_and_exports_whole(
    tmp_path: Path, one_process
) -> None:
    """ZeRO-2: EP 2 on 4 ranks → the same (DeepSpeed reloads the module from rank 0's file, EP rank 0's experts:
    the other EP ranks must get their own block back, or the first resumed step is silently wrong) → EP 4 on 4
    ranks → EP 1 on 2 ranks, the last two through the universal copy written on save: one process's 20 steps."""
    moe_train(tmp_path, *ROUTING, "distributed=zero2", ep(2), "trainer.stop_at=8", nproc=4)
    assert (latest_checkpoint(tmp_path) / "universal" / "pytorch_model" / "zero").is_dir()
    moe_train(tmp_path, *ROUTING, "distributed=zero2", ep(2), "resume=auto", "trainer.stop_at=10", nproc=4)
    moe_train(tmp_path, *ROUTING, "distributed=zero2", ep(4), "resume=auto", "trainer.stop_at=14", nproc=4)
    moe_train(tmp_path, *ROUTING, "distributed=zero2", ep(1), "resume=auto", "trainer.save_final=true", nproc=2)
    assert_same_training(tmp_path, one_process)

    model = load_exported_model(latest_checkpoint(tmp_path))  # a ZeRO-2 checkpoint at EP 1: DeepSpeed's own path
    assert model.blocks[0].ffn.experts.w_up.shape[0] == 4
    exported = load_exported_model(latest_checkpoint(tmp_path).parent / "step_00000014")  # EP 4: the universal copy
    assert [block.ffn.experts.w_up.shape[0] for block in exported.blocks if hasattr(block.ffn, "experts")] == [4] * 4


def eval_loss(model: torch.nn.Module, run_dir: Path) -> float:
    """The trainer's eval on one process: its validation batches, mean token loss."""
    from data_pipeline import build_loaders
    from moe_platform.config import load_run_config

    config = load_run_config(run_dir / "config.yaml")
    data = build_loaders(
        config.data, rank=0, world_size=1, micro_batch_size=config.trainer.micro_batch_size,
        model_vocab_size=config.model.vocab_size,
    )  # fmt: skip
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in data.val:
            logits = model(batch["input_ids"]).logits
            loss_sum += float(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            )
            tokens += batch["labels"].numel()
    return loss_sum / tokens
