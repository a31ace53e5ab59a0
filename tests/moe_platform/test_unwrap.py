"""`unwrapped_module` finds the module Accelerate's `unwrap_model` finds, for every wrapper a run without DeepSpeed
can hold (none, DDP, FSDP2's in-place shards, torch.compile outside or inside), without importing DeepSpeed."""

import torch
import torch.distributed as dist
from accelerate.utils import extract_model_from_parallel
from torch import nn
from torch.distributed.fsdp import fully_shard

from moe_platform.parallel.accelerator import unwrapped_module


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))


def with_compiled_block() -> nn.Module:
    inner = model()
    inner[0] = torch.compile(inner[0])  # as trainer.compile compiles each block: the wrapper stays inside
    return inner


def test_every_wrapper_of_a_run_without_deepspeed_unwraps_as_accelerate_unwraps_it() -> None:
    # A one-rank gloo group in this process (an in-memory store): DDP and FSDP2 need one, and it is gone after.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = lambda m: nn.parallel.DistributedDataParallel(m)  # noqa: E731
        cases = {
            "plain": model,
            "ddp": lambda: ddp(model()),
            "fsdp2": lambda: fully_shard(model()),
            "ddp, blocks compiled": lambda: ddp(with_compiled_block()),
            "compiled ddp": lambda: torch.compile(ddp(model())),
        }
        for name, build in cases.items():
            ours, theirs = build(), build()
            found, expected = unwrapped_module(ours, None, deepspeed=False), extract_model_from_parallel(theirs)
            assert type(found) is type(expected), name
            inner = getattr(found, "_orig_mod", found)
            assert not isinstance(inner, nn.parallel.DistributedDataParallel), name
            assert type(inner) is type(getattr(expected, "_orig_mod", expected)), name
            assert [p.shape for p in found.parameters()] == [p.shape for p in expected.parameters()], name
            if not isinstance(ours, torch._dynamo.eval_frame.OptimizedModule):
                # the very module inside the wrapper (DDP's .module, or the model itself)
                assert found is getattr(ours, "module", ours), name
    finally:
        dist.destroy_process_group()
