"""The one way this project composes the `train` config with Hydra: moe-train's pre-check, moe-submit, the tests and
the benches all call `compose_train` / `train_config`.

The configs are the package's own, `moe_platform.conf` (the repository's top-level conf/, shipped in the wheel as
moe_platform/conf/; pyproject.toml maps one onto the other), found through Hydra's `pkg://` search path, so an
installed `moe-train` finds them wherever it runs. A user's own config directory (`--config-dir=DIR`: groups and
experiments of their own, e.g. DIR/experiment/mine.yaml) is searched after them exactly as `hydra.main` searches it;
`hydra.searchpath=[file://DIR]` among the overrides works as it does for moe-train.
"""

import argparse
import contextlib
import importlib.resources
import io
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Optional

from hydra import compose, version
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from moe_platform.config import ConfigError, TrainConfig, to_train_config
from moe_platform.launch import bad_input

CONF_PACKAGE = "moe_platform.conf"
CONFIG_PATH = f"pkg://{CONF_PACKAGE}"  # moe-train's hydra.main(config_path=...): the same configs
CONFIG_NAME = "train"
SCHEMA = "train_schema"
JOB_NAME = "cli"  # what hydra.main names moe-train's job (its module's file name), so hydra.job.name composes alike


def conf_dir() -> Path:
    """The package's config tree on disk: the checkout's conf/ under an editable install, site-packages'
    moe_platform/conf/ from a wheel."""
    return Path(str(importlib.resources.files(CONF_PACKAGE)))


def register_configs() -> None:
    """Put the schema in Hydra's ConfigStore, once a process (turning the dataclasses into a config is ~30 ms, and
    moe-train's start asks twice); conf/train.yaml lists `train_schema` first in its defaults."""
    store = ConfigStore.instance()
    if f"{SCHEMA}.yaml" not in store.repo:
        store.store(name=SCHEMA, node=TrainConfig)


def user_config_dir(config_dir: str) -> str:
    """`--config-dir`'s directory as the absolute path Hydra searches; one sentence if it is not a directory."""
    path = os.path.abspath(config_dir)
    if not os.path.isdir(path):
        raise ConfigError(
            f"--config-dir={config_dir}: {path} is not a directory: give the directory that holds your own config "
            "groups, e.g. DIR for DIR/experiment/mine.yaml"
        )
    return path


def compose_train(
    overrides: Sequence[str] = (), config_dir: Optional[str] = None, *, with_hydra: bool = False
) -> DictConfig:
    """The `train` config composed from the package's configs, then `config_dir`'s (a user's --config-dir), with
    these overrides and the schema registered; `with_hydra` keeps the `hydra` node (run dir, output subdir)."""
    register_configs()
    with _hydra_searching(config_dir):
        return compose(CONFIG_NAME, overrides=list(overrides), return_hydra_config=with_hydra)


def train_config(overrides: Sequence[str] = (), config_dir: Optional[str] = None) -> TrainConfig:
    """`compose_train`'s config, typed and validated (one ConfigError sentence for a mistake in it)."""
    return to_train_config(compose_train(overrides, config_dir))


def composition_error(err: Exception, overrides: list[str], config_dir: Optional[str] = None) -> Optional[str]:
    """One sentence, naming the key and the fix, for a mistake met composing `overrides` (bad_input.py words it);
    None for anything else, which is not the user's input and keeps its own report."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, OverrideParseException):
        return bad_input.unparsable(str(err))
    if isinstance(err, MissingConfigException):
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        return bad_input.missing_option(group, option, list(err.options or []), bad_input.first_line(err))
    if isinstance(err, AssertionError):  # OmegaConf's, for an override that sets a key below a null node
        return bad_input.below_null(overrides, lambda some: compose_train(some, config_dir, with_hydra=True))
    if isinstance(err, ConfigCompositionException):
        # OmegaConf's error is Hydra's cause for an override, and only its context for a line of a config file
        cause = err.__cause__ or err.__context__
        return bad_input.composition_cause(cause, bad_input.first_line(err), overrides)
    return None


class PlainRun(NamedTuple):
    """A plain run's command line: its overrides, and the user's own config directory (`--config-dir`) if any."""

    overrides: list[str]
    config_dir: Optional[str]


def hydra_arguments(argv: list[str]) -> Optional[tuple[argparse.Namespace, list[str]]]:
    """(arguments, those it does not know) as Hydra's own parser reads `argv`, silently; None for what it refuses or
    answers itself (--version), which Hydra then says its own way."""
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_args_parser().parse_known_args(argv)
    except SystemExit:
        return None


def plain_run(argv: list[str]) -> Optional[PlainRun]:
    """A plain run's overrides and --config-dir, as Hydra's own argument parser reads them; None for anything
    else."""
    parsed = hydra_arguments(argv)
    if parsed is None:
        return None
    args, unknown = parsed
    other_work = (
        args.help, args.hydra_help, args.cfg, args.info, args.shell_completion, args.multirun,
        args.experimental_rerun, args.config_path, args.config_name,
    )  # fmt: skip
    if unknown or any(other_work) or any(o.lstrip("+").startswith("hydra.mode=") for o in args.overrides):
        return None
    return PlainRun(args.overrides, args.config_dir)


@contextlib.contextmanager
def _hydra_searching(config_dir: Optional[str]) -> Iterator[None]:
    """Hydra set up as `hydra.main` sets up moe-train, for `compose` to use, and put back as it was after.

    Hydra 1.3's public initializers take one config dir or module; the search path of an installed app plus a
    user's --config-dir is only built this way inside hydra.main (hydra/_internal/utils.py, `_run_hydra`'s
    `add_conf_dir`), so this repeats its three calls: the same search path, prepended the same way."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    version.setbase(None)
    search_path = create_config_search_path(CONFIG_PATH)
    if config_dir is not None:
        search_path.prepend(
            provider="command-line",
            path=f"file://{user_config_dir(config_dir)}",
            anchor=SearchPathQuery(provider="schema"),
        )
    Hydra.create_main_hydra2(task_name=JOB_NAME, config_search_path=search_path)
    try:
        yield
    finally:
        restore_gh_from_backup(backup)
