"""Test helpers, importable so that tests in any folder share them:
* `moe_train` runs the real `moe-train` CLI in one process, or in N gloo processes through torchrun/accelerate;
* `start_moe_train`, `wait_for_logged_step`, `worker_pids` act on a run while it trains (signals, preemption);
* `assert_resumes_exactly` states the resume property (every step once, the uninterrupted run's losses) for `Job`s;
* `assert_trains_like` states the layout property (another world size, EP or sharding logs the same training);
* `run_distributed` runs one test function in N processes joined by a gloo group, all on 127.0.0.1;
* `finished_wandb_files` reads wandb's offline run files back, once wandb has finished writing them;
* `first_batch_loss` / `lm_loss_on_the_first_batch`: the loss a run's step 1 should log, computed outside it."""

import importlib.util
import inspect
import json
import math
import multiprocessing
import os
import pickle
import queue
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moe_platform.parallel.accelerator import free_port

BIN = Path(sys.executable).parent
# Seconds-long runs: tiny MoE on a small synthetic corpus, every step logged, no eval unless asked.
FAST = [
    "model=moe_tiny",
    "data=synthetic",
    "data.synthetic.num_tokens=131072",
    "data.seq_len=32",
    "data.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "data.val.max_batches=1",
    "trainer.save_final=false",
    "logging.progress_bar=false",
    "logging.peak_memory=false",  # its profiled step costs ~0.5 s per run; test_training_options checks it
    "logging.peak_tflops=1.0",
]
# The expert-parallel tests' runs (20 steps): capacity drops (a factor of 1 leaves no slack) and the aux-loss-free
# bias, the parts EP must not change.
ROUTING = [
    "trainer.max_steps=20",
    "model.moe.capacity_factor=1.0",
    "model.moe.min_capacity=1",
    "model.moe.router.bias_update_rate=0.001",
    "data.global_batch_size=16",
]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


# What the rendezvous store says when its port was taken (not a bare DistNetworkError: a rank that loses its peer
# raises that too, and such a run must not be rerun in its own run directory).
PORT_TAKEN = ("Address already in use", "EADDRINUSE")


def moe_train(
    run_dir: Path,
    *overrides: str,
    nproc: int = 1,
    launcher: str | None = None,
    timeout: int = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run `moe-train` on 127.0.0.1 in `nproc` processes, with `env` added to the environment (e.g. MOE_FAULTS);
    raises AssertionError with the output on failure unless `check` is false. With no `launcher` the ranks are
    forked from this test process's prestarted `moe-train` (launch/prestarted.py: the same command with its
    imports done once); "torchrun" or "accelerate" launch it through that launcher. A free port can be taken by
    another process between choosing and binding it, so a launch that fails on its port is retried once on a new
    one."""
    args, run_env = [*FAST, *overrides, f"hydra.run.dir={run_dir}"], {**subprocess_env(), **(env or {})}
    for attempt in range(2):
        if launcher is None:
            command = [f"prestarted moe-train x{nproc}", *args]
            result = PRESTARTED.run(args, nproc, run_env, timeout)
        else:
            command = _launch_command(launcher, nproc, args)
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=run_env)
        port_taken = any(marker in result.stderr for marker in PORT_TAKEN)
        if result.returncode == 0 or not port_taken or attempt == 1:
            break
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)}\nexit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result


class Prestarted:
    """This test process's `python -m moe_platform.launch.prestarted`, started at its first run and kept."""

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None

    def run(self, args: list[str], nproc: int, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen(
                [sys.executable, "-m", "moe_platform.launch.prestarted"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=subprocess_env(),
            )  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="moe_prestarted_") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"argv": [str(BIN / "moe-train"), *args], "env": env, "cwd": os.getcwd(), "nproc": nproc}
            request |= {"port": free_port(), "stdout": str(out), "stderr": str(err), "timeout": timeout}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            line = self.server.stdout.readline()
            if not line:
                raise RuntimeError(f"the prestarted moe-train (pid {self.server.pid}) ended: exit {self.server.wait()}")
            reply = json.loads(line)
            if reply.get("timeout"):
                raise subprocess.TimeoutExpired(["moe-train", *args], timeout, out.read_text(), err.read_text())
            result = subprocess.CompletedProcess(
                ["moe-train", *args], reply["returncode"], out.read_text(), err.read_text()
            )
            result.rank_returncodes = reply["rank_returncodes"]
            return result


