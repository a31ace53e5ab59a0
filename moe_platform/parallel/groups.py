"""Process groups of the runtime's parallelisms, built collectively and kept as typed objects.

Expert parallelism with W ranks and EP = `distributed.expert_parallel_size`:
  * EP groups are blocks of consecutive ranks {g·EP, …, g·EP + EP-1}: rank r holds expert block r mod EP, and
    the all-to-all runs inside its EP group (consecutive ranks share a node when EP ≤ GPUs per node);
  * expert-data-parallel (EDP) groups are the W/EP ranks holding the same block: {j, j+EP, j+2·EP, …}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moe.expert_parallel import ExpertParallel


@dataclass(frozen=True)
class ExpertParallelGroups:
    """This rank's EP group (where tokens travel) and EDP group (where its expert block's gradients are reduced)."""

    expert_parallel: ExpertParallel
    data_group: dist.ProcessGroup | None
    data_size: int
    world_size: int


def build_expert_groups(ep_size: int) -> ExpertParallelGroups:
    """Collective: every rank creates every group, in the same order (torch requires it), and keeps its own."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % ep_size != 0:
        raise ValueError(f"expert_parallel_size={ep_size} does not divide the {world_size} ranks")
    ep_group = data_group = None
    for first in range(0, world_size, ep_size):
        group = dist.new_group(list(range(first, first + ep_size)))
        if first <= rank < first + ep_size:
            ep_group = group
    for block in range(ep_size):
        group = dist.new_group(list(range(block, world_size, ep_size)))
        if rank % ep_size == block:
            data_group = group
    return ExpertParallelGroups(
        expert_parallel=ExpertParallel(size=ep_size, rank=rank % ep_size, group=ep_group),
        data_group=data_group,
        data_size=world_size // ep_size,
        world_size=world_size,
    )
