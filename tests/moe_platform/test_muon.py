"""optim=muon (train/optimizers.py): our Muon is torch.optim.Muon step for step on a matrix and on each expert of a
stack alone, its AdamW half is torch's AdamW; the groups hold exactly the kinds they name, in every model family, and
the ledger counts their state as the real optimizer holds it; and through the real trainer DDP, FSDP2 and expert
parallelism train like one process, and a stopped run resumes exactly. Refusals: test_bad_inputs.py."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from moe import RunShape, Transformer
from moe.ledger import ADAMW_BYTES, MUON_BYTES, muon_params_by_rank, training_state_bytes_per_rank
from moe_platform.config import MuonConfig, OptimConfig
from moe_platform.launch.compose import train_config
from moe_platform.testing import EXACT, Job, assert_resumes_exactly, assert_trains_like, moe_train, read_metrics
from moe_platform.train.optimizers import MuonAdamW, build_optimizer, newton_schulz, param_groups

STEPS = 10


def steps_alike(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, pairs, steps: int = STEPS) -> None:
    """Give each (our parameter, their parameter) pair the same random gradient, step both, and compare bit for bit
    after every step."""
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for mine, reference in pairs:
            grad = torch.randn(mine.shape, generator=generator)
            mine.grad, reference.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
        for mine, reference in pairs:
            assert torch.equal(mine, reference), f"step {step + 1}: {(mine - reference).abs().max()}"


def muon_only(params, lr=0.02, weight_decay=0.1, **muon) -> MuonAdamW:
    settings = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "adjust_lr": "match_rms_adamw", **muon}
    return MuonAdamW(
        [{"params": params, "algorithm": "muon"}], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
        **settings,
    )  # fmt: skip


def torch_muon(params, settings: dict) -> torch.optim.Muon:
    return torch.optim.Muon(
        params, lr=0.02, weight_decay=0.1, momentum=settings.get("momentum", 0.95), nesterov=settings["nesterov"],
        ns_steps=settings.get("ns_steps", 5), adjust_lr_fn=settings["adjust_lr"],
    )  # fmt: skip


MUON_SETTINGS = [
    {"nesterov": True, "adjust_lr": "match_rms_adamw"},
    {"nesterov": False, "adjust_lr": "original", "momentum": 0.9, "ns_steps": 3},
]


@pytest.mark.parametrize("settings", MUON_SETTINGS, ids=["nesterov-match_rms", "plain-original"])
@pytest.mark.parametrize("shape", [(48, 96), (96, 40)], ids=["wide", "tall"])
def test_a_matrix_steps_as_torch_muon_bit_for_bit(settings: dict, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    mine = nn.Parameter(torch.randn(shape))
    reference = nn.Parameter(mine.detach().clone())
    theirs = torch_muon([reference], settings)
    steps_alike(muon_only([mine], **settings), theirs, [(mine, reference)])


@pytest.mark.parametrize("settings", MUON_SETTINGS, ids=["nesterov-match_rms", "plain-original"])
def test_each_expert_of_a_stack_steps_as_torch_muon_on_that_expert_alone(settings: dict) -> None:
    """A stack [E, in, out] (x @ w[e]) against E torch Muons, each on its expert's nn.Linear-shaped [out, in]."""
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(4, 96, 40))
    experts = [nn.Parameter(w.detach().t().clone()) for w in stack]
    theirs = [torch_muon([w], settings) for w in experts]
    ours = muon_only([stack], **settings)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        stack.grad = torch.randn(stack.shape, generator=generator)
        for e, w in enumerate(experts):
            w.grad = stack.grad[e].t().clone()
        ours.step()
        for optimizer in theirs:
            optimizer.step()
        assert all(torch.equal(stack[e].t(), w) for e, w in enumerate(experts)), f"step {step + 1}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_of_a_stack_is_each_matrix_alone_and_not_the_stacked_tensor(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    stack = torch.randn(3, 32, 64) * torch.tensor([1.0, 10.0, 0.1]).view(3, 1, 1)  # scales the stack's norm mixes
    ortho = newton_schulz(stack, 5, dtype)
    assert ortho.dtype == dtype
    assert torch.equal(ortho, torch.stack([newton_schulz(w, 5, dtype) for w in stack]))
    flat = newton_schulz(stack.flatten(0, 1), 5, dtype).view_as(stack)
    assert not torch.allclose(flat.float(), ortho.float(), atol=1e-2)
    singular = torch.linalg.svdvals(ortho.float())  # NS_5's band: about [0.7, 1.2]
    assert singular.min() > 0.5 and singular.max() < 1.3


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_the_adamw_groups_step_as_torch_adamw_bit_for_bit(kernel: dict) -> None:
    torch.manual_seed(0)
    mine = [nn.Parameter(torch.randn(258, 96)), nn.Parameter(torch.randn(96))]
    reference = [nn.Parameter(p.detach().clone()) for p in mine]
    decays = ({"weight_decay": 0.1}, {"weight_decay": 0.0})
    groups = [{"params": [p], "algorithm": "adamw", **d} for p, d in zip(mine, decays, strict=True)]
    ours = MuonAdamW(
        groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
        adjust_lr="match_rms_adamw", **kernel,
    )  # fmt: skip
    theirs = torch.optim.AdamW(
        [{"params": [p], **d} for p, d in zip(reference, decays, strict=True)], lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
        **kernel,
    )  # fmt: skip
    steps_alike(ours, theirs, list(zip(mine, reference, strict=True)))


