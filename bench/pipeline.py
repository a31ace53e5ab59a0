"""Benchmark pipeline parallelism on gloo CPU ranks: each stage's measured idle share of a step (its bubble) against
the schedule's theory (`moe.stages.bubble_fraction`), and the step time of PP=2 against PP=1 at equal global batch.

Legend: PP pipeline ranks, V stages per rank (1, or 2 for interleaved_1f1b / zbv / dualpipev), S = PP·V stages,
m micro-batches per step, B rows per micro-batch, T tokens, D model width; F, B_ (backward) the time one stage takes
for one micro-batch; under zbv B_ splits into I (input gradient) and W (weight gradient).

How, per PP size, in one launch of PP spawned processes (`moe_platform.testing.run_distributed`: gloo on
127.0.0.1, one thread per rank):
  * every schedule is built as the trainer builds it (`moe.stages.balanced_layout`, then parallel/pipeline.py's
    `build_meshes`, `keep_stages`, `stage_modules`, `build_schedule`), on a real model made from the same seed, so
    each schedule and the PP=1 loop start from the same weights (their first losses agree: the test checks it);
  * rounds interleave the schedules (and, at PP=2, the PP=1 loop), each running `--steps` steps; a barrier
    precedes every step, and a step is `schedule.step` over m micro-batches and then AdamW;
  * on every rank the stage's compute methods (`forward_one_chunk`, `backward_one_chunk`,
    `backward_weight_one_chunk`, and the last stage's loss) are wrapped to add up their wall and thread CPU time,
    and torch's P2P helpers (`_batch_p2p`, `_sorted_batch_p2p`, `_wait_batch_p2p`) to add up the time spent
    posting and waiting on sends and receives;
  * a step's span is from the earliest rank's start of `schedule.step` to the latest rank's end (time stamps of
    one monotonic clock, shared by the processes); rank r's idle fraction is 1 - busy_r / span, the theory's
    definition (a stage's idle share of the pipeline's step). The table gives the mean over ranks, per round
    (sums over the round's steps), median [min-max] over rounds.

The theory assumes B_ = 2F, equal stages and free communication. To tell these apart, each step is also replayed
(`replay`): the same actions in the same order per rank, lasting their measured thread CPU times, on one dedicated
core per rank with free communication. theory → replayed is what the real durations do (B_ ≠ 2F, uneven stages,
jitter); replayed → measured is what P2P and the schedule's Python cost (gloo over loopback TCP; the receiver's
wait holds both the dependency wait, which is the bubble, and the transfer, so `deliveries` times each awaited
input from its making to its use, and a ping-pong times one transfer alone). PP=4 runs 4 ranks on however many
cores there are: on 2 cores ranks share them and the measured figures are distorted; the replay is not (README).

    .venv/bin/python bench/pipeline.py                      # D=256, 8 MoE layers, m=8, B=4, T=64; PP=2 and 4
    .venv/bin/python bench/pipeline.py --quick              # seconds: tiny model, PP=2, 1 round
"""

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import Transformer
from moe.config import ModelConfig
from moe.moe_config import MoEConfig
from moe.stages import SCHEDULES, balanced_layout, bubble_fraction, style_of
from moe_platform.parallel import pipeline
from moe_platform.testing import run_distributed
from moe_platform.train.pipeline_step import token_mean_loss

VIRTUAL = {"single": 1, "loop": 2, "v": 2}  # stages per rank of each layout style (the trainer's run_shape)
DEFAULT_SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv")


@dataclass(frozen=True)
class Shape:
    """The model and the step: what each schedule trains (every layer MoE, top-2 of 4 SwiGLU experts)."""

    d_model: int
    n_layers: int
    n_heads: int
    expert_d_ff: int
    rows: int  # B, per micro-batch
    seq_len: int  # T
    microbatches: int  # m

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=258, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
            n_kv_heads=self.n_heads // 2, d_ff=2 * self.expert_d_ff, max_seq_len=self.seq_len,
            moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=self.expert_d_ff),
        )  # fmt: skip


