"""`moe-train`: compose the config with Hydra → validate → build objects in plain Python → `fit()`.

    moe-train model=moe_tiny data=synthetic trainer.max_steps=200 trainer.log_every=10 \
        trainer.save_every=50 resume=auto hydra.run.dir=runs/demo
    torchrun --nproc_per_node=2 --no-python moe-train distributed=zero2 hydra.run.dir=runs/zero2
    accelerate launch --multi_gpu --num_processes 2 -m moe_platform.launch.cli distributed=zero2 \
        hydra.run.dir=runs/zero2
    moe-train --config-dir=my_configs experiment=mine  # configs of one's own beside the package's (compose.py)

Under torchrun every rank runs this Hydra app. Only rank 0 lets Hydra write its .hydra/ files and log, and rank 0's
output directory is broadcast once the process group exists, so a time-stamped directory that differs by a second
between ranks cannot split a run.

Bad input (a config Hydra cannot compose or our checks refuse, data files or a tokenizer that cannot work, a checkpoint
that is not there) ends the start with exit 2 and one line on stderr, `<config|data|checkpoint> error: <key>...: <fix>`,
before any process group exists (rows that only tokenizing reveals excepted, see data_pipeline/preflight.py), and
leaves the run directory as it found it (bad_input.py).
"""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from data_pipeline import preflight
from moe_platform.checkpoint.catalog import resume_candidates
from moe_platform.checkpoint.errors import CheckpointWriteError
from moe_platform.checkpoint.layout import CheckpointLayout
from moe_platform.config import to_train_config, validate_launch, world_size_from_env
from moe_platform.interop.init_from import adopt_source_model
from moe_platform.launch.bad_input import (
    BAD_INPUT,
    RunDirBefore,
    bad_input_line,
    no_live_progress_bars_off_a_terminal,
)
from moe_platform.launch.compose import (
    CONFIG_NAME,
    CONFIG_PATH,
    compose_train,
    composition_error,
    hydra_arguments,
    plain_run,
    register_configs,
)
from moe_platform.launch.memory import check_memory_fits, local_rank, local_world_size, this_machine_memory
from moe_platform.redact import redacted_yaml, scrub_hydra_dir, secret_values
from moe_platform.train.nan_guard import NumericalFault
from moe_platform.train.preemption import RequeueLimitReached


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
    from moe_platform.parallel.accelerator import build_accelerator, has_gpu
    from moe_platform.train.trainer import Trainer

    hydra_config = HydraConfig.get()
    if hydra_config.output_subdir is not None:  # rank 0: Hydra has already recorded the overrides, secrets included
        scrub_hydra_dir(Path(hydra_config.runtime.output_dir) / hydra_config.output_subdir, secret_values(cfg))
    # model.* read from init.from_path's own config before validating: an override such as model.mla.* may only
    # make sense for the source's model, not the composed default's. Nothing is resolved here (a bad ${...} is
    # to_train_config's one-sentence error).
    if OmegaConf.select(cfg, "init.from_path", throw_on_resolution_failure=False) is not None:
        adopt_source_model(cfg, OmegaConf.to_container(hydra_config.overrides.task, resolve=False))
    config = to_train_config(cfg)
    world_size = world_size_from_env()
    grad_accum = validate_launch(config, world_size, has_gpu())
    check_memory_fits(config, world_size, local_world_size(world_size), this_machine_memory(local_rank()))
    preflight(config.data, config.model.vocab_size, world_size, config.trainer.micro_batch_size,
              config.samples_to_train)  # fmt: skip
    own_dir = Path(HydraConfig.get().runtime.output_dir)
    candidates, passed_over = resume_candidates(config.resume, own_dir)  # newest first, files all present
    if passed_over and int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(f"checkpoint passed over: {line}" for line in passed_over), file=sys.stderr, flush=True)
    layout = CheckpointLayout.of_run(config.distributed, world_size)
    load_universal = False
    if candidates:  # a checkpoint of another strategy or ZeRO stage is refused before any process group
        saved = CheckpointLayout.read(candidates[0])
        saved.check_resumable_as(layout, candidates[0])
        load_universal = saved.needs_universal_load(layout)
    accelerator = build_accelerator(config, grad_accum, world_size, load_universal)
    try:
        run_dir = agree_on_run_dir(accelerator, own_dir)
        config_yaml = redacted_yaml(cfg)  # resolved, secrets replaced: for the run dir and every checkpoint
        if accelerator.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(config_yaml)
        trainer = Trainer(config, run_dir, accelerator, grad_accum, config_yaml, layout, candidates)
        with trainer.liveness.exit_on_distributed_error():  # a dead or hung rank: one line naming it, exit 5
            return trainer.fit()
    finally:
        accelerator.end_training()  # destroys the process group


