"""Expert parallelism of one MoE layer, in real gloo processes: the same outputs and gradients as one process that
holds every expert and sees every rank's tokens."""

import pytest
import torch

from moe.expert_parallel import ExpertParallel, _source_to_expert_order, is_expert_parameter
from moe.moe_config import MoEConfig, RouterConfig
from moe.moe_layer import MoELayer
from moe_platform.testing import run_distributed

D, E, K, T = 16, 8, 2, 12


# DeepSeek-V3's routing: sigmoid scores plus the balancing bias choose top-2 inside the best 2 of 4 expert groups,
# gates scaled by 2.5. The router runs on the token's own rank, before dispatch, so EP must not change it.
V3_ROUTER = RouterConfig(score_fn="sigmoid", bias_update_rate=1e-3, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def layer_config(capacity_factor: float | None, routing: str = "softmax") -> MoEConfig:
    router = V3_ROUTER if routing == "v3" else RouterConfig()
    return MoEConfig(
        num_experts=E, top_k=K, expert_d_ff=24, capacity_factor=capacity_factor, min_capacity=1, num_shared_experts=1,
        router=router,
    )  # fmt: skip


def build_layer(capacity_factor: float | None, skew: str, routing: str = "softmax") -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(D, layer_config(capacity_factor, routing), "swiglu").double()
    with torch.no_grad():
        if routing == "v3":  # a bias large enough to change choices, as after some balancing
            layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E, dtype=layer.router.expert_bias.dtype))
        if skew == "one_rank":  # positive inputs pick experts 0 and 1: all work lands on the rank holding block 0
            layer.router.weight.fill_(-1.0)
            layer.router.weight[:2].fill_(1.0)
        elif skew == "idle_expert":  # expert E-1 never chosen: some rank receives zero rows for it
            layer.router.weight[E - 1].fill_(-100.0)
    return layer


def rank_input(rank: int, skew: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank its own tokens (an uneven number of them) and its own upstream gradient."""
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, T + 3 * rank, D, generator=generator, dtype=torch.float64)
    if rank == 1 or skew != "none":
        x = x.abs() + 1.0  # skews routing differently on one rank (on every rank for the skewed cases)
    return x, torch.randn(x.shape, generator=generator, dtype=torch.float64)


def ep_forward_backward_cases(rank: int, world_size: int, cases: list[tuple]) -> dict[tuple, tuple]:
    """Every case of one world size in one set of processes (spawning is what costs time here)."""
    return {case: ep_forward_backward(rank, world_size, *case[1:]) for case in cases}


def ep_forward_backward(rank: int, world_size: int, ep_size: int, capacity_factor, skew: str, routing="softmax"):
    import torch.distributed as dist

    from moe_platform.parallel.expert_parallel import reduce_expert_gradients, shard_model
    from moe_platform.parallel.groups import build_expert_groups

    layer = build_layer(capacity_factor, skew, routing)
    groups = build_expert_groups(ep_size)
    shard_model(layer, groups)
    x, grad_out = rank_input(rank, skew)
    x.requires_grad_(True)
    out = layer(x)
    (out.output * grad_out).sum().backward()
    for name, p in layer.named_parameters():  # what DDP would do for the replicated ones: mean over ranks
        if not is_expert_parameter(name):
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
    reduce_expert_gradients(layer, groups)
    grads = {name: p.grad for name, p in layer.named_parameters()}
    block = groups.expert_parallel.local_experts(E)
    return out.output.detach(), x.grad, grads, (block.start, block.stop), out.stats


def reference(world_size: int, capacity_factor, skew: str, routing: str = "softmax"):
    """One process, every expert: rank r's output and input gradient, and the parameter gradient of
    (1/W) Σ_r <out_r, grad_out_r> (what data parallelism averages)."""
    layer = build_layer(capacity_factor, skew, routing)
    outputs, input_grads = [], []
    for rank in range(world_size):
        x, grad_out = rank_input(rank, skew)
        x.requires_grad_(True)
        out = layer(x)
        ((out.output * grad_out).sum() / world_size).backward()
        outputs.append(out.output.detach())
        input_grads.append(x.grad * world_size)
    return outputs, input_grads, {name: p.grad for name, p in layer.named_parameters()}


CASES = [  # (world size, EP size, capacity factor, routing skew[, routing])
    (2, 2, None, "none"),
    (2, 2, None, "none", "v3"),  # group-limited sigmoid routing with bias and routed scaling
    (2, 2, 1.0, "none"),  # capacity drops on the token's own rank, as without EP
    (2, 2, None, "one_rank"),  # all rows go to one rank, the other computes nothing
    (2, 2, None, "idle_expert"),
    (4, 4, 1.25, "none"),  # EP = world
    (4, 2, None, "idle_expert"),  # EP 2 × EDP 2: expert gradients reduced over the EDP group
]


@pytest.fixture(scope="module")
def ep_runs() -> dict[tuple, list]:
    """Each case's per-rank results, one spawn of processes per world size."""
    results = {}
    for world_size in sorted({case[0] for case in CASES}):
        cases = [case for case in CASES if case[0] == world_size]
        by_rank = run_distributed(ep_forward_backward_cases, world_size, cases, timeout=300)
        results.update({case: [rank_results[case] for rank_results in by_rank] for case in cases})
    return results


@pytest.mark.parametrize("case", CASES, ids=lambda case: "W{}-EP{}-cf{}-{}".format(*case) + "-v3" * (len(case) > 4))
def test_an_ep_layer_computes_what_one_process_with_every_expert_computes(ep_runs, case):
    world_size, ep_size, capacity_factor, skew, *routing = case
    ranks = ep_runs[case]
    outputs, input_grads, param_grads = reference(world_size, capacity_factor, skew, *routing)
    for rank, (out, x_grad, grads, (first, stop), _) in enumerate(ranks):
        torch.testing.assert_close(out, outputs[rank], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x_grad, input_grads[rank], rtol=1e-10, atol=1e-12)
        assert stop - first == E // ep_size and first == (rank % ep_size) * (E // ep_size)
        for name, grad in grads.items():
            expected = param_grads[name][first:stop] if is_expert_parameter(name) else param_grads[name]
            torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12, msg=f"rank {rank} {name}")
    after = [stats.tokens_per_expert_after for *_, stats in ranks]
    if capacity_factor is not None:
        assert any((s.tokens_per_expert_before != s.tokens_per_expert_after).any() for *_, s in ranks), "no drops"
    if skew == "one_rank":
        assert all(a[2:].sum() == 0 for a in after), "every assignment went to experts 0 and 1"
    if skew == "idle_expert":
        assert all(a[E - 1] == 0 for a in after)


def test_received_rows_are_regrouped_by_local_expert_then_source_rank():
    # 2 source ranks × 3 local experts; rows arrive ordered (source, expert):
    # s0e0 ×2, s0e1 ×0, s0e2 ×1, s1e0 ×1, s1e1 ×2, s1e2 ×0
    received_PL = torch.tensor([[2, 0, 1], [1, 2, 0]])
    order = _source_to_expert_order(received_PL)
    # received rows: 0,1 = s0e0; 2 = s0e2; 3 = s1e0; 4,5 = s1e1  →  by expert: e0 (0,1,3), e1 (4,5), e2 (2)
    assert order.tolist() == [0, 1, 3, 4, 5, 2]


def test_a_rank_holds_a_contiguous_block_of_global_expert_ids():
    blocks = [ExpertParallel(size=4, rank=r).local_experts(8) for r in range(4)]
    assert [list(b) for b in blocks] == [[0, 1], [2, 3], [4, 5], [6, 7]]