# moe_tiny is D 96, 4 layers: 8 layers (1 per stage at S = 8) and D 256 make a stage's forward 8-30 ms against
# ~0.2 ms to send its 256 KiB activation, so compute dominates communication on 2 cores.
DEFAULT = Shape(d_model=256, n_layers=8, n_heads=8, expert_d_ff=512, rows=4, seq_len=64, microbatches=8)
QUICK = Shape(d_model=32, n_layers=4, n_heads=4, expert_d_ff=32, rows=2, seq_len=16, microbatches=4)


# ---- the clock -----------------------------------------------------------------------------------------------------


class ActionClock:
    """This rank's time in compute actions (wall and thread CPU) and in P2P calls, summed since `reset`, and each
    compute action in the order it ran: (kind F / B / I / W / loss, stage, micro-batch, start, wall, cpu)."""

    def __init__(self) -> None:
        self.reset()
        self._in_p2p = False

    def reset(self) -> None:
        self.compute_wall = self.compute_cpu = self.p2p_wall = self.p2p_post = 0.0
        self.actions: list[tuple[str, int, int, float, float, float]] = []

    def compute(self, kind: str, stage: int, fn):
        def timed(chunk: int, *args, **kwargs):
            name = "I" if kind == "B" and kwargs.get("full_backward", True) is False else kind
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(chunk, *args, **kwargs)
            finally:
                self.add(name, stage, chunk, start, time.perf_counter() - start, time.thread_time() - cpu)

        return timed

    def loss(self, fn):
        def timed(stage, output, target_mbs, mb_index, *args, **kwargs):
            if not stage.is_last:  # the schedules call it after every forward; only the last stage's computes
                return fn(stage, output, target_mbs, mb_index, *args, **kwargs)
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(stage, output, target_mbs, mb_index, *args, **kwargs)
            finally:
                end, cpu = time.perf_counter(), time.thread_time() - cpu
                self.add("loss", stage.stage_index, mb_index, start, end - start, cpu)

        return timed

    def add(self, kind: str, stage: int, chunk: int, start: float, wall: float, cpu: float) -> None:
        self.compute_wall += wall
        self.compute_cpu += cpu
        self.actions.append((kind, stage, chunk, start, wall, cpu))

    def p2p(self, posting: bool, fn):
        def timed(*args, **kwargs):
            if self._in_p2p:  # _sorted_batch_p2p calls _batch_p2p: count the outer call only
                return fn(*args, **kwargs)
            self._in_p2p, start = True, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                self.p2p_wall += seconds
                self.p2p_post += seconds if posting else 0.0
                self._in_p2p = False

        return timed


CLOCK = ActionClock()


def time_p2p() -> None:
    """Route torch's schedule P2P helpers through CLOCK (module globals: the schedules look them up per call)."""
    for name in ("_batch_p2p", "_sorted_batch_p2p", "_wait_batch_p2p"):
        setattr(torch_schedules, name, CLOCK.p2p(name != "_wait_batch_p2p", getattr(torch_schedules, name)))


def time_compute(schedule, pipeline_stages) -> None:
    for stage in pipeline_stages:
        s = stage.stage_index
        stage.forward_one_chunk = CLOCK.compute("F", s, stage.forward_one_chunk)
        stage.backward_one_chunk = CLOCK.compute("B", s, stage.backward_one_chunk)
        stage.backward_weight_one_chunk = CLOCK.compute("W", s, stage.backward_weight_one_chunk)
    schedule._maybe_compute_loss = CLOCK.loss(schedule._maybe_compute_loss)


# ---- one rank ------------------------------------------------------------------------------------------------------


