"""The model, built so that under ZeRO-3 no rank ever holds all of its weights, with the weights a plain build gives.

Every strategy but ZeRO-3 builds `Transformer(config.model)` whole on every rank, as it always did. ZeRO-3 builds it
inside DeepSpeed's partitioned construction, `deepspeed.zero.Init`: each module's parameters are split among the
ranks as soon as that module's `__init__` returns, so a rank holds one module's full weights at a time plus its
1/world share of the rest. The weights are unchanged, bit for bit:
  * a leaf module (Linear, Embedding, the experts, the router) draws its weights in its own `__init__`, before the
    split; the inits a parent runs afterwards (Transformer.reset_parameters, the shared experts') go through
    `Module.apply`, which zero.Init turns into gather → init on every rank → keep rank 0's → split again. The draws
    come from the same generator in the same order as in a plain build;
  * tensors are created in fp32 whatever the precision (zero.Init would otherwise create them in bf16 and draw in
    bf16, which gives other numbers); under bf16 each rank then rounds its shard, as the engine rounds a model built
    outside zero.Init. The optimizer's fp32 master copies are made from the rounded weights in both cases.
Accelerate's `zero3_init_context_manager` is not the tool here: it only tells transformers' `from_pretrained` to use
zero.Init; a model of our own has to be built inside zero.Init itself.

With `init.from_path` the source's weights are copied in after the build; a Hugging Face source is read then, tensor
by tensor, and under expert parallelism each rank reads only the expert rows of its own block (interop/init_from.py).
"""

from collections.abc import Callable

import torch
from accelerate import Accelerator

from moe import Transformer
from moe.expert_parallel import ExpertParallel
from moe_platform.config import TrainConfig
from moe_platform.interop.init_from import initial_state_dict, load_initial_weights
from moe_platform.parallel.accelerator import register_moe_leaf_modules
from moe_platform.train.materialize import build_meta, materialize
from moe_platform.train.seeding import seed_initial_weights, seed_noise_streams


def builds_partitioned(config: TrainConfig) -> bool:
    """ZeRO-3 (DeepSpeed stage 3) shards the parameters themselves, so it builds them sharded too."""
    return config.distributed.strategy == "deepspeed" and config.distributed.zero_stage == 3


def build_model(
    config: TrainConfig, accelerator: Accelerator, shard: Callable[[Transformer], None] | None = None
) -> Transformer:
    """The seeded model for `accelerator.prepare`: the same initial weights on every rank (and under every
    strategy), then this rank's own noise stream. Under ZeRO-3 the parameters come back already partitioned
    (`p.ds_tensor` holds this rank's shard) and each MoE layer is one ZeRO-3 leaf. Under FSDP or PP `shard` (the
    strategy's sharding or the stage split, collective) is applied to the structure on the meta device, and each
    rank's shards are then filled with the plain build's values (train/materialize.py). With `init.from_path` the
    weights are then replaced by the source's (or its upcycled ones), whole but for the expert rows of other EP
    ranks, which a Hugging Face source does not read, before expert parallelism slices them."""
    initial_state = initial_state_dict(config)  # first: a bad source fails before any collective
    if shard is not None:
        model = build_meta(config)
        shard(model)
        seed_initial_weights(config.trainer.seed)  # where a plain build starts drawing
        local = _local_experts(config, accelerator.process_index)
        # With CPU offload FSDP2 keeps the shards in host memory and moves each unit to the GPU when it is gathered.
        device = torch.device("cpu") if config.distributed.fsdp.cpu_offload else accelerator.device
        filler = materialize(model, config, device, local)
        if initial_state is not None:
            whole = build_meta(config)  # the unsplit structure the source must match (a pipeline stage holds part)
            load_initial_weights(
                model, initial_state, partitioned=False, local_experts=local, fill=filler.fill, whole_model=whole
            )
    elif builds_partitioned(config):
        seed_initial_weights(config.trainer.seed)
        model = _build_partitioned(config, accelerator, initial_state)
        register_moe_leaf_modules(model)
    else:
        seed_initial_weights(config.trainer.seed)
        model = Transformer(config.model)
        if initial_state is not None:
            local = _local_experts(config, accelerator.process_index)
            load_initial_weights(model, initial_state, partitioned=False, local_experts=local)
    seed_noise_streams(config.trainer.seed, accelerator.process_index)
    model.set_activation_checkpointing(config.trainer.activation_checkpointing)
    if config.trainer.compile:
        # Block by block, not the whole model: the MoE layers' split sizes are host integers (one graph break per
        # layer), and blocks of one shape share their compiled code.
        for block in model.blocks:
            block.compile()
    return model


def _local_experts(config: TrainConfig, rank: int) -> range | None:
    """The global expert ids `expert_parallel.attach` will keep on this rank (its groups put rank r at block
    r mod EP, parallel/groups.py), or None without expert parallelism."""
    ep = config.distributed.expert_parallel_size
    if ep == 1 or config.model.moe is None:
        return None
    return ExpertParallel(size=ep, rank=rank % ep).local_experts(config.model.moe.num_experts)


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    """A parameter's shape as a whole. Built partitioned, `p` itself is an empty placeholder (`p.ndim == 1`) until
    ZeRO-3 gathers it, so code that looks at shapes before training (weight-decay groups) must ask here."""
    return getattr(p, "ds_shape", p.shape)


def _build_partitioned(
    config: TrainConfig, accelerator: Accelerator, initial_state: dict[str, torch.Tensor] | None
) -> Transformer:
    import deepspeed

    # The DeepSpeed config Accelerate will hand to the engine (partition group, offload device, ...).
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    # DeepSpeed picks an explicit dtype as `dtype or fp16 if fp16_supported() else bf16 ...` (sic): fp32 comes back
    # as bf16 on a device without fp16 (a CPU without AVX512-FP16, e.g. an AMD EPYC). With no dtype it reads the
    # config instead, so a copy with bf16 and fp16 off builds in fp32; bf16 runs round the shards below.
    fp32_config = {**ds_config, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    with deepspeed.zero.Init(config_dict_or_path=fp32_config):
        model = Transformer(config.model)
    # a silent change of the draws must not pass, whatever DeepSpeed does next
    built = {p.ds_tensor.dtype for p in model.parameters()}
    if built != {torch.float32}:
        raise RuntimeError(f"deepspeed.zero.Init built the parameters in {built}, not fp32 as asked")
    if initial_state is not None:  # in fp32, before the shards are rounded, as a plain build loads then rounds
        load_initial_weights(model, initial_state, partitioned=True)
    if config.trainer.precision == "bf16":
        _round_shards(model, torch.bfloat16)
    return model


def _round_shards(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """What the engine does to a model built outside zero.Init (`p.data = p.data.to(dtype)`), done to each rank's
    shard: the same elementwise rounding, so the shards gather to exactly the rounded plain weights. The engine does
    not cast a zero.Init model: it takes the partitions to be in the training dtype already."""
    for p in model.parameters():
        shard = p.ds_tensor.data.to(dtype)
        p.ds_tensor.data = shard.pin_memory() if p.ds_tensor.is_pinned() else shard  # offload keeps pinned memory
        p.data = torch.empty(0, dtype=dtype, device=p.device)  # the placeholder's dtype is what a gather allocates
