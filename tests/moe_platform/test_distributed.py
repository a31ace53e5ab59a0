"""Real multi-process runs: 2 gloo processes on 127.0.0.1, each a real Accelerate/DeepSpeed rank, started the ways a
user starts them (torchrun, accelerate launch, slurm/launch.sh once per node).

Each strategy must reproduce the single-process losses (same global batches, same initial weights; only the
order of floating-point reductions differs), and ZeRO must really shard: the optimizer state each rank holds is
measured from the optimizer itself. (Stopping and resuming, on this or another world size: test_resume.py.)
"""

import subprocess
from pathlib import Path

import pytest

from moe_platform.testing import BIN, FAST, free_port, moe_train, read_metrics, subprocess_env

LAUNCH = Path(__file__).resolve().parents[2] / "slurm" / "launch.sh"

pytestmark = pytest.mark.slow
STEPS = range(1, 7)


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory) -> tuple[dict, dict]:
    run_dir = tmp_path_factory.mktemp("single")
    moe_train(run_dir)
    return read_metrics(run_dir)


# Each strategy's 2-rank run, started once for the tests that check it, each by one of the ways to start ranks:
# DDP by slurm/launch.sh on two loopback "nodes", ZeRO-2 by accelerate launch, the others by torchrun.
LAUNCHER = {"ddp": "slurm/launch.sh", "zero1": "torchrun", "zero2": "accelerate", "zero3": "torchrun"}


def launch_two_nodes(run_dir: Path, *overrides: str) -> tuple[str, str]:
    """slurm/launch.sh from MASTER_ADDR/MASTER_PORT/NNODES/NODE_RANK, one launcher per "node" of one process each;
    returns each node's output."""
    env = {
        **subprocess_env(),
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NNODES": "2", "NPROC_PER_NODE": "1"},
        "MOE_BIN": str(BIN),
    }
    args = [*FAST, *overrides, f"hydra.run.dir={run_dir}"]
    logs = [run_dir.parent / f"node{rank}.log" for rank in (0, 1)]  # files, not pipes: a full pipe would stall a rank
    launchers = []
    for rank, log in enumerate(logs):
        with log.open("w") as out:
            node_env = {**env, "NODE_RANK": str(rank)}
            launchers.append(subprocess.Popen([str(LAUNCH), *args], env=node_env, stdout=out, stderr=subprocess.STDOUT))
    for launcher, log in zip(launchers, logs, strict=True):
        assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
    return logs[0].read_text(), logs[1].read_text()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """(run dir, what each launcher printed) of a strategy's 2-rank run, started the first time a test asks."""
    runs: dict[str, tuple[Path, tuple[str, ...]]] = {}

    def run(strategy: str) -> tuple[Path, tuple[str, ...]]:
        if strategy not in runs:
            run_dir = tmp_path_factory.mktemp(strategy) / "run"
            if LAUNCHER[strategy] == "slurm/launch.sh":  # with the final checkpoint the run-dir test looks into
                printed = launch_two_nodes(run_dir, f"distributed={strategy}", "trainer.save_final=true")
            else:
                result = moe_train(run_dir, f"distributed={strategy}", nproc=2, launcher=LAUNCHER[strategy])
                printed = (result.stdout,)
            runs[strategy] = (run_dir, printed)
        return runs[strategy]

    return run