class Pipelined:
    """One schedule on this rank: its stages of a seed-0 model, torch's schedule over them, AdamW."""

    def __init__(self, name: str, shape: Shape, meshes: pipeline.PipelineMeshes) -> None:
        config = shape.model_config()
        pp = meshes.pipeline_size
        self.layout = balanced_layout(config, shape.seq_len, pp, name, VIRTUAL[style_of(name)])
        torch.manual_seed(0)
        model = Transformer(config)
        self.stage_ids = self.layout.stages_of_rank(meshes.pipeline_rank)
        pipeline.keep_stages(model, self.layout, self.stage_ids)
        self.stages = pipeline.stage_modules(model, self.layout, self.stage_ids)
        micro = pipeline.MicroBatchShape(
            shape.rows, shape.seq_len, shape.d_model, config.vocab_size, torch.float32, torch.float32
        )
        device = torch.device("cpu")
        self.schedule = pipeline.build_schedule(
            self.stages, self.stage_ids, self.layout, meshes, device, name, shape.microbatches, micro, token_mean_loss
        )
        # torch's PipelineStage objects: `_stages` of a multi-stage schedule, `_stage` of a single-stage one
        time_compute(self.schedule, getattr(self.schedule, "_stages", None) or [self.schedule._stage])
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.has_first = 0 in self.stage_ids
        self.has_last = self.layout.num_stages - 1 in self.stage_ids

    def step(self, ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> dict:
        CLOCK.reset()
        losses: list[torch.Tensor] = []
        args = (ids_BT,) if self.has_first else ()
        target = labels_BT if self.has_last else None
        start = time.perf_counter()
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False)
        end = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for stage in self.stages:
            stage.take_records()
        return {
            "start": start, "end": end, "step_end": time.perf_counter(),
            "compute_wall": CLOCK.compute_wall, "compute_cpu": CLOCK.compute_cpu, "p2p_wall": CLOCK.p2p_wall,
            "p2p_post": CLOCK.p2p_post,
            "actions": list(CLOCK.actions),
            "loss": float(torch.stack(losses).detach().mean()) if losses else None,
        }  # fmt: skip


class Unpipelined:
    """PP=1 on rank 0: the whole model as one stage, m micro-batches accumulated, gradients / m, AdamW."""

    def __init__(self, shape: Shape) -> None:
        config = shape.model_config()
        layout = balanced_layout(config, shape.seq_len, 1, "1f1b", 1)
        torch.manual_seed(0)
        model = Transformer(config)
        (self.stage,) = pipeline.stage_modules(model, layout, [0])
        self.params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        self.m = shape.microbatches

    def step(self, ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> dict:
        start = time.perf_counter()
        losses = []
        for ids, labels in zip(ids_BT.chunk(self.m), labels_BT.chunk(self.m), strict=True):
            loss = token_mean_loss(self.stage(ids), labels)
            loss.backward()  # the stage's aux losses ride along (StageModule's _WithAuxLoss), as in the pipeline
            losses.append(loss.detach())
        torch._foreach_div_([p.grad for p in self.params if p.grad is not None], self.m)  # the schedule's scale_grads
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.stage.take_records()
        return {"start": start, "step_end": time.perf_counter(), "loss": float(torch.stack(losses).mean())}


def ping_pong(meshes: pipeline.PipelineMeshes, shape: Shape, repeats: int = 20) -> float | None:
    """Seconds to send one activation tensor [B, T, D] between pipeline ranks 0 and 1 (half a round trip)."""
    x = torch.randn(shape.rows, shape.seq_len, shape.d_model)
    me, group = meshes.pipeline_rank, meshes.pipeline_group
    peer = meshes.global_rank(1 - me) if me < 2 else None
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        if me == 0:
            dist.send(x, dst=peer, group=group)
            dist.recv(x, src=peer, group=group)
        elif me == 1:
            dist.recv(x, src=peer, group=group)
            dist.send(x, dst=peer, group=group)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[2:]) if me == 0 else None


