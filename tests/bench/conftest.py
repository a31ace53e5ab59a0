"""The bench scripts' tests load a script from bench/ as a module (bench/ is not a package)."""

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def load_bench() -> Callable[[str], ModuleType]:
    """`load_bench("pipeline")`: bench/pipeline.py, executed as the module `bench_pipeline`, registered in
    sys.modules (a dataclass looks its module up there)."""

    def load(stem: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"bench_{stem}", BENCH / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module

    return load
