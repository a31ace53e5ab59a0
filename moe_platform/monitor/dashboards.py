"""What of a metrics record reaches wandb and TensorBoard: the scalar keys a `logging.moe_detail` mode keeps, and
pictures of expert load (an expert × layer utilisation heatmap, histograms of tokens per expert).

Legend: L MoE layers, E experts per layer. Utilisation of an expert = its load / the ideal load (routed assignments /
E), so 1.0 is perfect balance, 0 a dead expert and E the whole layer on one expert.

Key-count bound. metrics.jsonl keeps every key. The dashboards get:
* brief (default): the run's own scalars (loss, lr, grad_norm, throughput, memory, eval/*: a set fixed by the trainer)
  plus at most len(ACROSS_LAYER_METRICS) · len(ACROSS_LAYER_STATS) = 25 `moe/all/*` keys plus the `moe/alerts`
  count, and two media keys (`moe/load_heatmap`, `moe/all/utilisation`): independent of L and E.
* detailed: brief plus len(LAYER_SCALARS) = 7 scalar keys and one histogram key per MoE layer: 8 · L more,
  still independent of E.
Per-expert values never become a scalar key each; they only reach the heatmap and the histograms.
"""

import re
from typing import Any

import numpy as np

from moe.stats import load_balance

LAYER_SCALARS = ("maxvio", "drop_frac", "cv", "entropy", "dead_experts", "aux_loss", "z_loss")
ACROSS_LAYER_METRICS = ("maxvio", "drop_frac", "cv", "entropy", "dead_experts")
ACROSS_LAYER_STATS = ("min", "p50", "p95", "max", "worst_layer")
HEATMAP_KEY = "moe/load_heatmap"
ALL_UTILISATION_KEY = "moe/all/utilisation"
ALERTS_KEY = "moe/alerts"

_LAYER_KEY = re.compile(r"^moe/layer_(\d+)/(.+)$")


def scalar_metrics(record: dict[str, Any], moe_detail: str) -> dict[str, float]:
    """The record's scalars that reach wandb / TensorBoard: everything numeric except `step` and, unless
    moe_detail="detailed", the per-layer `moe/layer_*` keys (see the bound in the module docstring); `moe_detail` is
    one of config.MOE_DETAILS, checked at start-up."""
    scalars = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        match = _LAYER_KEY.match(key)
        if match is not None and not (moe_detail == "detailed" and match.group(2) in LAYER_SCALARS):
            continue
        scalars[key] = value
    return scalars


def tokens_per_expert_by_layer(record: dict[str, Any]) -> dict[int, list[int]]:
    """{layer id: tokens routed to each expert (before capacity)}, in layer order; empty for a record without load."""
    layers = {}
    for key, value in record.items():
        match = _LAYER_KEY.match(key)
        if match is not None and match.group(2) == "tokens_per_expert":
            layers[int(match.group(1))] = list(value)
    return dict(sorted(layers.items()))


def utilisation_LE(record: dict[str, Any]) -> tuple[list[int], np.ndarray]:
    """(layer ids, [L, E] utilisation): the record's `moe/layer_{i}/utilisation`, else load / mean load computed from
    tokens_per_expert; NaN where a layer has fewer experts than the widest one, or routed nothing."""
    loads = tokens_per_expert_by_layer(record)
    layers = list(loads)
    width = max((len(v) for v in loads.values()), default=0)
    util_LE = np.full((len(layers), width), np.nan)
    for row, layer in enumerate(layers):
        given = record.get(f"moe/layer_{layer}/utilisation")
        if given is not None:
            util_LE[row, : len(given)] = given
            continue
        if sum(loads[layer]) > 0:  # a layer that routed nothing stays NaN: no value to draw
            util_LE[row, : len(loads[layer])] = load_balance(loads[layer])["utilisation"]
    return layers, util_LE


def heatmap_image(util_LE: np.ndarray, max_side: int = 512) -> np.ndarray:
    """[H, W, 3] uint8 picture of an [L, E] utilisation matrix: one row per layer (top = first MoE layer), one
    column per expert. Colour is log2(utilisation) clipped to ±2: white balanced, red over-loaded (4× ideal and
    more saturate), blue under-loaded; black a dead expert, grey no value. Each cell is a square block of pixels."""
    num_layers, num_experts = util_LE.shape
    cell = max(1, min(32, max_side // max(num_layers, num_experts, 1)))
    with np.errstate(divide="ignore", invalid="ignore"):
        x_LE = np.clip(np.log2(util_LE), -2.0, 2.0) / 2.0  # in [-1, 1]
    over_LE, under_LE = np.clip(x_LE, 0, 1), np.clip(-x_LE, 0, 1)
    # white → red over-loaded: fade green and blue; white → blue under-loaded: fade red and green.
    rgb_LE3 = np.stack([1 - under_LE, 1 - np.maximum(over_LE, under_LE), 1 - over_LE], axis=-1)
    rgb_LE3[util_LE == 0] = 0.0
    rgb_LE3[np.isnan(util_LE)] = 0.5
    image = np.round(255 * np.nan_to_num(rgb_LE3, nan=0.5)).astype(np.uint8)
    return np.repeat(np.repeat(image, cell, axis=0), cell, axis=1)


def expert_histogram(tokens_per_expert: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(counts [E], bin edges [E+1]): a histogram over expert ids whose bar e, centred on e, is the tokens routed to
    expert e."""
    counts = np.asarray(tokens_per_expert, dtype=np.float64)
    return counts, np.arange(len(counts) + 1, dtype=np.float64) - 0.5


def should_draw(log_index: int, visuals_every: int) -> bool:
    """Pictures on this job's 1st log that carries expert load and every visuals_every-th after it (0: never)."""
    return visuals_every > 0 and log_index % visuals_every == 0
