"""Multi-token prediction (moe/mtp.py): the modules' parameters are the ledger's, L_MTP equals the paper's formula
written out here from the same weights (depth 1 and 2, with and without packed documents), a model without MTP is
the model it was before MTP existed, and bad settings are refused in one sentence."""

import pytest
import torch
import torch.nn.functional as F

from moe import ModelConfig, MoEConfig, Transformer, count_parameters
from moe.errors import ModelConfigError
from moe.mla_config import MLAConfig
from moe.mtp import IGNORE_INDEX, mtp_targets
from moe.mtp_config import MTPConfig

SMALL = dict(vocab_size=64, d_model=32, n_heads=4, d_ff=64, max_seq_len=32, n_layers=2)
MOE = MoEConfig(num_experts=4, top_k=2, expert_d_ff=16, first_dense_layers=1)
CONFIGS = {
    "dense_depth1": ModelConfig(**SMALL, mtp=MTPConfig(depth=1)),
    "moe_depth2": ModelConfig(**SMALL, moe=MOE, mtp=MTPConfig(depth=2, loss_weight=0.1)),
    "mla_moe_depth1": ModelConfig(
        **SMALL, attention="mla", mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16), moe=MOE, mtp=MTPConfig(depth=1)
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_mtp_parameters_are_the_ledgers(name: str) -> None:
    config = CONFIGS[name]
    model = Transformer(config)
    params = count_parameters(config)
    assert sum(p.numel() for p in model.mtp.parameters()) == params.mtp_total
    assert sum(p.numel() for p in model.parameters()) == params.total
    if config.moe is not None:  # the MTP block is built like the last layer: MoE, its experts split under EP
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}")
        assert routed == params.routed_experts


