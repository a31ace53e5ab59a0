"""The project installs like a library: its wheel holds the code, the configs and the Slurm job template, and the
`moe-train` / `moe-submit` it installs work from any directory, with nothing read from this checkout.

The wheel is built offline (`pip wheel --no-deps --no-build-isolation --no-index`: setuptools comes from the test's
own environment, where torch requires ≥ 77, which builds wheels without the `wheel` package) from a copy of the
sources, so that no build/ or egg-info lands in the checkout. It is installed with `pip --python` into a FRESH
virtualenv, made without pip.

What is borrowed, and why: installing torch, DeepSpeed, datasets, Hydra, ... into the fresh virtualenv would take
minutes, so a .pth file in its site-packages appends the site-packages of the environment running this test
(`sysconfig.get_paths()["purelib"]`: .venv under `make test`) to sys.path, after the fresh one's own. Only those
third-party packages are used from there. That directory also holds this checkout's editable install of
moe-platform (its dist-info, and a finder that a .pth file there starts), but Python runs the .pth files of site
directories only, not of a directory a .pth file names, so that finder never starts; and the wheel's moe_platform,
moe and data_pipeline come first on sys.path: the test checks that they are imported from the fresh virtualenv. The
.pth file is written after installing, so that pip sees a clean environment. torchrun is borrowed as a module, not
as a console script, so the fresh bin/ has none: the rendered job is checked, not run.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from moe_platform.testing import FAST, metric_steps, subprocess_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe", "data_pipeline", "moe_platform")
SHIPPED = {"conf": "moe_platform/conf", "slurm": "moe_platform/slurm"}  # pyproject.toml's package-dir
SOURCES = ("pyproject.toml", "README.md", *PACKAGES, *SHIPPED)


def expected_wheel_files() -> set[str]:
    """Every module of the packages, every config, and the job template with its launcher: nothing else (not
    slurm/dev-cluster/, the tests' cluster)."""
    files = {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    files |= {f"{SHIPPED['conf']}/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    names = ("__init__.py", "train.sbatch", "launch.sh")
    return files | {f"{SHIPPED['conf']}/__init__.py"} | {f"{SHIPPED['slurm']}/{name}" for name in names}


def run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out, ".", cwd=source)
    [built] = out.glob("moe_platform-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new virtualenv with the wheel installed and the running environment's site-packages borrowed after its
    own (module docstring); returns its bin/."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv.parent)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python]
    run(*pip, "install", "--no-deps", "--no-index", "-q", wheel, cwd=venv.parent)
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=venv.parent)
    borrowed = sysconfig.get_paths()["purelib"]
    Path(purelib.stdout.strip(), "_borrowed_third_party.pth").write_text(borrowed + "\n")
    return venv / "bin"


def fresh_env(bin_dir: Path) -> dict[str, str]:
    env = subprocess_env()
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}


def test_the_wheel_holds_every_module_config_and_the_job_template(wheel) -> None:
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if ".dist-info/" not in name}
        modes = {name: archive.getinfo(name).external_attr >> 16 for name in shipped}
    expected = expected_wheel_files()
    assert not expected - shipped, f"missing from the wheel (a package not in pyproject.toml?): {expected - shipped}"
    assert not shipped - expected, f"in the wheel but not expected: {shipped - expected}"
    assert modes["moe_platform/slurm/launch.sh"] & 0o111, "launch.sh stays executable"


def test_the_installed_commands_run_from_any_directory_on_the_wheels_own_files(fresh_venv, tmp_path) -> None:
    env, site = fresh_env(fresh_venv), fresh_venv.parent / "lib"
    where = run(
        fresh_venv / "python", "-c",
        "import moe_platform.launch.cli, moe_platform.conf, moe_platform.slurm, moe, data_pipeline, hydra;"
        "print(moe_platform.launch.cli.__file__, moe_platform.conf.__file__, moe_platform.slurm.__file__,"
        "moe.__file__, data_pipeline.__file__, hydra.__file__, sep='\\n')",
        cwd=tmp_path, env=env,
    ).stdout.split()  # fmt: skip
    *ours, borrowed = map(Path, where)
    assert all(site in path.parents for path in ours), where
    assert not any(ROOT in path.parents for path in ours), where
    assert site not in borrowed.parents, "hydra comes from the borrowed site-packages"

    run(fresh_venv / "moe-train", *FAST, "trainer.max_steps=2", "hydra.run.dir=run", cwd=tmp_path, env=env)
    assert metric_steps(tmp_path / "run") == [1, 2]
    assert "model:" in (tmp_path / "run" / "config.yaml").read_text()

    submit = [fresh_venv / "moe-submit", "--nodes=1", "--dry-run", "--", *FAST, "trainer.max_steps=2"]
    printed = run(*submit, "hydra.run.dir=job", cwd=tmp_path, env=env).stdout
    job = tmp_path / "job"
    assert f"rendered {job / 'train.sbatch'}" in printed
    script = (job / "train.sbatch").read_text()
    [launcher] = [line.partition("=")[2] for line in script.splitlines() if line.startswith("MOE_LAUNCH=")]
    assert site in Path(launcher).parents and Path(launcher).name == "launch.sh", launcher
    assert os.access(launcher, os.X_OK)
    assert f"MOE_BIN={fresh_venv}\n" in script and f"hydra.run.dir={job}" in script
    assert "max_steps: 2" in (job / "config.yaml").read_text()
