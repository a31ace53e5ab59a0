"""QK-clip and the max attention logit (moe/max_logit.py, train/qk_clip.py): S_max equals the materialised scores'
max; a clip brings exactly the heads over τ to τ on the same inputs and leaves the others as they were (a layer with
none over τ bit for bit); a 2-rank run clips like one process."""

import math
from pathlib import Path

import pytest
import torch

from moe.attention import Attention
from moe.max_logit import max_logit_per_head
from moe.mla import MultiHeadLatentAttention
from moe.model import Transformer
from moe_platform.config import ConfigError
from moe_platform.launch.compose import train_config
from moe_platform.testing import FAST, assert_trains_like, moe_train, read_metrics
from moe_platform.train.qk_clip import AttentionLogits


def reference_max(q_BHTd, k_BKSd, allowed, scale) -> torch.Tensor:
    k_BHSd = k_BKSd.repeat_interleave(q_BHTd.shape[1] // k_BKSd.shape[1], dim=1)
    scores = (q_BHTd @ k_BHSd.mT * scale).masked_fill(~allowed, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("mask_kind", ["causal", "documents", "alibi"])
def test_the_max_logit_is_the_materialised_scores_max(kv_heads: int, mask_kind: str, monkeypatch) -> None:
    monkeypatch.setattr("moe.max_logit.CHUNK", 5)  # several query blocks, the last one short
    generator = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 4, 13, 8
    q, k = torch.randn(B, H, T, d, generator=generator), torch.randn(B, kv_heads, T, d, generator=generator)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    documents_BT = torch.tensor([[0] * 6 + [1] * 7, [0] * 2 + [1] * 11])
    allowed = causal[None, None].expand(B, 1, T, T)
    mask = None
    if mask_kind == "documents":
        allowed = allowed & (documents_BT[:, None, :, None] == documents_BT[:, None, None, :])
        mask = allowed
    if mask_kind == "alibi":  # an additive mask: its bias is left out of the logit, its -inf keeps keys out
        mask = torch.where(allowed, -0.5 * torch.arange(T).float(), float("-inf"))
    got = max_logit_per_head(q, k, mask, scale=d**-0.5)
    # (chunks of queries change the matmul's blocking: equal to the last bits)
    torch.testing.assert_close(got, reference_max(q, k, allowed, d**-0.5), rtol=1e-6, atol=0)


VARIANTS = {"MHA": ["model.n_kv_heads=4"], "GQA": [], "MLA": ["model=deepseek_v3_like_tiny"]}


def watched_model(name: str, tau: float | None = None):
    config = train_config([*FAST, *VARIANTS[name], f"optim.qk_clip={tau or 1.0}"])
    torch.manual_seed(0)
    model = Transformer(config.model).train()
    with torch.no_grad():  # sharpen the queries so some heads' logits are large
        for module in model.modules():
            if isinstance(module, (Attention, MultiHeadLatentAttention)):
                w_q = module.w_q if isinstance(module.w_q, torch.nn.Linear) else module.w_q[-1]
                w_q.weight.mul_(torch.linspace(1.0, 40.0, w_q.weight.shape[0])[:, None])
    return config, model


def attention_inputs(watch: AttentionLogits, model, input_ids) -> dict[int, tuple]:
    """Each attention module's arguments in a forward of `input_ids`, to replay it on the same inputs."""
    seen, hooks = {}, []
    for layer, module in watch.layers.items():
        record = lambda module, args, kwargs, layer=layer: seen.setdefault(layer, (args, kwargs))  # noqa: E731
        hooks.append(module.register_forward_pre_hook(record, with_kwargs=True))
    model(input_ids, labels_BT=input_ids.roll(-1, dims=1))  # with labels: the MTP module's attention runs too
    for hook in hooks:
        hook.remove()
    return seen


def replayed_maxima(watch: AttentionLogits, inputs: dict[int, tuple]) -> torch.Tensor:
    for layer, (args, kwargs) in inputs.items():
        watch.layers[layer](*args, **kwargs)
    return watch._gathered_maxima()


@pytest.mark.parametrize("name", VARIANTS)
def test_a_clip_brings_the_heads_over_tau_to_tau_and_leaves_the_rest(name: str) -> None:
    """On the same inputs to each attention layer (a clipped layer changes what the next one sees)."""
    config, model = watched_model(name)
    input_ids = torch.randint(0, config.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    watch = AttentionLogits(model, config)
    inputs = attention_inputs(watch, model, input_ids)
    before_LH = watch._gathered_maxima()
    ordered = before_LH.flatten().sort().values
    middle = len(ordered) // 2
    tau = float(ordered[middle - 1] + ordered[middle]) / 2  # between two heads' maxima: none sits on τ
    watch.tau = tau
    weights = {id(p): p.detach().clone() for p in model.parameters()}
    for layer, (args, kwargs) in inputs.items():  # the step's forward, as the recorders see it
        watch.layers[layer](*args, **kwargs)
    watch.after_step()
    after_LH = replayed_maxima(watch, inputs)
    over = before_LH > tau
    assert over.any() and (~over).any()
    torch.testing.assert_close(after_LH[over], torch.full_like(after_LH[over], tau), rtol=1e-5, atol=0)
    # the other heads' projection rows are multiplied by exactly 1; their logits equal to the last bit (the GEMM
    # over the layer's rows may round one element differently once other rows changed)
    torch.testing.assert_close(after_LH[~over], before_LH[~over], rtol=1e-6, atol=0)
    assert watch.record()["attn/qk_clipped_heads"] == int(over.sum())
    for layer, module in watch.layers.items():  # a layer with no head over τ keeps its weights bit for bit
        if not over[layer].any():
            assert all(torch.equal(p, weights[id(p)]) for p in module.parameters())
    if name == "MLA":  # the shared rotary key is not touched (the MTP module's attention is layer L here)
        assert len(watch.layers) == config.model.num_blocks > config.model.n_layers
        assert all(torch.equal(m.w_kv_down.weight, weights[id(m.w_kv_down.weight)]) for m in watch.layers.values())


def test_a_layer_no_forward_ran_is_left_alone() -> None:
    """Without labels the MTP module's attention does not run: its maximum stays -inf, and however low τ, its weights
    keep every bit while every layer that ran is clipped."""
    config, model = watched_model("MLA", tau=1e-3)
    watch = AttentionLogits(model, config)
    weights = {id(p): p.detach().clone() for p in model.parameters()}
    model(torch.randint(0, config.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)))
    watch.after_step()
    idle = watch.layers[config.model.n_layers]  # the MTP module's attention
    assert all(torch.equal(p, weights[id(p)]) for p in idle.parameters())
    for layer in range(config.model.n_layers):
        assert not torch.equal(watch.layers[layer].w_kv_up.weight, weights[id(watch.layers[layer].w_kv_up.weight)])


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        (["optim.qk_clip=0"], "optim.qk_clip=0.0 must be a positive logit threshold"),
        (["optim.qk_clip=100", "distributed=zero2"], "optim.qk_clip rescales the module's W_Q and W_K"),
        (["optim.qk_clip=100", "trainer.compile=true"], "optim.qk_clip records logits beside the attention"),
    ],
)
def test_a_qk_clip_it_cannot_run_is_refused_in_one_sentence(overrides: list[str], sentence: str) -> None:
    with pytest.raises(ConfigError) as refused:
        train_config([*FAST, *overrides])
    assert str(refused.value).startswith(sentence) and "\n" not in str(refused.value)


