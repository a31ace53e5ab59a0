"""Pipeline stages: which layers each stage runs, and how long a schedule leaves stages idle (seed 003's ledger).

A layout lists, for each of the S = PP · V stages in stage order, its pieces: the embedding `embed` (first stage),
layer indices, and the final norm and head `norm`, `head` (last stage). Read in order, the stages spell out exactly

    embed, 0, 1, …, L-1, norm, head

so every layer is run once and activations only flow forward (Megatron's --pipeline-model-parallel-layout idea).
The multi-token-prediction modules (model.mtp.depth > 0) run where the head runs, on the last stage, which then
also holds a copy of the embedding they share with the first stage (parallel/pipeline.py sums the two copies'
gradients): layouts do not spell them.
The balanced layout cuts the layers into S contiguous runs minimising the costliest stage, the cost of a layer
being its training matmul FLOPs per token: attention (GQA or MLA) plus its FFN (dense, or router + top-k and shared
experts); the head's 2·D·V goes to the last stage, the embedding (a lookup) costs nothing.

Which rank runs which stage: with V = 1 rank p runs stage p; the interleaved schedule loops (rank p runs stages
p, p + PP, …); the V-shaped ones (zbv, dualpipev, V = 2) run stages p and 2·PP - 1 - p, so the first and last
stage share a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.config import ModelConfig, memoized_by_config
from moe.ffn import ffn_matmul_flops_per_token
from moe.flops import matmul_flops_per_token

EMBED, NORM, HEAD = "embed", "norm", "head"
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev")
LOOPED, V_SHAPED = ("interleaved_1f1b",), ("zbv", "dualpipev")

Piece = int | str


@dataclass(frozen=True)
class StageLayout:
    """`stages[s]`: the pieces of stage s, in order; `ranks_of_stage[s]`: the pipeline rank that runs it."""

    stages: tuple[tuple[Piece, ...], ...]
    pipeline_size: int
    style: str  # "single" (V = 1), "loop" or "v"

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def rank_of_stage(self, stage: int) -> int:
        if self.style == "v":
            return stage if stage < self.pipeline_size else 2 * self.pipeline_size - 1 - stage
        return stage % self.pipeline_size

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages s with rank_of_stage(s) == rank, ascending: the inverse of `rank_of_stage`, spelled out
        (the planner asks it ~10^5 times a plan)."""
        if not 0 <= rank < self.pipeline_size:
            return []
        if self.style == "v":
            return [s for s in (rank, 2 * self.pipeline_size - 1 - rank) if s < self.num_stages]
        return list(range(rank, self.num_stages, self.pipeline_size))

    def layers(self, stage: int) -> tuple[int, ...]:
        """The block indices of stage `stage`, in order (a tuple: memoized ledger functions take it as a key)."""
        return tuple(piece for piece in self.stages[stage] if isinstance(piece, int))


def style_of(schedule: str) -> str:
    return "v" if schedule in V_SHAPED else "loop" if schedule in LOOPED else "single"


@memoized_by_config
def layer_costs(config: ModelConfig, seq_len: int) -> tuple[int, ...]:
    """Training matmul FLOPs per token of each layer (3 × forward), the head's and the MTP modules' (which run on
    the stage of the head) added to the last."""
    flops = matmul_flops_per_token(config, seq_len)
    attention = (flops.projections + flops.attention) // config.n_layers
    costs = []
    for layer in range(config.n_layers):
        if config.is_moe_layer(layer):
            ffn = config.moe.matmul_flops_per_token(config.d_model, config.activation)
        else:
            ffn = ffn_matmul_flops_per_token(config.d_model, config.d_ff, config.activation)
        costs.append(3 * (attention + ffn))
    costs[-1] += 3 * (flops.lm_head + flops.mtp)
    return tuple(costs)


