"""moe-platform on a real Slurm cluster (slurm/dev-cluster: two slurmd nodes on this machine): the sbatch template
across two nodes, moe-submit, Hydra's submitit launcher, and preemption → checkpoint → requeue → resume."""

import pickle
import re
import subprocess
import time
from pathlib import Path

import pytest

from moe_platform.testing import (
    BIN,
    FAST,
    assert_resumes_exactly,
    metric_steps,
    moe_train,
    read_metrics,
    subprocess_env,
)

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "train.sbatch"
DDP = [*FAST, "distributed=ddp"]
JOB_TIMEOUT = 300


def job_env() -> dict[str, str]:
    """What a job inherits from the submitting shell (sbatch --export=ALL): offline, one thread, this venv's bin."""
    return {**subprocess_env(), "MOE_BIN": str(BIN)}


def submit_template(slurm, log_dir: Path, overrides: list[str], *sbatch_options: str, env: dict | None = None) -> str:
    """`sbatch [options] slurm/train.sbatch <overrides>` from the repository root, with `env` added to the job's
    environment; returns the job id."""
    command = ["sbatch", "--parsable", "--nodes=2", "--time=00:10:00", f"--output={log_dir}/slurm-%j.out"]
    job_environment = {**slurm.env, **job_env(), **(env or {})}
    result = slurm.run(*command, *sbatch_options, str(TEMPLATE), *overrides, env=job_environment, cwd=REPO)
    job = result.stdout.strip().split(";")[0]
    slurm.submitted.append(job)  # cancelled on teardown if the test fails while it runs
    return job


@pytest.fixture(scope="module")
def local_two_ranks(tmp_path_factory) -> dict[int, dict]:
    """The same run as two local processes (torchrun on one machine): what two Slurm nodes must reproduce."""
    run_dir = tmp_path_factory.mktemp("local")
    moe_train(run_dir, *DDP, nproc=2)
    return read_metrics(run_dir)[0]


def test_the_template_trains_across_two_nodes_like_two_local_processes(slurm, tmp_path, local_two_ranks) -> None:
    run_dir = tmp_path / "run"
    job = submit_template(slurm, tmp_path, [*DDP, f"hydra.run.dir={run_dir}"])
    slurm.wait_for_state(job, "COMPLETED", JOB_TIMEOUT)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    # One launcher per node, each on its own slurmd, joined into one world of two ranks.
    assert re.search(r"launch: node 0/2 .*\(node1\)", log) and re.search(r"launch: node 1/2 .*\(node2\)", log), log
    assert "2 rank(s), MULTI_CPU, model wrapped as DistributedDataParallel" in log
    assert slurm.job_info(job)["nodes"] == ["node1", "node2"]
    assert (run_dir / f"slurm-{job}.out").read_text() == log, "the run directory links to the job's log"
    train, _ = read_metrics(run_dir)
    for step in range(1, 7):
        assert train[step]["loss"] == pytest.approx(local_two_ranks[step]["loss"], rel=1e-6), step