def worker(rank: int, world_size: int, shape: dict, schedules: list[str], rounds: int, steps: int, pp1: bool) -> dict:
    """One rank: every schedule warmed up (2 steps), then `rounds` rounds of `steps` steps each, interleaved.
    `shape` comes as a dict: this module is loaded under another name in the spawned processes."""
    shape = Shape(**shape)
    time_p2p()
    meshes = pipeline.build_meshes("cpu", world_size, 1, 1)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(258, (shape.microbatches * shape.rows, shape.seq_len + 1), generator=generator)
    ids_BT, labels_BT = tokens[:, :-1], tokens[:, 1:]
    runs: dict[str, Pipelined | Unpipelined | None] = {name: Pipelined(name, shape, meshes) for name in schedules}
    if pp1:
        runs["pp1"] = Unpipelined(shape) if rank == 0 else None
    records: dict[str, list] = {name: [] for name in runs}
    first_loss, idle_cpu = {}, []
    for name, run in runs.items():
        for warm in range(2):
            dist.barrier()
            if run is not None:
                record = run.step(ids_BT, labels_BT)
                if warm == 0:
                    first_loss[name] = record["loss"]
    one_way = ping_pong(meshes, shape)
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(steps):
                dist.barrier()
                run = runs[name]
                if run is not None:
                    records[name].append({**run.step(ids_BT, labels_BT), "round": r})
                if name == "pp1":  # the others wait for rank 0 in a barrier: does gloo's wait take a core?
                    wall, cpu = time.perf_counter(), time.process_time()
                    dist.barrier()
                    if run is None:
                        idle_cpu.append((time.process_time() - cpu) / (time.perf_counter() - wall))
    return {
        "rank": rank, "records": records, "first_loss": first_loss, "one_way": one_way, "idle_process_cpu": idle_cpu,
    }  # fmt: skip


# ---- the parent: statistics and tables ---------------------------------------------------------------------------


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def replay(step: list[dict], num_stages: int) -> tuple[float, list[float]]:
    """One step replayed on one dedicated core per rank with free communication: each rank runs its recorded
    actions in their recorded order, each lasting its measured thread CPU time, and starts one when the previous has
    ended and its input exists (a forward once the previous stage's forward of that micro-batch has ended, a
    backward or input gradient once the next stage's has). Returns the span and each rank's busy time."""
    queues = [record["actions"] for record in step]
    ended: dict[tuple[str, int, int], float] = {}
    clocks, positions = [0.0] * len(queues), [0] * len(queues)
    while any(position < len(queue) for position, queue in zip(positions, queues, strict=True)):
        progressed = False
        for k, queue in enumerate(queues):
            while positions[k] < len(queue):
                kind, stage, chunk, _, _, cpu = queue[positions[k]]
                group = "B" if kind in ("B", "I") else kind
                need = None
                if kind == "F" and stage > 0:
                    need = ("F", stage - 1, chunk)
                elif group == "B" and stage < num_stages - 1:
                    need = ("B", stage + 1, chunk)
                if need is not None and need not in ended:
                    break
                clocks[k] = max(clocks[k], ended[need] if need else 0.0) + cpu
                ended[(group, stage, chunk)] = clocks[k]
                positions[k] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded action orders deadlock: a stage index or micro-batch was misread")
    return max(clocks), [sum(action[5] for action in queue) for queue in queues]


def deliveries(step: list[dict], num_stages: int) -> list[float]:
    """Seconds from the end of the action that made a stage's input on another rank to the start of the action that
    used it, wherever the user had nothing else to run (its previous action had ended before the input was made):
    what one transfer costs as the schedule sees it, posting, wake-ups and the schedule's Python included."""
    made = {}  # (F or B, stage, micro-batch) -> (rank, end)
    for k, record in enumerate(step):
        for kind, stage, chunk, start, wall, _ in record["actions"]:
            made["B" if kind in ("B", "I") else kind, stage, chunk] = (k, start + wall)
    seconds = []
    for k, record in enumerate(step):
        previous_end = record["start"]
        for kind, stage, chunk, start, wall, _ in record["actions"]:
            need = None
            if kind == "F" and stage > 0:
                need = ("F", stage - 1, chunk)
            elif kind in ("B", "I") and stage < num_stages - 1:
                need = ("B", stage + 1, chunk)
            if need is not None and made[need][0] != k and made[need][1] >= previous_end:
                seconds.append(start - made[need][1])
            previous_end = start + wall
    return seconds


