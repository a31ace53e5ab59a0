"""This machine's primitives, measured: what `moe-plan --this-machine` plans a CPU run with (`moe-plan --calibrate`).

A CPU "cluster" has no datasheet, so a short probe (~15-25 s) measures the rates the time model divides by, each
on the operation it stands for, never on a training run:
  * matmul FLOP/s of one thread, fp32 and bf16: the three GEMMs of a linear layer (forward, input gradient,
    weight gradient) on shapes of a small training step, rows 256-4096, widths 256-2048;
  * memory bandwidth of one thread: a 256 MiB copy (bytes read + written per second);
  * gloo between two processes on 127.0.0.1, one thread each (torch.distributed, as moe-train's ranks): the bus
    bandwidth of a 16 MiB all-reduce, reduce-scatter, all-gather, all-to-all and send/recv (gloo's reduce-scatter
    runs at ~0.4 of its all-reduce, which FSDP and ZeRO-2/3 pay for), the latency of a one-float all-reduce, and how
    much of an all-reduce hides behind matmuls running meanwhile (`dp_overlap`);
  * the fixed cost of one transformer block's forward and backward (Python, dispatch, autograd: what a block
    costs besides its FLOPs), from two sizes of a tiny real model (moe.Transformer) of 1 and 3 blocks;
  * the passes torch's AdamW step makes over the training state (`optimizer_passes`: its seconds × the memory
    bandwidth / the state's bytes; the foreach kernel reads and writes m, v, the weights and gradients several times);
  * given the model to be planned (`moe-plan --calibrate [overrides]`), the FLOP/s one rank sustains running that
    model's own blocks forward and backward at its micro-batch, with every core busy (`block_flops`: `cores`
    processes at once, one thread each, as a full run's ranks): the rate a training step meets, its small expert
    GEMMs, cold caches and the elementwise work between the matmuls included. On a CPU, GEMMs alone on hot
    operands run ~1.4× faster, and the work between them is ~3× what the memory and per-block terms say, so a
    plan timed from the GEMM probe alone is ~1.7× optimistic. The block is timed, never a step or a run.
Each figure is the median of its repetitions. The file records the cores, torch version and date it was taken on.

With `block_flops` the time model's compute term divides the rank's matmul FLOPs by it and its memory and
per-block terms drop what the block already contains (`this_machine_assumptions`: activation_passes 0,
per_layer_overhead_s 0); without it the GEMM rate and those terms stand.

A rank of moe-train on CPU runs one thread (torchrun sets OMP_NUM_THREADS=1 when it starts more than one process,
and our launches set it too), so W ranks on C cores each get min(1, C/W) of a core: `this_machine_cluster` scales
every rate by that share, links included (gloo over loopback is memcpy on the same cores).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from datetime import date
from pathlib import Path

import torch

from moe.ledger import FP32_BYTES
from moe_platform.config import TrainConfig
from moe_platform.plan.hardware import Cluster, Gpu
from moe_platform.plan.time_model import Assumptions

VERSION = 2  # of the file's fields; a file of another version is refused (rerun the probe)
ENV_VAR = "MOE_PLAN_CALIBRATION"
DEFAULT_PATH = Path("~/.cache/moe-platform/calibration.json")
RERUN = "rerun `moe-plan --calibrate` to measure this machine"

# (rows, in, out) of the linear layers probed: a micro-batch of 256-4096 tokens (and an expert's share of it)
# through projections and expert FFNs of width 256-2048.
MATMUL_SHAPES = ((256, 512, 1024), (1024, 512, 1024), (1024, 1024, 512), (4096, 256, 1024), (512, 2048, 512))
COPY_BYTES = 256 * 2**20  # well past any last-level cache
MESSAGE_BYTES = 16 * 2**20  # a DDP bucket's order (25 MiB), and a few layers' gathered weights
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Calibration:
    """What the probe measured on this machine: rates per thread (one rank's), gloo's between two processes."""

    matmul_flops: dict[str, float]  # FLOP/s one thread sustains on a linear layer's GEMMs, by dtype (fp32, bf16)
    memory_bandwidth: float  # bytes/s one thread moves in a large copy (read + write)
    all_reduce_bandwidth: float  # gloo bus bandwidth, 2 processes: 2·(n-1)/n · bytes / seconds
    all_to_all_bandwidth: float  # bytes a rank sends to others / seconds
    reduce_scatter_bandwidth: float  # gloo bus bandwidth: (n-1)/n · bytes / seconds
    all_gather_bandwidth: float  # gloo bus bandwidth: (n-1)/n · bytes / seconds
    send_recv_bandwidth: float  # bytes / seconds of one send, measured as half a ping-pong
    collective_latency_s: float  # one all-reduce of one float
    dp_overlap: float  # share of an all-reduce that hid behind matmuls run meanwhile (0: none, 1: all of it)
    per_layer_overhead_s: float  # a transformer block's fixed forward + backward cost, besides its FLOPs
    optimizer_passes: float  # AdamW's step time × memory_bandwidth / the training state's bytes
    cores: int  # the cores this process may run on
    memory_bytes: int  # physical memory of the machine
    torch_version: str
    measured_on: str  # ISO date
    # FLOP/s per rank of `block_model`'s blocks, forward + backward, every core busy, by dtype; None: not measured
    block_flops: dict[str, float] | None = None
    block_model: str | None = None  # what the blocks were: D, experts, top-k, tokens per micro-batch
    version: int = VERSION


def default_path() -> Path:
    """Where the calibration lives: $MOE_PLAN_CALIBRATION, else ~/.cache/moe-platform/calibration.json."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_PATH).expanduser()


def save(calibration: Calibration, path: str | Path | None = None) -> Path:
    """Write `calibration` as JSON to `path` (default: `default_path()`), creating its folder; returns the path."""
    path = Path(path).expanduser() if path is not None else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(calibration), indent=2) + "\n")
    return path


