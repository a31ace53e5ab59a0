"""MLA decode: absorbed vs unabsorbed weights, and the latent cache vs the per-head cache an MHA model would hold.

Both paths compute the same logits (tests/moe/test_mla.py). Unabsorbed decode re-expands every cached latent into
H keys and values at every step: S·d_c·H·(n + v) multiply-adds per layer and token. Absorbed decode moves W_UK onto
the H queries and applies W_UV to H attended latents instead (moe/mla.py). This script prints, side by side in one
run:
  * the time per decoded token of each path, after the same prefill, with greedy decoding;
  * the maximum difference of their logits;
  * the cache bytes, MLA's B·L·S·(d_c + d_r)·s beside an MHA cache's B·L·S·H·(n + r + v)·s.
Rounds alternate the two paths, so load from other processes hits both alike. Each cell is the median over rounds
[min, max].

    .venv/bin/python bench/mla_decode.py                 # d_model 512, 8 heads, prompt 512, 32 new tokens
    .venv/bin/python bench/mla_decode.py --quick         # a few seconds (tests/bench/test_mla_decode.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe import ModelConfig, Transformer  # noqa: E402


def build(quick: bool) -> Transformer:
    if quick:
        shape = dict(d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=96)
        mla = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    else:
        shape = dict(d_model=512, n_heads=8, n_layers=4, d_ff=1024, max_seq_len=1024)
        mla = dict(q_lora_rank=192, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=258, attention="mla", mla=mla, **shape)).eval()


@torch.no_grad()
def decode(model: Transformer, prompt_BT: torch.Tensor, new_tokens: int, absorb: bool) -> tuple[float, torch.Tensor]:
    """Seconds per decoded token after one prefill, and the logits of every decode step."""
    for block in model.blocks:
        block.attn.absorb_decode = absorb
    cache = model.new_kv_cache(prompt_BT.shape[0], prompt_BT.shape[1] + new_tokens)
    next_B1 = model(prompt_BT, kv_cache=cache).logits[:, -1:].argmax(-1)
    steps = []
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits_B1V = model(next_B1, kv_cache=cache).logits
        steps.append(logits_B1V)
        next_B1 = logits_B1V.argmax(-1)
    return (time.perf_counter() - start) / new_tokens, torch.cat(steps, dim=1)


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch, args.prompt, args.new_tokens = 1, 2, 48, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.quick)
    config, mla = model.config, model.config.mla
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt))
    times: dict[bool, list[float]] = {False: [], True: []}
    ratios, max_diff = [], 0.0
    for _ in range(args.rounds):
        results = {absorb: decode(model, prompt, args.new_tokens, absorb) for absorb in (False, True)}
        for absorb, (seconds, _) in results.items():
            times[absorb].append(seconds)
        ratios.append(results[False][0] / results[True][0])
        max_diff = max(max_diff, (results[False][1] - results[True][1]).abs().max().item())

    S, B, L, s = args.prompt + args.new_tokens, args.batch, config.n_layers, 4
    latent = model.new_kv_cache(B, S).num_bytes
    mha = B * L * S * config.n_heads * (mla.qk_head_dim + mla.v_head_dim) * s
    print(
        f"MLA d_model={config.d_model} H={config.n_heads} L={L} d_c={mla.kv_lora_rank} d_r={mla.qk_rope_head_dim} "
        f"n={mla.qk_nope_head_dim} v={mla.v_head_dim}; batch {B}, prompt {args.prompt}, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    print(f"ms per decoded token, unabsorbed: {cell([1e3 * t for t in times[False]])}")
    print(f"ms per decoded token, absorbed:   {cell([1e3 * t for t in times[True]])}")
    print(f"unabsorbed / absorbed:            {cell(ratios)}")
    print(f"max |logit difference|:           {max_diff:.2e}")
    print(
        f"cache at S={S}: latent {latent / 2**20:.2f} MiB = B·L·S·(d_c+d_r)·4; "
        f"an MHA cache would hold {mha / 2**20:.2f} MiB = B·L·S·H·(n+r+v)·4; ratio {mha / latent:.1f}"
    )
    return {"ratio": statistics.median(ratios), "max_diff": max_diff, "latent_bytes": latent, "mha_bytes": mha}


if __name__ == "__main__":
    main()
