"""The ledger under pipeline parallelism: each pipeline rank's pieces, the worst stage, the schedules' bubble and
the micro-batches they keep in flight, replayed from torch's own schedules with stand-in stages (no process group).

Properties, not snapshots: the stages' parameters add up to the model, each piece once; at PP=1 every figure is the
unpipelined one; the worst rank bounds every rank; the in-flight counts are what torch 2.13 runs."""

import itertools
import logging
import re
from collections import Counter
from dataclasses import replace

import pytest
import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

from moe import ModelConfig, MoEConfig, RunShape, activation_bytes, count_parameters, format_ledger
from moe.ledger import (
    ACTIVATION_BYTES,
    activation_bytes_per_rank,
    activations_in_flight,
    expert_params_per_rank,
    fsdp_unit_params,
    held_params_by_rank,
    muon_params_by_rank,
    params_per_rank,
    pipeline_activation_bytes,
    pipeline_fsdp_unit_params,
    pipeline_layout,
    sharding_peak_bytes,
    sharding_transient_bytes,
    stored_params_per_rank,
    training_state_bytes,
    training_state_bytes_per_rank,
)
from moe.stages import EMBED, HEAD, NORM, balanced_layout, bubble_fraction, in_flight, layer_costs, parse_layout
from moe_platform.launch.compose import train_config
from moe_platform.launch.memory import memory_demand
from moe_platform.monitor.peak_memory import predict_peak
from moe_platform.plan.memory import rank_memory

PRESETS = ["dense_tiny", "moe_tiny", "deepseek_v3_like_tiny", "mixtral_like", "deepseek_v3_like"]
# (pipeline size, schedule, stages per rank), each for the presets with enough layers
PIPELINES = [(2, "1f1b", 1), (3, "gpipe", 1), (2, "zbv", 2), (2, "dualpipev", 2)]
BIG_PIPELINES = [(4, "interleaved_1f1b", 2), (8, "zbv", 2), (16, "1f1b", 1)]  # for the 32- and 61-layer presets
TORCH_CLASSES = {
    "1f1b": torch_schedules.Schedule1F1B,
    "gpipe": torch_schedules.ScheduleGPipe,
    "interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
    "dualpipev": torch_schedules.ScheduleDualPipeV,
}


def preset(name: str) -> ModelConfig:
    """The preset without its MTP module, so that the pieces are the layout's alone (with MTP: the tests at the end)."""
    return train_config([f"model={name}", "model.mtp.depth=0"]).model


def pipelined(pp: int, schedule: str, virtual: int, m: int = 4, **fields) -> RunShape:
    """A pipeline's step of m micro-batches, each of the trainer's micro_batch_size rows (m = grad_accum)."""
    return RunShape(pipeline_size=pp, schedule=schedule, virtual_stages=virtual, microbatches=m, grad_accum=m, **fields)


def cases() -> list[tuple[str, RunShape]]:
    out = []
    for name in PRESETS:
        n_layers = preset(name).n_layers
        for pp, schedule, virtual in PIPELINES + (BIG_PIPELINES if n_layers >= 32 else []):
            if pp * virtual > n_layers:
                continue
            m = max(4, 2 * pp)  # dualpipev needs 2·PP
            out.append((name, pipelined(pp, schedule, virtual, m, seq_len=64, micro_batch_size=2)))
    return out


CASES = cases()
CASE_IDS = [f"{name}-PP{run.pipeline_size}-{run.schedule}" for name, run in CASES]


# ---- each piece once -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "run"), CASES, ids=CASE_IDS)
def test_the_pipeline_ranks_hold_every_piece_once_and_all_parameters(name: str, run: RunShape) -> None:
    config = preset(name)
    layout = pipeline_layout(config, run)
    pieces = [piece for p in range(run.pipeline_size) for s in layout.stages_of_rank(p) for piece in layout.stages[s]]
    expected = [EMBED, *range(config.n_layers), NORM, HEAD]
    assert sorted(pieces, key=str) == sorted(expected, key=str)
    held = held_params_by_rank(config, run)
    assert sum(dense + routed for dense, routed in held) == config.num_params()
    assert sum(routed for _, routed in held) == count_parameters(config).routed_experts


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("fsdp", [False, True])
def test_training_state_summed_over_pipeline_ranks_is_the_unpipelined_state(ep: int, fsdp: bool) -> None:
    """The same dp_size ranks per stage shard each stage as they would shard the whole model: the bytes are linear
    in the parameters, so the stages' figures add up to the whole model's at that dp_size."""
    config = preset("moe_tiny")
    flat = RunShape(dp_size=4, ep_size=ep, fsdp=fsdp, precision="bf16")
    for pp, schedule, virtual in [(2, "1f1b", 1), (2, "interleaved_1f1b", 2), (2, "zbv", 2), (4, "gpipe", 1)]:
        run = replace(flat, pipeline_size=pp, schedule=schedule, virtual_stages=virtual, microbatches=4, grad_accum=4)
        total = sum(training_state_bytes_per_rank(config, run, p).total for p in range(pp))
        assert total == pytest.approx(training_state_bytes_per_rank(config, flat).total)
        stored = sum(stored_params_per_rank(config, run, p) for p in range(pp))
        assert stored == pytest.approx(stored_params_per_rank(config, flat))