def load(path: str | Path | None = None) -> Calibration:
    """The calibration at `path` (default: `default_path()`); a ValueError naming the file and the fix if it is
    missing, unreadable, of another version or lacks a field."""
    path = Path(path).expanduser() if path is not None else default_path()
    if not path.is_file():
        raise ValueError(f"no calibration file at {path}: {RERUN} (or give --calibration FILE, ${ENV_VAR})")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the calibration file {path} is not readable JSON ({err}): {RERUN}") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        found = data.get("version") if isinstance(data, dict) else None
        raise ValueError(
            f"the calibration file {path} is of version {found}, this moe-plan reads version {VERSION}: {RERUN}"
        )
    names = {f.name for f in fields(Calibration)}
    if set(data) != names:
        missing, unknown = sorted(names - set(data)), sorted(set(data) - names)
        raise ValueError(f"the calibration file {path} lacks {missing} or has unknown {unknown}: {RERUN}")
    calibration = Calibration(**data)
    if bad := _first_bad_figure(calibration):
        raise ValueError(f"the calibration file {path} holds {bad}: {RERUN}")
    return calibration


def _first_bad_figure(c: Calibration) -> str | None:
    if not isinstance(c.matmul_flops, dict):
        return f"matmul_flops={c.matmul_flops!r}, not rates by dtype"
    rates = {**{f"matmul_flops.{k}": v for k, v in c.matmul_flops.items()}, "memory_bandwidth": c.memory_bandwidth}
    rates.update(all_reduce_bandwidth=c.all_reduce_bandwidth, all_to_all_bandwidth=c.all_to_all_bandwidth)
    rates.update(reduce_scatter_bandwidth=c.reduce_scatter_bandwidth, all_gather_bandwidth=c.all_gather_bandwidth)
    rates.update(send_recv_bandwidth=c.send_recv_bandwidth, cores=c.cores, memory_bytes=c.memory_bytes)
    for name, value in rates.items():
        if not isinstance(value, (int, float)) or not value > 0:
            return f"{name}={value!r}, not a positive number"
    if "fp32" not in c.matmul_flops:
        return "no fp32 matmul rate"
    if c.block_flops is not None and (
        not isinstance(c.block_flops, dict)
        or not all(isinstance(v, (int, float)) and v > 0 for v in c.block_flops.values())
    ):
        return f"block_flops={c.block_flops!r}, not positive rates by dtype"
    if not isinstance(c.optimizer_passes, (int, float)) or not c.optimizer_passes > 0:
        return f"optimizer_passes={c.optimizer_passes!r}, not a positive number"
    for name in ("collective_latency_s", "per_layer_overhead_s", "dp_overlap"):
        value = getattr(c, name)
        if not isinstance(value, (int, float)) or value < 0:
            return f"{name}={value!r}, not a number ≥ 0"
    return None


