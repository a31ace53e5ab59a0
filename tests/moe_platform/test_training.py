"""Single-process training through the real CLI: it learns, it logs, it exports. (It resumes exactly, the wandb run
included: test_resume.py.)"""

import math
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from data_pipeline import build_loaders
from moe_platform.checkpoint.catalog import latest_checkpoint
from moe_platform.interop.export import load_checkpoint_config, load_exported_model
from moe_platform.testing import BIN, moe_train, read_metrics, subprocess_env


def test_training_moves_the_loss_toward_the_entropy_floor(tmp_path: Path) -> None:
    result = moe_train(
        tmp_path, "trainer.max_steps=50", "data.seq_len=64", "data.global_batch_size=16", "trainer.micro_batch_size=8",
        "trainer.log_every=10", "trainer.eval_every=25", "data.synthetic.num_tokens=524288",
    )  # fmt: skip
    train, evals = read_metrics(tmp_path)
    floor = float(result.stdout.split("entropy floor:")[1].split()[0])
    start = math.log(258)  # a fresh model predicts about uniformly
    final = evals[50]["eval/loss"]
    assert floor < final < start
    assert (start - final) / (start - floor) > 0.5, f"eval loss {final} closed less than half the gap to {floor}"
    assert evals[25]["eval/loss"] > final
    assert "entropy floor" in result.stdout and "Matmul FLOPs per token" in result.stdout  # the ledger is printed


def test_metrics_records_carry_the_documented_keys(tmp_path: Path) -> None:
    moe_train(tmp_path, "trainer.eval_every=3", "trainer.max_steps=3")
    train, evals = read_metrics(tmp_path)
    record = train[3]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
        assert isinstance(record[key], float | int), key
    assert set(evals[3]) >= {"step", "eval/loss"}
    n_experts = 4
    for layer in range(4):  # moe_tiny routes in every layer
        prefix = f"moe/layer_{layer}/"
        counts = record[prefix + "tokens_per_expert"]
        assert len(counts) == n_experts
        # 3 … log_every=1: one step of 8 sequences × 32 tokens × top-2 assignments, summed over micro-batches.
        assert sum(counts) == 8 * 32 * 2
        assert record[prefix + "drop_frac"] == 0.0  # moe_tiny is dropless
        assert record[prefix + "max_over_mean"] >= 1.0 and record[prefix + "cv"] >= 0.0
        assert 0.0 < record[prefix + "entropy"] <= math.log(n_experts) + 1e-6
        assert record[prefix + "aux_loss"] > 0 and record[prefix + "z_loss"] > 0
    assert (tmp_path / "config.yaml").is_file()


def test_wandb_and_tensorboard_sinks_receive_the_records(tmp_path: Path) -> None:
    moe_train(tmp_path, "logging=all", "trainer.max_steps=2")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")), "TensorBoard wrote an event file"
    offline_runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert offline_runs and list(offline_runs[0].glob("*.wandb")), "wandb (offline) wrote its run file"


def test_capacity_drops_are_counted_after_summing_micro_batches(tmp_path: Path) -> None:
    moe_train(tmp_path, "model.moe.capacity_factor=0.5", "model.moe.min_capacity=0", "trainer.max_steps=2")
    train, _ = read_metrics(tmp_path)
    for layer in range(4):
        drop = train[2][f"moe/layer_{layer}/drop_frac"]
        assert 0.5 - 1e-9 <= drop < 1.0, "capacity 0.5 keeps at most half of the assignments"


def test_keep_last_and_latest_pointer(tmp_path: Path) -> None:
    moe_train(tmp_path, "trainer.save_every=1", "trainer.keep_last=2", "trainer.max_steps=4")
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_00000003", "step_00000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000004"
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def exported_eval_loss(checkpoint: Path) -> float:
    """Recompute the run's eval loss from the exported weights on the same validation batches."""
    config = load_checkpoint_config(checkpoint)
    model = load_exported_model(checkpoint).eval()
    val = build_loaders(config.data, 0, 1, config.trainer.micro_batch_size).val
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in val:
            logits = model(batch["input_ids"]).logits
            loss_sum += float(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"))
            tokens += batch["labels"].numel()
    return loss_sum / tokens


def test_export_loads_into_the_model_and_reproduces_the_eval_loss(tmp_path: Path) -> None:
    moe_train(tmp_path, "trainer.save_final=true", "trainer.eval_every=6")
    _, evals = read_metrics(tmp_path)
    checkpoint = latest_checkpoint(tmp_path)
    assert abs(exported_eval_loss(checkpoint) - evals[6]["eval/loss"]) < 1e-5
    out = tmp_path / "model.pt"
    subprocess.run(
        [str(BIN / "moe-export"), str(checkpoint), str(out)], check=True, env=subprocess_env(), capture_output=True
    )
    assert torch.load(out, weights_only=True).keys() == load_exported_model(checkpoint).state_dict().keys()


def test_a_cpu_run_without_a_configured_peak_reports_flops_but_no_mfu(tmp_path: Path) -> None:
    result = moe_train(tmp_path, "trainer.max_steps=2", "logging.peak_tflops=null")
    train, _ = read_metrics(tmp_path)
    record = train[2]
    assert "mfu" not in record, "a matmul probe is not a peak: no MFU on CPU"
    assert record["model_tflops_per_device"] > 0 and record["model_flops_vs_matmul_probe"] > 0
    assert "no MFU: a CPU has no datasheet peak; set logging.peak_tflops" in result.stdout
