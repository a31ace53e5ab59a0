"""Multi-token prediction through the real trainer (moe/mtp.py): deepseek_v3_like_tiny, whose one MTP module is an
MLA + MoE block, trains on 2 gloo ranks under FSDP2 and with its experts split (EP=2, MTP block's included) exactly
like one process, its MTP loss logged beside the LM loss; a pipeline with MTP is refused before any process starts."""

from pathlib import Path

import pytest

from moe_platform.config import ConfigError
from moe_platform.launch.compose import train_config
from moe_platform.testing import ROUTING, assert_trains_like, moe_train

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


def test_a_pipeline_with_mtp_is_refused_in_one_sentence() -> None:
    with pytest.raises(ConfigError, match=r"model\.mtp\.depth=1 needs the shared embedding") as error:
        train_config(["model=deepseek_v3_like_tiny", "distributed=ddp", "distributed.pipeline_parallel_size=2"])
    assert ". " not in str(error.value)
    train_config(["model=deepseek_v3_like_tiny", "model.mtp.depth=0", "distributed=ddp",
                  "distributed.pipeline_parallel_size=2"])  # fmt: skip
