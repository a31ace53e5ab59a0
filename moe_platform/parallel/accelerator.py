"""Accelerate + DeepSpeed set-up generated from our config: one source of truth, no hand-kept JSON.

Facts this module encodes (measured on CPU with torch 2.13, deepspeed 0.19.8, accelerate 1.15):
  * `Accelerator(cpu=True, deepspeed_plugin=…)` silently ignores DeepSpeed, so DeepSpeed runs with cpu=False and
    an explicit gloo process group when there is no GPU; DeepSpeed's own accelerator then picks the CPU.
  * Plain DDP on CPU needs cpu=True, otherwise Accelerate leaves the processes unaware of each other
    (DistributedType.NO with two processes that each train alone).
  * torch's AdamW is the client optimizer: DeepSpeed's fused/CPU Adam ops JIT-compile for over a minute; so would
    its CPU backend's shared-memory all-reduce, which only inference uses (`no_shared_memory_inference_op`).
"""

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs

from moe_platform.config import TrainConfig

log = logging.getLogger(__name__)


def has_gpu() -> bool:
    return torch.cuda.is_available()


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def describe_lone_process_group() -> None:
    """DeepSpeed and FSDP2 need a process group even for one rank (one GPU with ZeRO-3 offload is a real use). A
    process that no launcher started (plain `moe-train distributed=zero3`) gets the environment of a one-rank group
    on 127.0.0.1, as torchrun --nproc_per_node=1 would give it; a launched process is left as its launcher set it."""
    if any(name in os.environ for name in LAUNCHER_VARIABLES):
        return
    port = free_port()
    one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    os.environ.update({**one_rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    log.info("no launcher: one rank runs as a process group on 127.0.0.1:%d", port)


def deepspeed_config(
    config: TrainConfig, grad_accum: int, world_size: int, load_universal: bool = False
) -> dict[str, Any]:
    """The DeepSpeed JSON, derived field by field from `config` (ZeRO stage, offload, precision, clipping,
    accumulation and batch sizes); `load_universal` when resuming ZeRO shards written by another world size."""
    dist = config.distributed
    zero: dict[str, Any] = {"stage": dist.zero_stage}
    if dist.zero_stage >= 1:
        # Overlapping communication needs CUDA streams; on CPU it only adds buffers.
        zero["overlap_comm"] = has_gpu()
    if dist.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": has_gpu()}
    if dist.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": has_gpu()}
    return {
        "train_batch_size": config.data.global_batch_size,
        "train_micro_batch_size_per_gpu": config.trainer.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": config.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": config.trainer.precision == "bf16"},
        "fp16": {"enabled": False},
        # The client optimizer is torch's AdamW; allow it under ZeRO offload too.
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"load_universal": load_universal},
        "steps_per_print": 10**9,  # our own logger reports; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }


def build_accelerator(
    config: TrainConfig, grad_accum: int, world_size: int, load_universal: bool = False
) -> Accelerator:
    """An Accelerator for `distributed.strategy`; on a machine without GPUs everything runs on CPU over gloo."""
    dist = config.distributed
    gpu = has_gpu()
    backend = dist.backend or ("nccl" if gpu else "gloo")
    sharded = dist.strategy in ("deepspeed", "fsdp")  # both need a process group, even of one rank
    if sharded:
        describe_lone_process_group()
    if dist.strategy == "deepspeed" and not gpu:
        no_shared_memory_inference_op()
    # A lone process has no group to set up; passing group kwargs then makes Accelerate look for one.
    grouped = world_size > 1 or sharded
    timeout = timedelta(seconds=dist.timeout_s)
    handlers = [InitProcessGroupKwargs(backend=backend, timeout=timeout)] if grouped else []
    if grouped and not torch.distributed.is_initialized():
        # Made here, and Accelerate and DeepSpeed take it as it is: InitProcessGroupKwargs.to_kwargs() drops a
        # timeout equal to its own default (600 s), and the group then got torch's 30 min under DDP on gloo, or
        # DEEPSPEED_TIMEOUT under DeepSpeed (measured; train/liveness.py relies on this timeout to name a hung rank).
        torch.distributed.init_process_group(backend, timeout=timeout)
        # new_group() does not inherit it either but takes torch's module default (30 min on gloo, 10 on NCCL), and
        # DeepSpeed's data-parallel groups and expert_parallel's are made so (measured: a ZeRO-2 rank waited on a
        # stopped peer far past distributed.timeout_s=10). Every later group gets the configured timeout too.
        c10d = torch.distributed.distributed_c10d
        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    # FSDP2 applies its own mixed-precision policy to the model it shards (parallel/fsdp.py), which Accelerate never
    # wraps; Accelerate's autocast would only apply to models it prepares.
    bf16 = config.trainer.precision == "bf16" and dist.strategy != "fsdp"
    mixed_precision = "bf16" if bf16 else "no"
    if dist.strategy == "deepspeed":
        plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(config, grad_accum, world_size, load_universal))
        accelerator = Accelerator(
            deepspeed_plugin=plugin,
            kwargs_handlers=handlers,
            gradient_accumulation_steps=grad_accum,
            mixed_precision=mixed_precision,
        )
    else:
        accelerator = Accelerator(
            cpu=not gpu,
            kwargs_handlers=handlers,
            gradient_accumulation_steps=grad_accum,
            mixed_precision=mixed_precision,
        )
    if accelerator.num_processes != world_size:
        raise RuntimeError(
            f"the launcher announced {world_size} processes but Accelerate sees {accelerator.num_processes}: "
            "launch with torchrun or accelerate launch --multi_gpu (accelerate launch --cpu starts a single process)"
        )
    if not gpu and accelerator.is_main_process:
        log.info("no GPU found: running on CPU with the %s backend (%s)", backend, accelerator.distributed_type)
    return accelerator


def no_shared_memory_inference_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles its shared-memory all-reduce (deepspeed_shm_comm) when its communication
    starts, ~45 s of C++ on a 2-core machine in every new environment (the build is keyed by the environment's
    include paths), for `inference_all_reduce` alone, which training never calls: marked incompatible, the backend
    falls back to torch.distributed for it and compiles nothing (deepspeed/comm/torch.py, `build_shm_op`)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def register_moe_leaf_modules(model: torch.nn.Module) -> None:
    """ZeRO-3 fetches parameters per module as hooks fire; ranks that route to different experts would fire
    different hooks and hang. Treating each MoE layer as one leaf gathers all its experts together."""
    from deepspeed.utils import set_z3_leaf_modules

    from moe import MoELayer

    if any(isinstance(m, MoELayer) for m in model.modules()):
        set_z3_leaf_modules(model, [MoELayer])


def unwrapped_module(model: torch.nn.Module, accelerator: Accelerator, deepspeed: bool) -> torch.nn.Module:
    """The model inside its data-parallel wrapper, as `accelerator.unwrap_model` finds it. That imports DeepSpeed
    wherever it is installed, to recognise its engine: ~0.6-1 s of every DDP, FSDP and single-process start on 2 cores
    for a class only a DeepSpeed run can hold. Elsewhere the wrapper is DDP's (or none: FSDP2 shards in place), under
    a torch.compile wrapper if the whole model was compiled (`trainer.compile` compiles blocks, which stay inside)."""
    if deepspeed:
        return accelerator.unwrap_model(model)
    compiled = model if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else None
    inner = compiled._orig_mod if compiled is not None else model
    while isinstance(inner, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        inner = inner.module
    if compiled is None:
        return inner
    compiled._orig_mod = inner  # as Accelerate keeps torch.compile's wrapper around the unwrapped module
    return compiled
