"""What our trainer costs over a bare PyTorch loop: `moe-train` against the loop a person would write, per mode.

    .venv/bin/python bench/trainer_overhead.py --rounds 5                  # single, ddp (2 ranks), zero2 (2 ranks)
    .venv/bin/python bench/trainer_overhead.py --rounds 5 --modes zero1,zero2,zero3   # DeepSpeed's stages (2 ranks)
    .venv/bin/python bench/trainer_overhead.py --ablate --modes zero2,ddp --rounds 3 --cycles 5   # what each costs
    .venv/bin/python bench/trainer_overhead.py --rounds 3 --modes ddp --steps 40
    .venv/bin/python bench/trainer_overhead.py --rounds 3 --modes fsdp,fsdp_ep --steps 40    # FSDP2 (2 ranks)

Each round runs, per mode, both contenders back to back (their order alternates between rounds), launched as users
launch them: `moe-train` directly (single) or through `torchrun --nproc_per_node=2` on 127.0.0.1 (distributed=ddp,
distributed=zero1/2/3, gloo on CPU); the bare loop is this file started the same way with `--bare MODE`. Both train the
same model (built from the same composed config with the same seeds), on the same micro-batches (the bare loop
takes them from the same synthetic loader, read into memory before timing), with the same torch AdamW (the
trainer's parameter groups and hyper-parameters, the same learning rate per step), the same gradient accumulation
(global batch / (micro batch × ranks)), the same clipping and the same aux-loss-free bias update. The bare loops:
  single  forward → loss / accumulation → backward per micro-batch; clip_grad_norm_, step, zero_grad
  ddp     the model in torch's DistributedDataParallel, `no_sync()` on all but the last micro-batch
  zero1, zero2, zero3
          `deepspeed.initialize` with the DeepSpeed config the trainer builds (distributed.deepspeed_config), then
          engine.backward / engine.step per micro-batch, no Accelerate; ZeRO-3 builds the model partitioned, through
          the trainer's build_model as the trainer does
  fsdp    `fully_shard` on every block and the root (torch's defaults: fp32, reshard after forward but the root's),
          reduce-scatter after every micro-batch, torch's clip_grad_norm_ on the DTensor gradients
  fsdp_ep the same sharding with the experts split over both ranks: parallel/fsdp.py's `shard_model` (experts on
          their own mesh: there is no bare torch way to say that) and its two-mesh `clip_grad_norm`
The trainer logs to metrics.jsonl only (no progress bar, no wandb/TensorBoard), evaluates only after the loop and
saves no checkpoint.

What is timed: steady-state wall time per optimizer step, from the end of step `--warmup` to the end of step
`--warmup + --steps`, in windows of `--log-every` steps (the trainer's default 20). Every bound is read inside the
running process, so start-up (imports, Hydra, data, model and process-group set-up, the ledger) and the final
evaluation stay out. On the trainer's side the bounds are the `time` stamps of its log records: each is taken as a
log begins, so a window holds exactly `--log-every` whole steps and one whole log (reductions, the record, the
sink), with every per-step cost (liveness, the preemption flag, the NaN guard, the statistics). The record's own
`tokens_per_s` would not do: it times the steps of a window but not the log between windows. Timing two whole
runs of different lengths from outside would, but it subtracts two start-ups of several seconds each, whose noise
is as large as what is measured. The bare loop reads perf_counter at the same steps.

Printed: per mode, ms per step of each contender in its median window and the ratio trainer / bare, median and
range over the rounds (each ratio from the two runs of one round), and the same ratio from each run's fastest
window (other jobs on the machine only ever add time; measured here: one window of a loaded run at 10x the
others). Goal: ratio ≤ 1.05.

Ablation (`--ablate`, trainer_ablation.py): one `moe-train` run per mode and round switches each per-step addition
of the trainer off in its own windows (liveness, preemption flag, NaN guard, grad norm, MoE statistics, bias update,
data, fault points; every one, and none), dealt in a shuffled order per cycle, and also times what is spent inside
each addition's calls; the bare loop runs ten windows beside it. Printed per variant: ms per step, its share of the
step (1 − variant / everything on, from the same run) and its ratio to the bare loop, medians over rounds.

Threads: by default all cores for one process, shared out among 2 ranks. On a machine others load, use
`--threads 1`: a second OpenMP thread spins against the other jobs (measured here: steps of seconds instead of
0.3 s). There the share of the cores each run gets also drifts over the minutes between two back-to-back runs,
and ratios scatter by ±50% (measured); `--concurrent --threads 1` runs the two contenders at the same time, so
that drift hits both alike: a check that no large overhead hides in the noise, not the figure a quiet machine
gives (two 2-rank runs at once put four processes on the cores).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from itertools import islice, pairwise
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script, this folder would come first and shadow nothing; be explicit
BIN = Path(sys.executable).parent
MODES = {"single": 1, "ddp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "fsdp": 2, "fsdp_ep": 2}
ZERO = ("zero1", "zero2", "zero3")  # DeepSpeed's engine steps inside the loop
# The distributed.* overrides of each mode (fsdp_ep: FSDP2 with the experts split over both ranks).
STRATEGY = {
    "single": ["distributed=single"],
    "ddp": ["distributed=ddp"],
    "zero1": ["distributed=zero1"],
    "zero2": ["distributed=zero2"],
    "zero3": ["distributed=zero3"],
    "fsdp": ["distributed=fsdp"],
    "fsdp_ep": ["distributed=fsdp", "distributed.expert_parallel_size=2"],
}


def run_overrides(args: argparse.Namespace, mode: str) -> list[str]:
    """The Hydra overrides both contenders compose their config from (the trainer's own defaults otherwise)."""
    return [
        *STRATEGY[mode],
        "logging=jsonl",
        "logging.progress_bar=false",
        f"trainer.max_steps={args.warmup + args.steps}",
        f"trainer.log_every={args.log_every}",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "trainer.save_final=false",
        *args.overrides,
    ]


def launch(mode: str, program: list[str]) -> list[str]:
    if MODES[mode] == 1:
        return program
    from moe_platform.parallel.accelerator import free_port

    return [
        str(BIN / "torchrun"), f"--nproc_per_node={MODES[mode]}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", "--no-python", *program,
    ]  # fmt: skip


def child_env(args: argparse.Namespace, mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # Both contenders get the same threads: by default all cores for one process, shared out among ranks.
    threads = args.threads or max(1, (os.cpu_count() or 1) // MODES[mode])
    env.update({"OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)})
    return env


@functools.cache
def ablation_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """trainer_ablation.py's ADDITIONS and VARIANTS, loaded by path (bench/ is not a package, and putting it on
    sys.path would let its data_pipeline.py shadow the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trainer_ablation", Path(__file__).with_name("trainer_ablation.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ADDITIONS, module.VARIANTS


def run_ablation(args: argparse.Namespace, mode: str) -> list[dict]:
    """`moe-train` through trainer_ablation.py, each per-step addition off in its share of the windows: per window,
    its variant, seconds per step and the seconds per step spent inside each addition's calls that were on."""
    with tempfile.TemporaryDirectory(prefix="bench_ablation_") as run_dir:
        program = [sys.executable, str(Path(__file__).with_name("trainer_ablation.py"))]
        program += [str(args.warmup), str(args.log_every), str(args.cycles), "--"]
        program += [*run_overrides(args, mode), f"hydra.run.dir={run_dir}"]
        env = {**child_env(args, mode), "MOE_ABLATION_OUT": f"{run_dir}/ablation.json"}
        result = subprocess.run(launch(mode, program), capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"moe-train ablation ({mode}) failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
        return json.loads(Path(run_dir, "ablation.json").read_text())["windows"]


def by_variant(windows: list[dict]) -> dict[str, list[float]]:
    """Seconds per step of each variant's windows, and under `inside:NAME` the seconds per step spent inside each
    addition's calls, the log window's and the log's, in the windows with everything on (a call's wait for a
    collective included)."""
    ADDITIONS, VARIANTS = ablation_names()

    seconds = {variant: [w["s_per_step"] for w in windows if w["variant"] == variant] for variant in VARIANTS}
    on = [w["inside_s_per_step"] for w in windows if w["variant"] == "none"]
    inside = {f"inside:{name}": [w.get(name, 0.0) for w in on] for name in (*ADDITIONS, "window", "log")}
    return {**seconds, **inside}


def ablate(args: argparse.Namespace, modes: list[str]) -> None:
    """Per mode and round: one trainer run with every variant's windows, and the bare loop over as many steps."""
    ADDITIONS, VARIANTS = ablation_names()

    ablation_steps = args.log_every * len(VARIANTS) * args.cycles
    bare_steps = args.log_every * 10  # ten windows: its median is as steady, in a fraction of the time
    inside = [f"inside:{name}" for name in (*ADDITIONS, "window", "log")]
    ms = {mode: {variant: [] for variant in (*VARIANTS, "bare", *inside)} for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            contenders = [("trainer", run_ablation), ("bare", time_bare)]
            for name, fn in contenders if round_ % 2 == 0 else contenders[::-1]:
                if name == "bare":
                    args.steps = bare_steps
                    ms[mode]["bare"].append(1e3 * statistics.median(fn(args, mode)))
                    continue
                args.steps = ablation_steps
                for key, seconds in by_variant(fn(args, mode)).items():
                    ms[mode][key].append(1e3 * statistics.median(seconds))
            r = ms[mode]
            print(
                f"round {round_ + 1}/{args.rounds} {mode}: ms/step everything on {r['none'][-1]:.1f}, everything off "
                f"{r['all'][-1]:.1f}, bare {r['bare'][-1]:.1f}",
                flush=True,
            )
    print(
        f"\nablation: each variant's windows ({args.log_every} steps and one log) over {args.cycles} cycles of "
        f"{len(VARIANTS)} windows, after {args.warmup} steps; per round the median window, then median [min–max] "
        f"over {args.rounds} rounds. share = 1 − variant / everything on, from the same round's run; inside = the "
        "time spent inside that addition's own calls per step (rank 0, windows with everything on)"
    )
    for mode, r in ms.items():
        print(f"{mode} ({MODES[mode]} rank{'s' if MODES[mode] > 1 else ''})")
        header = f"{'switched off':14s} {'ms/step':>22s} {'share of the step':>26s} {'/ bare loop':>22s}"
        print(f"  {header} {'inside, ms/step':>24s}")
        for variant in (*VARIANTS, "window", "log", "bare"):
            within = spread(r[f"inside:{variant}"], ".3f") if f"inside:{variant}" in r else ""
            if variant in ("window", "log"):  # never switched off: timed inside only
                print(f"  {f'(the {variant})':14s} {'':>22s} {'':>26s} {'':>22s} {within:>24s}")
                continue
            share = [1 - v / on for v, on in zip(r[variant], r["none"], strict=True)]
            ratio = [v / bare for v, bare in zip(r[variant], r["bare"], strict=True)]
            label = {"none": "nothing", "all": "everything", "bare": "(bare loop)"}.get(variant, variant)
            shares = spread([100 * x for x in share], "+.1f") + " %" if variant != "none" else ""
            row = f"{label:14s} {spread(r[variant], '.1f'):>22s} {shares:>26s} {spread(ratio, '.3f'):>22s}"
            print(f"  {row} {within:>24s}")


def run_trainer(args: argparse.Namespace, mode: str) -> list[dict]:
    """`moe-train`'s training records (metrics.jsonl without eval records or alerts)."""
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as run_dir:
        program = [str(BIN / "moe-train"), *run_overrides(args, mode), f"hydra.run.dir={run_dir}"]
        result = subprocess.run(launch(mode, program), capture_output=True, text=True, env=child_env(args, mode))
        if result.returncode != 0:
            raise RuntimeError(f"moe-train ({mode}) failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "tokens_per_s" in r]


def window_steps(args: argparse.Namespace) -> list[int]:
    """The steps that bound the timed log windows: warm-up's end, then every log up to the last timed step."""
    return list(range(args.warmup, args.warmup + args.steps + 1, args.log_every))


def per_window(stamps: dict[int, float], bounds: list[int]) -> list[float]:
    """Seconds per step in each window between consecutive `bounds`."""
    return [(stamps[b] - stamps[a]) / (b - a) for a, b in pairwise(bounds)]


def seconds_per_step(records: list[dict], bounds: list[int]) -> list[float]:
    """Per window between the logs of consecutive `bounds`, wall seconds per step (the records' `time` stamps)."""
    return per_window({r["step"]: datetime.fromisoformat(r["time"]).timestamp() for r in records}, bounds)


def time_trainer(args: argparse.Namespace, mode: str) -> list[float]:
    """Seconds per optimizer step of `moe-train`, per timed log window."""
    return seconds_per_step(run_trainer(args, mode), window_steps(args))


def time_bare(args: argparse.Namespace, mode: str) -> list[float]:
    """Seconds per optimizer step of the bare loop (this file with --bare, launched like the trainer), per window."""
    return run_bare(args, mode)["window_s_per_step"]


def run_bare(args: argparse.Namespace, mode: str) -> dict[str, list[float]]:
    """The bare loop launched like the trainer: its seconds per step per window and its loss per step."""
    with tempfile.TemporaryDirectory(prefix="bench_bare_") as out:
        program = [sys.executable, str(Path(__file__).resolve()), "--bare", mode, "--out", f"{out}/t.json"]
        program += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--log-every", str(args.log_every)]
        program += ["--", *args.overrides]
        result = subprocess.run(launch(mode, program), capture_output=True, text=True, env=child_env(args, mode))
        if result.returncode != 0:
            raise RuntimeError(f"bare loop ({mode}) failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
        return json.loads(Path(out, "t.json").read_text())


# ---- the bare loop (one process of it) ------------------------------------------------------------------------------


def bare_loop(args: argparse.Namespace) -> list[float]:
    """Trains as the module docstring says; rank 0 writes the seconds per step of each window and the losses to
    `args.out` (when given). Returns the LM loss of each step: the mean over micro-batches and ranks, which is what
    the trainer logs for a step (with trainer.log_every=1)."""
    import torch
    import torch.nn.functional as F

    from data_pipeline import build_loaders
    from moe.moe_layer import balancing_routers, step_balancing_biases
    from moe_platform.config import validate_launch, world_size_from_env
    from moe_platform.launch.cli import leave_without_interpreter_teardown
    from moe_platform.launch.compose import train_config
    from moe_platform.parallel.accelerator import deepspeed_config
    from moe_platform.train import optimizers
    from moe_platform.train.model_build import build_model

    mode = args.bare
    config = train_config(run_overrides(args, mode))
    world = world_size_from_env()
    accum = validate_launch(config, world, torch.cuda.is_available())
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    if mode in ZERO:  # DeepSpeed's own view of the group, which ZeRO-3's partitioned build asks for its world size
        import deepspeed

        from moe_platform.parallel.accelerator import no_shared_memory_inference_op

        no_shared_memory_inference_op()  # as the trainer does: no ~45 s compile of an op training never calls
        deepspeed.init_distributed("gloo")
    loaders = build_loaders(
        config.data,
        rank=rank,
        world_size=world,
        micro_batch_size=config.trainer.micro_batch_size,
        model_vocab_size=config.model.vocab_size,
    )
    total = args.warmup + args.steps
    batches = [(b["input_ids"], b["labels"], b.get("document_ids")) for b in islice(loaders.train, total * accum)]

    # The trainer's model build (seeds, trainer.activation_checkpointing, trainer.compile, ZeRO-3's partitioned
    # construction) reads only the rank and, under ZeRO-3, the DeepSpeed config from the Accelerator.
    ds_config = deepspeed_config(config, accum, world) if mode in ZERO else None
    plugin = SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=ds_config))
    model = build_model(config, SimpleNamespace(process_index=rank, state=plugin))
    optim = config.optim
    engine = model
    if mode == "ddp":
        engine = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model, reshard_after_forward=False)
    elif mode == "fsdp_ep":
        from moe_platform.parallel import fsdp

        meshes = fsdp.build_meshes("cpu", replicate_size=1, ep_size=world)
        fsdp.shard_model(model, meshes, fsdp.ShardingPolicy(reshard_after_forward=True, bf16=False, cpu_offload=False))
    # The trainer's parameter groups and AdamW kernel, on what this rank holds (FSDP: its shards).
    optimizer = optimizers.build_optimizer(optimizers.param_groups(model, optim), optim)
    if mode in ZERO:
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    max_norm = optim.grad_clip or float("inf")
    bias_routers = balancing_routers(model)  # as the trainer finds them, once

    def loss_of(ids, labels, documents):
        # document_ids only where the loader gives them (data.document_mask), as the trainer passes them on.
        output = engine(ids) if documents is None else engine(ids, document_ids_BT=documents)
        lm_loss = F.cross_entropy(output.logits.float().flatten(0, 1), labels.flatten())
        lm_losses.append(lm_loss.detach())  # read after the timing: no host sync inside the loop
        return lm_loss + output.aux_loss

    stamps, lm_losses, bounds = {}, [], window_steps(args)
    for step in range(total):
        for group in optimizer.param_groups:
            group["lr"] = optim.lr_at(step, config.trainer.max_steps)
        for i in range(accum):
            batch = batches[step * accum + i]
            if mode not in ZERO:  # FSDP2 reduce-scatters after every backward, as the trainer's runs do
                last = i == accum - 1
                with contextlib.nullcontext() if last or mode != "ddp" else engine.no_sync():
                    (loss_of(*batch) / accum).backward()
            else:  # DeepSpeed scales by the accumulation, all-reduces, clips and steps at the boundary itself
                engine.backward(loss_of(*batch))
                engine.step()
        if mode not in ZERO:
            if mode == "fsdp_ep":
                fsdp.clip_grad_norm(model, max_norm)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step_balancing_biases(bias_routers)
        if step + 1 in bounds:
            stamps[step + 1] = time.perf_counter()
    losses = torch.stack(lm_losses).view(total, accum).mean(dim=1).double()
    if world > 1:  # the mean over ranks, as the trainer's records hold it
        torch.distributed.all_reduce(losses)
        losses /= world
    if rank == 0 and args.out:
        record = {"window_s_per_step": per_window(stamps, bounds), "loss_per_step": losses.tolist()}
        Path(args.out).write_text(json.dumps(record))
    if world > 1:
        # Leave before this frame's locals go: freeing DDP's Reducer destroys the gloo group, whose destructor joins
        # a worker thread that waits for the GIL the destructor holds (seen here: a rank hung 17 min after its results
        # were written). Every rank has its results; nothing else is left to do.
        torch.distributed.barrier()
        leave_without_interpreter_teardown()
    return losses.tolist()


# ---- the comparison -------------------------------------------------------------------------------------------------


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="single,ddp,zero2", help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timed window (a log step)")
    parser.add_argument("--steps", type=int, default=80, help="timed steps (a multiple of --log-every)")
    parser.add_argument("--log-every", type=int, default=20, help="trainer.log_every (the trainer's default)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per process (default: the cores over the ranks)"
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run the two contenders at the same time (a loaded machine: see the module docstring)",
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="switch each per-step addition of the trainer off in turn (trainer_ablation.py) and print its share",
    )
    parser.add_argument("--cycles", type=int, default=3, help="--ablate: windows per variant in each run")
    parser.add_argument("--bare", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both contenders (after --)")
    args = parser.parse_args()
    if args.warmup % args.log_every or args.steps % args.log_every:
        parser.error("--warmup and --steps must be multiples of --log-every (the trainer stamps its log steps)")
    if args.bare:
        from moe_platform.launch.cli import leave_without_interpreter_teardown

        bare_loop(args)
        leave_without_interpreter_teardown()  # as moe-train leaves: Python's teardown can abort under gloo's threads

    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}: choose from {list(MODES)}")
    if args.ablate:
        ablate(args, modes)
        return
    # Per round and mode: each contender's ms/step in its median log window and in its fastest one (interference
    # from other jobs only ever adds time); ratios from the two runs of the same round.
    keys = ("trainer", "bare", "ratio", "trainer_fast", "bare_fast", "ratio_fast")
    results = {mode: {key: [] for key in keys} for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            contenders = [("trainer", time_trainer), ("bare", time_bare)]
            if args.concurrent:  # both at once: whatever else loads the machine loads both alike
                with ThreadPoolExecutor(2) as pool:
                    futures = {name: pool.submit(fn, args, mode) for name, fn in contenders}
                    windows = {name: future.result() for name, future in futures.items()}
            else:
                order = contenders if round_ % 2 == 0 else contenders[::-1]
                windows = {name: fn(args, mode) for name, fn in order}
            r = results[mode]
            for name, seconds in windows.items():
                r[name].append(1e3 * statistics.median(seconds))  # one stalled window does not sway it
                r[f"{name}_fast"].append(1e3 * min(seconds))
            r["ratio"].append(r["trainer"][-1] / r["bare"][-1])
            r["ratio_fast"].append(r["trainer_fast"][-1] / r["bare_fast"][-1])
            print(
                f"round {round_ + 1}/{args.rounds} {mode:6s}: ms/step trainer {r['trainer'][-1]:7.1f} "
                f"(fastest window {r['trainer_fast'][-1]:7.1f}), bare {r['bare'][-1]:7.1f} "
                f"({r['bare_fast'][-1]:7.1f}); ratio {r['ratio'][-1]:.3f} (fastest windows {r['ratio_fast'][-1]:.3f})",
                flush=True,
            )
    print(
        f"\nms per optimizer step, steps {args.warmup + 1}–{args.warmup + args.steps} (windows of {args.log_every} "
        f"steps, one log each), median [min–max] over {args.rounds} rounds; goal trainer / bare ≤ 1.05"
    )
    print(f"{'mode':16s} {'moe-train':>21s} {'bare loop':>21s} {'trainer / bare':>21s} {'fastest windows':>21s}")
    for mode, r in results.items():
        ranks = f"{mode} ({MODES[mode]} rank{'s' if MODES[mode] > 1 else ''})"
        print(
            f"{ranks:16s} {spread(r['trainer'], '.1f'):>21s} {spread(r['bare'], '.1f'):>21s} "
            f"{spread(r['ratio'], '.3f'):>21s} {spread(r['ratio_fast'], '.3f'):>21s}"
        )


if __name__ == "__main__":
    main()