def this_machine_cluster(calibration: Calibration, ranks: int) -> Cluster:
    """One node of `ranks` one-thread processes sharing the machine's cores: each rank's matmul, memory and link
    rates are the calibrated one-thread figures × min(1, cores / ranks); its memory, the machine's / ranks. The
    matmul rate is the blocks' (`block_flops`) where measured, else the GEMM probe's. The link is gloo's all-reduce
    bus bandwidth (the time model's ring formulas divide by exactly that)."""
    if ranks < 1:
        raise ValueError(f"--gpus-per-node {ranks}: a CPU run needs at least one process")
    share = min(1.0, calibration.cores / ranks)
    rates = calibration.block_flops or calibration.matmul_flops
    link = calibration.all_reduce_bandwidth * share
    cpu = Gpu(
        name=f"CPU ({calibration.cores} cores, calibrated {calibration.measured_on})",
        memory_bytes=calibration.memory_bytes / ranks,
        peak_flops={dtype: rate * share for dtype, rate in rates.items()},
        memory_bandwidth=calibration.memory_bandwidth * share,
        nvlink_bandwidth=link,
    )
    return Cluster(nodes=1, gpus_per_node=ranks, gpu=cpu, intra_node_bandwidth=link, inter_node_bandwidth=link)


def this_machine_assumptions(calibration: Calibration) -> Assumptions:
    """The time model's constants on this machine: efficiencies 1 (the calibrated rates are achieved ones), the
    latency, overlap, optimizer passes and per-block cost the probe measured; with `block_flops` no activation
    passes or per-block cost on top (the blocks' time holds them)."""
    blocks = calibration.block_flops is not None
    return Assumptions(
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        comm_efficiency=1.0,
        reduce_scatter_speed=calibration.reduce_scatter_bandwidth / calibration.all_reduce_bandwidth,
        all_gather_speed=calibration.all_gather_bandwidth / calibration.all_reduce_bandwidth,
        dp_overlap=calibration.dp_overlap,
        collective_latency_s=calibration.collective_latency_s,
        activation_passes=0.0 if blocks else Assumptions.activation_passes,
        per_layer_overhead_s=0.0 if blocks else calibration.per_layer_overhead_s,
        optimizer_passes=calibration.optimizer_passes,
    )


# ---- the probe -----------------------------------------------------------------------------------------------------


