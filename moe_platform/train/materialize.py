"""Under FSDP, the model is built without any rank ever holding all of it, and with the weights a plain build gives.

`Transformer(config.model)` on the meta device gives the structure for free; the strategy then shards it (expert
blocks, `fully_shard`), `to_empty` allocates this rank's shards, and `materialize` fills each shard with exactly
the values of the plain build, bit for bit. A plain build draws from the one seeded generator in two phases:
  A. the constructor: each child of the Transformer in registration order (the order `__init__` creates them); a
     block draws its own weights (attention projections, router, experts, shared experts), and a torch module
     (Embedding, Linear, norms) draws what its `reset_parameters` draws;
  B. `Transformer.reset_parameters`: `Module.apply(_init_module)`, children before parents, re-draws every matrix.
`materialize` replays both phases in that order on real tensors, one block (phase A) or one leaf module (phase B)
at a time, and keeps only this rank's shard of each value. Phase A keeps everything its pieces hold (the experts'
and routers' final values, the buffers); phase B overwrites what `_init_module` sets, found by running it on a
NaN-filled copy, so the rule which modules it re-draws is read from the model, not repeated here. A parameter two
modules share (tied embeddings) keeps the first value phase B gives it: the plain build ties after
`reset_parameters`, so the head's own draw is drawn and dropped. Host memory: one block's weights at a time (the
largest unit), not the model; every rank draws every number (time, not memory), also those of the pieces another
pipeline stage holds, which it drops. `tests/moe_platform/
test_materialize.py` checks the equality for every model preset's tiny shape.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from moe import Transformer
from moe.expert_parallel import is_expert_parameter
from moe.model import Block, MTPModule
from moe_platform.checkpoint.sharded import copy_into_shard
from moe_platform.config import TrainConfig
from moe_platform.monitor.peak_memory import meta_transformer


def build_meta(config: TrainConfig) -> Transformer:
    """The model's structure on the meta device: no memory, and no draw from any generator."""
    return meta_transformer(config.model)


class ShardFiller:
    """Copies whole tensors, by name, into this rank's shard of a sharded (and expert-split) model."""

    def __init__(self, model: Transformer, local_experts: range | None) -> None:
        # Every name a tensor goes by: a tied weight is the head's and the embedding's.
        self.tensors: dict[str, torch.Tensor] = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers()),
        }
        self.local_experts = local_experts
        self.num_experts = model.config.moe.num_experts if model.config.moe is not None else 0
        # A pipeline stage's model lacks other stages' pieces (parallel/pipeline.py): their values are dropped.
        self.partial = (
            model.embed is None or model.lm_head is None or any(not isinstance(block, Block) for block in model.blocks)
        )

    def holds(self, name: str) -> bool:
        return name in self.tensors

    def fill(self, name: str, whole: torch.Tensor) -> None:
        """`whole` as the plain model holds it; an expert tensor also as this rank's rows only (a lazy read)."""
        if self.partial and name not in self.tensors:
            return
        target = self.tensors[name]
        if self.local_experts is not None and is_expert_parameter(name) and whole.shape[0] == self.num_experts:
            whole = whole[self.local_experts.start : self.local_experts.stop]
        copy_into_shard(target, whole)


@torch.no_grad()
def materialize(
    model: Transformer, config: TrainConfig, device: torch.device, local_experts: range | None
) -> ShardFiller:
    """Allocate `model`'s shards on `device` and fill them with the plain build's weights (module docstring); call
    with the generator where a plain build would start (after `seed_initial_weights`). Returns the filler, for
    `init.from_path`'s weights to follow."""
    model.to_empty(device=device)
    filler = ShardFiller(model, local_experts)
    twin = build_meta(config)  # unsharded structure: the pieces each phase rebuilds
    for name, child in twin.named_children():  # phase A
        if name == "blocks":
            for i in range(len(child)):
                _keep(filler, f"blocks.{i}", Block(config.model, i))
        elif name == "mtp":  # each module draws as its constructor does, like a block
            for k in range(1, len(child) + 1):
                _keep(filler, f"mtp.{k - 1}", MTPModule(config.model, k))
        elif any(True for _ in child.parameters()):
            piece = copy.deepcopy(child).to_empty(device="cpu")
            piece.reset_parameters()
            _keep(filler, name, piece)
    filled: set[int] = set()
    for name, module in _post_order(twin):  # phase B: Module.apply's order
        if next(module.children(), None) is not None or not any(True for _ in module.parameters(recurse=False)):
            continue
        leaf = copy.deepcopy(module).to_empty(device="cpu")
        for p in leaf.parameters():
            p.fill_(float("nan"))
        twin._init_module(leaf)
        for short, p in leaf.named_parameters():
            full = f"{name}.{short}"
            if not filler.holds(full):  # another pipeline stage's
                continue
            target = filler.tensors[full]
            if torch.isnan(p).any() or id(target) in filled:
                continue  # not re-drawn by _init_module, or a tied weight given its value already
            filler.fill(full, p)
            filled.add(id(target))
    return filler


def _keep(filler: ShardFiller, prefix: str, piece: nn.Module) -> None:
    for short, tensor in [*piece.named_parameters(), *piece.named_buffers()]:
        filler.fill(f"{prefix}.{short}", tensor.detach())


def _post_order(module: nn.Module, prefix: str = ""):
    """(name, module) children first, as `Module.apply` visits them."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module