def test_fsdp_under_pp_gathers_each_of_its_units_until_the_step_ends() -> None:
    """torch's stage keeps every unit it ran backward through gathered to the step's end: over the pipeline ranks
    the gathered bytes are each unit of the model once (the roots split by stage), the gradients fp32."""
    config = preset("moe_tiny")
    run = pipelined(2, "1f1b", 1, fsdp=True, precision="bf16", dp_size=2)
    units = [pipeline_fsdp_unit_params(config, run, p) for p in range(2)]
    assert sum(map(sum, units)) == config.num_params() == sum(fsdp_unit_params(config, 1))
    for p in range(2):
        transient = sharding_transient_bytes(config, run, p)
        assert transient.gathered == sum(units[p]) * 2
        assert transient.gradients == sum(units[p]) * 4 + max(units[p]) * 2
        assert transient.reduce_scatter == max(units[p]) * 4
    assert sharding_transient_bytes(config, replace(run, fsdp=False)).total == 0


# ---- PP = 1 is today's ledger ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense_tiny", "moe_tiny", "deepseek_v3_like_tiny"])
@pytest.mark.parametrize(
    "layout",
    [{}, {"zero_stage": 3}, {"fsdp": True, "dp_size": 4, "ep_size": 2}, {"dp_size": 4, "zero_stage": 2, "ep_size": 2}],
    ids=["ddp", "zero3", "fsdp-ep2", "zero2-ep2"],
)
def test_without_a_pipeline_every_figure_is_the_unpipelined_one(name: str, layout: dict) -> None:
    config = preset(name)
    if config.moe is None and "ep_size" in layout:
        layout = {k: v for k, v in layout.items() if k != "ep_size"}
    run = RunShape(micro_batch_size=2, seq_len=32, precision="bf16", **layout)
    params = count_parameters(config)
    ep, W = run.ep_size, run.dp_size
    expert_shards = W // ep if ep > 1 else W
    state = partial_state(run)
    unpipelined = state(params.total - params.routed_experts, W) + state(
        expert_params_per_rank(config, ep), expert_shards
    )
    for rank in (None, 0):
        assert training_state_bytes_per_rank(config, run, rank) == unpipelined
        assert activation_bytes_per_rank(config, run, rank) == activation_bytes(config, 2, 32, "bf16").total
    assert pipeline_activation_bytes(config, run, 0).total == activation_bytes(config, 2, 32, "bf16").total
    if run.zero_stage < 3 and not run.fsdp:
        assert stored_params_per_rank(config, run) == params_per_rank(config, ep)
    assert activations_in_flight(run, 0) == 1
    prediction = predict_peak(config, run)
    assert prediction.state_bytes == unpipelined.total
    assert prediction.transient_bytes == sharding_peak_bytes(config, run)
    assert "Pipeline" not in format_ledger(config, run)


def partial_state(run: RunShape):
    return lambda n, shards: training_state_bytes(n, run.precision, run.zero_stage, shards, fsdp=run.fsdp)