def summarise(ranks: list[dict], name: str, pp: int, shape: Shape) -> dict:
    """Per round (sums over its steps): each rank's idle share of the step spans, measured and replayed, then the
    mean over ranks; the table gives median [min-max] over rounds."""
    by_round = defaultdict(list)
    for step in zip(*(rank["records"][name] for rank in ranks), strict=True):
        by_round[step[0]["round"]].append(step)
    num_stages = pp * VIRTUAL[style_of(name)]
    idle, replayed, p2p, other, step_ms, cpu_per_wall = [], [], [], [], [], []
    rank_idle = [[] for _ in range(pp)]
    for steps in by_round.values():
        span = sum(max(r["end"] for r in step) - min(r["start"] for r in step) for step in steps)
        for k in range(pp):
            rank_idle[k].append(1 - sum(step[k]["compute_wall"] for step in steps) / span)
        idle.append(statistics.mean(ranks_idle[-1] for ranks_idle in rank_idle))
        p2p.append(statistics.mean(sum(step[k]["p2p_wall"] for step in steps) / span for k in range(pp)))
        # inside the rank's schedule.step but neither compute nor P2P: the schedule's own Python
        inside = [
            sum(step[k]["end"] - step[k]["start"] - step[k]["compute_wall"] - step[k]["p2p_wall"] for step in steps)
            for k in range(pp)
        ]
        other.append(statistics.mean(inside) / span)
        replays = [replay(step, num_stages) for step in steps]
        replay_span = sum(r[0] for r in replays)
        replayed.append(statistics.mean(1 - sum(r[1][k] for r in replays) / replay_span for k in range(pp)))
        step_ms.append(
            1e3 * statistics.median(max(r["step_end"] for r in s) - min(r["start"] for r in s) for s in steps)
        )
        wall = sum(step[k]["compute_wall"] for step in steps for k in range(pp))
        cpu_per_wall.append(sum(step[k]["compute_cpu"] for step in steps for k in range(pp)) / wall)
    delivered = [
        t for step in zip(*(r["records"][name] for r in ranks), strict=True) for t in deliveries(step, num_stages)
    ]
    actions, stage_cpu = defaultdict(list), defaultdict(float)
    for rank in ranks:
        for record in rank["records"][name]:
            for kind, stage, _, _, _, cpu in record["actions"]:
                actions[kind].append(cpu)
                stage_cpu[stage] += cpu
    steps_run = len(ranks[0]["records"][name])
    posting = [sum(r["records"][name][i]["p2p_post"] for r in ranks) / len(ranks) for i in range(steps_run)]
    per_micro = [stage_cpu[s] / (steps_run * shape.microbatches) for s in sorted(stage_cpu)]  # c_s
    theory = bubble_fraction(name, pp, shape.microbatches, VIRTUAL[style_of(name)])
    return {
        "schedule": name, "pp": pp, "theory": theory, "idle": idle, "replayed": replayed, "p2p": p2p, "other": other,
        "ratio": [v / theory for v in idle], "step_ms": step_ms, "cpu_per_wall": cpu_per_wall,
        "action_ms": {kind: 1e3 * statistics.median(values) for kind, values in actions.items()},
        "stage_ms": [1e3 * c for c in per_micro], "rank_idle": rank_idle,
        "delivery_ms": [1e3 * t for t in delivered], "deliveries_per_step": len(delivered) / steps_run,
        "posting_ms": 1e3 * statistics.median(posting),
        "uneven": uneven_stages_bubble(per_micro, shape.microbatches) if style_of(name) == "single" else None,
    }  # fmt: skip


