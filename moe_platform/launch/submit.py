"""`moe-submit [sbatch options] -- <hydra overrides>`: validate the config, render the job, submit it.

    moe-submit --nodes=4 --gpus-per-node=8 --time=12:00:00 -- model=moe_small distributed=zero2

    moe-submit --nodes=2 -- --config-dir=my_configs experiment=mine

1. The config is composed and validated here, on the submit host, for the job's world size (nodes × ranks per
   node), with the user's --config-dir and hydra.* overrides (hydra.searchpath included) as moe-train would take
   them: a bad config is refused in one sentence and nothing reaches the queue.
2. The run directory (`hydra.run.dir`, default runs/<job name>-<time>) gets `train.sbatch`, a copy of the package's
   job template (slurm/train.sbatch) with these sbatch options, the overrides, the --config-dir made absolute, the
   package's slurm/launch.sh and this environment's bin/ fixed in it (re-runnable with plain `sbatch`), and
   `config.yaml`, the resolved config. The job's log goes to RUN_DIR/slurm-<job id>.out, appended across requeues.
3. `sbatch` submits it; the job id and the run directory are printed.
`--dry-run` stops after step 2. With `--gpu NAME` (a moe-plan catalog name; or a type it knows in
`--gpus-per-node=TYPE:N`) step 1 also checks that the run's peak per GPU fits, with moe-plan's model
(launch/memory.py `plan_refusal`), and a refusal names the layout that fits; without it the memory check is left to
the job's start-up (the submit host is not a compute node).
"""

import argparse
import importlib.resources
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from moe_platform.config import ConfigError, to_train_config, validate_launch
from moe_platform.launch.bad_input import BAD_INPUT
from moe_platform.launch.compose import compose_train, composition_error, plain_run, user_config_dir
from moe_platform.launch.memory import plan_refusal
from moe_platform.plan.hardware import cluster_of, gpu_named
from moe_platform.redact import redacted_yaml

# The job template and the per-node launcher as this install ships them (pyproject.toml): the checkout's slurm/
# under an editable install, site-packages' moe_platform/slurm/ from a wheel.
SLURM_DIR = Path(str(importlib.resources.files("moe_platform.slurm")))
TEMPLATE = SLURM_DIR / "train.sbatch"
LAUNCHER = SLURM_DIR / "launch.sh"
SETTINGS = re.compile(r"^# ---- settings.*?^# ---- end of settings ----\n", re.MULTILINE | re.DOTALL)


def sbatch_option(options: list[str], long: str, short: str | None = None) -> str | None:
    """The last value of an sbatch option in `options` (`--nodes=2`, `--nodes 2`, `-N2`, `-N 2`), or None."""
    value = None
    for i, option in enumerate(options):
        following = options[i + 1] if i + 1 < len(options) else None
        if option.startswith(f"{long}="):
            value = option.split("=", 1)[1]
        elif option == long or (short is not None and option == short):
            value = following
        elif short is not None and option.startswith(short) and len(option) > len(short):
            value = option[len(short) :]
    return value


def template_options(template: str) -> list[str]:
    """The `#SBATCH` options of a batch script as command-line tokens, in order (`--nodes 2` gives two)."""
    lines = [line.removeprefix("#SBATCH ") for line in template.splitlines() if line.startswith("#SBATCH ")]
    return [token for line in lines for token in shlex.split(line)]


def option_lines(tokens: list[str]) -> list[str]:
    """Command-line tokens grouped one option per line: a token that does not start with '-' is the value of the
    option before it (`--nodes 2`, `-J name`)."""
    lines: list[str] = []
    for token in tokens:
        if token.startswith("-") or not lines:
            lines.append(shlex.quote(token))
        else:
            lines[-1] += f" {shlex.quote(token)}"
    return lines


def job_shape(options: list[str]) -> tuple[int, int]:
    """(nodes, GPUs per node) from the sbatch options; slurm/launch.sh starts one rank per GPU, or one per node."""
    nodes = sbatch_option(options, "--nodes", "-N") or "1"
    gpus = sbatch_option(options, "--gpus-per-node") or "0"
    return int(nodes.split("-")[0]), int(gpus.rsplit(":", 1)[-1])  # --nodes=2-4 starts with 2; --gpus-per-node=a100:8