# ---- the worst stage -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "run"), CASES, ids=CASE_IDS)
def test_the_worst_pipeline_rank_bounds_every_rank(name: str, run: RunShape) -> None:
    config = preset(name)
    run = replace(run, fsdp=True, dp_size=2)
    ranks = range(run.pipeline_size)
    figures = [
        (lambda p: training_state_bytes_per_rank(config, run, p).total),
        (lambda p: stored_params_per_rank(config, run, p)),
        (lambda p: sharding_transient_bytes(config, run, p).total),
        (lambda p: activation_bytes_per_rank(config, run, p)),
        (lambda p: predict_peak(config, run, p).total),
    ]
    worst = [
        training_state_bytes_per_rank(config, run).total,
        stored_params_per_rank(config, run),
        sharding_transient_bytes(config, run).total,
        activation_bytes_per_rank(config, run),
        predict_peak(config, run).total,
    ]
    for figure, bound in zip(figures, worst, strict=True):
        values = [figure(p) for p in ranks]
        assert bound == max(values)  # one of the ranks', and at least every one's


def test_the_memory_gate_checks_the_worst_stage() -> None:
    base = ["model=moe_tiny", "distributed=fsdp", "data.global_batch_size=16", "trainer.micro_batch_size=2"]
    flat = train_config(base)
    piped = train_config([*base, "distributed.pipeline_parallel_size=2"])
    run = piped.run_shape(4)
    worst = max(rank_memory(piped, 4, pipeline_rank=p).total for p in range(2))
    assert memory_demand(piped, 4, has_gpu=True).device_bytes == worst
    assert memory_demand(piped, 4, has_gpu=False).host_bytes == pytest.approx(
        max(rank_memory(piped, 4, pipeline_rank=p, on_gpu=False).total for p in range(2))
    )
    # The gate's worst rank holds at least the ledger's state and what FSDP gathers of the worst stage.
    assert worst >= max(
        training_state_bytes_per_rank(piped.model, run, p).total + sharding_transient_bytes(piped.model, run, p).total
        for p in range(2)
    )
    # About half the model per rank, sharded over half as many ranks: about the state of the run without a pipeline.
    assert (
        training_state_bytes_per_rank(piped.model, run).total
        <= training_state_bytes_per_rank(flat.model, flat.run_shape(4)).total * 1.05
    )
    assert memory_demand(piped, 4, has_gpu=True).build_host_bytes == max(fsdp_unit_params(piped.model, 1)) * 4


# ---- activations -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense_tiny", "moe_tiny", "deepseek_v3_like_tiny"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_stages_activations_add_up_to_the_models(name: str, checkpointing: str) -> None:
    """One micro-batch through all stages keeps what the unsplit model keeps: each boundary tensor is one stage's
    output and the next stage's input, counted once (as the output); the logits' gradients once."""
    config = preset(name)
    pp = config.n_layers if config.n_layers <= 3 else 2
    run = pipelined(pp, "1f1b", 1, micro_batch_size=2, seq_len=32, checkpointing=checkpointing)
    acts = [pipeline_activation_bytes(config, run, p) for p in range(pp)]
    kept = sum(a.kept / a.in_flight[p] for p, a in enumerate(acts))
    whole = activation_bytes(config, 2, 32, "fp32", checkpointing)
    assert kept + acts[-1].logits_gradients == pytest.approx(whole.total - whole.recompute)
    N_D_s = 2 * 32 * config.d_model * ACTIVATION_BYTES["fp32"]
    m = run.microbatches
    assert [a.buffers for a in acts] == [m * N_D_s, *[3 * m * N_D_s] * (pp - 2), 2 * m * N_D_s]


def test_activations_grow_with_what_the_schedule_keeps_in_flight() -> None:
    config = preset("moe_tiny")
    one_f_one_b = [pipeline_activation_bytes(config, pipelined(2, "1f1b", 1, 8), p) for p in range(2)]
    gpipe = [pipeline_activation_bytes(config, pipelined(2, "gpipe", 1, 8), p) for p in range(2)]
    assert [a.in_flight for a in one_f_one_b] == [{0: 2}, {1: 1}]
    assert [a.in_flight for a in gpipe] == [{0: 8}, {1: 8}]
    for few, many in zip(one_f_one_b, gpipe, strict=True):
        assert many.kept > few.kept and many.buffers == few.buffers
    # the first stage of 1F1B holds PP micro-batches, the last one: its per-micro-batch share times 2 and 1
    assert one_f_one_b[0].kept == pytest.approx(2 * gpipe[0].kept / 8)


def test_pipeline_micro_batches_are_the_steps_rows_cut_into_m() -> None:
    config = preset("moe_tiny")
    run = RunShape(micro_batch_size=4, grad_accum=2, pipeline_size=2, microbatches=4)
    same = RunShape(micro_batch_size=2, grad_accum=4, pipeline_size=2, microbatches=4)
    assert pipeline_activation_bytes(config, run, 0) == pipeline_activation_bytes(config, same, 0)
    with pytest.raises(ValueError, match="does not divide"):
        training_state_bytes_per_rank(config, replace(run, microbatches=3))


