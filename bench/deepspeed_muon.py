"""Why `optim=muon` is refused under DeepSpeed: its own ZeRO Muon (0.19, `"optimizer": {"type": "Muon"}`) is another
optimizer than torch.optim.Muon, which ours equals step for step (tests/moe_platform/test_muon.py).

    .venv/bin/python bench/deepspeed_muon.py            # one process, ZeRO-1 and ZeRO-2, ~20 s on 2 cores

ZeRO-1/2 write Newton–Schulz's output O into the gradient partitions and then run the engine's usual norm and clip
over them, so `gradient_clipping` clips the orthogonalised updates, not the gradients: the norm the engine reports
(and clips by) is ‖[O of every matrix, the other gradients]‖, about √min(A, B) per matrix however small the
gradient, where torch (and moe-train under one process, DDP, FSDP) clips the gradients before Muon sees them. At
clip 1.0 every Muon step is then scaled by 1/‖·‖ (and the AdamW half's gradients with it). Besides: nesterov and
the 5 Newton–Schulz steps are fixed there (optim.muon.nesterov and ns_steps could not reach it), the update is
scaled by √max(1, rows/cols) of the tensor as stored (for our [E, in, out] experts that is in/out, the transpose
of torch's fan_out/fan_in), and its kernels are torch.compile'd on the first step (seconds per shape on a CPU).

Printed per ZeRO stage, same model, batch and seed: the gradients' norm (plain torch), the norm the engine reports,
their ratio, and the first step's seconds. The model is a 3-layer MLP (32 → 64 → 32), Muon on its two matrices.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # before bench/, whose data_pipeline.py would shadow it
from moe_platform.parallel.accelerator import free_port, no_shared_memory_inference_op


def model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    return model, torch.randn(4, 32)


def gradient_norm() -> float:
    """‖∇L‖ over every parameter, as torch's clip_grad_norm_ (and so moe-train under DDP or FSDP) computes it."""
    model, x = model_and_batch()
    model(x).pow(2).mean().backward()
    return float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())


def deepspeed_norm(stage: int) -> tuple[float, float]:
    """(the global grad norm DeepSpeed's engine reports after its first Muon step, that step's seconds)."""
    import deepspeed

    model, x = model_and_batch()
    for p in model.parameters():
        p.use_muon = p.ndim == 2
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "ns_method": "standard"}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    start = time.perf_counter()
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return float(engine.get_global_grad_norm()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="1,2", help="ZeRO stages with Muon in DeepSpeed's ZeRO optimizer")
    args = parser.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo")
    no_shared_memory_inference_op()
    raw = gradient_norm()
    print(f"{'':8} {'‖grad‖ (torch)':>15} {'engine norm':>12} {'ratio':>7} {'1st step s':>11}")
    for stage in (int(s) for s in args.stages.split(",")):
        reported, seconds = deepspeed_norm(stage)
        print(f"ZeRO-{stage:<3} {raw:15.4f} {reported:12.4f} {reported / raw:7.1f} {seconds:11.2f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