def uneven_stages_bubble(per_micro: list[float], m: int) -> float:
    """GPipe / 1F1B's idle share, mean over stages, when stage s costs c_s per micro-batch (forward + backward) and
    communication is free: the step lasts Σ_s c_s (the first micro-batch's trip) + (m - 1) · max_s c_s (the rest,
    at the slowest stage's pace), and stage s is busy m · c_s of it. Equal stages give (PP - 1) / (m + PP - 1)."""
    span = sum(per_micro) + (m - 1) * max(per_micro)
    return statistics.mean(1 - m * c / span for c in per_micro)


def run_pp(pp: int, shape: Shape, schedules: list[str], rounds: int, steps: int) -> dict:
    pp1 = pp == 2
    start = time.perf_counter()
    ranks = run_distributed(worker, pp, asdict(shape), schedules, rounds, steps, pp1, timeout=1800.0)
    rows = [summarise(ranks, name, pp, shape) for name in schedules]
    result = {"pp": pp, "rows": rows, "seconds": time.perf_counter() - start, "one_way_ms": 1e3 * ranks[0]["one_way"]}
    # the rank holding the last stage has a schedule's losses (the last rank under 1f1b, rank 0 under V schedules)
    result["first_loss"] = {name: loss for r in ranks for name, loss in r["first_loss"].items() if loss is not None}
    if pp1:
        single = [r["step_end"] - r["start"] for r in ranks[0]["records"]["pp1"]]
        result["pp1"] = {"step_ms": per_round(ranks[0]["records"]["pp1"], single)}
        result["idle_process_cpu"] = [v for r in ranks[1:] for v in r["idle_process_cpu"]]
    return result


def per_round(records: list[dict], seconds: list[float]) -> list[float]:
    by_round = defaultdict(list)
    for record, value in zip(records, seconds, strict=True):
        by_round[record["round"]].append(value)
    return [1e3 * statistics.median(values) for values in by_round.values()]