# ---- bubble ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_bubble_fraction_follows_its_formulas_and_falls_with_m(pp: int) -> None:
    for m in (1, 4, 8, 32):
        assert bubble_fraction("1f1b", pp, m) == bubble_fraction("gpipe", pp, m) == (pp - 1) / (m + pp - 1)
        assert bubble_fraction("interleaved_1f1b", pp, m, 2) == (pp - 1) / (2 * m + pp - 1)
        assert bubble_fraction("zbv", pp, m, 2) == (pp - 1) / (3 * m + pp - 1)  # F = 1, B = 2: (PP-1)·F idle
    for schedule in ("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"):
        fractions = [bubble_fraction(schedule, pp, m, 2) for m in range(1, 40)]
        assert all(a > b for a, b in itertools.pairwise(fractions))
        assert bubble_fraction(schedule, 1, 8, 2) == 0.0
    assert bubble_fraction("interleaved_1f1b", pp, 8, 2) < bubble_fraction("1f1b", pp, 8)


# ---- in flight: torch's schedules ------------------------------------------------------------------------------


class RecordingStage:
    """Stands in for torch's PipelineStage: records what the schedule runs on it; nothing to send or receive."""

    def __init__(self, stage_index: int, num_stages: int, pp: int, rank: int, order: list) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = stage_index, num_stages, pp, rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod, self.stage_index_to_group_rank, self.order = None, {}, order

    def __getattr__(self, name: str):
        if name.startswith("get_") and name.endswith("_ops"):  # the p2p ops: none
            return lambda *args, **kwargs: []
        if name in ("set_local_fwd_input", "set_local_bwd_input", "get_local_bwd_output", "perform_reduce_grad"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.order.append((self.stage_index, "F", mb))

    def backward_one_chunk(self, mb: int, *args, full_backward: bool = True, **kwargs) -> None:
        self.order.append((self.stage_index, "B" if full_backward else "I", mb))

    def backward_weight_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.order.append((self.stage_index, "W", mb))


def torch_order(schedule: str, pp: int, m: int, virtual: int, rank: int) -> list[tuple[int, str, int]]:
    """What torch's schedule runs on pipeline rank `rank`, in order: its own `_step_microbatches` (the code a step
    runs), with stand-in stages and its stage metadata taken as already exchanged."""
    order: list = []
    num_stages = pp * virtual
    style = "v" if schedule in ("zbv", "dualpipev") else "loop"
    stages = [
        RecordingStage(s, num_stages, pp, rank, order)
        for s in generate_rank_to_stage_mapping(pp, num_stages, style)[rank]
    ]
    cls = TORCH_CLASSES[schedule]
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.WARNING)
    if schedule in ("1f1b", "gpipe"):  # torch's single-stage schedules
        runner = cls(stages[0], m, loss_fn=None)
        runner._stage_forward_initialized = runner._stage_backward_initialized = True
    else:
        runner = cls(stages, m, loss_fn=None)
        runner._stages_forward_initialized = runner._stages_backward_initialized = True
    runner._has_backward = True  # a loss_fn would ask the stages to compute it; the order is the same
    runner._step_microbatches()
    return order


def peak_in_flight(order: list[tuple[int, str, int]]) -> dict[int, int]:
    """Per stage, the forwards run whose backward (B, or W after I) has not, when their total first peaks."""
    live: Counter = Counter()
    best, at_best = 0, {}
    for stage, kind, _ in order:
        if kind == "F":
            live[stage] += 1
        elif kind in ("B", "W"):  # I leaves what W reads
            live[stage] -= 1
        if live.total() > best:
            best, at_best = live.total(), {s: n for s, n in live.items() if n}
    return at_best


SCHEDULE_CASES = [
    (schedule, pp, m, virtual)
    for schedule, virtual in [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)]
    for pp in (2, 4)
    for m in (4, 8)
    if not (schedule == "dualpipev" and m < 2 * pp)  # torch refuses it
]


