"""`moe-submit [sbatch options] -- <hydra overrides>`: validate the config, render the job, submit it.

    moe-submit --nodes=4 --gpus-per-node=8 --time=12:00:00 -- model=moe_small distributed=zero2

1. The config is composed and validated here, on the submit host, for the job's world size (nodes × ranks per
   node): a bad config is refused in one sentence and nothing reaches the queue.
2. The run directory (`hydra.run.dir`, default runs/<job name>-<time>) gets `train.sbatch`, a copy of
   slurm/train.sbatch with these sbatch options and overrides fixed in it (re-runnable with plain `sbatch`), and
   `config.yaml`, the resolved config. The job's log goes to RUN_DIR/slurm-<job id>.out, appended across requeues.
3. `sbatch` submits it; the job id and the run directory are printed.
`--dry-run` stops after step 2. The machine's memory check is left to the job: the submit host is not a compute node.
"""

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, OverrideParseException

from moe_platform.config import to_train_config, validate_launch
from moe_platform.launch.cli import BAD_INPUT, CONF_DIR, register_configs
from moe_platform.redact import redacted_yaml

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "train.sbatch"
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
        f"MOE_HOME={shlex.quote(str(REPO))}\n"
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
    args, options = parser.parse_known_args(options)

    template = TEMPLATE.read_text()
    all_options = [*template_options(template), *options]
    nodes, gpus_per_node = job_shape(all_options)
    per_node = max(gpus_per_node, 1)
    register_configs()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("train", overrides=[o for o in overrides if not o.startswith("hydra.")])
        validate_launch(to_train_config(cfg), nodes * per_node, has_gpu=gpus_per_node > 0)
    except (*BAD_INPUT, ConfigCompositionException, OverrideParseException) as err:
        # Hydra's composition errors run over several lines; keep the sentences, drop OmegaConf's key dump.
        text = f"{err}\n{err.__cause__ or ''}"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        message = " ".join(
            line for line in lines if not line.startswith(("full_key:", "object_type=", "reference_type"))
        )
        print(f"config error: {message} (nothing was submitted)", file=sys.stderr)
        sys.exit(2)

    job_name = sbatch_option(all_options, "--job-name", "-J") or "moe-train"
    run_dir = Path(_override(overrides, "hydra.run.dir") or f"runs/{job_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = run_dir.resolve()
    overrides = [o for o in overrides if not o.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(redacted_yaml(cfg))  # secrets replaced, as moe-train writes it
    script = run_dir / "train.sbatch"
    script.write_text(render(template, options, overrides, run_dir, Path(sys.executable).parent))
    print(f"rendered {script} ({nodes} node(s) × {per_node} rank(s)) with {run_dir / 'config.yaml'}")
    if args.dry_run:
        return
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"sbatch refused the job: {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}; run dir {run_dir}; log {run_dir / f'slurm-{job_id}.out'}")


def _override(overrides: list[str], key: str) -> str | None:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return values[-1] if values else None


if __name__ == "__main__":
    main()
