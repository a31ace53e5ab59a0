"""Run many `moe-train` invocations for the price of one start: import the CLI once, then fork a child per case.

    python cli_cases.py CASES.json RESULTS.json

CASES.json is a list of {"id", "argv", "env", "cwd", "run_dir", "timeout"}. Each child (two at a time) changes to
`cwd`, adds `env`, sets sys.argv to `moe-train <argv>`, sends its stdout and stderr to files and calls
`moe_platform.launch.cli.main()`, just as the console script does. RESULTS.json maps each id to its exit code, stdout,
stderr, whether `run_dir` exists afterwards, and whether a process group was started: in each child
`torch.distributed.init_process_group` is a tripwire that notes the call and exits with PROCESS_GROUP_STARTED, so
reaching it cannot go unnoticed, hang on a port where nothing listens, or pass for a bad-input exit.
"""

import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

PROCESS_GROUP_STARTED = 97
TIMED_OUT = -9


def run_cases(cases: list[dict], out_dir: Path, parallel: int) -> dict[str, dict]:
    """Each case in a forked child, `parallel` at a time; a child past its case's timeout is killed."""
    pending, running, results = list(cases), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            case = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(case, *(out_dir / f"{case['id']}.{name}" for name in ("stdout", "stderr", "tripwire")))
            running[pid] = (case, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            case, start = running.pop(pid)
            results[case["id"]] = _result(case, out_dir, os.waitstatus_to_exitcode(status), start)
            continue
        for pid, (case, start) in list(running.items()):
            if time.monotonic() - start > case.get("timeout", 60):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del running[pid]
                results[case["id"]] = _result(case, out_dir, TIMED_OUT, start)
        time.sleep(0.01)
    return results


def _result(case: dict, out_dir: Path, code: int, start: float) -> dict:
    stdout, stderr, tripwire = (out_dir / f"{case['id']}.{name}" for name in ("stdout", "stderr", "tripwire"))
    run_dir = Path(case["cwd"], case["run_dir"]) if case.get("run_dir") else None
    return {
        "exit_code": code,
        "stdout": stdout.read_text(errors="replace") if stdout.exists() else "",
        "stderr": stderr.read_text(errors="replace") if stderr.exists() else "",
        "run_dir_exists": run_dir.exists() if run_dir else None,
        "process_group_started": tripwire.exists() or code == PROCESS_GROUP_STARTED,
        "seconds": round(time.monotonic() - start, 2),
    }


def _child(case: dict, stdout: Path, stderr: Path, tripwire: Path) -> None:
    code = 1
    try:
        os.chdir(case["cwd"])
        os.environ.update(case.get("env", {}))
        for stream, path in ((1, stdout), (2, stderr)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, stream)
            os.close(fd)
        import torch.distributed as dist

        def started(*args, **kwargs):
            tripwire.write_text("init_process_group was called")
            os._exit(PROCESS_GROUP_STARTED)

        dist.init_process_group = started
        dist.distributed_c10d.init_process_group = started
        sys.argv = [str(Path(sys.executable).parent / "moe-train"), *case["argv"]]
        from moe_platform.launch import cli
        from moe_platform.launch.prestarted import system_exit_code

        try:
            cli.main()
            code = 0
        except SystemExit as exit_:
            code = system_exit_code(exit_)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2]).parent / "streams"
    out_dir.mkdir(parents=True, exist_ok=True)
    # What the starts import, imported once: the children share it. datasets reads its settings from the
    # environment at import, so the one the CLI sets when stderr is no terminal (as in every child) is set here
    # first; test_bad_inputs checks that a real start prints the same.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets.packaged_modules.json.json  # noqa: F401
    import transformers  # noqa: F401

    import moe_platform.launch.cli
    import moe_platform.parallel.accelerator
    import moe_platform.train.trainer  # noqa: F401

    _compose_once()
    # Out of the garbage collector's reach, what the imports made (~4·10^5 objects): otherwise each child's first
    # full collection walks them all, ~0.3 s of a ~0.8 s case measured on 2 cores (this file: 62 -> 43 s of cases).
    gc.collect()
    gc.freeze()
    results = run_cases(cases, out_dir, parallel=min(2, os.cpu_count() or 1))
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


def _compose_once() -> None:
    """One composition here warms what every child would build again (override and interpolation grammars,
    schema caches); compose_train puts Hydra's global state back as it found it."""
    from moe_platform.launch.compose import compose_train

    compose_train(["trainer.max_steps=3", "hydra.run.dir=."], with_hydra=True)


if __name__ == "__main__":
    main()