PRESTARTED = Prestarted()

TORCHRUN_SUMMARY = re.compile(r"rank +: (\d+) \(local_rank: \d+\)\n +exitcode +: (-?\d+) ")


def rank_exit_codes(result: subprocess.CompletedProcess) -> dict[int, int]:
    """Each rank's exit code (minus the signal that ended it): the prestarted launcher's reply, or the failed ranks
    of torchrun's failure summary (it names only those that did not exit 0)."""
    if hasattr(result, "rank_returncodes"):
        return dict(enumerate(result.rank_returncodes))
    return {int(rank): int(code) for rank, code in TORCHRUN_SUMMARY.findall(result.stderr)}


def start_moe_train(
    run_dir: Path, *overrides: str, nproc: int = 1, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`moe-train` (through torchrun when nproc > 1) started in the background, in its own process group, for tests
    that act on a run while it trains (signals, preemption); stdout and stderr go to run_dir/../<name>.log."""
    args = [*FAST, *overrides, f"hydra.run.dir={run_dir}"]
    command = _launch_command("torchrun" if nproc > 1 else None, nproc, args)
    with open(Path(run_dir).parent / f"{Path(run_dir).name}.log", "w") as log:  # the child keeps its own copy
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, text=True, env={**subprocess_env(), **(env or {})},
            start_new_session=True,
        )  # fmt: skip


def wait_for_logged_step(run_dir: Path, step: int, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Block until metrics.jsonl holds a record of `step` (the run is past it), or fail if the run ended first."""
    deadline = time.monotonic() + timeout
    metrics = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.is_file() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            return
        if process.poll() is not None:
            raise AssertionError(f"the run ended (exit {process.returncode}) before step {step}")
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {metrics} after {timeout} s")


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the training processes a torchrun launcher started."""
    import psutil

    workers = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        rank = child.environ().get("RANK")
        if rank is not None and "moe-train" in " ".join(child.cmdline()):
            workers[int(rank)] = child.pid
    return workers


def finish(process: subprocess.Popen, timeout: float = 180.0) -> int:
    """The exit code of a run started by `start_moe_train`; its whole process group is killed if it overruns."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


class Job:
    """One `moe-train` start of a run, beyond FAST and the run dir: its overrides, its ranks and launcher (as for
    `moe_train`), and the step it stops at (trainer.stop_at) when it ends before trainer.max_steps."""

    def __init__(self, *overrides: str, nproc: int = 1, launcher: str | None = None, stop_at: int | None = None):
        self.overrides, self.nproc, self.launcher, self.stop_at = overrides, nproc, launcher, stop_at

    def run(self, run_dir: Path, *extra: str, **kwargs: Any) -> subprocess.CompletedProcess:
        stop = () if self.stop_at is None else (f"trainer.stop_at={self.stop_at}",)
        return moe_train(run_dir, *self.overrides, *stop, *extra, nproc=self.nproc, launcher=self.launcher, **kwargs)

    def __repr__(self) -> str:
        stop = "" if self.stop_at is None else f", stop_at={self.stop_at}"
        return f"Job({', '.join(self.overrides)}, nproc={self.nproc}{stop})"


EXACT = None  # a tolerance of `assert_resumes_exactly`'s `match`: equal bit for bit


def assert_resumes_exactly(
    run_dir: Path,
    reference: Path,
    *jobs: Job,
    match: dict[str, tuple[float, float] | None] | None = None,
    weights: bool = False,
) -> list[int]:
    """The resume property, for every test of it: a run stopped (trainer.stop_at, a signal, a kill) and continued
    with resume=auto, at the same or another world size, ZeRO layout or EP size, trains as if never interrupted.

    `run_dir` has stopped; each of `jobs` continues it with resume=auto. Before each, the run has stopped at the last
    step it logged, before the end, with a complete checkpoint of that step (its newest) and no preemption request
    left; a job with `stop_at` stops there. At the end every step of the uninterrupted `reference` run is in
    metrics.jsonl exactly once, and each key of `match` (default: the loss) equals the reference's at every step:
    bit for bit (EXACT), as it must where the layout is unchanged, or within the (rel, abs) tolerance a case documents
    where only the order of floating-point reductions changed. `weights`: both runs' last checkpoints also hold
    bit-identical consolidated weights and the same trainer state (step, tokens seen, data position, NaN counters).
    With no `jobs` the run has been resumed already (after a kill, a damaged checkpoint) and only the end is checked.
    Returns the step the run had stopped at before each job. The runs log every step (FAST's trainer.log_every=1)."""
    from moe_platform.checkpoint.catalog import latest_checkpoint, step_dirname, step_of
    from moe_platform.train.preemption import REQUEST_FILE

    steps = list(range(1, max(metric_steps(reference)) + 1))
    stops = []
    for job in jobs:
        stopped = max(metric_steps(run_dir))
        assert stopped < steps[-1], f"the run went on to step {stopped} of {steps[-1]}: it was not interrupted"
        newest = latest_checkpoint(run_dir)
        assert newest is not None and step_of(newest) == stopped, (
            f"step {stopped} was logged, the newest checkpoint is {newest}"
        )
        assert not (run_dir / REQUEST_FILE).exists(), "the preemption request was cleared"
        stops.append(stopped)
        job.run(run_dir, "resume=auto")
        if job.stop_at is not None:
            assert max(metric_steps(run_dir)) == job.stop_at, f"{job} stopped at step {max(metric_steps(run_dir))}"
    assert metric_steps(run_dir) == steps, "every step is logged exactly once"
    resumed, uninterrupted = read_metrics(run_dir)[0], read_metrics(reference)[0]
    for key, tolerance in (match or {"loss": EXACT}).items():
        for step in steps:
            got, want = resumed[step][key], uninterrupted[step][key]
            rel, abs_ = (0.0, 0.0) if tolerance is EXACT else tolerance
            same = got == want if tolerance is EXACT else math.isclose(got, want, rel_tol=rel, abs_tol=abs_)
            assert same, (
                f"step {step}, {key}: {got!r} after the resume, {want!r} uninterrupted (rel, abs: {rel}, {abs_})"
            )
    if weights:
        import torch

        from moe_platform.checkpoint.checkpointer import TRAINER_STATE
        from moe_platform.checkpoint.consolidate import export_fp32_state_dict

        last = [Path(run) / "checkpoints" / step_dirname(steps[-1]) for run in (run_dir, reference)]
        ours, theirs = (export_fp32_state_dict(checkpoint) for checkpoint in last)
        assert ours.keys() == theirs.keys()
        assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == [], "weights that differ"
        assert json.loads((last[0] / TRAINER_STATE).read_text()) == json.loads((last[1] / TRAINER_STATE).read_text())
    return stops


def _launch_command(launcher: str | None, nproc: int, args: list[str]) -> list[str]:
    if launcher is None:
        return [str(BIN / "moe-train"), *args]
    if launcher == "torchrun":
        return [
            str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", "--no-python", str(BIN / "moe-train"), *args,
        ]  # fmt: skip
    # Accelerate's launcher needs --multi_gpu to start N processes, even on CPU (--cpu starts one).
    return [
        str(BIN / "accelerate"), "launch", "--multi_gpu", f"--num_processes={nproc}", "--num_machines=1",
        "--mixed_precision=no", "--dynamo_backend=no", "--main_process_ip=127.0.0.1",
        f"--main_process_port={free_port()}", "-m", "moe_platform.launch.cli", *args,
    ]  # fmt: skip


def launched_records(nproc: int, overrides: Sequence[str], *, prefix: str = "launched_") -> list[dict]:
    """The metrics.jsonl records of one `moe-train` launched by torchrun on `nproc` ranks (127.0.0.1) with exactly
    `overrides` (none of the tests' FAST defaults: the benches time and measure what they name), in a temporary
    run directory; RuntimeError with the output's tails when it fails."""
    with tempfile.TemporaryDirectory(prefix=prefix) as run_dir:
        command = _launch_command("torchrun", nproc, [*overrides, f"hydra.run.dir={run_dir}"])
        result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env())
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(overrides)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def read_metrics(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """(train records by step, eval records by step) from metrics.jsonl; a resumed run appends to the file.
    A step recorded twice would be hidden here: `metric_steps` lists every record's step, repeats included."""
    train, evals = {}, {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "alert" in record:  # routing alerts (monitor/alerts.py) are records of their own
            continue
        (evals if "eval/loss" in record else train)[record["step"]] = record
    return train, evals


def assert_trains_like(
    run_dir: Path, reference: Path, steps: list[int] | None = None, rel: float = 1e-5
) -> dict[int, dict]:
    """`run_dir` logged the training `reference` logged, at each of `steps` (default: every step of the reference),
    as another layout of the same run must (more ranks, experts split, parameters sharded): loss, grad norm, aux
    loss (and MTP loss) within `rel` (only the order of floating-point reductions differs) and each MoE layer's
    tokens per expert exactly (every token is routed alike). Returns run_dir's training records."""
    import pytest

    def counts(record: dict) -> list[str]:
        return sorted(key for key in record if key.startswith("moe/layer_") and key.endswith("/tokens_per_expert"))

    train, want = read_metrics(run_dir)[0], read_metrics(reference)[0]
    for step in steps or sorted(want):
        got, ref = train[step], want[step]
        assert got["loss"] == pytest.approx(ref["loss"], rel=rel, abs=rel), step
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=rel), step
        assert got["aux_loss"] == pytest.approx(ref["aux_loss"], rel=rel, abs=1e-7), step
        assert ("mtp_loss" in got) == ("mtp_loss" in ref), step
        if "mtp_loss" in ref:  # multi-token prediction (moe/mtp.py)
            assert got["mtp_loss"] == pytest.approx(ref["mtp_loss"], rel=rel, abs=rel), step
        assert counts(got) == counts(ref), step
        for key in counts(ref):
            assert got[key] == ref[key], (step, key)
    return train


# What run_distributed's fork server imports before it forks a rank: torch and what the tests' rank functions import
# (the model, the trainer's pieces, pipelining, DeepSpeed for ZeRO-3 builds). Imports only, like the prestarted
# moe-train's: none starts a thread (tests/moe_platform/test_prestarted.py).
DISTRIBUTED_PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "torch.distributed.pipelining", "pytest", "accelerate", "deepspeed", "moe", "data_pipeline",
    "moe_platform.testing", "moe_platform.launch.compose", "moe_platform.train.trainer",
    "moe_platform.train.pipeline_step",
)  # fmt: skip


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 120.0) -> list[Any]:
    """`fn(rank, world_size, *args)` in `world_size` fresh processes that share a gloo process group on 127.0.0.1;
    returns each rank's return value, in rank order. A rank's exception fails the call with that rank's traceback;
    a rank left waiting in a collective is killed after `timeout` seconds.

    `fn` must be a module-level function; it is found again in its source file, which may be a test module pytest
    imported by path. The processes are not forked from the caller (that would copy its torch thread pools) but from
    multiprocessing's fork server, a process that only imported DISTRIBUTED_PRELOAD, started at this test process's
    first call and kept: each rank then starts in ~0.1 s where a spawned one imported torch and the platform again
    (~3-5 s of CPU on 2 cores, for each of the suite's ~60 ranks). A rank gets the caller's environment and working
    directory as a spawned one would.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(DISTRIBUTED_PRELOAD))  # read when the server starts, at the first call
    results = context.Queue()
    source = (inspect.getsourcefile(fn), fn.__qualname__)
    port = free_port()
    environment = dict(os.environ)
    processes = [
        context.Process(target=_distributed_worker, args=(source, rank, world_size, port, args, results, environment))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    by_rank: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            by_rank[rank] = pickle.loads(value)
    except queue.Empty:
        missing = sorted(set(range(world_size)) - set(by_rank))
        raise AssertionError(f"ranks {missing} gave no result in {timeout} s") from None
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    return [by_rank[rank] for rank in range(world_size)]


def _distributed_worker(
    source: tuple[str, str], rank: int, world_size: int, port: int, args: tuple, results, environment: dict[str, str]
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environment)  # the caller's now, not the fork server's from its start
    torch.set_num_threads(1)
    try:
        path, name = source
        spec = importlib.util.spec_from_file_location(f"_distributed_test_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            # Plain pickle bytes: the queue would pass tensors through shared memory that dies with this process.
            results.put((rank, True, pickle.dumps(getattr(module, name)(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    # Like moe-train (cli.leave_without_interpreter_teardown): a gloo thread that takes the GIL while Python
    # finalizes aborts the process, so leave once the result has been handed to the queue's pipe.
    results.close()
    results.join_thread()
    os._exit(0)


def metric_steps(run_dir: Path) -> list[int]:
    """The step of every training record in metrics.jsonl, in file order, repeats included."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [record["step"] for record in records if "loss" in record]


