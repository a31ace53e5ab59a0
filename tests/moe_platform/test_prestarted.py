"""The prestarted `moe-train` (launch/prestarted.py) forks its ranks from a process that has imported what a run
imports, and `run_distributed`'s fork server (testing.py) its ranks from one that imported DISTRIBUTED_PRELOAD. A
fork copies only the forking thread, so those imports must start no thread of their own (an OpenMP pool, a compile
worker) and no process: a rank forked after one would run without it. The ranks' own behaviour is every other test
that launches through them."""

import json
import subprocess
import sys
from collections import Counter

import pytest

from moe_platform.testing import subprocess_env

pytestmark = pytest.mark.slow

# Each thread's name before and after the imports, and the child processes after them. torch's import starts one
# thread of its own, before anything the server adds.
THREADS_AND_CHILDREN = """
import json, os, psutil, torch
def threads():
    return sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))
before = threads()
IMPORTS
print(json.dumps([before, threads(), len(psutil.Process().children())]))
"""
# pyarrow's jemalloc starts its background thread when loaded; jemalloc itself starts it again in a forked child.
FORK_SAFE = {"jemalloc_bg_thd"}


IMPORTS = {
    "prestarted moe-train": "from moe_platform.launch.prestarted import import_the_command\nimport_the_command()",
    "run_distributed's fork server": (
        "import importlib\nfrom moe_platform.testing import DISTRIBUTED_PRELOAD\n"
        "for module in DISTRIBUTED_PRELOAD: importlib.import_module(module)"
    ),
}


@pytest.mark.parametrize("server", IMPORTS)
def test_the_imports_before_the_fork_start_no_thread_and_no_process(server: str) -> None:
    code = THREADS_AND_CHILDREN.replace("IMPORTS", IMPORTS[server])
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    before, after, children = json.loads(result.stdout.splitlines()[-1])
    added = Counter(after) - Counter(before)
    assert set(added) <= FORK_SAFE and children == 0, (before, after, children)
