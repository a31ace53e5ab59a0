"""Expert parallelism through the real trainer: 4 gloo ranks on 127.0.0.1 train exactly like 1 process holding
every expert, and each rank stores only its expert block. (A run resumes at any EP size and world size, under DDP and
ZeRO-2, and exports whole: test_resume.py, on the same ROUTING config.)"""

from pathlib import Path

import pytest

from moe_platform.testing import ROUTING, assert_trains_like, moe_train, read_metrics

pytestmark = pytest.mark.slow


def ep(size: int) -> str:
    return f"distributed.expert_parallel_size={size}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one_process")
    moe_train(run_dir, *ROUTING)
    return run_dir


@pytest.mark.parametrize(("strategy", "ep_size"), [("ddp", 2), ("ddp", 4), ("zero1", 4)])
def test_four_ranks_with_experts_split_train_like_one_process_holding_them_all(
    tmp_path: Path, one_process, strategy: str, ep_size: int
) -> None:
    result = moe_train(tmp_path, *ROUTING, f"distributed={strategy}", ep(ep_size), nproc=4)
    assert f"Expert parallelism (EP={ep_size} of W=4 ranks" in result.stdout, "the ledger prints the EP figures"
    first = assert_trains_like(tmp_path, one_process)[1]
    assert first["memory/params_per_rank"] == [first["ledger/params_per_rank"]] * 4, "each rank holds its block"
    whole = read_metrics(one_process)[0][1]["memory/params_per_rank"][0]
    assert first["ledger/params_per_rank"] < whole, "EP stores fewer parameters per rank"
    for held in first["memory/optimizer_state_bytes_per_rank"]:
        assert held == pytest.approx(first["ledger/optimizer_state_bytes_per_rank"], rel=0.01)
