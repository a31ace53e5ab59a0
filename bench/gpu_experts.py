"""The routed experts' grouped GEMM against the loop over experts, on one device: forward + backward of one MoE layer.

    speed-up = median time of experts_impl=loop / median time of experts_impl=grouped_mm

Both layers hold the same weights and route the same tokens (dropless); rounds alternate between them, so load from
elsewhere hits both alike, and the spread over rounds is printed beside the median. On CUDA in bf16 (torch's
grouped_mm kernel is for Hopper-class cards), synchronised around each round; `--tiny` is a seconds-long CPU run
of the same code (bench/gpu_check.sh --cpu-smoke).

    python bench/gpu_experts.py                # N 16384 tokens, D 2048, F 1024, 16 experts top-2 (gpu_mfu's layer)
    python bench/gpu_experts.py --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing it

from moe import MoEConfig, MoELayer


def time_layers(tokens: int, d_model: int, d_ff: int, experts: int, top_k: int, rounds: int, device, dtype) -> dict:
    layers = {}
    for impl in ("grouped_mm", "loop"):
        torch.manual_seed(0)  # the same weights for both
        config = MoEConfig(num_experts=experts, top_k=top_k, expert_d_ff=d_ff, capacity_factor=None, experts_impl=impl)
        layers[impl] = MoELayer(d_model, config, "swiglu").to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, d_model, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def run(layer) -> float:
        sync()
        start = time.perf_counter()
        inputs = x.detach().requires_grad_()
        layer(inputs).output.float().square().mean().backward()
        sync()
        return time.perf_counter() - start

    seconds = {impl: [] for impl in layers}
    for layer in layers.values():  # warm-up: kernels chosen, memory pools filled
        run(layer)
    for _ in range(rounds):
        for impl, layer in layers.items():
            seconds[impl].append(run(layer))
    medians = {impl: statistics.median(s) for impl, s in seconds.items()}
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"tokens": tokens, "d_model": d_model, "d_ff": d_ff, "experts": experts, "top_k": top_k},
        "median_s": medians,
        "range_s": {impl: [min(s), max(s)] for impl, s in seconds.items()},
        "speedup": medians["loop"] / medians["grouped_mm"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long CPU configuration (the smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per implementation (default 20; tiny 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (256, 64, 32, 4, 2) if args.tiny else (16384, 2048, 1024, 16, 2)
    rounds = args.rounds or (3 if args.tiny else 20)
    result = time_layers(*shape, rounds, device, dtype)
    grouped, loop = result["median_s"]["grouped_mm"], result["median_s"]["loop"]
    print(
        f"experts on {result['device']} ({result['dtype']}, N={shape[0]} D={shape[1]} F={shape[2]} E={shape[3]} "
        f"K={shape[4]}): grouped_mm {grouped * 1e3:.2f} ms, loop {loop * 1e3:.2f} ms (medians of {rounds}), "
        f"speed-up {result['speedup']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
