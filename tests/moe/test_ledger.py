"""The ledger against the seeds' hand-computed cases, torch's own FLOP counter and, under expert parallelism,
the real model's expert blocks."""

import re
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moe import (
    ModelConfig,
    MoEConfig,
    RunShape,
    Transformer,
    all_to_all_bytes_per_step,
    count_parameters,
    expert_params_per_rank,
    format_ledger,
    kv_cache_bytes,
    matmul_flops_per_token,
    params_per_rank,
    training_state_bytes_per_rank,
)
from moe.config import attention_num_params
from moe.experts import GroupedExperts
from moe.ledger import (
    _human,
    fsdp_unit_params,
    mha_kv_cache_bytes,
    sharding_peak_bytes,
    sharding_transient_bytes,
    stored_params_per_rank,
    training_state_bytes,
)
from moe.mla_config import MLAConfig
from moe.moe_config import RouterConfig

# MLA in small, v = n + r and v ≠ n + r, with and without the query latent.
MLA_Q = MLAConfig(q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10)
MLA_FULL_Q = MLAConfig(kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8)


def test_kv_cache_is_128_kib_per_token_in_the_seeds_example() -> None:
    """Seed 001 §1.5: 32 layers, 8 KV heads, 128 dims, 2 bytes → 131072 B/token; 8192 tokens → 1 GiB."""
    config = ModelConfig(n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, vocab_size=32000, d_ff=64)
    assert kv_cache_bytes(config, batch_size=1, seq_len=1, bytes_per_element=2) == 131072
    assert kv_cache_bytes(config, batch_size=1, seq_len=8192, bytes_per_element=2) == 2**30
    assert kv_cache_bytes(config, batch_size=4, seq_len=8192, bytes_per_element=2) == 4 * 2**30
    # Seed: two KV heads instead of eight → a quarter of the payload.
    mqa_ish = ModelConfig(n_layers=32, n_heads=32, n_kv_heads=2, d_model=4096, vocab_size=32000, d_ff=64)
    assert kv_cache_bytes(mqa_ish, 1, 8192, 2) * 4 == 2**30


def test_mla_cache_is_the_latent_payload_not_the_gqa_formula() -> None:
    """Seed 001: B·L·S·(d_c + d_r)·s. DeepSeek-V3's shapes (61 layers, d_c = 512, d_r = 64, bf16): 70,272 B per
    token, against 61·128·(192 + 128)·2 = 4,997,120 B for per-head keys and values, 71× more."""
    mla = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    config = ModelConfig(n_layers=61, n_heads=128, d_model=7168, vocab_size=8, d_ff=8, attention="mla", mla=mla)
    assert kv_cache_bytes(config, batch_size=1, seq_len=1, bytes_per_element=2) == 61 * 576 * 2 == 70_272
    assert kv_cache_bytes(config, 4, 4096, 2) == 4 * 4096 * 70_272
    assert mha_kv_cache_bytes(config, 1, 1, 2) == 61 * 128 * (192 + 128) * 2 == 4_997_120
    # A GQA model's MHA equivalent is its cache at H_kv = H.
    gqa = ModelConfig(n_layers=2, n_heads=8, n_kv_heads=2, d_model=64)
    assert mha_kv_cache_bytes(gqa, 3, 5, 2) == kv_cache_bytes(replace(gqa, n_kv_heads=8), 3, 5, 2)
    assert mha_kv_cache_bytes(gqa, 3, 5, 2) == 4 * kv_cache_bytes(gqa, 3, 5, 2)