def measure(*, repeats: int = 5, config: TrainConfig | None = None) -> Calibration:
    """Run the whole probe on this machine (~15-25 s, ~30 s more with a `config`): matmuls, a copy, a tiny model and
    an AdamW step on one thread here, gloo in two spawned processes, and `config`'s blocks in `cores`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's thread, as moe-train's ranks run
    try:
        matmul = {name: matmul_rate(dtype, repeats) for name, dtype in TORCH_DTYPES.items()}
        bandwidth = memory_bandwidth(repeats)
        overhead = per_layer_overhead(repeats)
        optimizer = optimizer_passes(bandwidth, repeats)
    finally:
        torch.set_num_threads(threads)
    comm = gloo_figures(repeats)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    blocks = None if config is None else loaded_block_rates(config, cores, repeats)
    return Calibration(
        matmul_flops=matmul,
        memory_bandwidth=bandwidth,
        per_layer_overhead_s=overhead,
        optimizer_passes=optimizer,
        block_flops=blocks,
        block_model=None if config is None else block_model(config),
        cores=cores,
        memory_bytes=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
        torch_version=torch.__version__,
        measured_on=date.today().isoformat(),
        **comm,
    )


def _median_seconds(fn: Callable[[], object], repeats: int, min_s: float = 0.05) -> float:
    """Median over `repeats` of the seconds one call of `fn` takes, each repeat timing enough calls to last
    `min_s` (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_s or calls == 0:
            fn()
            calls += 1
        samples.append(elapsed / calls)
    return statistics.median(samples)


def matmul_rate(dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of a linear layer's three GEMMs over MATMUL_SHAPES, on this thread: total FLOPs / total seconds."""
    flops = seconds = 0.0
    for rows, d_in, d_out in MATMUL_SHAPES:
        x_MK, w_NK, g_MN = (torch.randn(*shape, dtype=dtype) for shape in ((rows, d_in), (d_out, d_in), (rows, d_out)))

        def linear_layer(x=x_MK, w=w_NK, g=g_MN):  # y = x wᵀ; dx = g w; dw = gᵀ x
            return x @ w.t(), g @ w, g.t() @ x

        seconds += _median_seconds(linear_layer, repeats)
        flops += 3 * 2 * rows * d_in * d_out
    return flops / seconds


def memory_bandwidth(repeats: int = 5) -> float:
    """Bytes/s (read + written) of one thread copying COPY_BYTES."""
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / _median_seconds(lambda: dst.copy_(src), repeats, min_s=0.1)


def per_layer_overhead(repeats: int = 5) -> float:
    """One block's forward + backward fixed cost: (3 blocks - 1 block) / 2 of a tiny MoE Transformer (D 32, 16
    tokens, top-2 of 4 experts) whose FLOPs take microseconds, so what remains is per-op dispatch and autograd."""
    from moe.config import ModelConfig
    from moe.model import Transformer
    from moe.moe_config import MoEConfig

    def step_seconds(n_layers: int) -> float:
        torch.manual_seed(0)
        config = ModelConfig(
            d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16,
            moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=32),
        )  # fmt: skip
        model = Transformer(config)
        ids_BT = torch.randint(0, config.vocab_size, (1, 16))

        def forward_backward():
            out = model(ids_BT)
            (out.logits.float().square().mean() + out.aux_loss).backward()

        return _median_seconds(forward_backward, repeats, min_s=0.1)

    return max(0.0, (step_seconds(3) - step_seconds(1)) / 2)


# AdamW's state for OPTIMIZER_PARAMS fp32 parameters: weights, gradients, m, v = 16 B each (64 MiB), past the caches.
OPTIMIZER_PARAMS = 4 * 2**20


def optimizer_passes(bandwidth: float, repeats: int = 5) -> float:
    """How many times torch's AdamW step (the trainer's foreach kernel) moves its state: seconds × `bandwidth` /
    bytes of weights, gradients, m and v, over a few tensors of OPTIMIZER_PARAMS parameters in all."""
    params = [torch.zeros(OPTIMIZER_PARAMS // 4, requires_grad=True) for _ in range(4)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    seconds = _median_seconds(optimizer.step, repeats, min_s=0.1)
    return seconds * bandwidth / (OPTIMIZER_PARAMS * 4 * FP32_BYTES)


def block_model(config: TrainConfig) -> str:
    """What `block_rate` times, in words: the block's widths and routing and the tokens of one micro-batch."""
    m = config.model
    ffn = f"{m.moe.num_experts} experts of {m.moe.expert_d_ff} top-{m.moe.top_k}" if m.moe else f"FFN {m.d_ff}"
    tokens = config.trainer.micro_batch_size * config.data.seq_len
    return f"D {m.d_model}, {m.n_heads} heads, {ffn}, {tokens} tokens a micro-batch"


def block_rate(config: TrainConfig, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of one of `config`'s blocks forward and backward on this thread at its micro-batch: the model of 3
    blocks minus that of 1 (embedding, head and loss cancel), its matmul FLOPs (moe.flops, × 3) over the seconds.
    MoE blocks where the model has any (the dense prefix is the rarer block). bf16 autocasts as the trainer does.

    The two models are timed in pairs, one right after the other, and the rate is the median of the pairs'
    differences: a busy neighbour slows both halves of a pair alike, where two separate medians can differ by more
    than the blocks themselves take (a tiny model on a loaded machine once measured 3 blocks faster than 1)."""
    from moe.flops import matmul_flops_per_token
    from moe.model import Transformer

    model = config.model
    tokens_B, seq = config.trainer.micro_batch_size, config.data.seq_len
    moe = dataclasses.replace(model.moe, first_dense_layers=0) if model.moe is not None else None

    def forward_backward_and_flops(n_layers: int) -> tuple[Callable[[], None], float]:
        torch.manual_seed(0)
        shape = dataclasses.replace(model, n_layers=n_layers, moe=moe)
        net = Transformer(shape)
        ids_BT = torch.randint(0, shape.vocab_size, (tokens_B, seq))

        def forward_backward() -> None:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                out = net(ids_BT)
                loss = out.logits.float().square().mean() + out.aux_loss
            loss.backward()

        return forward_backward, matmul_flops_per_token(shape, seq).training * tokens_B * seq

    (small, f_small), (large, f_large) = forward_backward_and_flops(1), forward_backward_and_flops(3)
    differences = [
        _median_seconds(large, 1, min_s=0.2) - _median_seconds(small, 1, min_s=0.2) for _ in range(max(repeats, 3))
    ]
    seconds = statistics.median(differences)
    if seconds <= 0:
        raise RuntimeError(
            f"the block probe measured 3 blocks no slower than 1 ({seconds * 1e3:.2f} ms median difference "
            f"over {len(differences)} pairs): the machine is too busy to time them; rerun moe-plan --calibrate "
            "when it is quiet."
        )
    return (f_large - f_small) / seconds


def loaded_block_rates(config: TrainConfig, processes: int, repeats: int = 5) -> dict[str, float]:
    """`block_rate` by dtype in `processes` spawned one-thread processes started together (every core busy, as in
    a full run): the median over the processes."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_block_worker, args=(config, repeats, barrier, results)) for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    rates = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    return {name: statistics.median(rate[name] for rate in rates) for name in TORCH_DTYPES}


def _block_worker(config: TrainConfig, repeats: int, barrier, results) -> None:
    torch.set_num_threads(1)
    rates = {}
    for name, dtype in TORCH_DTYPES.items():
        barrier.wait()  # every process times the same dtype at once
        rates[name] = block_rate(config, dtype, repeats)
    results.put(rates)


def gloo_figures(repeats: int = 5) -> dict[str, float]:
    """The gloo half of the probe, in two spawned processes (one thread each) on 127.0.0.1; rank 0's figures."""
    import torch.multiprocessing as mp

    from moe_platform.parallel.accelerator import free_port

    with tempfile.TemporaryDirectory(prefix="moe_calibrate_") as folder:
        out = Path(folder) / "gloo.json"
        mp.start_processes(_gloo_worker, args=(2, free_port(), repeats, str(out)), nprocs=2, start_method="spawn")
        return json.loads(out.read_text())


def _gloo_worker(rank: int, world: int, port: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        figures = _gloo_probe(rank, world, repeats)
        if rank == 0:
            Path(out).write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def _gloo_probe(rank: int, world: int, repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    def timed(fn: Callable[[], object], reps: int) -> float:
        """Median seconds of `fn` over `reps` calls, each started together on every rank (a barrier before) and
        taken as the slowest rank's (a collective's time is its last participant's)."""
        samples = []
        for _ in range(reps + 1):  # the first call warms up connections and buffers
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            samples.append(float(elapsed))
        return statistics.median(samples[1:])

    n = world
    buffer = torch.ones(MESSAGE_BYTES // 4)
    received = torch.empty_like(buffer)
    one = torch.ones(1)
    latency = timed(lambda: dist.all_reduce(one), 20 * repeats)
    all_reduce = timed(lambda: dist.all_reduce(buffer), repeats)
    all_to_all = timed(lambda: dist.all_to_all_single(received, buffer), repeats)
    shard = torch.ones(MESSAGE_BYTES // 4 // n)
    reduce_scatter = timed(lambda: dist.reduce_scatter_tensor(shard, buffer), repeats)
    all_gather = timed(lambda: dist.all_gather_into_tensor(received, shard), repeats)

    def ping_pong():
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(received, 1)
        elif rank == 1:
            dist.recv(received, 0)
            dist.send(buffer, 0)

    send_recv = timed(ping_pong, repeats) / 2
    # Overlap, as the time model defines it: the share of the compute running meanwhile that an all-reduce hides
    # behind. Matmuls of about the all-reduce's duration alone, the all-reduce alone, then the all-reduce posted
    # asynchronously under the same matmuls; hidden = alone + alone - together. Rounds interleave the three, so a
    # burst of load hits all of them, and the medians over 4 × repeats rounds are taken: one round is noise (the
    # gloo thread and the matmuls share a core, and one all-reduce alone varies by ±25%).
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    calls = torch.tensor([max(1, round(all_reduce / _median_seconds(lambda: a @ b, 3)))])
    dist.broadcast(calls, 0)  # the same matmuls on every rank

    def matmuls():
        for _ in range(int(calls)):
            a @ b

    def both():
        work = dist.all_reduce(buffer, async_op=True)
        matmuls()
        work.wait()

    rounds = [
        (timed(matmuls, 1), timed(lambda: dist.all_reduce(buffer), 1), timed(both, 1)) for _ in range(4 * repeats)
    ]
    compute, alone, together = (statistics.median(column) for column in zip(*rounds, strict=True))
    hidden = (compute + alone - together) / compute
    return {
        "all_reduce_bandwidth": 2 * (n - 1) / n * MESSAGE_BYTES / all_reduce,
        "all_to_all_bandwidth": (n - 1) / n * MESSAGE_BYTES / all_to_all,
        "reduce_scatter_bandwidth": (n - 1) / n * MESSAGE_BYTES / reduce_scatter,
        "all_gather_bandwidth": (n - 1) / n * MESSAGE_BYTES / all_gather,
        "send_recv_bandwidth": MESSAGE_BYTES / send_recv,
        "collective_latency_s": latency,
        "dp_overlap": min(1.0, max(0.0, hidden)),
    }
