"""DeepSpeed's side of expert parallelism (ZeRO-1/2): its expert groups, the flags that tell the engine which
parameters are experts, and the optimizer groups it wants them in.

DeepSpeed reduces a parameter flagged `allreduce=False` over the expert-data-parallel group named by its
`group_name`, with the same 1/W scale as the rest (so no correction is needed: see expert_parallel.py), shards its
optimizer state over that group, and adds every block once into the clipping norm: but only when the engine finds a
`deepspeed.moe.layer.MoE` module in the model. A parameter-free marker of that class says so; our layer does the
computing. (Measured on deepspeed 0.19.8, ZeRO-1/2, fp32 and bf16: the same steps as one process.) Checkpoints of
such a run: checkpoint/universal.py.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from moe import MoELayer
from moe.expert_parallel import ExpertParallel, expert_parameters
from moe_platform.parallel.groups import ExpertParallelGroups


def group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"  # the name deepspeed.utils.groups gives the groups of this EP size


def build_groups(ep_size: int) -> ExpertParallelGroups:
    """Collective: DeepSpeed's expert groups for `ep_size`, the same blocks as `groups.build_expert_groups`."""
    from deepspeed.utils import groups

    groups._create_expert_and_data_parallel(ep_size)  # contiguous EP groups, strided EDP groups, as ours
    name = group_name(ep_size)
    world_size = dist.get_world_size()
    return ExpertParallelGroups(
        expert_parallel=ExpertParallel(
            size=ep_size, rank=groups._get_expert_parallel_rank(name), group=groups._get_expert_parallel_group(name)
        ),
        data_group=groups._get_expert_data_parallel_group(name),
        data_size=world_size // ep_size,
        world_size=world_size,
    )


def mark_experts(model: nn.Module, ep_size: int) -> None:
    """Flag the expert weights for the engine and give the model the marker it looks for (module docstring)."""
    from deepspeed.moe.layer import MoE

    class DeepSpeedMoEMarker(MoE):
        """Tells the engine the model has expert-parallel parameters; it has none itself and never runs."""

        def __init__(self, num_experts: int) -> None:
            nn.Module.__init__(self)  # not MoE.__init__: that would build DeepSpeed's own gate and experts
            self.num_experts, self.ep_size = num_experts, ep_size
            self.expert_group_name = group_name(ep_size)
            self.num_local_experts = 0  # no per-expert checkpoint files: the ZeRO shards hold the experts

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups exist already (build_groups)

        def forward(self, *args, **kwargs):
            raise RuntimeError("the DeepSpeed MoE marker holds no layer")

    for _, parameter in expert_parameters(model):
        parameter.allreduce = False
        parameter.group_name = group_name(ep_size)
    num_experts = next(m.config.num_experts for m in model.modules() if isinstance(m, MoELayer))
    model.deepspeed_moe_marker = DeepSpeedMoEMarker(num_experts)


def optimizer_param_groups(param_groups: list[dict]) -> list[dict]:
    """The expert parameters in optimizer groups of their own (named after their EDP group), as DeepSpeed wants."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(param_groups)
