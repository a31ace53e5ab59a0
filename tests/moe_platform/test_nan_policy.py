"""trainer.on_nan (train/nan_guard.py): a NaN injected into one module's output (faults.py) never reaches the weights or
a checkpoint. `skip` withholds the step's update on every rank and trains on; `halt` stops with exit code 4 and a
message naming the step, the module, its rank and the last good checkpoint, which stays the latest."""

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from data_pipeline import build_loaders
from moe_platform.checkpoint.catalog import latest_checkpoint, step_dirname
from moe_platform.checkpoint.consolidate import export_fp32_state_dict
from moe_platform.config import ConfigError, TrainerConfig
from moe_platform.interop.export import load_checkpoint_config, load_exported_model
from moe_platform.testing import moe_train, rank_exit_codes, read_metrics, run_distributed
from moe_platform.train.nan_guard import NanGuard, poison_nonfinite

ATTN_NAN_AT_3 = "nan@blocks.1.attn:step=3"


def nan_run(run_dir: Path, fault: str, *overrides: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """A run that checkpoints every step, with `fault` injected; its exit code is left to the test."""
    every_step = ["trainer.save_every=1", "trainer.keep_last=10"]
    return moe_train(run_dir, *every_step, *overrides, nproc=nproc, env={"MOE_FAULTS": fault}, check=False)


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / step_dirname(step)


def saved_steps(run_dir: Path) -> list[str]:
    """Every entry under checkpoints/ but `latest`, unfinished `.tmp_…` directories included."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name != "latest")


def stopped_messages(result: subprocess.CompletedProcess) -> list[str]:
    """The `stopped: …` messages on stderr, one per rank (two ranks may write theirs into one line)."""
    return re.findall(r"stopped: (.*?)(?=stopped: |\n|$)", result.stderr)


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[key], b[key]) for key in a), [key for key in a if not torch.equal(a[key], b[key])]


def assert_finite(state: dict[str, torch.Tensor]) -> None:
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def test_a_non_finite_loss_makes_every_gradient_nan_and_a_finite_one_changes_nothing() -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    poison_nonfinite(model(x).sum()).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))
    model.zero_grad()
    # An Inf loss whose gradients are finite (the Inf does not depend on the weights) would update the weights.
    poison_nonfinite(model(x).sum() + float("inf")).backward()
    assert all(p.grad.isnan().all() for p in model.parameters())


def test_on_nan_accepts_halt_or_skip_only() -> None:
    with pytest.raises(ConfigError, match=re.escape("trainer.on_nan='ignore' is unknown")):
        TrainerConfig(on_nan="ignore")
    with pytest.raises(ConfigError, match=re.escape("trainer.nan_max_consecutive=0 must be >= 1")):
        TrainerConfig(nan_max_consecutive=0)


def test_skip_withholds_the_update_of_a_nan_step_and_trains_on(tmp_path: Path) -> None:
    result = nan_run(
        tmp_path, ATTN_NAN_AT_3, "trainer.on_nan=skip", "trainer.max_steps=5", "model.moe.router.bias_update_rate=0.01"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    train, _ = read_metrics(tmp_path)
    assert [train[step]["nan/skipped_steps"] for step in range(1, 6)] == [0, 0, 1, 0, 0]  # in each log window
    assert [train[step]["nan/skipped_steps_total"] for step in range(1, 6)] == [0, 0, 1, 1, 1]
    assert "step 3, skipped: it first appears in the output of blocks.1.attn (rank 0, micro-batch 0)" in (
        result.stdout + result.stderr
    )
    # Step 3 changed nothing: the weights, the routing biases, AdamW's moments and step count are step 2's.
    before, after = checkpoint(tmp_path, 2), checkpoint(tmp_path, 3)
    assert_same_tensors(export_fp32_state_dict(before), export_fp32_state_dict(after))
    optimizer = [torch.load(c / "optimizer.bin", weights_only=True)["state"] for c in (before, after)]
    for key in optimizer[0]:
        assert_same_tensors(optimizer[0][key], optimizer[1][key])
    # The step counter, the LR schedule and the data order went on: step 4's loss is that of step 2's weights on
    # the run's 4th batch, and its learning rate the schedule's 4th.
    config = load_checkpoint_config(after)
    accumulation = config.data.global_batch_size // config.trainer.micro_batch_size
    micro_batches = iter(build_loaders(config.data, 0, 1, config.trainer.micro_batch_size).train)
    batches = [next(micro_batches) for _ in range(4 * accumulation)][3 * accumulation :]
    model = load_exported_model(after).eval()
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(b["input_ids"]).logits.float().flatten(0, 1), b["labels"].flatten()) for b in batches
        ]
    assert train[4]["loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-6)
    assert train[4]["lr"] == config.optim.lr_at(3, config.trainer.max_steps)
    assert_finite(export_fp32_state_dict(checkpoint(tmp_path, 5)))


def test_halt_stops_at_the_nan_step_naming_the_module_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    result = nan_run(tmp_path, ATTN_NAN_AT_3, "trainer.max_steps=5")  # trainer.on_nan=halt is the default
    assert result.returncode == 4, result.stderr[-3000:]
    last_good = checkpoint(tmp_path, 2)
    assert stopped_messages(result) == [
        "non-finite loss at step 3: it first appears in the output of blocks.1.attn (rank 0, micro-batch 0); the "
        f"last good checkpoint is {last_good}; set trainer.on_nan=skip to skip such steps"
    ]
    assert saved_steps(tmp_path) == ["step_00000001", "step_00000002"]  # nothing of step 3, not even a .tmp_
    assert latest_checkpoint(tmp_path) == last_good
    assert_finite(export_fp32_state_dict(last_good))


def test_skip_halts_at_the_nth_nan_step_in_a_row(tmp_path: Path) -> None:
    faults = ",".join(f"nan@blocks.1.attn:step={step}" for step in (2, 4, 5))  # step 3 ends the first streak
    overrides = ["trainer.on_nan=skip", "trainer.nan_max_consecutive=2", "trainer.max_steps=6"]
    result = nan_run(tmp_path, faults, *overrides)
    assert result.returncode == 4, result.stderr[-3000:]
    (message,) = stopped_messages(result)
    assert message.startswith("non-finite loss at step 5, the last of 2 in a row (trainer.nan_max_consecutive=2)")
    assert f"the last good checkpoint is {checkpoint(tmp_path, 4)};" in message  # a skipped step's weights are good
    train, _ = read_metrics(tmp_path)
    assert [train[step]["nan/skipped_steps_total"] for step in range(1, 5)] == [0, 1, 1, 2]
    assert 5 not in train and saved_steps(tmp_path) == [step_dirname(step) for step in range(1, 5)]


def test_a_checkpoint_is_refused_when_a_weight_is_not_finite(tmp_path: Path) -> None:
    assert _weights_verdicts(0, 1, tmp_path) == [None, "the weights after step 7 are not finite"]


def _weights_verdicts(rank: int, world_size: int, run_dir: Path) -> list[str | None]:
    """NanGuard.nonfinite_weights on a small model: all finite, then with a NaN in the last rank's copy only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu"), is_main_process=rank == 0)
    state = SimpleNamespace(skipped_steps=0, skipped_in_a_row=0)
    guard = NanGuard(TrainerConfig(), accelerator, model, state, run_dir)
    verdicts = [guard.nonfinite_weights(7)]
    if rank == world_size - 1:
        with torch.no_grad():
            model[1].bias[2] = float("inf")
    message = guard.nonfinite_weights(7)
    assert message.endswith(
        f"(1.bias on rank {world_size - 1}): its checkpoint was not written; no checkpoint has been written yet"
    )
    return [*verdicts, message.split(" (")[0]]


# ---- several ranks: they skip or halt together ----------------------------------------------------------------


@pytest.mark.slow
def test_every_rank_refuses_the_checkpoint_when_one_holds_a_non_finite_weight(tmp_path: Path) -> None:
    assert run_distributed(_weights_verdicts, 2, tmp_path) == [[None, "the weights after step 7 are not finite"]] * 2


@pytest.mark.slow
def test_ddp_ranks_halt_together_on_a_nan_in_rank_1_alone(tmp_path: Path) -> None:
    result = nan_run(tmp_path, f"{ATTN_NAN_AT_3}:rank=1", "distributed=ddp", "trainer.max_steps=4", nproc=2)
    assert result.returncode != 0
    # Both ranks stop with code 4; the launcher ends a rank still tearing down once the other has exited (SIGTERM).
    exit_codes = set(rank_exit_codes(result).values())
    assert 4 in exit_codes and exit_codes <= {4, -15}, exit_codes
    messages = stopped_messages(result)  # one per rank that got to print it, all the same
    assert messages and len(set(messages)) == 1
    assert messages[0].startswith("non-finite loss at step 3: it first appears in the output of blocks.1.attn (rank 1")
    assert saved_steps(tmp_path) == ["step_00000001", "step_00000002"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, module",
    [
        (["distributed=zero2"], "blocks.1.attn"),  # DeepSpeed steps inside backward and checks the norm itself
        (["distributed=ddp", "distributed.expert_parallel_size=2"], "blocks.1.ffn.experts"),  # rank 1's experts
    ],
    ids=["zero2", "ddp_ep2"],
)
def test_ranks_skip_together_on_a_nan_in_rank_1_alone(tmp_path: Path, strategy: list[str], module: str) -> None:
    fault = f"nan@{module}:step=3:rank=1"
    result = nan_run(tmp_path, fault, *strategy, "trainer.on_nan=skip", "trainer.max_steps=4", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"step 3, skipped: it first appears in the output of {module} (rank 1, micro-batch 0)" in (
        result.stdout + result.stderr
    )
    train, _ = read_metrics(tmp_path)
    assert [train[step]["nan/skipped_steps_total"] for step in range(1, 5)] == [0, 0, 1, 1]
    assert_same_tensors(
        export_fp32_state_dict(checkpoint(tmp_path, 2)), export_fp32_state_dict(checkpoint(tmp_path, 3))
    )
    assert_finite(export_fp32_state_dict(checkpoint(tmp_path, 4)))