@memoized_by_config
def balanced_layout(config: ModelConfig, seq_len: int, pipeline_size: int, schedule: str, virtual: int) -> StageLayout:
    """The contiguous cut of the layers into PP · V stages whose costliest stage is cheapest (exact, by dynamic
    programming over cut points); ties go to the cut with the earlier stages heavier, which hold no head."""
    num_stages = pipeline_size * virtual
    costs = layer_costs(config, seq_len)
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"{num_stages} pipeline stages cannot each run one of {n} layers")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][i]: the least possible costliest stage when the first i layers form s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst <= best[s][i]:  # `<=`: the latest cut j, so earlier stages take more
                    best[s][i], cut[s][i] = worst, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    stages: list[tuple[Piece, ...]] = [tuple(range(a, b)) for a, b in reversed(bounds)]
    stages[0] = (EMBED, *stages[0])
    stages[-1] = (*stages[-1], NORM, HEAD)
    return StageLayout(tuple(stages), pipeline_size, style_of(schedule))


def parse_layout(stages: list[list[Piece]], n_layers: int, pipeline_size: int, schedule: str) -> StageLayout:
    """An explicit layout, checked: S = PP · V stages, none empty, spelling embed, 0 … L-1, norm, head in order.
    Raises ValueError with one sentence naming what is wrong."""
    if not stages or len(stages) % pipeline_size:
        raise ValueError(f"it has {len(stages)} stages, not a multiple of pipeline_parallel_size={pipeline_size}")
    per_rank = {"single": 1, "v": 2}.get(style_of(schedule))
    if per_rank is not None and len(stages) != per_rank * pipeline_size:
        raise ValueError(
            f"it has {len(stages)} stages but schedule {schedule} runs {per_rank} per pipeline rank: give "
            f"{per_rank * pipeline_size}"
        )
    for index, pieces in enumerate(stages):
        if not pieces:
            raise ValueError(f"stage {index} is empty: give every stage at least one piece")
        for piece in pieces:
            if isinstance(piece, bool) or not (isinstance(piece, int) or piece in (EMBED, NORM, HEAD)):
                raise ValueError(f"stage {index} names {piece!r}: pieces are layer indices, embed, norm and head")
    flat = [piece for pieces in stages for piece in pieces]
    expected = [EMBED, *range(n_layers), NORM, HEAD]
    if flat != expected:
        missing = [p for p in expected if p not in flat]
        repeated = [p for p in expected if flat.count(p) > 1]
        if any(isinstance(p, int) and not 0 <= p < n_layers for p in flat):
            why = f"names layers outside 0..{n_layers - 1}"
        elif missing:
            why = f"misses {_pieces(missing)}"
        elif repeated:
            why = f"repeats {_pieces(repeated)}"
        else:
            why = "puts its pieces out of order (embed first, layers ascending, norm and head last)"
        raise ValueError(f"it {why}: read in order, the stages must spell embed, 0, …, {n_layers - 1}, norm, head")
    return StageLayout(tuple(tuple(pieces) for pieces in stages), pipeline_size, style_of(schedule))


def _pieces(pieces: list[Piece]) -> str:
    layers = [p for p in pieces if isinstance(p, int)]
    named = [p for p in pieces if not isinstance(p, int)]
    return " and ".join([*([f"layer(s) {layers}"] if layers else []), *named])


