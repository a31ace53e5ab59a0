"""`moe-train`: compose the config with Hydra → validate → build objects in plain Python → `fit()`.

    moe-train model=moe_tiny data=synthetic trainer.max_steps=200 trainer.log_every=10 \
        trainer.save_every=50 resume=auto hydra.run.dir=runs/demo
    torchrun --nproc_per_node=2 --no-python moe-train distributed=zero2 hydra.run.dir=runs/zero2
    accelerate launch --multi_gpu --num_processes 2 -m moe_platform.cli distributed=zero2 hydra.run.dir=runs/zero2

Under torchrun every rank runs this Hydra app. Only rank 0 lets Hydra write its .hydra/ files and log, and rank 0's
output directory is broadcast once the process group exists, so a time-stamped directory that differs by a second
between ranks cannot split a run.
"""

import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data_pipeline import DataConfigError, DataError
from moe import ModelConfigError
from moe_platform.checkpoint import (
    CheckpointError,
    needs_universal_load,
    read_layout,
    resolve_resume,
    sharding_layout,
)
from moe_platform.config import ConfigError, TrainConfig, to_train_config, validate_launch, world_size_from_env
from moe_platform.memory import check_training_state_fits, local_rank, local_world_size, this_machine_memory
from moe_platform.preemption import RequeueLimitReached
from moe_platform.redact import redacted_yaml, scrub_hydra_dir, secret_values

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
# The error types that mean bad input (a config, a checkpoint, the data), and the word that introduces each.
BAD_INPUT = {
    ConfigError: "config",
    ModelConfigError: "config",
    DataConfigError: "config",
    CheckpointError: "checkpoint",
    DataError: "data",
}


def agree_on_run_dir(accelerator, own_dir: Path) -> Path:
    """Rank 0's Hydra output directory, on every rank; a rank's own stray directory is removed if empty."""
    if accelerator.num_processes == 1:
        return own_dir
    from accelerate.utils import broadcast_object_list

    shared = broadcast_object_list([str(own_dir)], from_process=0)[0]
    if not accelerator.is_main_process and Path(shared) != own_dir:
        try:
            own_dir.rmdir()
        except OSError:
            pass  # not empty, or already gone: leave it
    return Path(shared)


def run(cfg: DictConfig) -> dict[str, Any]:
    """The whole job after composition; returns the last logged metrics."""
    from moe_platform.distributed import build_accelerator, has_gpu
    from moe_platform.trainer import Trainer

    hydra_config = HydraConfig.get()
    if hydra_config.output_subdir is not None:  # rank 0: Hydra has already recorded the overrides, secrets included
        scrub_hydra_dir(Path(hydra_config.runtime.output_dir) / hydra_config.output_subdir, secret_values(cfg))
    config = to_train_config(cfg)
    world_size = world_size_from_env()
    grad_accum = validate_launch(config, world_size, has_gpu())
    check_training_state_fits(config, world_size, local_world_size(world_size), this_machine_memory(local_rank()))
    own_dir = Path(HydraConfig.get().runtime.output_dir)
    resume_from = resolve_resume(config.resume, own_dir)
    distributed = config.distributed
    layout = sharding_layout(distributed.strategy, distributed.zero_stage, world_size, distributed.expert_parallel_size)
    load_universal = resume_from is not None and needs_universal_load(read_layout(resume_from), layout)
    accelerator = build_accelerator(config, grad_accum, world_size, load_universal)
    try:
        run_dir = agree_on_run_dir(accelerator, own_dir)
        config_yaml = redacted_yaml(cfg)  # resolved, secrets replaced: for the run dir and every checkpoint
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(config_yaml)
        trainer = Trainer(config, run_dir, accelerator, grad_accum, config_yaml, layout, resume_from)
        return trainer.fit()
    finally:
        accelerator.end_training()  # destroys the process group


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    try:
        return run(cfg)  # a sweep's launcher (e.g. submitit) hands each job's last metrics back
    except tuple(BAD_INPUT) as err:  # a user's mistake: one sentence, no trace; anything else keeps its traceback
        kind = next(kind for error_type, kind in BAD_INPUT.items() if isinstance(err, error_type))
        print(f"{kind} error: {err}", file=sys.stderr)
        sys.exit(2)
    except RequeueLimitReached as err:  # the checkpoint is complete; the job just may not requeue again
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(3)


def register_configs() -> None:
    """Put the schema in Hydra's ConfigStore; conf/train.yaml lists `train_schema` first in its defaults."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _quiet_hydra_on_other_ranks() -> None:
    """Ranks other than 0 must not write .hydra/ or a log file into what may be rank 0's run directory."""
    if int(os.environ.get("RANK", "0")) != 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    register_configs()
    _quiet_hydra_on_other_ranks()
    _hydra_main()
    _leave_without_interpreter_teardown()


def _leave_without_interpreter_teardown() -> None:
    """A finished run exits here, skipping Python's finalization, which can abort it.

    Gloo's worker threads release a finished collective's tensors a moment after the caller has been released, and
    freeing a tensor takes the GIL. A C++ thread that asks for the GIL while the interpreter finalizes is ended with
    pthread_exit, whose forced unwind through C++ aborts the whole process ("terminate called without an active
    exception", SIGABRT): a completed run then reports failure and Slurm marks the job FAILED (seen in about one
    2-rank run in ten on an idle 2-core machine; pytorch/pytorch#179291 is the same race). By now the metrics,
    checkpoints and trackers are closed and the process group destroyed, so only the teardown is skipped.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
