"""moe-submit's rendering, without a cluster: the job script carries the sbatch options whole, one per line."""

from pathlib import Path

from moe_platform.launch.submit import LAUNCHER, TEMPLATE, job_shape, main, sbatch_option, template_options


def sbatch_lines(script: Path) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]


def test_options_in_every_spelling_reach_the_rendered_script_whole(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = ["distributed=ddp", "data.global_batch_size=24", "trainer.micro_batch_size=8"]
    overrides.append(f"hydra.run.dir={run_dir}")
    main(["--nodes", "3", "-t", "00:05:00", "-J", "named", "--requeue", "--dry-run", "--", *overrides])
    script = run_dir / "train.sbatch"
    added = ["--nodes 3", "-t 00:05:00", "-J named", "--requeue", f"--output={run_dir}/slurm-%j.out"]
    assert sbatch_lines(script)[-len(added) :] == added
    tokens = template_options(script.read_text())
    assert sbatch_option(tokens, "--nodes", "-N") == "3" and sbatch_option(tokens, "--job-name", "-J") == "named"
    assert job_shape(tokens) == (3, 0), "the later #SBATCH line wins over the template's --nodes=2"


def test_the_template_itself_is_a_two_node_job() -> None:
    assert job_shape(template_options(TEMPLATE.read_text())) == (2, 0)


def test_the_rendered_job_starts_the_launcher_this_install_ships(tmp_path: Path) -> None:
    """From a wheel the template lies in site-packages: the job names its launcher by path, not by a checkout."""
    run_dir = tmp_path / "run"
    main(["--nodes=1", "--dry-run", "--", "trainer.max_steps=2", f"hydra.run.dir={run_dir}"])
    script = (run_dir / "train.sbatch").read_text()
    assert f"MOE_LAUNCH={LAUNCHER}\n" in script and LAUNCHER.parent == TEMPLATE.parent
    assert 'srun --kill-on-bad-exit=1 bash "$MOE_LAUNCH"' in script