def bubble_fraction(schedule: str, pipeline_size: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a stage's time in one step, with forward F and backward B = 2F per micro-batch and no
    communication cost: GPipe and 1F1B (PP - 1) / (m + PP - 1); interleaved (PP - 1) / (V·m + PP - 1) (Megatron's
    (PP-1)/(V·m) of the busy time); zero-bubble V schedules split B into input and weight halves (B = 2W) and fill
    the warm-up with weight work: (PP-1)·(F + B - 2W) = (PP-1)·F of idle time per stage, over m·(F + B) busy."""
    p, m = pipeline_size, microbatches
    if p == 1:
        return 0.0
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (virtual * m + p - 1)
    idle, busy = (p - 1) * 1.0, m * 3.0  # F = 1, B = 2, W = 1: (p-1)(1 + 2 - 2)
    return idle / (busy + idle)


BUBBLE_FORMULAS = {
    "1f1b": "(PP - 1) / (m + PP - 1)",
    "gpipe": "(PP - 1) / (m + PP - 1)",
    "interleaved_1f1b": "(PP - 1) / (V·m + PP - 1)",
    "zbv": "(PP - 1)·F / (m·(F + B) + (PP - 1)·F), B = 2F split into I and W halves",
    "dualpipev": "(PP - 1)·F / (m·(F + B) + (PP - 1)·F), B = 2F split into I and W halves",
}  # what `bubble_fraction` computes, in words for the ledger's table


def in_flight(schedule: str, pipeline_size: int, microbatches: int, virtual: int, rank: int) -> dict[int, int]:
    """Micro-batches each stage of pipeline rank p holds activations of, at the moment their total peaks: forwards
    it has run whose backward (B, or the weight half W under zero bubble: the input half I leaves what W reads) it
    has not. Read off torch 2.13's schedules (torch/distributed/pipelining/schedules.py) and checked against the
    order each of them runs (tests/moe/test_ledger_pipeline.py); m micro-batches, V stages per rank:
      gpipe: every forward before any backward, {p: m};
      1f1b: min(m, PP - p) warm-up forwards, then one forward per backward, {p: min(m, PP - p)};
      interleaved_1f1b: torch runs r = max(1, m // PP) rounds of M = m / r micro-batches; rank p warms up with
        w = min((V-1)·M + 2·(PP-1-p), V·m) forwards and its first steady step adds one before the first backward,
        so n = min(w + 1, V·m) chunk-forwards, the k-th on stage ((k // M) mod V)·PP + p;
      zbv: stage p holds min(2·PP - 1 - p, m), stage 2·PP - 1 - p min(p + 1, m), at most 2·PP in all;
      dualpipev (torch needs m >= 2·PP): stage p holds 2·PP - p, stage 2·PP - 1 - p holds p + 1: 2·PP + 1 in all,
        one more than zbv, since it overlaps a forward with a backward that has not yet freed its own.
    Without a pipeline (PP = 1) one micro-batch at a time: {0: 1}."""
    p, P, m, V = rank, pipeline_size, microbatches, virtual
    if not 0 <= p < P:
        raise ValueError(f"pipeline rank {p} is not one of the {P} pipeline ranks: use 0 … {P - 1}")
    if P == 1:
        return {0: 1}
    if schedule == "gpipe":
        return {p: m}
    if schedule == "1f1b":
        return {p: min(m, P - p)}
    if schedule == "interleaved_1f1b":
        rounds = max(1, m // P)
        if m % rounds:
            raise ValueError(
                f"interleaved_1f1b runs {rounds} rounds of micro-batches, which {m} micro-batches do not fill evenly: "
                f"use a multiple of {rounds}"
            )
        per_round = m // rounds
        n = min((V - 1) * per_round + 2 * (P - 1 - p) + 1, V * m)
        counts = {chunk * P + p: 0 for chunk in range(V)}
        for k in range(n):
            counts[(k // per_round) % V * P + p] += 1
        return counts
    if schedule == "zbv":
        return {p: min(2 * P - 1 - p, m), 2 * P - 1 - p: min(p + 1, m)}
    if schedule == "dualpipev":
        if m < 2 * P:
            raise ValueError(f"dualpipev needs at least 2·PP = {2 * P} micro-batches per step, not {m}: raise them")
        return {p: 2 * P - p, 2 * P - 1 - p: p + 1}
    raise ValueError(f"schedule={schedule!r} is unknown: use one of {SCHEDULES}")


IN_FLIGHT_FORMULAS = {
    "1f1b": "rank p: min(m, PP - p)",
    "gpipe": "every rank: m",
    "interleaved_1f1b": "rank p: min((V-1)·M + 2·(PP-1-p) + 1, V·m), M = m / max(1, m // PP)",
    "zbv": "rank p: min(2·PP-1-p, m) on stage p + min(p+1, m) on stage 2·PP-1-p",
    "dualpipev": "rank p: 2·PP - p on stage p + p + 1 on stage 2·PP-1-p",
}  # what `in_flight` counts, in words for the ledger's table
