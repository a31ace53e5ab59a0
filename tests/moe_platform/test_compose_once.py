"""`moe-train` composes a plain run's config once, not three times: before Hydra (for one-sentence errors). Hydra's
own two compositions, one made only to read `hydra.mode` and one to run, are answered from it, and Hydra then runs
in the mode it would have found itself, with the config it would have composed itself. The child process runs
`cli.main()` with the training replaced by a record of the config it is handed (the job's, Hydra's node included),
each command line once as it is and once with Hydra left to compose alone, and reports how many times the config
was composed, in which mode Hydra ran, and what the job saw."""

import json
import subprocess
import sys
from pathlib import Path

from moe_platform.testing import subprocess_env

CHILD = r"""
import contextlib, json, sys
import hydra._internal.utils as hydra_utils
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
import moe_platform.launch.cli as cli

composed, modes = [], []
load_configuration = ConfigLoaderImpl.load_configuration
def counted(self, *args, **kwargs):
    composed.append(1)
    return load_configuration(self, *args, **kwargs)
ConfigLoaderImpl.load_configuration = counted
run_app = hydra_utils._run_app
def noted(*args, **kwargs):
    modes.append(str(kwargs["mode"]))
    return run_app(*args, **kwargs)
hydra_utils._run_app = noted
jobs = []
def job(cfg):  # the job itself, replaced by what it is handed: its config and Hydra's node
    jobs.append(json.dumps([OmegaConf.to_container(cfg, resolve=False),
                            OmegaConf.to_container(HydraConfig.get(), resolve=False)], default=str))
    return {}
cli.run = job
cli.leave_without_interpreter_teardown = lambda: None
handed_the_config = cli._hydra_handed_the_config

report = []
for argv in json.loads(sys.argv[1]):
    for told in (True, False):
        cli._hydra_handed_the_config = handed_the_config if told else (lambda *_: contextlib.nullcontext())
        composed.clear(); modes.clear(); jobs.clear()
        sys.argv = ["moe-train", *argv]
        cli.main()
        report.append({"argv": argv, "told": told, "compositions": len(composed), "modes": list(modes),
                       "jobs": list(jobs)})
print(json.dumps(report))
"""

EXPERIMENT_SETTING_THE_MODE = """\
# @package _global_
hydra:
  mode: RUN
"""


def test_a_plain_run_is_composed_once_and_run_as_hydra_would_run_it(tmp_path: Path) -> None:
    config_dir = tmp_path / "my_configs"
    (config_dir / "experiment").mkdir(parents=True)
    (config_dir / "experiment" / "run_mode.yaml").write_text(EXPERIMENT_SETTING_THE_MODE)
    cases = [
        [f"hydra.run.dir={tmp_path / 'plain'}"],
        [f"--config-dir={config_dir}", "experiment=run_mode", f"hydra.run.dir={tmp_path / 'mode_in_a_config'}"],
    ]
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True,
                           env=subprocess_env(), cwd=tmp_path, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(report) == 2 * len(cases)
    # What Hydra.get_mode reads: nothing set (Hydra then runs as RUN), and RUN where the experiment sets it.
    found_modes = ["None", "RunMode.RUN"]
    for told, alone, found in zip(report[::2], report[1::2], found_modes, strict=True):
        assert told["told"] and not alone["told"]
        assert (told["compositions"], alone["compositions"]) == (1, 3), (told, alone)
        assert told["modes"] == alone["modes"] == [found], (told, alone)
        # the job's config and Hydra's node (mode, overrides, run dir, choices) as Hydra composes them alone
        assert len(told["jobs"]) == len(alone["jobs"]) == 1
        assert told["jobs"] == alone["jobs"], (told["argv"], told["jobs"][0][-3000:], alone["jobs"][0][-3000:])