# ---- which parameters each group holds ----------------------------------------------------------------------------

MODELS = {
    "moe_tiny": ["model=moe_tiny"],
    "dense_tiny": ["model=dense_tiny"],
    "deepseek_v3_like_tiny": ["model=deepseek_v3_like_tiny"],  # MLA, both latents, shared expert, dense layer 0, MTP
    "mla_no_q_latent-biases": [
        "model=deepseek_v3_like_tiny", "model.mla.q_lora_rank=null", "model.attention_bias=true",
    ],
    "gqa-biases-gelu-learned": [
        "model=dense_tiny", "model.attention_bias=true", "model.ffn_bias=true", "model.activation=gelu",
        "model.pos_encoding=learned", "model.norm=layernorm",
    ],
    "mixtral_like-tied": ["model=mixtral_like", "model.n_layers=2", "model.tie_embeddings=true"],
}  # fmt: skip


def kind(name: str, p: nn.Parameter) -> str:
    """The group a parameter belongs in, by what it is: a block's or an MTP module's matrix (M_k too, not a router's)
    is Muon's; every other matrix (embeddings, learned positions, head, routers) AdamW's with decay; vectors (norms,
    biases) without."""
    if re.match(r"(blocks|mtp)\.\d+\.", name) and p.ndim >= 2 and ".router." not in name:
        return "muon"
    return "decay" if p.ndim >= 2 else "no_decay"


@pytest.mark.parametrize("model", MODELS, ids=list(MODELS))
def test_the_groups_hold_exactly_the_kinds_they_name_and_the_ledger_counts_them(model: str) -> None:
    config = train_config([*MODELS[model], "optim=muon", "optim.muon.lr=0.02", "optim.muon.weight_decay=0.05"])
    with torch.device("meta"):
        module = Transformer(config.model)
    groups = param_groups(module, config.optim)
    placed = {id(p): group["name"] for group in groups for p in group["params"]}
    assert len(placed) == sum(len(group["params"]) for group in groups), "a parameter is in two groups"
    named = dict(module.named_parameters())
    assert {name: placed.get(id(p)) for name, p in named.items()} == {name: kind(name, p) for name, p in named.items()}
    assert any(kind(name, p) == "muon" for name, p in named.items())
    by_name = {group["name"]: group for group in groups}
    assert (by_name["muon"]["lr"], by_name["muon"]["weight_decay"]) == (0.02, 0.05)
    assert (by_name["decay"]["lr"], by_name["decay"]["weight_decay"]) == (config.optim.lr, config.optim.weight_decay)
    assert by_name["no_decay"]["weight_decay"] == 0.0
    assert groups[0]["name"] == "decay", "the logged lr (group 0's) is optim.lr's schedule"

    # The ledger's analytic count of what Muon steps, and so of the state both halves hold
    muon = sum(p.numel() for p in by_name["muon"]["params"])
    total = sum(p.numel() for p in named.values())
    run = RunShape(optimizer="muon")
    (dense, routed), = muon_params_by_rank(config.model, run)  # fmt: skip
    assert dense + routed == muon
    assert training_state_bytes_per_rank(config.model, run).optimizer == MUON_BYTES * muon + ADAMW_BYTES * (
        total - muon
    )
    adamw_run = replace(run, optimizer="adamw")
    assert training_state_bytes_per_rank(config.model, adamw_run).optimizer == ADAMW_BYTES * total


def test_the_state_muon_creates_is_one_buffer_for_a_matrix_and_adamws_for_the_rest() -> None:
    config = train_config(["model=moe_tiny", "optim=muon"])
    module = Transformer(config.model)
    optimizer = build_optimizer(param_groups(module, config.optim), config.optim)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group in optimizer.param_groups:
        keys = {"momentum_buffer"} if group["name"] == "muon" else {"step", "exp_avg", "exp_avg_sq"}
        assert all(set(optimizer.state[p]) == keys for p in group["params"]), group["name"]