KV_CASES = {
    "mla_q_latent": dict(attention="mla", mla=MLA_Q),
    "mla_full_rank_q": dict(attention="mla", mla=MLA_FULL_Q),
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "alibi_gqa": dict(n_kv_heads=2, pos_encoding="alibi"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", KV_CASES)
def test_kv_cache_bytes_equal_the_cache_the_model_allocates(case: str, dtype: torch.dtype) -> None:
    config = ModelConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4, d_ff=48, max_seq_len=16, **KV_CASES[case])
    model = Transformer(config).to(dtype)
    B, S = 2, 11
    cache = model.new_kv_cache(B, S)
    assert cache.num_bytes == kv_cache_bytes(config, B, S, dtype.itemsize)


@pytest.mark.parametrize("mla", [MLA_Q, MLA_FULL_Q], ids=["q_latent", "full_rank_q"])
def test_mla_mha_equivalent_is_the_keys_and_values_the_expanded_path_builds(
    mla: MLAConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MHA-equivalent cache holds exactly the per-head K and V an uncached MLA forward reconstructs for SDPA."""
    import moe.mla

    config = ModelConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4, d_ff=48, attention="mla", mla=mla)
    handed: list[int] = []
    attention = moe.mla.grouped_attention

    def spy(q, k, v, **kwargs):
        # the values' own columns: moe/mla.py pads narrower values with zeros for SDPA's fused kernels
        v_columns = v.shape[:-1].numel() * config.mla.v_head_dim
        handed.append(k.numel() * k.element_size() + v_columns * v.element_size())
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(moe.mla, "grouped_attention", spy)
    B, S = 2, 9
    with torch.no_grad():
        Transformer(config)(torch.randint(0, 50, (B, S)))
    assert sum(handed) == mha_kv_cache_bytes(config, B, S, 4)
    assert mha_kv_cache_bytes(config, B, S, 4) > kv_cache_bytes(config, B, S, 4)


def test_gqa_projection_parameters_from_the_seeds() -> None:
    """Seed 000: d=128, h_q=8, h_kv=2, d_h=16 → 40960 vs 65536 for MHA (ratio 5/8)."""
    gqa = ModelConfig(d_model=128, n_heads=8, n_kv_heads=2)
    mha = ModelConfig(d_model=128, n_heads=8, n_kv_heads=8)
    assert attention_num_params(gqa) == 40960
    assert attention_num_params(mha) == 65536
    # Seed 001: D=2048, H_q=16, H_kv=4, d_h=128 → 10,485,760 for the four projections, W_O alone 4,194,304.
    big = ModelConfig(d_model=2048, n_heads=16, n_kv_heads=4)
    assert attention_num_params(big) == 10_485_760
    assert Transformer(ModelConfig(d_model=2048, n_heads=16, n_kv_heads=4, n_layers=1, vocab_size=2, d_ff=1)) \
        .blocks[0].attn.w_o.weight.numel() == 4_194_304  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_state_is_16_bytes_per_parameter_without_zero(precision: str) -> None:
    assert training_state_bytes(1000, precision, zero_stage=0, dp_size=8).total == 16_000


def test_zero_stages_shard_what_they_claim() -> None:
    """bf16, Ψ params, N ranks, as DeepSpeed 0.19.8 allocates (tests/moe_platform/test_footprint.py measures it):
    stage 1 = 2Ψ weights + 2Ψ grads + 12Ψ/N (fp32 master, m, v); stage 2 = 2Ψ + 16Ψ/N, the gradient partitions
    being fp32; stage 3 = 18Ψ/N. fp32 adds the master partition DeepSpeed clones: stage 3 = 20Ψ/N."""
    psi, n = 1_000_000, 8
    assert training_state_bytes(psi, "bf16", 1, n).total == 4 * psi + 12 * psi / n
    assert training_state_bytes(psi, "bf16", 2, n).total == 2 * psi + 16 * psi / n
    assert training_state_bytes(psi, "bf16", 3, n).total == 18 * psi / n
    assert training_state_bytes(psi, "fp32", 3, 1).total == 20 * psi
    for stage in (1, 2, 3):
        assert training_state_bytes(psi, "bf16", stage, n).master == 4 * psi / n
        assert training_state_bytes(psi, "bf16", stage, n).optimizer == 8 * psi / n
    assert training_state_bytes(psi, "bf16", 0, n) == training_state_bytes(psi, "fp32", 0, n), "DDP autocasts"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_shards_fp32_weights_gradients_and_optimizer_state_in_either_precision(precision: str) -> None:
    """FSDP2 keeps fp32 shards whatever the compute dtype: 4 + 4 + 8 = 16 B/param over N ranks, no master copy."""
    psi, n = 1_000_000, 8
    state = training_state_bytes(psi, precision, 0, n, fsdp=True)
    assert (state.weights, state.gradients, state.master, state.optimizer) == (4 * psi / n, 4 * psi / n, 0, 8 * psi / n)
    with pytest.raises(ValueError, match="fsdp shards everything"):
        training_state_bytes(psi, precision, 3, n, fsdp=True)


def test_training_state_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="precision"):
        training_state_bytes(10, "fp16x", 0, 1)
    with pytest.raises(ValueError, match="zero_stage"):
        training_state_bytes(10, "fp32", 4, 1)


def test_flop_terms_follow_the_seeds_formulas() -> None:
    """Seed 000 (MHA, d = H·d_h): projections 8d², FFN 4df, attention 4Td per token."""
    d, f, T, L, V = 64, 256, 32, 3, 100
    config = ModelConfig(d_model=d, d_ff=f, n_layers=L, n_heads=4, vocab_size=V, activation="gelu")
    flops = matmul_flops_per_token(config, seq_len=T)
    assert flops.projections == L * 8 * d * d
    assert flops.ffn == L * 4 * d * f
    assert flops.attention == L * 4 * T * d
    assert flops.lm_head == 2 * d * V
    assert flops.training == 3 * flops.forward


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": 1, "activation": "gelu"},
        {"n_kv_heads": 2, "pos_encoding": "learned"},
        # Dropless MoE: the experts compute exactly K assignments per token, plus the router and a shared expert.
        {"moe": MoEConfig(num_experts=4, top_k=2, expert_d_ff=24, num_shared_experts=1, moe_layer_interval=2)},
        {"moe": MoEConfig(num_experts=3, top_k=1, expert_d_ff=20, router=RouterConfig(renormalize_topk=False))},
        # MLA: the query path with and without its latent, W_DKV + W_KR, W_UK/W_UV on every token, W_O, and
        # scores over n + r against values of v; ALiBi's bias is an addition, no matmul.
        {"attention": "mla", "mla": MLA_Q},
        {"attention": "mla", "mla": MLA_FULL_Q, "attention_bias": True},
        {"attention": "mla", "mla": MLA_Q, "moe": MoEConfig(num_experts=4, top_k=2, expert_d_ff=24)},
        {"n_kv_heads": 2, "pos_encoding": "alibi"},
    ],
)
def test_forward_flops_equal_torchs_flop_counter(overrides: dict) -> None:
    """The ledger's analytic matmul FLOPs equal what torch counts on a real forward (B·T tokens).

    The math SDPA backend runs attention as visible matmuls (the fused CPU kernel is opaque to the counter)."""
    fields = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=16)
    config = ModelConfig(**{**fields, **overrides})
    model = Transformer(config)
    B, T = 2, 16
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, 50, (B, T)))
    assert counter.get_total_flops() == B * T * matmul_flops_per_token(config, seq_len=T).forward


def test_format_ledger_prints_five_tables_with_assumptions() -> None:
    text = format_ledger(ModelConfig(), RunShape(precision="bf16", zero_stage=2, dp_size=4))
    titles = ("Parameters", "Training state per rank", "Activations per micro-batch", "KV cache", "Matmul FLOPs")
    for title in titles:
        assert title in text
    assert "fp32 master" in text and "ZeRO-2" in text and "2 · B · L · S · H_kv · d_h · s" in text
    assert "attention=gqa" in text and "MHA equivalent" not in text


def test_format_ledger_prints_the_mla_latent_cache_beside_its_mha_equivalent() -> None:
    config = ModelConfig(n_layers=2, n_heads=4, d_model=32, attention="mla", mla=MLA_Q)
    run = RunShape(micro_batch_size=2, seq_len=16)
    text = format_ledger(config, run)
    latent, mha = kv_cache_bytes(config, 2, 16, 2), mha_kv_cache_bytes(config, 2, 16, 2)
    assert "attention=mla" in text and "B · L · S · (d_c + d_r) · s" in text and "H_kv" not in text
    assert f"MHA equivalent  {_human(mha, 'B')}" in text and f"{mha / latent:.1f}×" in text
    assert "2 · S · H · (n + r) + 2 · S · H · max(v, n + r)" in text


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism: W ranks, each MoE layer's E experts split into EP contiguous blocks
# ---------------------------------------------------------------------------------------------------------------

_SMALL = dict(vocab_size=20, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=8)
EP_CONFIGS = [
    ModelConfig(**_SMALL, moe=MoEConfig(num_experts=8, top_k=2, expert_d_ff=8, num_shared_experts=1)),
    ModelConfig(
        **{**_SMALL, "n_layers": 3, "activation": "gelu"},
        moe=MoEConfig(
            num_experts=4,
            top_k=1,
            expert_d_ff=8,
            first_dense_layers=1,
            moe_layer_interval=2,
            router=RouterConfig(renormalize_topk=False),
        ),
    ),
    ModelConfig(
        **_SMALL,
        tie_embeddings=True,
        pos_encoding="learned",
        norm="layernorm",
        moe=MoEConfig(num_experts=6, top_k=2, expert_d_ff=8, num_shared_experts=2),
    ),
]


PARTS = ("weights", "gradients", "master", "optimizer")


def _ep_sizes(config: ModelConfig) -> list[int]:
    return [ep for ep in range(1, config.moe.num_experts + 1) if config.moe.num_experts % ep == 0]


def _num_moe_layers(config: ModelConfig) -> int:
    return sum(config.is_moe_layer(layer) for layer in range(config.n_layers))


@pytest.mark.parametrize("config", [ModelConfig(), *EP_CONFIGS])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_ep_1_gives_todays_figures(config: ModelConfig, precision: str, zero_stage: int) -> None:
    total = config.num_params()
    assert params_per_rank(config, 1) == total
    assert all_to_all_bytes_per_step(config, 64, 4, 1, 2) == 0
    for world in (1, 4):
        per_rank = training_state_bytes_per_rank(
            config, RunShape(precision=precision, zero_stage=zero_stage, dp_size=world)
        )
        today = training_state_bytes(total, precision, zero_stage, world)
        for name in PARTS:
            assert getattr(per_rank, name) == pytest.approx(getattr(today, name), rel=1e-12)
    text = format_ledger(config, RunShape(precision=precision, zero_stage=zero_stage, dp_size=4))
    assert "Expert parallelism" not in text and "EP=" not in text


def _real_params_on_rank(model: Transformer, rank: int, ep: int) -> tuple[int, int]:
    """(all, routed-expert) parameters that rank `rank` of an EP group holds, counted on the real module: every
    parameter outside GroupedExperts whole, and rows [rank·E/EP, (rank+1)·E/EP) of each stacked expert tensor."""
    expert_params = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    everything = experts = 0
    for p in model.parameters():
        if id(p) in expert_params:
            block = p.shape[0] // ep
            n = p[rank * block : (rank + 1) * block].numel()
            experts += n
            everything += n
        else:
            everything += p.numel()
    return everything, experts


@pytest.mark.parametrize("config", EP_CONFIGS)
def test_per_rank_parameters_match_the_real_models_expert_blocks(config: ModelConfig) -> None:
    """Each rank holds every non-expert parameter (routers, shared experts included) and its block of E/EP
    experts; the EP distinct blocks together are exactly the model's routed experts."""
    model = Transformer(config)
    real_routed = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    assert count_parameters(config).routed_experts == real_routed
    for ep in _ep_sizes(config):
        held = [_real_params_on_rank(model, rank, ep) for rank in range(ep)]
        assert all(everything == params_per_rank(config, ep) for everything, _ in held)
        assert all(experts == expert_params_per_rank(config, ep) for _, experts in held)
        assert sum(experts for _, experts in held) == real_routed
        replicated = config.num_params() - real_routed
        assert sum(everything for everything, _ in held) - (ep - 1) * replicated == config.num_params()


@pytest.mark.parametrize("config", EP_CONFIGS)
def test_per_rank_parameters_match_a_model_built_with_e_over_ep_experts(config: ModelConfig) -> None:
    """A rank's parameters are those of the same model built with E/EP experts per MoE layer, except that the
    router still scores all E experts: it is [E, D], not [E/EP, D]."""
    E, D = config.moe.num_experts, config.d_model
    for ep in _ep_sizes(config):
        top_k = min(config.moe.top_k, E // ep)  # top-k has no parameters; only the config check needs K <= E/EP
        router = replace(config.moe.router, renormalize_topk=config.moe.router.renormalize_topk and top_k > 1)
        local = replace(config, moe=replace(config.moe, num_experts=E // ep, top_k=top_k, router=router))
        local_model_params = sum(p.numel() for p in Transformer(local).parameters())
        router_rows_elsewhere = _num_moe_layers(config) * (E - E // ep) * D
        assert params_per_rank(config, ep) == local_model_params + router_rows_elsewhere


@pytest.mark.parametrize("config", EP_CONFIGS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_ep_training_state_summed_over_ranks_counts_each_copy(
    config: ModelConfig, precision: str, zero_stage: int
) -> None:
    """Summed over all W ranks, a sharded quantity is stored once per parameter; an unsharded one W times for a
    replicated parameter and W/EP times for an expert parameter (one copy per rank holding its block)."""
    total, routed = config.num_params(), count_parameters(config).routed_experts
    per_param = training_state_bytes(1, precision, zero_stage, 1)  # bytes of one parameter on one rank
    world = 2 * config.moe.num_experts
    for ep in _ep_sizes(config):
        state = training_state_bytes_per_rank(
            config, RunShape(precision=precision, zero_stage=zero_stage, dp_size=world, ep_size=ep)
        )
        copies = world * (total - routed) + (world // ep) * routed
        for name, sharded in zip(
            PARTS, (zero_stage >= 3, zero_stage >= 2, zero_stage >= 1, zero_stage >= 1), strict=True
        ):
            expected = getattr(per_param, name) * (total if sharded else copies)
            assert world * getattr(state, name) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("config", EP_CONFIGS)
def test_all_to_all_bytes_scale_with_the_share_of_remote_experts(config: ModelConfig) -> None:
    """0 at EP=1, otherwise ∝ (EP-1)/EP, linear in tokens and micro-batches; and equal to a count of the
    assignments that leave each rank when N·K assignments cover the E experts evenly."""
    E, K, D = config.moe.num_experts, config.moe.top_k, config.d_model
    N, s = 6 * E, 2
    assert all_to_all_bytes_per_step(config, N, 3, 1, s) == 0
    per_share = {ep: all_to_all_bytes_per_step(config, N, 1, ep, s) / ((ep - 1) / ep) for ep in _ep_sizes(config)[1:]}
    assert max(per_share.values()) == pytest.approx(min(per_share.values()), rel=1e-12)
    for ep in _ep_sizes(config)[1:]:
        one = all_to_all_bytes_per_step(config, N, 1, ep, s)
        assert all_to_all_bytes_per_step(config, 2 * N, 3, ep, s) == pytest.approx(6 * one, rel=1e-12)
        expert_ids_NK = torch.arange(N * K) % E  # uniform routing: every expert gets N·K/E assignments
        for rank in range(ep):
            leaving = int((expert_ids_NK // (E // ep) != rank).sum())
            # dispatch + combine, forward + backward, every MoE layer, D elements of s bytes each
            assert one == pytest.approx(4 * _num_moe_layers(config) * leaving * D * s, rel=1e-12)


def test_format_ledger_prints_the_ep_block_with_formulas() -> None:
    config = EP_CONFIGS[0]
    run = RunShape(precision="bf16", zero_stage=1, dp_size=8, ep_size=4, grad_accum=2)
    text = format_ledger(config, run)
    assert "Expert parallelism (EP=4 of W=8 ranks" in text and "experts over EP=4" in text
    block = text.split("Expert parallelism")[1].split("\n\n")[0]
    state = training_state_bytes_per_rank(config, run)
    expected_a2a = all_to_all_bytes_per_step(config, run.micro_batch_size * run.seq_len, 2, 4, 2)
    for row in (
        f"{expert_params_per_rank(config, 4):,}",
        f"{params_per_rank(config, 4):,}",
        "routed experts / EP",
        "(replicated / W + routed / EP / (W/EP))",
        "4 · L_moe · B·S·K · (EP-1)/EP · D · s",
        "uniform routing, payload only",
    ):
        assert row in block
    assert _human(state.optimizer, "B") in block and _human(expected_a2a, "B") in block


def test_expert_parallel_sizes_that_do_not_fit_are_refused() -> None:
    config = EP_CONFIGS[0]  # 8 experts
    with pytest.raises(ValueError, match="num_experts=8"):
        params_per_rank(config, 3)
    with pytest.raises(ValueError, match="world size W=6"):
        training_state_bytes_per_rank(config, RunShape(zero_stage=1, dp_size=6, ep_size=4))
    with pytest.raises(ValueError, match="dense"):
        params_per_rank(ModelConfig(), 2)
    with pytest.raises(ValueError, match="ep_size=0"):
        all_to_all_bytes_per_step(config, 8, 1, 0, 2)


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 and HSDP, alone and with EP: R replicas of shards over W/R ranks, experts over EP × W/EP
# ---------------------------------------------------------------------------------------------------------------

FSDP_BYTES = {"weights": 4, "gradients": 4, "master": 0, "optimizer": 8}  # fp32 shards in either precision


def _fsdp(world: int, ep: int = 1, replicas: int = 1, precision: str = "fp32") -> RunShape:
    return RunShape(precision=precision, dp_size=world, ep_size=ep, fsdp=True, replicate_size=replicas)


@pytest.mark.parametrize("config", [ModelConfig(**_SMALL), *EP_CONFIGS])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_at_w_ranks_holds_a_wth_of_every_part_with_or_without_ep(config: ModelConfig, precision: str) -> None:
    """Dense parameters sharded over W, each expert block over its W/EP ranks: routed / EP / (W/EP) = routed / W, so
    every EP size gives total / W of each part, and the parameters stored are total / W."""
    total = config.num_params()
    eps = _ep_sizes(config) if config.moe else [1]
    for world in (1, 4, 8, 24):
        for ep in (ep for ep in eps if world % ep == 0):
            run = _fsdp(world, ep, precision=precision)
            state = training_state_bytes_per_rank(config, run)
            for name, bytes_per_param in FSDP_BYTES.items():
                assert getattr(state, name) == pytest.approx(bytes_per_param * total / world, rel=1e-12), (world, ep)
            assert stored_params_per_rank(config, run) == pytest.approx(total / world, rel=1e-12)


@pytest.mark.parametrize("config", EP_CONFIGS)
def test_hsdp_shards_the_non_expert_state_over_one_replica_and_the_experts_over_all_ranks(config: ModelConfig) -> None:
    """Non-expert state / (W/R), R copies of it; under EP the experts' / W (the expert mesh does not replicate),
    without EP the experts are sharded with the rest, / (W/R) (measured: bench/memory_per_rank.py's hsdp row)."""
    total, routed = config.num_params(), count_parameters(config).routed_experts
    world = 4 * config.moe.num_experts
    for replicas in (2, 4):
        for ep in _ep_sizes(config):
            state = training_state_bytes_per_rank(config, _fsdp(world, ep, replicas))
            expert_shards = world if ep > 1 else world // replicas
            for name, b in FSDP_BYTES.items():
                expected = b * ((total - routed) / (world // replicas) + routed / expert_shards)
                assert getattr(state, name) == pytest.approx(expected, rel=1e-12), (replicas, ep, name)
            copies_of_experts = 1 if ep > 1 else replicas  # summed over ranks: R copies of the dense state
            summed = 8 * (replicas * (total - routed) + copies_of_experts * routed)
            assert world * state.optimizer == pytest.approx(summed, rel=1e-12), (replicas, ep)


@pytest.mark.parametrize("config", EP_CONFIGS)
def test_expert_optimizer_state_falls_as_one_over_ep_times_the_expert_data_parallel_size(config: ModelConfig) -> None:
    """The EP table's expert row: 8 B · routed / (EP · W/EP) = 8 B · routed / W under FSDP + EP (and ZeRO-1/2 + EP,
    whose partitions over the W/EP ranks are measured in tests/moe_platform/test_footprint.py)."""
    routed = count_parameters(config).routed_experts
    world = 2 * config.moe.num_experts
    for ep in _ep_sizes(config)[1:]:
        for run in (_fsdp(world, ep), RunShape(zero_stage=2, dp_size=world, ep_size=ep)):
            block = format_ledger(config, run).split("Expert parallelism")[1].split("\n\n")[0]
            expert_row = next(line for line in block.splitlines() if "expert optimizer per rank" in line)
            assert _human(8 * routed / world, "B") in expert_row, expert_row
            assert ("routed / W" in expert_row) == run.fsdp


@pytest.mark.parametrize("config", [ModelConfig(**_SMALL), *EP_CONFIGS])
def test_fsdp_units_are_the_real_models_root_and_blocks(config: ModelConfig) -> None:
    """The units FSDP gathers: the root (embeddings, final norm, head; tied: one table) and each block, counted on the
    real module; under EP a block holds E/EP of its experts."""
    model = Transformer(config)
    root, *blocks = fsdp_unit_params(config, ep_size=1)
    assert blocks == [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
    assert root == sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    for ep in _ep_sizes(config) if config.moe else [1]:
        assert sum(fsdp_unit_params(config, ep)) == params_per_rank(config, ep)


@pytest.mark.parametrize("config", EP_CONFIGS)
def test_fsdp_transient_is_the_root_and_largest_blocks_gathered_and_reduced(config: ModelConfig) -> None:
    """(U_root + 2·B)·p gathered, (U_root + B)·p unsharded gradients, max(U_root, B)·4 reduce-scatter input, with B
    the largest block (its experts E/EP): independent of the shard count, half the gathered bytes in bf16, fewer
    under EP; nothing without FSDP."""
    for ep in _ep_sizes(config):
        root, *blocks = fsdp_unit_params(config, ep)
        largest = sorted(blocks, reverse=True)
        for precision, p in (("fp32", 4), ("bf16", 2)):
            transient = sharding_transient_bytes(config, _fsdp(4 * config.moe.num_experts, ep, precision=precision))
            assert transient.gathered == (root + sum(largest[:2])) * p
            assert transient.gradients == (root + largest[0]) * p
            assert transient.reduce_scatter == max(root, largest[0]) * 4
            assert transient == sharding_transient_bytes(
                config, _fsdp(8 * config.moe.num_experts, ep, precision=precision)
            )
    gathered = [
        sharding_transient_bytes(config, _fsdp(config.moe.num_experts, ep)).gathered for ep in _ep_sizes(config)
    ]
    assert gathered == sorted(gathered, reverse=True) and gathered[-1] < gathered[0]
    for stage in (0, 1, 2):
        assert sharding_transient_bytes(config, RunShape(zero_stage=stage, dp_size=8, ep_size=2)).total == 0


@pytest.mark.parametrize("config", EP_CONFIGS)
def test_fsdp_peak_counts_the_gathered_units_and_the_gradients_beyond_a_blocks_activations(config: ModelConfig) -> None:
    """gathered ≤ peak transient ≤ gathered + gradients + reduce-scatter, the gradients' part shrinking as a block's
    activations grow (longer sequences); ZeRO-3 keeps the sum."""
    for ep in _ep_sizes(config):
        beyond = []
        for seq_len in (8, 64, 512):
            run = replace(_fsdp(4 * config.moe.num_experts, ep), seq_len=seq_len)
            transient, peak = sharding_transient_bytes(config, run), sharding_peak_bytes(config, run)
            assert transient.gathered <= peak <= transient.total
            beyond.append(peak - transient.gathered)
        assert beyond == sorted(beyond, reverse=True)
    zero3 = RunShape(zero_stage=3, dp_size=8)
    assert sharding_peak_bytes(config, zero3) == sharding_transient_bytes(config, zero3).total


@pytest.mark.parametrize("config", [ModelConfig(**_SMALL), *EP_CONFIGS])
def test_zero3_gathers_its_largest_module_with_every_expert(config: ModelConfig) -> None:
    """ZeRO-3 gathers a module while it runs; the MoE layer is one leaf, so all E experts at once: the largest of
    the real model's embedding, head, attention and FFN / MoE layer, and as many bytes of its unsharded gradients."""
    model = Transformer(config)
    modules = [model.embed, model.lm_head, *(m for block in model.blocks for m in (block.attn, block.ffn))]
    largest = max(sum(p.numel() for p in module.parameters()) for module in modules)
    for precision, p in (("fp32", 4), ("bf16", 2)):
        transient = sharding_transient_bytes(config, RunShape(precision=precision, zero_stage=3, dp_size=8))
        assert transient.gathered == transient.gradients == largest * p and transient.reduce_scatter == 0


def test_format_ledger_prints_the_fsdp_and_hsdp_layouts() -> None:
    config = EP_CONFIGS[0]
    text = format_ledger(config, _fsdp(8, ep=2, precision="bf16"))
    table = text.split("Training state per rank")[1].split("\n\n")[0]
    assert "FSDP2 over W=8 ranks, experts over EP=2 × W/EP = 4 expert-data-parallel" in table
    transient = sharding_transient_bytes(config, _fsdp(8, ep=2, precision="bf16"))
    for row, value in (("gathered", transient.gathered), ("reduce-scatter", transient.reduce_scatter)):
        assert re.search(rf"{row}\s+{re.escape(_human(value, 'B'))}", table), row
    assert not any(line.split()[0] == "master" for line in table.splitlines()[1:]), "FSDP's weights are the master"
    assert "in either precision" in table
    hsdp = format_ledger(config, _fsdp(8, ep=2, replicas=2)).split("Training state per rank")[1].split("\n\n")[0]
    assert "HSDP: 2 replicas × shards over W/R = 4 of W=8 ranks" in hsdp and "non-expert / 4, routed / W" in hsdp
    hsdp = format_ledger(config, _fsdp(8, replicas=2)).split("Training state per rank")[1].split("\n\n")[0]
    assert "non-expert / 4, routed / 4" in hsdp, "without EP the experts are sharded like the rest"


def test_layouts_that_do_not_exist_are_refused() -> None:
    config = EP_CONFIGS[0]
    with pytest.raises(ValueError, match="replicate_size=3"):
        training_state_bytes_per_rank(config, _fsdp(8, replicas=3))
    with pytest.raises(ValueError, match="replicate_size=2 needs fsdp"):
        training_state_bytes_per_rank(config, RunShape(dp_size=8, replicate_size=2))
    with pytest.raises(ValueError, match="fsdp shards everything"):
        training_state_bytes_per_rank(config, RunShape(dp_size=8, zero_stage=2, fsdp=True))
