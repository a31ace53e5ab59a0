"""Multi-token prediction through the real trainer (moe/mtp.py): deepseek_v3_like_tiny, whose one MTP module is an
MLA + MoE block, trains on 2 gloo ranks under FSDP2 and with its experts split (EP=2, MTP block's included) exactly
like one process, its MTP loss logged beside the LM loss; and under pipeline parallelism, whose last stage runs the
MTP module with a copy of the embedding, through a chain of layouts that saves and loads both copies."""

from pathlib import Path

import pytest

from moe_platform.config import ConfigError
from moe_platform.launch.compose import train_config
from moe_platform.testing import ROUTING, Job, assert_resumes_exactly, assert_trains_like, moe_train

# Dropless, so that every layout routes every assignment alike; 4 steps of a global batch of 16.
MTP_RUN = ["model=deepseek_v3_like_tiny", *ROUTING, "model.moe.capacity_factor=null", "trainer.max_steps=4"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("mtp_one_process")
    moe_train(run_dir, *MTP_RUN)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["distributed=fsdp"], ["distributed=ddp", "distributed.expert_parallel_size=2"]])
def test_two_ranks_with_mtp_train_like_one_process(tmp_path: Path, one_process: Path, layout: list[str]) -> None:
    moe_train(tmp_path, *MTP_RUN, *layout, nproc=2)
    records = assert_trains_like(tmp_path, one_process)
    assert all(record["mtp_loss"] > 0 for record in records.values())
    # The MTP block's router is logged after the main layers' (layers 1 and 2 are MoE, 3 is the MTP block).
    assert "moe/layer_3/tokens_per_expert" in records[1]


@pytest.mark.slow
def test_a_pipeline_with_mtp_trains_and_resumes_like_one_process(tmp_path: Path, one_process: Path) -> None:
    """PP=2 under DDP to step 2 (rank 1's checkpoint holds the embedding's copy beside rank 0's), one process to 3
    (the two copies load as the one embedding), PP=2 under FSDP2 to 4 (and load as two again, sharded)."""
    run_dir = tmp_path / "run"
    pipeline = ["distributed.pipeline_parallel_size=2", "trainer.save_every=1"]
    first = Job(*MTP_RUN, *pipeline, "distributed=ddp", nproc=2, stop_at=2).run(run_dir)
    assert "a pipeline of 2 ranks, 2 stages" in first.stdout
    close = {key: (1e-5, 1e-7) for key in ("loss", "mtp_loss", "aux_loss", "grad_norm")}
    stops = assert_resumes_exactly(
        run_dir, one_process, Job(*MTP_RUN, "trainer.save_every=1", stop_at=3),
        Job(*MTP_RUN, *pipeline, "distributed=fsdp", nproc=2), match=close,
    )  # fmt: skip
    assert stops == [2, 3]
    records = assert_trains_like(run_dir, one_process)  # and every MoE layer's counts, the MTP block's included
    assert all(record["mtp_loss"] > 0 for record in records.values())


def test_a_v_schedule_takes_one_mtp_module_under_ddp_and_refuses_the_rest_in_one_sentence() -> None:
    """zbv and dualpipev split each backward into input and weight gradients, which torch 2.13 cannot do through
    MTP modules chained on one embedding, and put the first and last stage, two FSDP2 roots, on one rank (config.py
    says why); depth 1 under DDP, and the other schedules at any depth, run."""
    v_schedule = ["model=moe_tiny", "distributed=ddp", "distributed.pipeline_parallel_size=2",
                  "distributed.pipeline.schedule=zbv"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"distributed\.pipeline\.schedule=zbv splits each backward") as error:
        train_config([*v_schedule, "model.mtp.depth=2"])
    assert ". " not in str(error.value)
    train_config([*v_schedule, "model.mtp.depth=1"])
    with pytest.raises(ConfigError, match=r"two FSDP2 roots cannot share the embedding") as error:
        train_config([*v_schedule, "model.mtp.depth=1", "distributed=fsdp"])
    assert ". " not in str(error.value)
    train_config([*v_schedule[:-1], "distributed.pipeline.schedule=interleaved_1f1b", "model.mtp.depth=2"])
