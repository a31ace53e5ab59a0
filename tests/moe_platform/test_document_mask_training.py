"""`moe-train data.document_mask=true`: the trainer hands the batches' document ids to the model in training, in
evaluation, and when nan_guard re-runs a step's forwards to find where a NaN began."""

from pathlib import Path

from moe_platform.testing import moe_train, read_metrics


def test_training_with_document_mask_runs_evaluates_and_locates_a_nan(tmp_path: Path) -> None:
    result = moe_train(
        tmp_path, "data.document_mask=true", "trainer.max_steps=3", "trainer.eval_every=3", "trainer.on_nan=skip",
        env={"MOE_FAULTS": "nan@blocks.1.attn:step=2"},
    )  # fmt: skip
    train, evals = read_metrics(tmp_path)
    assert [train[step]["nan/skipped_steps_total"] for step in range(1, 4)] == [0, 1, 1]
    assert "it first appears in the output of blocks.1.attn (rank 0, micro-batch 0)" in result.stdout + result.stderr
    assert all(train[step]["loss"] < 6.0 for step in (1, 3)) and evals[3]["eval/loss"] < 6.0  # finite, near log 258