def render(template: str, options: list[str], overrides: list[str], run_dir: Path, bin_dir: Path) -> str:
    """The template with the settings block fixed and the given sbatch options after its own #SBATCH lines (sbatch
    reads them in order, so a later line wins)."""
    settings = (
        "# ---- settings: written by moe-submit ----\n"
        f"MOE_LAUNCH={shlex.quote(str(LAUNCHER))}\n"
        f"MOE_BIN={shlex.quote(str(bin_dir))}\n"
        f"if [[ $# -eq 0 ]]; then set -- {' '.join(shlex.quote(o) for o in overrides)}; fi\n"
        "# ---- end of settings ----\n"
    )
    body = SETTINGS.sub(lambda _: settings, template, count=1)
    lines = body.splitlines(keepends=True)
    last_sbatch = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
    added = [f"#SBATCH {line}\n" for line in option_lines([*options, f"--output={run_dir}/slurm-%j.out"])]
    return "".join([*lines[: last_sbatch + 1], "# moe-submit:\n", *added, *lines[last_sbatch + 1 :]])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit("usage: moe-submit [sbatch options] [--dry-run] -- <hydra overrides>")
    split = argv.index("--")
    options, overrides = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(prog="moe-submit", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="render the run directory, do not submit")
    parser.add_argument("--gpu", help="the job's GPU (moe-plan's catalog: H100, H200, A100-80GB, …): check it fits")
    args, options = parser.parse_known_args(options)

    template = TEMPLATE.read_text()
    all_options = [*template_options(template), *options]
    nodes, gpus_per_node = job_shape(all_options)
    per_node = max(gpus_per_node, 1)
    config_dir = None
    try:
        run = plain_run(overrides)
        if run is None:
            raise ConfigError(
                "the arguments after -- are not one training run (moe-train's --help, --cfg, --multirun and "
                "--config-name are not for moe-submit): give moe-train's overrides there, after --config-dir=DIR "
                "for configs of your own"
            )
        overrides = run.overrides
        if run.config_dir is not None:
            config_dir = user_config_dir(run.config_dir)  # absolute: the job may start elsewhere
        cfg = compose_train(overrides, config_dir)
        config = to_train_config(cfg)
        validate_launch(config, nodes * per_node, has_gpu=gpus_per_node > 0)
        gpu = args.gpu or _gres_type(all_options)
        if gpu is not None and gpus_per_node > 0:
            refusal = plan_refusal(config, cluster_of(nodes, gpus_per_node, gpu))
            if refusal is not None:
                raise ConfigError(refusal)
    except Exception as err:
        sentence = str(err) if isinstance(err, tuple(BAD_INPUT)) else composition_error(err, overrides, config_dir)
        if sentence is None:
            raise  # not a mistake in the input: it keeps its traceback
        print(f"config error: {sentence} (nothing was submitted)".replace("\n", " "), file=sys.stderr)
        sys.exit(2)

    job_name = sbatch_option(all_options, "--job-name", "-J") or "moe-train"
    run_dir = Path(_override(overrides, "hydra.run.dir") or f"runs/{job_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = run_dir.resolve()
    overrides = [o for o in overrides if not o.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(redacted_yaml(cfg))  # secrets replaced, as moe-train writes it
    script = run_dir / "train.sbatch"
    job_args = [*([f"--config-dir={config_dir}"] if config_dir is not None else []), *overrides]
    script.write_text(render(template, options, job_args, run_dir, Path(sys.executable).parent))
    print(f"rendered {script} ({nodes} node(s) × {per_node} rank(s)) with {run_dir / 'config.yaml'}")
    if args.dry_run:
        return
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"sbatch refused the job: {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}; run dir {run_dir}; log {run_dir / f'slurm-{job_id}.out'}")


def _gres_type(options: list[str]) -> str | None:
    """The GPU type of `--gpus-per-node=TYPE:N` if moe-plan's catalog knows it (a site's gres names may differ)."""
    value = sbatch_option(options, "--gpus-per-node")
    if value is None or ":" not in value:
        return None
    kind = value.rsplit(":", 1)[0]
    try:
        gpu_named(kind)
    except ValueError:
        return None
    return kind


def _override(overrides: list[str], key: str) -> str | None:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return values[-1] if values else None


if __name__ == "__main__":
    main()
