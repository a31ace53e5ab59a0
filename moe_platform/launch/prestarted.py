"""`moe-train` with its imports already done: a process that imports the command once, then forks it per run.

The tests launch a few hundred short runs, and a run on this kind of machine spends most of its time importing
(torch, DeepSpeed, Accelerate, Hydra: ~3.5 s of CPU per rank, measured on 2 cores) and torchrun's agent ~2 s more,
against ~0.1 s a step. This server pays the imports once per test process. Each request forks the run's ranks,
each of which sets the environment torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, ...), points its stdout and stderr at the request's files and calls `cli.main()` as the `moe-train`
script does. The ranks are real processes with a real gloo group, DeepSpeed and Accelerate: only the launcher
differs. Like torchrun it watches the ranks, ends the others with SIGTERM (SIGKILL 30 s later) when one fails, and
exits 1 for a failed multi-rank run; a single process's exit code is its own, as for a direct `moe-train`.

What stays on real torchrun: signals, preemption, kills and hangs (the tests that start runs in the background),
the Slurm jobs, and the launcher cases of test_distributed. The server never runs torch code itself: a fork after
OpenMP has started its threads would leave the child without them.

Protocol: one JSON request per line on stdin ({"argv", "env", "cwd", "nproc", "port", "stdout", "stderr",
"timeout"}), one JSON reply per line on stdout ({"returncode", "rank_returncodes"} or {"timeout": true}), one
request at a time. The tests read each rank's exit code from the reply (testing.rank_exit_codes), where torchrun
prints them in its failure summary.
"""

import importlib
import json
import os
import signal
import sys
import time
import traceback
from types import ModuleType

# What every ZeRO start imports late, in each rank (measured with -X importtime in the forked ranks: ~6-8 s per rank
# on 2 cores, where DDP and FSDP ranks import nothing more): DeepSpeed's ZeRO optimizer check imports its Muon, whose
# torch.compile decorators pull in torch._inductor; Accelerate's DeepSpeed plugin imports transformers' integration;
# the engine its expert-parallel config. Imports only: no thread is started (test_prestarted.py).
ZERO_LATE_IMPORTS = (
    "deepspeed.ops",  # its op builders, read to mark the CPU backend's shared-memory op off (parallel/accelerator.py)
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "transformers.integrations",
    "deepspeed.module_inject.auto_ep_config",
)

GRACE_S = 30.0  # torchrun's wait between SIGTERM and SIGKILL for the survivors of a failed rank
POLL_S = 0.05


def rank_environment(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables torchrun gives a worker on one node (run_id and restart counts included)."""
    if nproc == 1:
        return dict(env)
    ranks = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank, "WORLD_SIZE": nproc}
    ranks |= {"LOCAL_WORLD_SIZE": nproc, "GROUP_WORLD_SIZE": 1, "ROLE_WORLD_SIZE": nproc, "MASTER_PORT": port}
    ranks |= {"TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0}
    named = {"MASTER_ADDR": "127.0.0.1", "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "none"}
    return {**env, **{key: str(value) for key, value in ranks.items()}, **named}


def import_the_command() -> ModuleType:
    """moe-train's module and what a run imports on its way (the trainer's strategies, checkpoints, interop)."""
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import torch.distributed.checkpoint
    import torch.distributed.fsdp  # noqa: F401

    import moe_platform.launch.cli as cli
    import moe_platform.train.pipeline_step  # the trainer imports it under pipeline parallelism only
    import moe_platform.train.trainer  # noqa: F401  (cli.run imports it late: 1-2 s per rank, torch._dynamo with it)
    from moe_platform.launch.compose import register_configs

    register_configs()  # the schema in Hydra's ConfigStore, for every forked rank

    for module in ZERO_LATE_IMPORTS:
        importlib.import_module(module)
    return cli


def run_rank(cli: ModuleType, request: dict, rank: int) -> None:
    """In the forked child: become the rank and run moe-train; never returns."""
    code = 1
    try:
        os.setsid()  # its own session, as torchrun starts a worker: ending it ends what it started
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(rank_environment(request["env"], rank, request["nproc"], request["port"]))
        import torch  # imported already by the server: this only names it

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        for handler in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(handler, signal.SIG_DFL if handler != signal.SIGINT else signal.default_int_handler)
        sys.argv = list(request["argv"])
        cli.main()  # leaves through os._exit(0) when the run finishes
        code = 0
    except SystemExit as stop:
        code = system_exit_code(stop)
        if stop.code is not None and not isinstance(stop.code, int):  # as the interpreter reports sys.exit("...")
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def system_exit_code(stop: SystemExit) -> int:
    """The process exit code the interpreter gives `sys.exit(code)`: an int as is, None 0, anything else 1."""
    return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)


def exit_code(status: int) -> int:
    """subprocess's convention: the exit code, or minus the signal that ended the process."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def launch(cli: ModuleType, request: dict) -> dict:
    """Fork the ranks, watch them as torchrun does, and say how they ended."""
    nproc, pids = request["nproc"], []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            run_rank(cli, request, rank)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline, failed_at = time.monotonic() + request["timeout"], None
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = exit_code(status)
            if codes[pid] != 0 and failed_at is None:
                failed_at = time.monotonic()
                _signal(set(pids) - set(codes), signal.SIGTERM)
            continue
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            _signal(set(pids) - set(codes), signal.SIGKILL)
            if now > deadline:
                for left in set(pids) - set(codes):
                    os.waitpid(left, 0)
                return {"timeout": True}
        time.sleep(POLL_S)
    ordered = [codes[pid] for pid in pids]
    returncode = ordered[0] if nproc == 1 else int(any(code != 0 for code in ordered))
    return {"returncode": returncode, "rank_returncodes": ordered}


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # not yet in its own session
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the imports print (DeepSpeed logs to stdout) is not a reply
    cli = import_the_command()
    for line in sys.stdin:
        replies.write(json.dumps(launch(cli, json.loads(line))) + "\n")


if __name__ == "__main__":
    main()