# wandb's run file (run-<id>.wandb) is a LevelDB-style log of protobuf `Record`s: a 7-byte header (":W&B", magic
# 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of type byte + data, length,
# type: 1 full, 2 first, 3 middle, 4 last). wandb >= 0.19 writes it from Go and no longer ships a Python reader
# (the old wandb.sdk.internal.datastore), so the framing is read here and every record parsed with wandb's own
# protobuf classes.
WANDB_BLOCK = 32768


def read_wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), f"{path} is not a wandb run file"
    position, chunks, pending = 7, [], b""
    while position + 7 <= len(data):
        left_in_block = WANDB_BLOCK - position % WANDB_BLOCK
        if left_in_block < 7:  # a block's tail too short for a chunk header is zero padding
            position += left_in_block
            continue
        crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad CRC at byte {position}"
        if kind in (1, 2):
            pending = b""
        pending += chunk
        if kind in (1, 4):
            chunks.append(pending)
    return [wandb_internal_pb2.Record.FromString(chunk) for chunk in chunks]


def finished_wandb_files(run_dir: Path, expected: int, timeout: float = 30.0) -> list[list]:
    """The records of each of the `expected` offline run files under run_dir, once every file ends with its `exit`
    record: wandb's service process may still be writing a file after `finish()` has returned."""
    deadline = time.monotonic() + timeout
    while True:
        paths = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        try:
            files = [read_wandb_records(path) for path in paths]
            if len(files) == expected and all(f and f[-1].WhichOneof("record_type") == "exit" for f in files):
                return files
            problem = (
                f"{len(files)} of {expected} run files, ends: {[f[-1].WhichOneof('record_type') for f in files if f]}"
            )
        except AssertionError as err:  # a chunk still being written fails its CRC
            problem = str(err)
        if time.monotonic() > deadline:
            raise AssertionError(f"wandb's offline files under {run_dir} are not complete after {timeout} s: {problem}")
        time.sleep(0.1)


