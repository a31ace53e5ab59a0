"""Under FSDP the model is built on the meta device, sharded, and each rank's shards filled by replaying the plain
build's draws (moe_platform/train/materialize.py): the shards hold exactly the plain build's values, for every model
preset's tiny shape, with and without experts split, and the tied head is the embedding."""

import pytest
import torch

from moe_platform.launch.compose import train_config
from moe_platform.testing import run_distributed

pytestmark = pytest.mark.slow
WORLD = 4
CASES = {
    "moe_tiny": ["model=moe_tiny"],
    "moe_tiny, EP=2": ["model=moe_tiny", "distributed.expert_parallel_size=2"],
    # MLA, shared experts, a dense first layer, the aux-free bias buffers:
    "deepseek_v3_like_tiny, EP=4": ["model=deepseek_v3_like_tiny", "distributed.expert_parallel_size=4"],
    "dense_tiny, tied, learned positions": [
        "model=dense_tiny",
        "model.tie_embeddings=true",
        "model.pos_encoding=learned",
    ],
}


def compare_every_case_on_this_rank(rank: int, world_size: int) -> dict[str, list[str]]:
    """Per case, the names of the tensors whose shard on this rank differs from the plain build's shard."""
    from torch.distributed.tensor import DTensor

    from moe import Transformer
    from moe_platform.parallel import fsdp
    from moe_platform.train.materialize import build_meta, materialize
    from moe_platform.train.model_build import _local_experts
    from moe_platform.train.seeding import seed_initial_weights

    differing = {}
    for case, overrides in CASES.items():
        config = train_config(["distributed=fsdp", *overrides])
        ep = config.distributed.expert_parallel_size
        policy = fsdp.ShardingPolicy(reshard_after_forward=True, bf16=False, cpu_offload=False)
        seed_initial_weights(config.trainer.seed)
        plain = Transformer(config.model)
        fsdp.shard_model(plain, fsdp.build_meshes("cpu", 1, ep), policy)
        meta = build_meta(config)
        fsdp.shard_model(meta, fsdp.build_meshes("cpu", 1, ep), policy)
        seed_initial_weights(config.trainer.seed)
        materialize(meta, config, torch.device("cpu"), _local_experts(config, rank))

        def local(t):
            return (t.to_local() if isinstance(t, DTensor) else t).detach()

        expected = {**dict(plain.named_parameters()), **dict(plain.named_buffers())}
        built = {**dict(meta.named_parameters()), **dict(meta.named_buffers())}
        assert expected.keys() == built.keys(), case
        differing[case] = [n for n in expected if not torch.equal(local(expected[n]), local(built[n]))]
        if config.model.tie_embeddings:
            assert meta.lm_head.weight is meta.embed.weight, case
    return differing


def test_sharded_build_holds_the_plain_builds_weights_bit_for_bit() -> None:
    for differing in run_distributed(compare_every_case_on_this_rank, WORLD, timeout=300):
        assert differing == {case: [] for case in CASES}
