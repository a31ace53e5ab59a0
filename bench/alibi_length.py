"""ALiBi at twice the training length: train at seq_len L, evaluate windows of 2L, loss per position.

Each row trains the same tiny model (conf/model/<--model>.yaml, model.max_seq_len = 2L so that 2L windows fit) with
pos_encoding=alibi, and the same with rope for comparison, for `--steps` AdamW steps on windows of L tokens of the
embedded synthetic corpus (data_pipeline, no download). It then evaluates held-out windows of 2L tokens and prints the
mean next-token loss over positions [0, L) (the trained length) and [L, 2L) (never seen in training). In a causal
model position t sees only tokens ≤ t, so the [0, L) half of a 2L window is exactly an L-token evaluation.

Each repeat trains from a different seed (weights and sample order); the table prints the median over repeats and the
range. The synthetic language is a first-order Markov chain (its entropy floor is printed): the next token depends on
the previous one only, so this measures whether a model stays finite and keeps its trained-length loss past L, not
whether it uses long-range context. Only the measured numbers are claimed.

    .venv/bin/python bench/alibi_length.py                       # L=64, 300 steps, 3 repeats
    .venv/bin/python bench/alibi_length.py --quick                # seconds: L=8, 3 steps, 1 repeat
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # first on the path: `data_pipeline` is the package, not bench/data_pipeline.py

from data_pipeline import DataConfig, SyntheticConfig, ValConfig, build_loaders  # noqa: E402
from moe import ModelConfig, Transformer  # noqa: E402

POS_ENCODINGS = ("alibi", "rope")


def model_config(args: argparse.Namespace, pos_encoding: str) -> ModelConfig:
    """conf/model/<args.model>.yaml with this position encoding and room for 2L positions."""
    preset = OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")
    override = {"pos_encoding": pos_encoding, "max_seq_len": 2 * args.seq_len}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), preset, override))


def data_config(args: argparse.Namespace, seq_len: int, seed: int) -> DataConfig:
    synthetic = SyntheticConfig(num_tokens=args.num_tokens)
    val = ValConfig(fraction=args.val_fraction, max_batches=args.eval_batches)
    return DataConfig(synthetic=synthetic, val=val, seq_len=seq_len, global_batch_size=args.batch, seed=seed)


def train(args: argparse.Namespace, pos_encoding: str, seed: int) -> Transformer:
    """`args.steps` AdamW steps on L-token windows: loss = cross-entropy + the MoE auxiliary losses."""
    torch.manual_seed(seed)
    model = Transformer(model_config(args, pos_encoding))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = iter(build_loaders(data_config(args, args.seq_len, seed)).train)
    model.train()
    for _ in range(args.steps):
        batch = next(batches)
        out = model(batch["input_ids"])
        loss = F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten()) + out.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model


@torch.no_grad()
def loss_per_position(model: Transformer, args: argparse.Namespace) -> torch.Tensor:
    """Mean next-token loss at each position t of held-out 2L-token windows: (2L,) float64."""
    model.eval()
    loaders = build_loaders(data_config(args, 2 * args.seq_len, seed=0))
    total_T, count = torch.zeros(2 * args.seq_len, dtype=torch.float64), 0
    for batch in loaders.val:
        logits_BTV = model(batch["input_ids"]).logits
        loss_BT = F.cross_entropy(logits_BTV.transpose(1, 2), batch["labels"], reduction="none")
        total_T += loss_BT.double().sum(dim=0)
        count += loss_BT.shape[0]
    return total_T / count


def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """{pos_encoding: [(mean loss on [0, L), mean loss on [L, 2L)) per repeat]}."""
    L = args.seq_len
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in POS_ENCODINGS}
    for repeat in range(args.repeats):
        for pos_encoding in POS_ENCODINGS:  # interleaved, so each repeat's seed trains both
            loss_T = loss_per_position(train(args, pos_encoding, seed=repeat), args)
            inside, beyond = loss_T[:L].mean().item(), loss_T[L:].mean().item()
            results[pos_encoding].append((inside, beyond))
            print(
                f"  repeat {repeat + 1}: {pos_encoding:<6s} [0,{L}) {inside:.4f}   [{L},{2 * L}) {beyond:.4f}",
                flush=True,
            )
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="moe_tiny", help="a preset under conf/model/")
    parser.add_argument("--seq-len", type=int, default=64, help="L, the training window")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="windows per step (and per evaluation batch)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-tokens", type=int, default=2**20, help="synthetic corpus size")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="held-out share of the corpus's documents")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches of 2L windows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="L=8, 3 steps, 1 repeat, small corpus: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.steps, args.repeats, args.num_tokens, args.eval_batches = 8, 3, 1, 2**15, 1
        args.batch = 4
    return args


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    floor = build_loaders(data_config(args, args.seq_len, seed=0)).entropy_floor
    print(
        f"model={args.model} L={args.seq_len} (evaluated at 2L={2 * args.seq_len}), {args.steps} steps of "
        f"{args.batch} windows, lr {args.lr}, {args.repeats} repeat(s); synthetic entropy floor {floor:.4f} nats"
    )
    results = measure(args)
    L = args.seq_len
    print(f"\n  {'pos_encoding':<12s} {f'loss [0,{L})':>28s} {f'loss [{L},{2 * L})':>28s}   (median [min, max])")
    for name, rows in results.items():
        cells = []
        for column in zip(*rows, strict=True):
            cells.append(f"{statistics.median(column):.4f} [{min(column):.4f}, {max(column):.4f}]")
        finite = all(math.isfinite(value) for row in rows for value in row)
        print(f"  {name:<12s} {cells[0]:>28s} {cells[1]:>28s}   {'finite' if finite else 'NOT FINITE'}")
    return results


if __name__ == "__main__":
    main()