@hydra.main(version_base=None, config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    try:
        return run(cfg)  # a sweep's launcher (e.g. submitit) hands each job's last metrics back
    except tuple(BAD_INPUT) as err:  # a user's mistake: one sentence, no trace; anything else keeps its traceback
        print(bad_input_line(err), file=sys.stderr)
        _undo_refused_start()
        sys.exit(2)
    except RequeueLimitReached as err:  # the checkpoint is complete; the job just may not requeue again
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(3)
    except NumericalFault as err:  # a NaN/Inf loss, gradient or weight: the last good checkpoint is the latest
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(4)
    except CheckpointWriteError as err:  # a full disk or failing storage: the earlier checkpoints are intact
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(6)


QUIET = ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def _quiet_hydra_on_other_ranks() -> None:
    """Ranks other than 0 must not write .hydra/ or a log file into what may be rank 0's run directory."""
    if int(os.environ.get("RANK", "0")) != 0:
        sys.argv[1:] = with_overrides(sys.argv[1:], QUIET)


def with_overrides(argv: list[str], more: list[str]) -> list[str]:
    """`argv` with `more` overrides beside its own: Hydra's parser takes its overrides as one run of arguments, so
    appended after an option that follows them (`a=1 --config-dir=X`) they would be refused as unrecognized."""
    parsed = hydra_arguments(argv)
    overrides = parsed[0].overrides if parsed is not None else []  # refused arguments: Hydra says so itself
    end = argv.index(overrides[0]) + len(overrides) if overrides else len(argv)  # after them: `more` wins
    return [*argv[:end], *more, *argv[end:]]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    register_configs()
    _quiet_hydra_on_other_ranks()
    no_live_progress_bars_off_a_terminal()
    composed = _compose_or_exit(sys.argv[1:])
    with _hydra_handed_the_config(composed, sys.argv[1:]):
        _hydra_main()
    leave_without_interpreter_teardown()


# What the run directory held before Hydra made it; noted by _compose_or_exit, read if the start is refused.
_run_dir_before: Optional[RunDirBefore] = None


def _compose_or_exit(argv: list[str]) -> Optional[DictConfig]:
    """Compose a plain run's config once before Hydra does, so that a mistake in composing it is one sentence
    (`config error: trainer.max_step is not a key of trainer: did you mean trainer.max_steps?`) and exit 2, not
    Hydra's several lines and exit 1, with a user's --config-dir as with the package's configs alone; and note the
    run directory as it is before Hydra makes it. Anything but a plain run (--help, --cfg, --multirun, ...) is left
    to Hydra as it is. Returns the composed config (with its `hydra` node); None where Hydra composes alone."""
    global _run_dir_before
    run = plain_run(argv)
    if run is None:
        return None
    try:
        cfg = compose_train(run.overrides, run.config_dir, with_hydra=True)
    except Exception as err:
        sentence = composition_error(err, run.overrides, run.config_dir)
        if sentence is None:
            return None  # not a mistake in the input: Hydra composes again and reports it its own way
        print(f"config error: {sentence}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    with contextlib.suppress(Exception):  # a run dir that cannot be resolved here fails in Hydra just the same
        hydra_node = cfg.hydra
        _run_dir_before = RunDirBefore.look(str(hydra_node.run.dir), hydra_node.output_subdir)
    return cfg


@contextlib.contextmanager
def _hydra_handed_the_config(composed: Optional[DictConfig], argv: list[str]) -> Iterator[None]:
    """Hydra composes a plain run's config twice more after `_compose_or_exit` has: once only to read `hydra.mode`
    (Hydra.get_mode), once to run it. Composing is ~0.1-0.3 s of every rank's start (the test suite starts ~500
    ranks), so both are answered from the config composed already, which is exactly what Hydra would compose:

    * get_mode reads `hydra.mode`: None unless a config or override sets it (--multirun and hydra.mode overrides
      are not plain runs);
    * where that is None, Hydra runs with the override `hydra.mode=RUN` added (hydra/_internal/utils.py,
      `_run_app`), which composes to the same config with `hydra.mode` RUN and that override listed last in
      `hydra.overrides.hydra`; the config handed over is given both.

    The config is handed over once, and only for the call with exactly the plain run's overrides (plus Hydra's
    `hydra.mode=RUN`); any other composition, and a Hydra without these private methods, composes as before.
    tests/moe_platform/test_compose_once.py checks the job's config equals the one Hydra composes itself."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode

    run = plain_run(argv)
    private = (getattr(Hydra, "get_mode", None), getattr(ConfigLoaderImpl, "load_configuration", None))
    if composed is None or run is None or not all(callable(method) for method in private):
        yield
        return
    mode = OmegaConf.select(composed, "hydra.mode", throw_on_resolution_failure=False)
    own_overrides = list(run.overrides) + ([] if mode is not None else ["hydra.mode=RUN"])
    handed = [composed]
    get_mode, load = private

    def load_configuration(self, config_name, overrides, run_mode, *args, **kwargs):
        if not handed or run_mode != RunMode.RUN or list(overrides) != own_overrides:
            return load(self, config_name, overrides, run_mode, *args, **kwargs)
        cfg = handed.pop()
        if mode is None:  # what Hydra's added override composes to
            cfg.hydra.mode = RunMode.RUN
            cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
        return cfg

    Hydra.get_mode = lambda self, config_name, overrides: mode
    ConfigLoaderImpl.load_configuration = load_configuration
    try:
        yield
    finally:
        Hydra.get_mode, ConfigLoaderImpl.load_configuration = get_mode, load


def _undo_refused_start() -> None:
    """A start refused for bad input leaves no half-made run directory: what this start added goes, nothing else.
    Only rank 0 wrote Hydra's files and the config.yaml; another rank removes just a directory it made empty."""
    if _run_dir_before is None or not HydraConfig.initialized():
        return
    hydra_config = HydraConfig.get()
    ours = set()
    if hydra_config.output_subdir is not None:
        ours = {hydra_config.output_subdir, f"{hydra_config.job.name}.log", "config.yaml"}
    with contextlib.suppress(OSError):
        _run_dir_before.undo(hydra_config.runtime.output_dir, ours)


def leave_without_interpreter_teardown() -> None:
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
