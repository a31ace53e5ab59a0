"""A user's own config groups and experiments, kept outside the package (README, "Add your own experiment"): found
with `--config-dir=DIR` or `hydra.searchpath=[file://DIR]` by moe-train and moe-submit alike, and a mistake in them
is one sentence with exit 2, as a mistake in an override is."""

import subprocess
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from moe_platform.launch import submit
from moe_platform.launch.compose import compose_train, composition_error, train_config
from moe_platform.testing import BIN, FAST, metric_steps, subprocess_env

# FAST without its model and steps: the command line wins over the experiment's `override /model` and its values.
SMALL = [o for o in FAST if not o.startswith(("model=", "trainer.max_steps="))]
MODEL = """\
# a user's own option of the package's model group, built on one of the package's
defaults:
  - moe_tiny
  - _self_
d_model: 64
"""
EXPERIMENT = """\
# @package _global_
defaults:
  - override /model: mine_tiny
trainer:
  {steps_key}: 2
"""


def user_configs(root: Path, steps_key: str = "max_steps") -> Path:
    """DIR/model/mine_tiny.yaml and DIR/experiment/mine.yaml, as the README's example lays them out."""
    config_dir = root / "my_configs"
    (config_dir / "model").mkdir(parents=True)
    (config_dir / "experiment").mkdir()
    (config_dir / "model" / "mine_tiny.yaml").write_text(MODEL)
    (config_dir / "experiment" / "mine.yaml").write_text(EXPERIMENT.format(steps_key=steps_key))
    return config_dir


def moe_train_in(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "moe-train"), *argv], capture_output=True, text=True, cwd=cwd, env=subprocess_env(), timeout=300
    )


def test_a_users_experiment_composes_through_config_dir_and_searchpath(tmp_path: Path) -> None:
    config_dir = user_configs(tmp_path)
    by_dir = train_config(["experiment=mine"], str(config_dir))
    by_searchpath = train_config([f"hydra.searchpath=[file://{config_dir}]", "experiment=mine"])
    for config in (by_dir, by_searchpath):
        assert (config.model.d_model, config.model.n_layers, config.trainer.max_steps) == (64, 4, 2)
    assert train_config(["model=mine_tiny"], str(config_dir)).model.d_model == 64  # the group option on its own


def test_moe_train_trains_two_steps_with_a_users_experiment(tmp_path: Path) -> None:
    user_configs(tmp_path)
    result = moe_train_in(tmp_path, "--config-dir=my_configs", *SMALL, "experiment=mine", "hydra.run.dir=run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert metric_steps(tmp_path / "run") == [1, 2]
    assert "d_model: 64" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_typo_in_a_users_experiment_is_one_sentence_and_exit_2(tmp_path: Path) -> None:
    config_dir = user_configs(tmp_path, steps_key="max_step")
    sentence = "in experiment/mine.yaml, trainer.max_step is not a key of trainer: did you mean trainer.max_steps?"
    result = moe_train_in(tmp_path, "--config-dir=my_configs", *SMALL, "experiment=mine", "hydra.run.dir=run")
    assert (result.returncode, result.stderr) == (2, f"config error: {sentence}\n")
    assert not (tmp_path / "run").exists()
    # The same sentence through hydra.searchpath, and for a misspelt option of the user's own.
    overrides = [f"hydra.searchpath=[file://{config_dir}]", "experiment=mine"]
    with pytest.raises(ConfigCompositionException) as excinfo:
        compose_train(overrides)
    assert composition_error(excinfo.value, overrides) == sentence
    with pytest.raises(Exception) as excinfo:
        compose_train(["experiment=mnie"], str(config_dir))
    assert "did you mean experiment=mine?" in composition_error(excinfo.value, ["experiment=mnie"], str(config_dir))


def test_a_config_dir_that_is_not_there_is_one_sentence(tmp_path: Path) -> None:
    result = moe_train_in(tmp_path, "--config-dir=nowhere", "experiment=mine", "hydra.run.dir=run")
    assert result.returncode == 2
    assert result.stderr == (
        f"config error: --config-dir=nowhere: {tmp_path / 'nowhere'} is not a directory: give the directory that "
        "holds your own config groups, e.g. DIR for DIR/experiment/mine.yaml\n"
    )


def test_moe_submit_composes_with_a_users_configs_and_hands_them_to_the_job(tmp_path: Path, monkeypatch) -> None:
    config_dir = user_configs(tmp_path)
    monkeypatch.chdir(tmp_path)
    submit.main(["--nodes=1", "--dry-run", "--", "--config-dir=my_configs", "experiment=mine", "hydra.run.dir=a"])
    script = (tmp_path / "a" / "train.sbatch").read_text()
    # Absolute, so that `sbatch a/train.sbatch` from anywhere finds the same configs.
    assert f"set -- --config-dir={config_dir} experiment=mine hydra.run.dir={tmp_path / 'a'};" in script
    assert "d_model: 64" in (tmp_path / "a" / "config.yaml").read_text()
    searchpath = f"hydra.searchpath=[file://{config_dir}]"
    submit.main(["--nodes=1", "--dry-run", "--", searchpath, "experiment=mine", "hydra.run.dir=b"])
    assert "d_model: 64" in (tmp_path / "b" / "config.yaml").read_text()
    assert f"'{searchpath}'" in (tmp_path / "b" / "train.sbatch").read_text()


def test_moe_submit_refuses_a_typo_in_a_users_experiment(tmp_path: Path, monkeypatch, capsys) -> None:
    user_configs(tmp_path, steps_key="max_step")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as excinfo:
        submit.main(["--nodes=1", "--dry-run", "--", "--config-dir=my_configs", "experiment=mine", "hydra.run.dir=a"])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err == (
        "config error: in experiment/mine.yaml, trainer.max_step is not a key of trainer: did you mean "
        "trainer.max_steps? (nothing was submitted)\n"
    )
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["experiment=mine", "--config-dir=DIR"],
        ["--config-dir=DIR", "experiment=mine", "trainer.seed=1"],
        ["--config-dir", "DIR", "experiment=mine"],
        ["--config-dir=DIR"],
        [],
    ],
)
def test_ranks_other_than_0_keep_the_command_line_as_hydra_parses_it(argv: list[str]) -> None:
    """Ranks but 0 add overrides that keep Hydra's files out of the run dir. Hydra parses overrides as one run of
    arguments, so they go right after the user's, wherever --config-dir stands, and win over them."""
    from hydra._internal.utils import get_args_parser

    from moe_platform.launch.cli import QUIET, with_overrides

    before = get_args_parser().parse_args(argv)
    after = get_args_parser().parse_args(with_overrides(argv, QUIET))  # refuses stray arguments with SystemExit
    assert after.overrides == [*before.overrides, *QUIET]
    assert after.config_dir == before.config_dir