def test_muon_settings_reach_the_optimizer_and_adamw_refuses_them() -> None:
    optim = OptimConfig(name="muon", muon=MuonConfig(momentum=0.9, nesterov=False, ns_steps=3, adjust_lr="original"))
    optimizer = build_optimizer(param_groups(Transformer(train_config(["model=moe_tiny"]).model), optim), optim)
    muon = next(group for group in optimizer.param_groups if group["name"] == "muon")
    assert (muon["momentum"], muon["nesterov"], muon["ns_steps"], muon["adjust_lr"]) == (0.9, False, 3, "original")
    assert (muon["lr"], muon["weight_decay"]) == (optim.lr, optim.weight_decay)  # null: AdamW's
    with pytest.raises(ValueError, match=r"optim.muon.momentum=0.9 sets Muon up but optim.name='adamw'"):
        OptimConfig(muon=MuonConfig(momentum=0.9))


# ---- through the real trainer -------------------------------------------------------------------------------------

# 10 steps of moe_tiny with capacity drops and the aux-free bias (as ROUTING), a short warmup so that Muon's updates
# are large enough for a layout's mistake to show. Newton–Schulz in fp32: in bf16 the last-bit differences of another
# layout's reductions flip roundings that NS amplifies (measured: DDP on 2 ranks vs one process, grad norms 5e-5
# apart at step 3 and 1e-3 at step 10), which would hide a real mistake under the noise.
MUON = [
    "optim=muon", "optim.warmup_steps=2", "optim.muon.ns_dtype=float32", f"trainer.max_steps={STEPS}",
    "model.moe.capacity_factor=1.0", "model.moe.min_capacity=1", "model.moe.router.bias_update_rate=0.001",
]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("muon_one_process")
    moe_train(run_dir, *MUON, "trainer.save_final=true")
    return run_dir


@pytest.mark.slow
def test_one_process_learns_and_the_footprint_is_the_ledgers(one_process: Path) -> None:
    records = read_metrics(one_process)[0]
    assert records[STEPS]["loss"] < records[1]["loss"]
    first = records[1]
    assert first["memory/optimizer_state_bytes_per_rank"] == [first["ledger/optimizer_state_bytes_per_rank"]]


LAYOUTS = {
    "ddp": ["distributed=ddp"],  # every rank orthogonalises the same all-reduced gradient
    "fsdp": ["distributed=fsdp"],  # the matrices' rows gathered for NS; the experts' stacks split along E
    "ddp-ep2": ["distributed=ddp", "distributed.expert_parallel_size=2"],  # each expert on one rank
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_two_ranks_train_like_one_process(tmp_path: Path, one_process: Path, layout: str) -> None:
    moe_train(tmp_path, *MUON, *LAYOUTS[layout], nproc=2)
    records = assert_trains_like(tmp_path, one_process, rel=1e-5)
    first = records[1]
    assert first["memory/optimizer_state_bytes_per_rank"] == [first["ledger/optimizer_state_bytes_per_rank"]] * 2


@pytest.mark.slow
def test_a_stopped_run_resumes_bit_for_bit_with_its_momentum(tmp_path: Path, one_process: Path) -> None:
    """Stopped at step 3 (momentum and AdamW moments in the checkpoint), continued: every loss and grad norm, the
    final weights and trainer state equal the uninterrupted run's bit for bit."""
    Job(*MUON, stop_at=3).run(tmp_path)
    match = {"loss": EXACT, "grad_norm": EXACT}
    assert_resumes_exactly(tmp_path, one_process, Job(*MUON, "trainer.save_final=true"), match=match, weights=True)


@pytest.mark.slow
def test_an_fsdp_run_resumes_bit_for_bit_from_its_dcp_shards(tmp_path: Path) -> None:
    """FSDP2 on 2 ranks stopped at step 4 and continued on 2: the sharded momentum buffers come back through DCP."""
    reference = tmp_path / "uninterrupted"
    moe_train(reference, *MUON, "distributed=fsdp", nproc=2)
    run_dir = tmp_path / "run"
    Job(*MUON, "distributed=fsdp", nproc=2, stop_at=4).run(run_dir)
    match = {"loss": EXACT, "grad_norm": EXACT}
    assert_resumes_exactly(run_dir, reference, Job(*MUON, "distributed=fsdp", nproc=2), match=match)


@pytest.mark.slow
def test_an_expert_parallel_run_resumes_on_one_process(tmp_path: Path, one_process: Path) -> None:
    """EP 2 on 2 ranks stopped at step 4 (each rank's experts' momentum in the shards by global id), continued by
    one process holding every expert: it trains as the uninterrupted one (reduction order aside)."""
    Job(*MUON, "distributed=ddp", "distributed.expert_parallel_size=2", nproc=2, stop_at=4).run(tmp_path)
    close = {"loss": (1e-5, 1e-5), "grad_norm": (1e-5, 0.0)}
    assert_resumes_exactly(tmp_path, one_process, Job(*MUON), match=close)