@pytest.mark.parametrize(("schedule", "pp", "m", "virtual"), SCHEDULE_CASES)
def test_in_flight_counts_are_what_torchs_schedules_run(schedule: str, pp: int, m: int, virtual: int) -> None:
    run = pipelined(pp, schedule, virtual, m)
    for rank in range(pp):
        order = torch_order(schedule, pp, m, virtual, rank)
        assert Counter(kind for _, kind, _ in order)["F"] == m * virtual  # every micro-batch through every stage
        counts = {s: n for s, n in in_flight(schedule, pp, m, virtual, rank).items() if n}
        assert counts == peak_in_flight(order), (schedule, pp, m, rank)
        assert activations_in_flight(run, rank) == sum(counts.values())


@pytest.mark.parametrize("virtual", [1, 3])
def test_interleaved_in_flight_holds_for_other_stage_counts(virtual: int) -> None:
    for pp, m in itertools.product((2, 3, 4), (2, 3, 4, 6, 8, 12)):
        if m % max(1, m // pp):
            continue  # torch refuses micro-batch counts that fill its rounds unevenly
        for rank in range(pp):
            counts = {s: n for s, n in in_flight("interleaved_1f1b", pp, m, virtual, rank).items() if n}
            assert counts == peak_in_flight(torch_order("interleaved_1f1b", pp, m, virtual, rank)), (pp, m, rank)


def test_in_flight_refuses_what_torch_refuses() -> None:
    with pytest.raises(ValueError, match="dualpipev needs at least 2·PP = 8 micro-batches"):
        in_flight("dualpipev", 4, 4, 2, 0)
    with pytest.raises(ValueError, match="do not fill evenly"):
        in_flight("interleaved_1f1b", 3, 10, 2, 0)
    with pytest.raises(ValueError, match="is not one of the 2 pipeline ranks"):
        in_flight("1f1b", 2, 4, 1, 2)


# ---- layouts ---------------------------------------------------------------------------------------------------


def mixed_config(n_layers: int) -> ModelConfig:
    """Dense and MoE layers of different costs, so that the cut matters."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_d_ff=96, first_dense_layers=1, moe_layer_interval=2)
    return ModelConfig(n_layers=n_layers, d_model=32, n_heads=4, d_ff=64, vocab_size=200, moe=moe)


@pytest.mark.parametrize(
    ("n_layers", "pp", "virtual"),
    [(n, pp, v) for n in (3, 5, 7) for pp, v in ((2, 1), (3, 1), (2, 2)) if pp * v <= n],
)
def test_balanced_layout_is_the_best_contiguous_cut(n_layers: int, pp: int, virtual: int) -> None:
    config = mixed_config(n_layers)
    num_stages = pp * virtual
    costs = layer_costs(config, 64)

    def costliest(bounds: tuple[int, ...]) -> int:
        edges = [0, *bounds, n_layers]
        return max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))

    best = min(costliest(cut) for cut in itertools.combinations(range(1, n_layers), num_stages - 1))
    layout = balanced_layout(config, 64, pp, "interleaved_1f1b" if virtual > 1 else "1f1b", virtual)
    assert [piece for stage in layout.stages for piece in stage] == [EMBED, *range(n_layers), NORM, HEAD]
    assert all(layout.layers(s) for s in range(num_stages))
    assert max(sum(costs[layer] for layer in layout.layers(s)) for s in range(num_stages)) == best


@pytest.mark.parametrize(
    ("stages", "schedule", "message"),
    [
        ([["embed", 0], [2, 3, "norm", "head"]], "1f1b", "misses layer(s) [1]"),
        ([["embed", 0, 1], [1, 2, 3, "norm", "head"]], "1f1b", "repeats layer(s) [1]"),
        ([["embed", 0, 1, 2, 3], [], ["norm", "head"]], "gpipe", "not a multiple of"),
        ([["embed", 0, 1], [], [2], [3, "norm", "head"]], "interleaved_1f1b", "stage 1 is empty"),
        ([["embed", 0], [1], [2], [3, "norm", "head"]], "1f1b", "runs 1 per pipeline rank: give 2"),
        ([["embed", 0, 1], [2, 3, "norm", "head"]], "zbv", "runs 2 per pipeline rank: give 4"),
        ([["embed", 0, 1], [2, 3, "norm"]], "1f1b", "misses head"),
    ],
)
def test_parse_layout_refuses_with_one_sentence(stages: list, schedule: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as refusal:
        parse_layout(stages, 4, 2, schedule)
    text = str(refusal.value)
    assert "\n" not in text and ". " not in text and not text.endswith(".")


def test_an_explicit_layout_is_the_one_the_ledger_counts() -> None:
    config = preset("deepseek_v3_like_tiny")  # layer 0 dense, 1 and 2 MoE
    stages = (("embed", 0), (1, 2, "norm", "head"))
    run = pipelined(2, "1f1b", 1, layout=stages)
    assert pipeline_layout(config, run).stages == stages
    (dense0, routed0), (dense1, routed1) = held_params_by_rank(config, run)
    assert routed0 == 0 and routed1 == count_parameters(config).routed_experts


# ---- the table -------------------------------------------------------------------------------------------------


def test_format_ledger_prints_a_row_per_pipeline_rank_and_the_bubble() -> None:
    config = preset("moe_tiny")
    run = pipelined(2, "1f1b", 1, 8, micro_batch_size=2, seq_len=32, dp_size=2, fsdp=True)
    text = format_ledger(config, run)
    table = next(t for t in text.split("\n\n") if t.startswith("Pipeline"))
    assert table.startswith("Pipeline (PP=2, schedule 1f1b, m=8 micro-batches")
    rows = table.splitlines()[2:4]
    assert "embed 0 1" in rows[0] and "2 3 norm head" in rows[1]
    for p, row in enumerate(rows):
        dense, routed = held_params_by_rank(config, run)[p]
        assert f"{dense + routed:,}" in row
        assert f" {activations_in_flight(run, p)} " in row
    assert f"{bubble_fraction('1f1b', 2, 8):.1%}  (PP - 1) / (m + PP - 1)" in table
    assert "pipeline rank" in next(t for t in text.split("\n\n") if t.startswith("Training state"))
    zbv = format_ledger(config, pipelined(2, "zbv", 2, 8))
    assert "embed 0 | 3 norm head" in zbv and "4 = 3 + 1" in zbv


# ---- against a measured step -----------------------------------------------------------------------------------

# case: (schedule, overrides); moe_tiny, 2 ranks, m = 4 micro-batches; "1f1b mtp": two MTP modules and the
# embedding's copy on the last stage
MEASURED = {
    "1f1b": ("1f1b", []),
    "zbv": ("zbv", []),
    "gpipe": ("gpipe", []),
    "1f1b mtp": ("1f1b", ["model.mtp.depth=2"]),
}


def measure_a_pipeline_step_on_this_rank(rank: int, world_size: int) -> dict[str, tuple[float, float]]:
    """Per schedule: (this stage's measured peak bytes in its first step, the ledger's weights + gradients +
    activations of its pipeline rank: the first step has no optimizer state yet)."""
    import torch

    from moe import Transformer
    from moe.ledger import pipeline_layout
    from moe_platform.monitor.peak_memory import measure_peak, storage_bytes
    from moe_platform.parallel import pipeline
    from moe_platform.train.pipeline_step import token_mean_loss

    torch.set_num_threads(1)
    micro, seq, m = 2, 128, 4
    results = {}
    for case, (schedule, overrides) in MEASURED.items():
        config = train_config([*overrides,
            "model=moe_tiny", "distributed=ddp", f"distributed.pipeline_parallel_size={world_size}",
            f"distributed.pipeline.schedule={schedule}", f"data.global_batch_size={micro * m}",
            f"trainer.micro_batch_size={micro}", f"data.seq_len={seq}",
        ])  # fmt: skip
        run = config.run_shape(world_size)
        layout = pipeline_layout(config.model, run)
        meshes = pipeline.build_meshes("cpu", world_size, 1, 1)
        torch.manual_seed(0)
        model = Transformer(config.model)
        stage_ids = layout.stages_of_rank(meshes.pipeline_rank)
        pipeline.keep_stages(model, layout, stage_ids)
        stages = pipeline.stage_modules(model, layout, stage_ids)
        shape = pipeline.MicroBatchShape(micro, seq, config.model.d_model, config.model.vocab_size, torch.float32,
                                         torch.float32)  # fmt: skip
        steps = pipeline.build_schedule(stages, stage_ids, layout, meshes, torch.device("cpu"), schedule, m, shape,
                                        token_mean_loss)  # fmt: skip
        batch = torch.randint(
            0, config.model.vocab_size, (micro * m, seq + 1), generator=torch.Generator().manual_seed(0)
        )
        last = layout.num_stages - 1 in stage_ids
        args = (batch[:, :-1],) if 0 in stage_ids else ()
        labels = {"labels_BT": batch[:, 1:]} if config.model.mtp.depth else {}
        with measure_peak("cpu", start_bytes=storage_bytes([*model.parameters(), batch])) as peak:
            steps.step(*args, target=batch[:, 1:] if last else None, return_outputs=False, **labels)
        held = sum(p.numel() for p in model.parameters())
        predicted = held * 8 + activation_bytes_per_rank(config.model, run, meshes.pipeline_rank)
        results[case] = (peak.peak_bytes, predicted)
    return results


@pytest.mark.slow
def test_the_ledger_predicts_a_measured_pipeline_step() -> None:
    """Weights + gradients + the in-flight activations and torch's buffers, against the CPU allocator's peak of one
    step on each of 2 pipeline ranks (within 20%: per-op transients and the allocator's rounding are not counted)."""
    from moe_platform.testing import run_distributed

    for rank, results in enumerate(run_distributed(measure_a_pipeline_step_on_this_rank, 2, timeout=300)):
        for schedule, (measured, predicted) in results.items():
            assert measured == pytest.approx(predicted, rel=0.2), (schedule, rank)


# ---- multi-token prediction -------------------------------------------------------------------------------------

# (model, pipeline size, schedule, stages per rank): deepseek_v3_like_tiny has 3 layers, too few for 4 stages
MTP_PIPELINES = [
    ("deepseek_v3_like_tiny", 2, "1f1b", 1), ("deepseek_v3_like_tiny", 3, "gpipe", 1),
    ("moe_tiny", 2, "interleaved_1f1b", 2), ("moe_tiny", 2, "zbv", 2),
]  # fmt: skip


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize(("name", "pp", "schedule", "virtual"), MTP_PIPELINES, ids=[p[2] for p in MTP_PIPELINES])
def test_under_mtp_each_rank_holds_what_the_trainer_builds_for_it(
    name, pp: int, schedule: str, virtual: int, optimizer
):
    """The ledger's per-rank parameters, Muon's share and FSDP's units are those of the model the trainer keeps on
    that rank (parallel/pipeline.py's keep_stages): the last stage's rank holds the MTP modules and, unless it runs
    the first stage too (a V schedule), a copy of the embedding, so the ranks sum to the model plus that copy."""
    import torch

    from moe import Transformer
    from moe.expert_parallel import is_expert_parameter
    from moe_platform.parallel.pipeline import keep_stages
    from moe_platform.train.optimizers import param_groups

    muon_override = ["optim=muon"] if optimizer == "muon" else []
    config = train_config([f"model={name}", "model.mtp.depth=2", *muon_override])
    model_config = config.model
    run = pipelined(pp, schedule, virtual, 4, seq_len=64, micro_batch_size=2, fsdp=True, dp_size=2, ep_size=2,
                    optimizer=optimizer)  # fmt: skip
    layout = pipeline_layout(model_config, run)
    copy = layout.rank_of_stage(0) != layout.rank_of_stage(layout.num_stages - 1)
    held, muon = held_params_by_rank(model_config, run), muon_params_by_rank(model_config, run)
    params = count_parameters(model_config)
    assert sum(d + r for d, r in held) == params.total + copy * params.embedding
    for p in range(pp):
        with torch.device("meta"):
            model = Transformer(model_config)
        keep_stages(model, layout, layout.stages_of_rank(p))
        named = dict(model.named_parameters())
        routed = sum(x.numel() for name, x in named.items() if is_expert_parameter(name))
        assert held[p] == (sum(x.numel() for x in named.values()) - routed, routed), p
        assert (model.mtp is not None) == (layout.num_stages - 1 in layout.stages_of_rank(p))
        groups = {group["name"]: group["params"] for group in param_groups(model, config.optim)}
        stepped = groups.get("muon", [])
        expert_ids = {id(x) for name, x in named.items() if is_expert_parameter(name)}
        muon_routed = sum(x.numel() for x in stepped if id(x) in expert_ids)
        assert muon[p] == (sum(x.numel() for x in stepped) - muon_routed, muon_routed), p
        dense, routed = held[p]
        assert sum(pipeline_fsdp_unit_params(model_config, run, p)) == dense + routed // run.ep_size
    # the balanced cut weighs the MTP modules on the last stage
    costs = layer_costs(model_config, 64)
    assert costs[-1] > layer_costs(preset(name), 64)[-1]
