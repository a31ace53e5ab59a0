"""Shared test settings: offline Hugging Face libraries, deterministic small CPU runs."""

import os

# Nothing in the test suite may download models or data.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker's torch gets its share of the cores: `make test`'s two workers on 2 cores would
    otherwise run two intra-op threads each, four spinning threads on two cores (tests/moe took 81 s so, 61 s with
    one thread a worker). The runs the tests start as processes already get one (testing.subprocess_env)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


# ---- longest files first ------------------------------------------------------------------------------------------
# `make test` runs two xdist workers that each take whole files (--dist loadfile) in collection order
# (--no-loadscope-reorder). Collected longest-first by the seconds each file took in a recorded run
# (tests/file_durations.json; a file not in it comes after those, in its own order), the last files to start are the
# short ones, which even the workers out instead of one long file running on alone at the end.
# `make durations` re-records the file; a stale one only balances the workers less well.
DURATIONS = os.path.join(os.path.dirname(__file__), "file_durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-file-durations", action="store_true", help=f"write each file's seconds to {DURATIONS}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import json

    seconds = json.load(open(DURATIONS)) if os.path.isfile(DURATIONS) else {}
    position = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0.0), position[item.nodeid]))


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Setup, call and teardown seconds by file (under xdist the controller sees every worker's reports)."""
    file = report.nodeid.split("::")[0]
    _file_seconds[file] = _file_seconds.get(file, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With --record-file-durations, the files this session ran get their seconds in DURATIONS; others keep theirs."""
    if session.config.getoption("--record-file-durations") and not hasattr(session.config, "workerinput"):
        import json

        seconds = json.load(open(DURATIONS)) if os.path.isfile(DURATIONS) else {}
        seconds.update({file: round(s, 1) for file, s in _file_seconds.items()})
        with open(DURATIONS, "w") as f:
            json.dump(dict(sorted(seconds.items())), f, indent=1)
            f.write("\n")