CLIPPED = ["optim.qk_clip=0.3", "optim.lr=0.02", "trainer.max_steps=8"]  # moe_tiny passes 0.3 at step ~5


@pytest.fixture(scope="module")
def clipped_one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("qk_one")
    moe_train(run_dir, *CLIPPED)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["distributed=ddp"], ["distributed=fsdp"], ["distributed=ddp", "distributed.pipeline_parallel_size=2"]],
    ids=["ddp", "fsdp", "pp2"],
)
def test_two_ranks_clip_like_one_process(tmp_path: Path, clipped_one_process: Path, layout: list[str]) -> None:
    """Under FSDP each rank rescales the rows of its own shards; under PP each stage its own layers, with every
    layer's maximum (and count of clipped heads) known to both."""
    moe_train(tmp_path, *CLIPPED, *layout, nproc=2)
    records = assert_trains_like(tmp_path, clipped_one_process)
    reference = read_metrics(clipped_one_process)[0]
    assert sum(r["attn/qk_clipped_heads"] for r in reference.values()) > 0, "τ must bite in this run"
    for step, record in records.items():
        layers = [key for key in reference[step] if key.startswith("attn/max_logit/layer_")]
        assert len(layers) == 4 and all(math.isfinite(reference[step][key]) for key in layers)
        for key in [*layers, "attn/qk_clipped_heads"]:
            assert record[key] == pytest.approx(reference[step][key], rel=1e-5), (step, key)


def test_a_run_logs_the_max_logit_without_clipping(tmp_path: Path) -> None:
    moe_train(tmp_path, "logging.attention_max_logit=true", "trainer.max_steps=2")
    records = read_metrics(tmp_path)[0]
    assert all(f"attn/max_logit/layer_{i}" in r for r in records.values() for i in range(4))
    assert not any("attn/qk_clipped_heads" in r for r in records.values())
