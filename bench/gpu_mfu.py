"""MFU of a ~1B-parameter MoE on one GPU, and of the dense model with as many active parameters.

    tokens/s          = timed steps · B · S / wall time (after warm-up steps, CUDA synchronised)
    model FLOP/s      = the ledger's training matmul FLOPs per token (3 × forward, attention over the full S×S
                        grid as the ledger counts it) · tokens/s
    MFU               = model FLOP/s / the card's dense bf16 datasheet peak (moe_platform/monitor/throughput.py's table)
    peak memory       = torch.cuda.max_memory_allocated over one steady step (CPU: the allocator's records),
                        beside the ledger's training state + activations of one micro-batch

The loop is plain PyTorch on the model library, because that is what MFU measures: bf16 weights and activations,
fp32 master weights and AdamW state (fused on CUDA), as DeepSpeed's bf16 engine keeps them, so the ledger's bf16
row (2 + 2 + 12 B per parameter) is the state it holds (plus the masters' fp32 gradients, 4 B per parameter, during
the optimizer step only: the step peaks earlier, as backward starts, unless activations are small). Data are random
tokens (nothing to download).
Imports only torch, `moe` and two torch-only modules of `moe_platform`, so it runs on a bare GPU image.

    python bench/gpu_mfu.py                 # the 1.1B MoE (D 2048, 16 layers, 16 experts top-2) and its dense twin
    python bench/gpu_mfu.py --tiny          # a seconds-long CPU run of the same code (tests/bench/test_gpu_mfu.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing it

from moe import ModelConfig, MoEConfig, RunShape, Transformer, count_parameters, matmul_flops_per_token
from moe_platform.monitor.peak_memory import measure_peak, predict_peak, storage_bytes, training_tensors
from moe_platform.monitor.throughput import device_peak_flops


def moe_1b(tiny: bool) -> ModelConfig:
    """1.10B total, 0.40B active: D 2048, 16 layers, GQA 16/4, 16 SwiGLU experts of width 512, top-2, dropless."""
    if tiny:
        return ModelConfig(
            vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
            moe=MoEConfig(num_experts=4, top_k=2, expert_d_ff=32, capacity_factor=None),
        )  # fmt: skip
    return ModelConfig(
        vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=4, d_ff=1024, max_seq_len=2048,
        moe=MoEConfig(num_experts=16, top_k=2, expert_d_ff=512, capacity_factor=None),
    )  # fmt: skip


def dense_twin(config: ModelConfig) -> ModelConfig:
    """The same model with one dense FFN per layer as wide as the K active experts: equal active parameters up to
    the router's E·D per layer."""
    moe = config.moe
    d_ff = moe.top_k * moe.expert_d_ff + moe.num_shared_experts * moe.expert_d_ff
    return ModelConfig(**{**vars(config), "moe": None, "d_ff": d_ff})


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Result:
    name: str
    total_params: int
    active_params: int
    tokens_per_s: float
    model_tflops: float
    mfu: float | None
    peak_gib: float
    predicted_gib: float
    final_loss: float


class MasterWeightsAdamW:
    """AdamW on fp32 copies of bf16 parameters: the update is computed in fp32 and rounded into the bf16 weights."""

    def __init__(self, model: torch.nn.Module, lr: float, fused: bool) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.1, fused=fused)

    def step(self) -> None:
        for p, master in zip(self.params, self.master, strict=True):
            master.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def train(name: str, config: ModelConfig, args: argparse.Namespace, device: torch.device) -> Result:
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    model = Transformer(config).to(device=device, dtype=dtype)
    model.train()
    fused = device.type == "cuda"
    if dtype == torch.float32:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused)
    else:
        optimizer = MasterWeightsAdamW(model, lr=3e-4, fused=fused)
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch AdamW holding the state
    step_fn = torch.compile(model) if args.compile else model
    generator = torch.Generator(device="cpu").manual_seed(1)
    # Random tokens: the loss stays near ln V, which is all a throughput bench needs.
    batches = [
        torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator).to(device)
        for _ in range(4)
    ]

    def step(i: int) -> torch.Tensor:
        tokens_BT1 = batches[i % len(batches)]
        output = step_fn(tokens_BT1[:, :-1])
        loss = F.cross_entropy(output.logits.float().flatten(0, 1), tokens_BT1[:, 1:].flatten())
        (loss + output.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    step(0)  # optimizer state exists from here on: the next step is a steady one
    # On CPU count what the step starts from directly: a test process holds other tensors besides this run's.
    held = [*training_tensors(model, inner), *getattr(optimizer, "master", [])]
    with measure_peak(device, storage_bytes(held)) as peak:
        step(1)
    for i in range(2, args.warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    sync()
    elapsed = time.perf_counter() - start

    tokens_per_s = args.steps * args.micro_batch * args.seq_len / elapsed
    model_flops = matmul_flops_per_token(config, args.seq_len).training * tokens_per_s
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak_flops, _ = device_peak_flops(args.peak_tflops, args.dtype, gpu)
    predicted = predict_peak(
        config, RunShape(micro_batch_size=args.micro_batch, seq_len=args.seq_len, precision=args.dtype)
    )
    params = count_parameters(config)
    return Result(
        name=name,
        total_params=params.total,
        active_params=params.active,
        tokens_per_s=tokens_per_s,
        model_tflops=model_flops / 1e12,
        mfu=model_flops / peak_flops if peak_flops else None,
        peak_gib=peak.peak_bytes / 2**30,
        predicted_gib=predicted.total / 2**30,
        final_loss=float(loss),
    )


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long configuration (CPU test)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30; 2 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 2 with --tiny)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 8; 2 tiny)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; 32 tiny)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default="bf16", help="fp32 for the CPU test: bf16 grouped_mm is slow on CPU"
    )
    parser.add_argument("--only", choices=("moe", "dense"), default=None, help="run one of the two models")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, if unknown")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    defaults = (2, 2, 2, 32) if args.tiny else (30, 5, 8, 2048)
    for key, value in zip(("steps", "warmup", "micro_batch", "seq_len"), defaults, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.warmup = max(args.warmup, 2)  # the first two steps build the optimizer state and measure memory

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no datasheet peak: no MFU)"
    moe_config = moe_1b(args.tiny)
    runs = [("moe", moe_config), ("dense", dense_twin(moe_config))]
    print(
        f"{where}, torch {torch.__version__}, {args.dtype}, B={args.micro_batch} S={args.seq_len}, "
        f"{args.steps} timed steps after {args.warmup}, compile={args.compile}",
        flush=True,
    )
    results = []
    for name, config in runs:
        if args.only in (None, name):
            results.append(train(name, config, args, device))
            gc.collect()  # the model and optimizer of this run are gone before the next one measures its peak
            if device.type == "cuda":
                torch.cuda.empty_cache()

    header = (
        f"{'model':<6} {'total':>9} {'active':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'peak GiB':>9} {'ledger GiB':>10} {'peak/ledger':>11} {'loss':>6}"
    )
    print(header)
    for r in results:
        mfu = f"{100 * r.mfu:5.1f}%" if r.mfu is not None else "   n/a"
        print(
            f"{r.name:<6} {r.total_params / 1e6:8.1f}M {r.active_params / 1e6:8.1f}M {r.tokens_per_s:10.0f} "
            f"{r.model_tflops:8.2f} {mfu:>6} {r.peak_gib:9.3f} {r.predicted_gib:10.3f} "
            f"{r.peak_gib / r.predicted_gib:11.2f} {r.final_loss:6.3f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([vars(r) for r in results], indent=2))
    return results


if __name__ == "__main__":
    main()