def lm_loss_on_the_first_batch(logits_of: Callable, config) -> float:
    """Mean LM loss of `logits_of(input_ids)` over the first global batch that a fresh single-process run with
    `config` (a TrainConfig) trains on: what its step 1 logs, taken before its update."""
    import torch
    import torch.nn.functional as F

    from data_pipeline import build_loaders

    micro = config.trainer.micro_batch_size
    batches = iter(build_loaders(config.data, 0, 1, micro, model_vocab_size=config.model.vocab_size).train)
    with torch.no_grad():
        losses = []
        for _ in range(config.data.global_batch_size // micro):
            batch = next(batches)
            logits = logits_of(batch["input_ids"])
            losses.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))
    return float(torch.stack(losses).mean())


def first_batch_loss(run_dir: Path, data_of: Path | None = None) -> float:
    """The LM loss of a run's newest saved model on the first global batch a fresh run with its config trains on,
    or with the config of the run in `data_of` (one started from that model with other data settings)."""
    from moe import Transformer
    from moe_platform.checkpoint.catalog import latest_checkpoint
    from moe_platform.checkpoint.consolidate import export_fp32_state_dict
    from moe_platform.config import load_run_config

    checkpoint = latest_checkpoint(run_dir)
    config = load_run_config(checkpoint / "config.yaml")
    model = Transformer(config.model)
    model.load_state_dict(export_fp32_state_dict(checkpoint), strict=True)
    if data_of is not None:
        config = load_run_config(Path(data_of) / "config.yaml")
    return lm_loss_on_the_first_batch(lambda input_ids: model(input_ids).logits, config)