def reference_mtp_loss(model: Transformer, window_BW: torch.Tensor, document_ids_BT: torch.Tensor | None) -> float:
    """DeepSeek-V3 §2.2 from the weights: h^0 the final-normed hidden state; per depth k, position i < T - k:
    h'^k_i = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))], h^k = Norm_k(Block_k(h')), CE against t_{i+k+1}
    where t_i .. t_{i+k} lie in one document; L = λ / K · Σ_k mean CE."""
    config = model.config
    T = window_BW.shape[1] - 1
    x = model.embed(window_BW[:, :T])
    rope, mask = model.attention_context(torch.arange(T), x.dtype, 0, None, document_ids_BT)
    for block in model.blocks:
        x, _ = block(x, rope, mask, None, None)
    h = model.final_norm(x)
    eps = config.norm_eps
    total = 0.0
    for k, module in enumerate(model.mtp, start=1):
        N = T - k
        rope, mask = model.attention_context(
            torch.arange(N), x.dtype, 0, None, None if document_ids_BT is None else document_ids_BT[:, :N]
        )
        e = model.embed(window_BW[:, k : k + N])
        joined = torch.cat(
            (F.rms_norm(h[:, :N], (config.d_model,), module.hidden_norm.weight, eps),
             F.rms_norm(e, (config.d_model,), module.embed_norm.weight, eps)), dim=-1,
        )  # fmt: skip
        y, _ = module.block(joined @ module.proj.weight.T, rope, mask, None, None)
        h = F.rms_norm(y, (config.d_model,), module.norm.weight, eps)
        logits = h @ model.lm_head.weight.T
        losses, count = 0.0, 0
        for b in range(window_BW.shape[0]):
            for i in range(N):
                if document_ids_BT is not None and document_ids_BT[b, i] != document_ids_BT[b, i + k]:
                    continue
                losses += F.cross_entropy(logits[b, i].double(), window_BW[b, i + k + 1]).item()
                count += 1
        total += losses / count
    return config.mtp.loss_weight / config.mtp.depth * total


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("documents", [False, True])
def test_mtp_loss_equals_the_formula_written_out(name: str, documents: bool) -> None:
    torch.manual_seed(0)
    config = CONFIGS[name]
    model = Transformer(config).eval()
    window_BW = torch.randint(1, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    document_ids_BT = None
    if documents:  # EOS = 0 at a few places; an EOS belongs to the document it closes
        window_BW[0, 5] = window_BW[0, 9] = window_BW[1, 12] = 0
        is_eos_BT = (window_BW[:, :-1] == 0).long()
        document_ids_BT = is_eos_BT.cumsum(1) - is_eos_BT
    with torch.no_grad():
        output = model(window_BW[:, :-1], document_ids_BT=document_ids_BT, labels_BT=window_BW[:, 1:])
        expected = reference_mtp_loss(model, window_BW, document_ids_BT)
    assert [tuple(x.shape) for x in output.mtp_logits] == [(2, 16 - k, config.vocab_size) for k in (1, 2)][
        : config.mtp.depth
    ]
    assert output.mtp_loss.item() == pytest.approx(expected, rel=1e-5)
    # The MTP blocks' routers add their aux losses and statistics after the main layers'.
    assert len(output.moe_outputs) == config.n_layers + config.mtp.depth


def test_without_mtp_the_model_is_todays() -> None:
    """Depth 0 builds nothing and its forward, labels or not, gives the
    same logits bit for bit and a zero MTP loss; the MTP modules of a depth-1 model with the same main weights
    change neither its logits nor its decoding."""
    plain, with_mtp = ModelConfig(**SMALL, moe=MOE), ModelConfig(**SMALL, moe=MOE, mtp=MTPConfig(depth=1))
    a, b = Transformer(plain), Transformer(with_mtp)
    assert a.mtp is None and not any(name.startswith("mtp") for name in a.state_dict())
    missing, unexpected = b.load_state_dict(a.state_dict(), strict=False)
    assert all(name.startswith("mtp.") for name in missing) and missing and not unexpected
    ids_BT = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    labels_BT = torch.roll(ids_BT, -1, dims=1)
    out_a, out_a_labels, out_b = a(ids_BT), a(ids_BT, labels_BT=labels_BT), b(ids_BT, labels_BT=labels_BT)
    assert torch.equal(out_a.logits, out_b.logits) and torch.equal(out_a.logits, out_a_labels.logits)
    assert torch.equal(out_a.aux_loss, out_a_labels.aux_loss) and out_a_labels.mtp_loss.item() == 0.0
    assert torch.equal(a.generate(ids_BT[:, :4], 5, temperature=0), b.generate(ids_BT[:, :4], 5, temperature=0))


def test_targets_ignore_what_the_lm_loss_ignores_and_cross_no_document() -> None:
    labels_BT = torch.tensor([[1, 2, IGNORE_INDEX, 4, 5, 6]])
    documents_BT = torch.tensor([[0, 0, 0, 0, 1, 1]])
    depth1, depth2 = mtp_targets(labels_BT, documents_BT, 2)
    # depth 1 at i: t_{i+2} = labels[i+1], kept when labels[i], labels[i+1] are kept and doc[i] == doc[i+1]
    assert depth1.tolist() == [[2, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 6]]
    assert depth2.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    assert mtp_targets(labels_BT, None, 1)[0].tolist() == [[2, IGNORE_INDEX, IGNORE_INDEX, 5, 6]]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(depth=-1), "model.mtp.depth=-1"),
        (dict(depth=0, loss_weight=0.1), "model.mtp.depth=0 builds no MTP module"),
        (dict(depth=1, loss_weight=0.0), "model.mtp.loss_weight=0.0 must be positive"),
    ],
)
def test_bad_mtp_settings_are_refused_in_one_sentence(fields: dict, needle: str) -> None:
    with pytest.raises(ModelConfigError, match=needle) as error:
        MTPConfig(**fields)
    assert ". " not in str(error.value)
    with pytest.raises(ModelConfigError, match=r"model\.mtp\.depth=32 predicts past"):
        ModelConfig(**SMALL, mtp=MTPConfig(depth=32))
