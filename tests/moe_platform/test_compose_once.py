"""`moe-train` composes a plain run's config twice, not three times: once before Hydra (for one-sentence errors) and
once in Hydra's run. Hydra's own extra composition, made only to read `hydra.mode`, is answered from the first, and
Hydra then runs in the mode it would have found itself. The child process runs `cli.main()` with the training
replaced by a no-op (composition is what is measured), each command line once as it is and once with Hydra left to
find the mode, and reports how many times the config was composed and in which mode Hydra ran."""

import json
import subprocess
import sys
from pathlib import Path

from moe_platform.testing import subprocess_env

CHILD = r"""
import contextlib, json, sys
import hydra._internal.utils as hydra_utils
from hydra._internal.config_loader_impl import ConfigLoaderImpl
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
cli.run = lambda cfg: {}  # the job itself: not what is measured
cli.leave_without_interpreter_teardown = lambda: None
told_the_mode = cli._hydra_told_the_mode

report = []
for argv in json.loads(sys.argv[1]):
    for told in (True, False):
        cli._hydra_told_the_mode = told_the_mode if told else (lambda composed: contextlib.nullcontext())
        composed.clear(); modes.clear()
        sys.argv = ["moe-train", *argv]
        cli.main()
        report.append({"argv": argv, "told": told, "compositions": len(composed), "modes": list(modes)})
print(json.dumps(report))
"""

EXPERIMENT_SETTING_THE_MODE = """\
# @package _global_
hydra:
  mode: RUN
"""


def test_a_plain_run_is_composed_twice_and_run_in_the_mode_hydra_finds(tmp_path: Path) -> None:
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
        assert (told["compositions"], alone["compositions"]) == (2, 3), (told, alone)
        assert told["modes"] == alone["modes"] == [found], (told, alone)