@pytest.mark.parametrize(
    ("strategy", "engine", "wrapper"),
    [
        ("ddp", "MULTI_CPU", "DistributedDataParallel"),
        ("zero1", "DEEPSPEED", "DeepSpeedEngine"),
        ("zero2", "DEEPSPEED", "DeepSpeedEngine"),
        ("zero3", "DEEPSPEED", "DeepSpeedEngine"),
    ],
    ids=lambda value: f"{value} by {Path(LAUNCHER[value]).name}" if value in LAUNCHER else None,
)
def test_two_ranks_reproduce_the_single_process_losses(
    two_rank_run, single_process_run, strategy: str, engine: str, wrapper: str
) -> None:
    run_dir, printed = two_rank_run(strategy)
    assert f"2 rank(s), {engine}, model wrapped as {wrapper}" in printed[0], "two ranks, the requested engine"
    train, _ = read_metrics(run_dir)
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-5), step
        assert train[step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-4), step
    # Expert statistics are all-reduced: the two ranks' counts add up to the single process's.
    for layer in range(4):
        key = f"moe/layer_{layer}/tokens_per_expert"
        assert sum(train[6][key]) == sum(single[6][key])

    per_rank = train[1]["memory/optimizer_state_bytes_per_rank"]
    full = single[1]["memory/optimizer_state_bytes_per_rank"][0]
    assert len(per_rank) == 2
    if strategy == "ddp":
        assert per_rank == [full, full], "DDP replicates the optimizer state"
    else:
        # ZeRO ≥ 1 partitions m and v: each rank holds half (up to DeepSpeed's alignment padding).
        for held in per_rank:
            assert abs(held - full / 2) <= 0.01 * full, (held, full)
        assert per_rank[0] == pytest.approx(train[1]["ledger/optimizer_state_bytes_per_rank"], rel=0.01)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_deepspeed_runs_as_one_plain_process_without_a_launcher(tmp_path: Path, single_process_run, strategy) -> None:
    """`moe-train distributed=zero3` on one GPU (or CPU) with no torchrun: a one-rank process group is made. It
    compiles nothing: DeepSpeed's CPU backend would JIT-build its shared-memory inference all-reduce (~45 s) into
    TORCH_EXTENSIONS_DIR, here an empty directory of the test's (parallel/accelerator.py)."""
    extensions = tmp_path / "torch_extensions"
    result = moe_train(tmp_path / "run", f"distributed={strategy}", env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert not extensions.exists() or not any(extensions.iterdir()), sorted(extensions.rglob("*"))
    assert "1 rank(s), DEEPSPEED, model wrapped as DeepSpeedEngine" in result.stdout
    assert "no launcher: one rank runs as a process group" in result.stdout + result.stderr
    train, _ = read_metrics(tmp_path / "run")
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-5), step


def test_global_aux_scope_on_two_ranks_equals_one_process_on_their_pooled_micro_batches(tmp_path: Path) -> None:
    """aux_loss_scope=global pools each micro-batch's expert counts over the ranks: 2 DDP ranks with micro-batches
    of 4 train exactly like 1 process with micro-batches of 8 (the same 8 samples per micro-step)."""
    scope = ["model.moe.aux_loss_scope=global", "data.global_batch_size=8"]
    moe_train(tmp_path / "one", *scope, "trainer.micro_batch_size=8")
    moe_train(tmp_path / "two", *scope, "trainer.micro_batch_size=4", "distributed=ddp", nproc=2)
    one, _ = read_metrics(tmp_path / "one")
    two, _ = read_metrics(tmp_path / "two")
    for step in STEPS:
        for key in ("aux_loss", "loss", "grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_two_node_launchers_on_loopback_form_one_job_without_slurm(two_rank_run) -> None:
    """slurm/launch.sh on each "node": node ranks 0 and 1 join one process group of world size 2, the DDP run whose
    losses test_two_ranks_reproduce_the_single_process_losses checks."""
    _, (node0, node1) = two_rank_run("ddp")
    assert "launch: node 0/2" in node0 and "launch: node 1/2" in node1
    assert "2 rank(s), MULTI_CPU, model wrapped as DistributedDataParallel" in node0


def test_bf16_zero2_trains_close_to_fp32(tmp_path: Path, single_process_run) -> None:
    moe_train(tmp_path, "distributed=zero2", "trainer.precision=bf16", nproc=2)
    train, _ = read_metrics(tmp_path)
    single, _ = single_process_run
    for step in STEPS:
        assert train[step]["loss"] == pytest.approx(single[step]["loss"], rel=2e-2), step


def test_run_dir_is_shared_and_only_rank_zero_writes(two_rank_run) -> None:
    run_dir, _ = two_rank_run("ddp")
    train, _ = read_metrics(run_dir)
    assert sorted(train) == list(STEPS), "one record per step: rank 1 wrote nothing"
    assert (run_dir / "checkpoints" / "step_00000006" / "random_states_1.pkl").is_file()
