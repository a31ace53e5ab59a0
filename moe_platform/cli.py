"""`moe-train`: the main job on the embedded default.

Until the Hydra trainer lands (it replaces this module's `main`), the job is a short, honest CPU smoke: build the
default model, print the resource ledger, take a few AdamW steps on a fixed batch (the loss must fall), and
generate from the KV cache.
"""

import argparse
import time

import torch

from moe import ModelConfig, MoEConfig, RunShape, Transformer, format_ledger


def default_model_config(dense: bool) -> ModelConfig:
    """A tiny MoE model (every other layer routed, top-2 of 4 experts) or its dense twin."""
    moe = None if dense else MoEConfig(num_experts=4, top_k=2, expert_d_ff=128, moe_layer_interval=2)
    return ModelConfig(vocab_size=258, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256, max_seq_len=128,
                       moe=moe)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="moe-train", description=__doc__.splitlines()[0])
    parser.add_argument("--dense", action="store_true", help="use the dense twin of the default MoE model")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of the smoke run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    config = default_model_config(args.dense)
    run = RunShape(micro_batch_size=8, seq_len=64, precision="fp32", zero_stage=0, dp_size=1)
    print(format_ledger(config, run), end="\n\n")

    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, config.vocab_size, (run.micro_batch_size, run.seq_len + 1))
    inputs, labels = batch[:, :-1], batch[:, 1:]
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        output = model(inputs)
        lm_loss = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten())
        (lm_loss + output.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % 10 == 0 or step == args.steps:
            tokens_per_s = step * inputs.numel() / (time.perf_counter() - start)
            print(f"step {step:4d}  lm_loss {lm_loss.item():.4f}  aux_loss {output.aux_loss.item():.4f}  "
                  f"tokens/s {tokens_per_s:,.0f}")  # fmt: skip

    prompt = inputs[:1, :8]
    generated = model.generate(prompt, max_new_tokens=16, temperature=0)
    print(f"\ngreedy continuation of {prompt[0].tolist()}: {generated[0, 8:].tolist()}")


if __name__ == "__main__":
    main()