def report(results: list[dict], shape: Shape, rounds: int, steps: int) -> None:
    cores = os.cpu_count()
    print(
        f"\nbubble: idle share of a step per stage, mean over ranks; median [min–max] over {rounds} rounds of {steps}"
    )
    print(f"steps; {cores} cores, one thread per rank (PP > cores: ranks share cores, see README).")
    print("theory: bubble_fraction; replayed: the recorded actions at their thread CPU times, one core per rank, free")
    print("P2P; measured: 1 - busy / span from time stamps; P2P: the span's share in sends and receives (posting and")
    print("waiting); other: its share inside the rank's schedule.step in neither (the schedule's Python); the rest of")
    print("the idle share is before the rank's start or after its end; cpu/wall: of the compute actions, lowest round")
    columns = ("replayed", "measured", "measured/theory", "P2P", "other")
    print(f"  {'schedule':<17s} {'PP':>2s} {'theory':>6s}  " + " ".join(f"{c:<22s}" for c in columns) + " cpu/wall")
    for result in results:
        for row in result["rows"]:
            cells = [spread(row["replayed"]), spread(row["idle"]), spread(row["ratio"], "{:.2f}")]
            cells += [spread(row["p2p"]), spread(row["other"])]
            print(
                f"  {row['schedule']:<17s} {row['pp']:>2d} {row['theory']:6.3f}  "
                + " ".join(f"{c:<22s}" for c in cells)
                + f" {min(row['cpu_per_wall']):8.2f}"
            )
            if row["pp"] <= cores and min(row["cpu_per_wall"]) < 0.9:
                print(f"  ^ compute ran at {min(row['cpu_per_wall']):.2f} CPU per wall: another process took a core")
    print("\nper action: thread CPU ms, median over ranks, stages and steps; per stage: CPU ms per micro-batch;")
    print("per rank: measured idle share, median over rounds; uneven: 1f1b's bubble for the stage costs, free P2P")
    for result in results:
        for row in result["rows"]:
            ms = row["action_ms"]
            cells = "  ".join(f"{kind} {ms[kind]:.2f}" for kind in ("F", "B", "I", "W", "loss") if kind in ms)
            backward = ms.get("B", ms.get("I", 0.0) + ms.get("W", 0.0))
            stages = " ".join(f"{c:.1f}" for c in row["stage_ms"])
            ranks = " ".join(f"{statistics.median(idle):.3f}" for idle in row["rank_idle"])
            uneven = f"   uneven {row['uneven']:.3f}" if row["uneven"] is not None else ""
            print(f"  {row['schedule']:<17s} PP={row['pp']}: {cells}   (B+I+W)/F {backward / ms['F']:.2f}")
            print(f"  {'':<17s}       stages {stages}   ranks {ranks}{uneven}")
            delivery = row["delivery_ms"]
            if delivery:
                quartiles = statistics.quantiles(delivery, n=4) if len(delivery) > 1 else delivery * 3
                print(
                    f"  {'':<17s}       awaited inputs: {row['deliveries_per_step']:.1f} per step, made → used "
                    f"{quartiles[1]:.2f} ms median [{quartiles[0]:.2f}, {quartiles[2]:.2f}] quartiles; posting "
                    f"sends and receives {row['posting_ms']:.1f} ms per step and rank"
                )
        send = f"[{shape.rows}, {shape.seq_len}, {shape.d_model}]"
        print(f"  PP={result['pp']}: one {send} fp32 activation sent in {result['one_way_ms']:.3f} ms")
    for result in results:
        if "pp1" not in result:
            continue
        pp1 = result["pp1"]["step_ms"]
        ideal = (shape.microbatches + 1) / (2 * shape.microbatches)
        print(
            f"\nstep time at equal global batch ({shape.microbatches} × {shape.rows} rows), schedule.step + AdamW, ms"
        )
        print(f"median [min–max] over {rounds} rounds; PP=1 on one rank while the other waits in a barrier")
        print(f"  PP=1 (accumulation over {shape.microbatches} micro-batches): {spread(pp1, '{:.1f}')}")
        for row in result["rows"]:
            ratios = [a / b for a, b in zip(row["step_ms"], pp1, strict=True)]
            print(f"  PP=2 {row['schedule']:<17s}: {spread(row['step_ms'], '{:.1f}')}   PP=2 / PP=1 {spread(ratios)}")
        print(f"  ideal with 2 cores, 1f1b: (m + 1) / (2m) = {ideal:.3f}")
        cpu = result["idle_process_cpu"]
        if cpu:
            print(f"  the waiting rank's process CPU / wall during PP=1: {spread(cpu, '{:.3f}')}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after 2 warm-up steps per schedule)")
    parser.add_argument("--steps", type=int, default=4, help="steps per schedule per round")
    parser.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--pp", nargs="+", type=int, default=[2, 4], help="pipeline sizes (PP=2 adds PP=1)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, m=4, PP=2, 1 round of 2 steps")
    parser.add_argument("--rows", type=int, default=DEFAULT.rows, help="B, rows per micro-batch")
    parser.add_argument("--d-model", type=int, default=DEFAULT.d_model, help="D (the experts' width is 2·D)")
    args = parser.parse_args(argv)
    shape = replace(DEFAULT, rows=args.rows, d_model=args.d_model, expert_d_ff=2 * args.d_model)
    if args.quick:
        shape, args.rounds, args.steps, args.pp = QUICK, 1, 2, [2]
    print("Pipeline bubble on gloo CPU ranks (127.0.0.1, 1 thread each) against moe.stages.bubble_fraction")
    print(f"reproduce: .venv/bin/python bench/pipeline.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"shape: {asdict(shape)}, every layer MoE (top-2 of 4 SwiGLU experts), vocabulary 258, fp32")
    results = []
    for pp in args.pp:
        result = run_pp(pp, shape, args.schedules, args.rounds, args.steps)
        print(f"PP={pp}: {result['seconds']:.1f} s (spawn, build, measurement); first losses {result['first_loss']}")
        results.append(result)
    report(results, shape, args.rounds, args.steps)
    return results


if __name__ == "__main__":
    main()