def test_moe_submit_validates_renders_and_submits(slurm, tmp_path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(BIN / "moe-submit"), "--nodes=2", "--time=00:10:00", "--", *DDP, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env={**job_env(), **slurm.env}, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    job = re.search(r"submitted job (\d+); run dir (\S+)", result.stdout).group(1)
    slurm.submitted.append(job)  # cancelled on teardown if the test fails while it runs
    assert f"run dir {run_dir}" in result.stdout
    script = (run_dir / "train.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and f"hydra.run.dir={run_dir}" in script
    assert (run_dir / "config.yaml").is_file()
    slurm.wait_for_state(job, "COMPLETED", JOB_TIMEOUT)
    assert metric_steps(run_dir) == list(range(1, 7))
    assert "2 rank(s), MULTI_CPU" in (run_dir / f"slurm-{job}.out").read_text(), "the log lives in the run dir"


def test_moe_submit_refuses_a_bad_config_before_anything_reaches_the_queue(slurm, tmp_path) -> None:
    def jobs_from_here() -> set[str]:
        """Jobs whose working directory lies under this test's tmp_path: the other slurm tests (running beside this
        one under pytest-xdist) submit theirs from elsewhere."""
        listed = slurm.run("sacct", "-a", "-X", "-n", "-P", "--format=JobID,WorkDir", "--starttime=now-1days").stdout
        rows = [line.split("|", 1) for line in listed.splitlines() if "|" in line]
        return {job for job, workdir in rows if workdir.startswith(str(tmp_path))}

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(BIN / "moe-submit"), "--nodes=2", "--", "model.n_kv_heads=3", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env={**job_env(), **slurm.env}, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "config error: model.n_heads=4 is not a multiple of model.n_kv_heads=3" in result.stderr
    assert "nothing was submitted" in result.stderr and "Traceback" not in result.stderr
    assert not run_dir.exists() and jobs_from_here() == set()


def test_hydra_submitit_launcher_runs_a_sweep_as_slurm_jobs(slurm, tmp_path) -> None:
    """`moe-train -m hydra/launcher=submitit_slurm …`: each sweep value is one Slurm job; Hydra waits for both."""
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [str(BIN / "moe-train"), "-m", "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={sweep}",
         "hydra.launcher.timeout_min=10", "hydra.launcher.mem_gb=null", "hydra.launcher.cpus_per_task=1",
         *FAST, "trainer.max_steps=2,3"],
        capture_output=True, text=True, env={**job_env(), **slurm.env}, cwd=tmp_path, timeout=JOB_TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    finished = sorted(max(metric_steps(job_dir)) for job_dir in (sweep / "0", sweep / "1"))
    assert finished == [2, 3]
    # Each Slurm job handed its last metrics back through submitit's result file.
    results = [pickle.loads(path.read_bytes()) for path in sorted(sweep.glob(".submitit/*/*_result.pkl"))]
    assert [outcome for outcome, _ in results] == ["success", "success"]
    assert sorted(job_return.return_value["step"] for _, job_return in results) == [2, 3]


def test_usr1_checkpoints_requeues_and_resumes_with_every_step_once(slurm, tmp_path) -> None:
    """The time-limit warning (USR1 to the batch shell) on a 2-node ZeRO-2 job: both ranks save their shards at the
    same step, the job requeues itself, resumes, finishes; metrics hold every step once and the losses equal an
    uninterrupted run's exactly (fp32 on CPU)."""
    steps = 20
    args = [*FAST, "distributed=zero2", f"trainer.max_steps={steps}", "trainer.save_final=true"]
    straight = tmp_path / "straight"
    moe_train(straight, *args, nproc=2)
    run_dir = tmp_path / "run"
    # Every rank stalls after step 2 (the requeued job, resumed past it, never does): a window the signal, sent once
    # step 1 is logged, hits however slowly it travels, instead of racing 19 steps of a tiny model.
    stall = {"MOE_FAULTS": "stall@step_end:step=2:seconds=8"}
    job = submit_template(slurm, tmp_path, [*args, f"hydra.run.dir={run_dir}"], env=stall)
    slurm.wait_for_state(job, "RUNNING", JOB_TIMEOUT)
    deadline = time.monotonic() + JOB_TIMEOUT
    while not ((run_dir / "metrics.jsonl").is_file() and metric_steps(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    slurm.wait_for_state(job, "COMPLETED", JOB_TIMEOUT)

    log = (tmp_path / f"slurm-{job}.out").read_text()
    stopped = re.search(r"stopped at step (\d+) \(\.preempt request\); checkpoint .* is complete: requeued", log)
    assert stopped, log[:6000]  # the first start's part of the log, where the stop is said
    stopped_at = int(stopped.group(1))
    # The file appears in step 2's stall; the ranks' flags sum at the boundary after it and are read one step later.
    assert stopped_at == 3 and "(restart 1)" in log, log[:6000]
    shards = run_dir / "checkpoints" / f"step_{stopped_at:08d}" / "pytorch_model"
    for rank in (0, 1):
        assert (shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file(), rank
    assert slurm.job_info(job)["restarts"] in (1, None)  # None: only accounting still knows the job
    assert_resumes_exactly(run_dir, straight)  # the requeued job resumed already: every step once, equal losses
