"""Exact resume in every layout a run can stop and resume in: a run stopped after step k (trainer.stop_at) and
continued with resume=auto, on the same or another world size, ZeRO layout or EP size, logs every step once and
trains as the uninterrupted run does (`assert_resumes_exactly` in moe_platform/testing.py states the property).

Where the layout is unchanged the losses are equal bit for bit (fp32 on CPU). Where it changes, only the order of
floating-point reductions may differ, so they are held to the tolerance of the uninterrupted single-process run
that test_distributed.py and test_expert_parallel.py hold straight multi-rank runs to. Each case also checks the
state it is about: exported weights, the router's balancing bias, the wandb run, the universal copy, expert files
by global id, and the refusal of a resize or stage change that would not continue exactly (said in one line, the
stopped run left as it was). The uninterrupted runs are module fixtures, one per config, shared by its cases.

A stop by signal is in test_preemption.py, by SIGKILL at random points in test_chaos.py, a resume past a damaged
checkpoint in test_checkpoint_integrity.py: they state the same property with the same helper."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moe_platform.checkpoint.catalog import latest_checkpoint, step_dirname
from moe_platform.interop.export import load_exported_model
from moe_platform.testing import EXACT, ROUTING, Job, assert_resumes_exactly, read_metrics

pytestmark = pytest.mark.slow

# The losses of a layout that changed, as test_distributed.py holds 2 ranks to 1 process: (rel, abs).
CLOSE = {"loss": (1e-5, 1e-5), "grad_norm": (1e-4, 0.0)}
BIT_FOR_BIT = {"loss": EXACT, "grad_norm": EXACT}
# 6 steps of the FAST defaults (moe_platform.testing); the final checkpoint holds the bias after the last step.
DEEPSEEK = ("model=deepseek_v3_like_tiny", "distributed=zero2", "trainer.save_final=true")
# ROUTING (20 steps): EP runs match one process as test_expert_parallel.py holds them to.
EP_CLOSE = {
    "loss": (1e-5, 1e-5),
    "grad_norm": (1e-5, 0.0),
    "aux_loss": (1e-5, 1e-7),
    **{f"moe/layer_{layer}/tokens_per_expert": EXACT for layer in range(4)},
}
UNINTERRUPTED = {
    "moe_tiny": Job("trainer.save_final=true"),
    "deepseek_v3_like_tiny": Job(*DEEPSEEK, nproc=2),
    "routing": Job(*ROUTING),
}


def ep(size: int) -> str:
    return f"distributed.expert_parallel_size={size}"


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / step_dirname(step)


# ---- what single cases check besides the property ----------------------------------------------------------------


def the_wandb_run_continues(run_dir: Path, _: Path) -> None:
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(run.name.endswith(f"-{run_id}") for run in offline_runs)


def the_universal_copy_was_made_from_the_shards(run_dir: Path, _: Path) -> None:
    """ZeRO-1/2 shards of 2 ranks reach 1 rank through DeepSpeed's universal checkpoint, converted once on resume."""
    assert (checkpoint(run_dir, 3) / "universal").is_dir()


def expert_biases(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every router's `expert_bias` from the ZeRO-2 module state that rank 0 saved at `step`."""
    (states,) = checkpoint(run_dir, step).rglob("mp_rank_00_model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    return {name: tensor for name, tensor in module.items() if name.endswith("router.expert_bias")}


def deepseek_trains_and_its_balancing_bias_comes_back(run_dir: Path, uninterrupted: Path) -> None:
    """MLA, group-limited sigmoid routing with the balancing bias, routed scaling, a shared expert, a first dense
    layer: it trains, and the bias (a buffer, not a parameter: no optimizer holds it) is restored on resume."""
    train, _ = read_metrics(uninterrupted)
    assert all(torch.isfinite(torch.tensor(train[step]["loss"])) for step in train)
    assert train[6]["loss"] < train[1]["loss"], "it trains"
    # Layer 0 is dense (first_dense_layers=1); layers 1 and 2 route.
    assert set(train[6]) >= {"moe/layer_1/tokens_per_expert", "moe/layer_2/tokens_per_expert"}
    final, resumed = expert_biases(uninterrupted, 6), expert_biases(run_dir, 6)
    # and the MTP module's MoE block (moe/mtp.py) routes and balances as they do.
    assert sorted(final) == [
        "blocks.1.ffn.router.expert_bias", "blocks.2.ffn.router.expert_bias", "mtp.0.block.ffn.router.expert_bias"
    ]  # fmt: skip
    for name, bias in final.items():
        assert bias.abs().sum() > 0, f"{name}: the bias moved during training, so restoring it is tested"
        assert torch.equal(resumed[name], bias), f"{name}: the resumed run's bias equals the uninterrupted run's"
    stopped = expert_biases(run_dir, 3)
    assert any(not torch.equal(stopped[name], final[name]) for name in final), "the bias kept moving after resume"


def experts_are_stored_by_global_id(run_dir: Path) -> None:
    assert sorted(p.name for p in (latest_checkpoint(run_dir) / "experts").iterdir()) == [
        "experts_00000_00002.safetensors",
        "experts_00002_00004.safetensors",
    ], "experts are stored by global id, one file per EP block"


def the_ep_4_checkpoint_exports_whole(run_dir: Path, _: Path) -> None:
    """The consolidated export of the EP=4 checkpoint is the whole model: it reproduces the run's eval loss."""
    model = load_exported_model(latest_checkpoint(run_dir))
    assert model.blocks[0].ffn.experts.w_up.shape[0] == 4
    _, evals = read_metrics(run_dir)
    assert evals[20]["eval/loss"] == pytest.approx(eval_loss(model, run_dir), rel=1e-5)


def a_universal_copy_is_written_on_save(run_dir: Path) -> None:
    assert (latest_checkpoint(run_dir) / "universal" / "pytorch_model" / "zero").is_dir()


def zero2_ep_checkpoints_export_whole(run_dir: Path, _: Path) -> None:
    model = load_exported_model(latest_checkpoint(run_dir))  # a ZeRO-2 checkpoint at EP 1: DeepSpeed's own path
    assert model.blocks[0].ffn.experts.w_up.shape[0] == 4
    exported = load_exported_model(checkpoint(run_dir, 14))  # EP 4: the universal copy
    assert [block.ffn.experts.w_up.shape[0] for block in exported.blocks if hasattr(block.ffn, "experts")] == [4] * 4


def eval_loss(model: torch.nn.Module, run_dir: Path) -> float:
    """The trainer's eval on one process: its validation batches, mean token loss."""
    from data_pipeline import build_loaders
    from moe_platform.config import load_run_config

    config = load_run_config(run_dir / "config.yaml")
    data = build_loaders(
        config.data, rank=0, world_size=1, micro_batch_size=config.trainer.micro_batch_size,
        model_vocab_size=config.model.vocab_size,
    )  # fmt: skip
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in data.val:
            logits = model(batch["input_ids"]).logits
            loss_sum += float(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            )
            tokens += batch["labels"].numel()
    return loss_sum / tokens


# ---- the cases ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    uninterrupted: str  # a key of UNINTERRUPTED: the run this one must equal
    first: Job  # the job that stops
    resumes: tuple[Job, ...]  # the jobs that continue it; all but the last stop again
    match: dict  # the keys compared at every step, with their tolerance (assert_resumes_exactly)
    weights: bool = False  # the last checkpoints' weights and trainer state too (both runs save at the end)
    refused: tuple[tuple[Job, str], ...] = ()  # starts refused on the stopped run, each with its sentence
    printed: str = ""  # a line the uninterrupted run prints
    after_stop: Callable[[Path], None] | None = None
    after: Callable[[Path, Path], None] | None = None  # (the resumed run, the uninterrupted run)


CASES = [
    Case(
        "single, wandb continues",
        "moe_tiny",
        Job("logging=wandb", stop_at=3),
        (Job("logging=wandb", "trainer.save_final=true"),),
        BIT_FOR_BIT,
        weights=True,
        after=the_wandb_run_continues,
    ),
    Case("ddp on 2 ranks, then 1 process", "moe_tiny", Job("distributed=ddp", nproc=2, stop_at=3), (Job(),), CLOSE),
    Case(
        "zero1 on 2 ranks, then 1",
        "moe_tiny",
        Job("distributed=zero1", nproc=2, stop_at=3),
        (Job("distributed=zero1"),),
        CLOSE,
        after=the_universal_copy_was_made_from_the_shards,
    ),
    Case(
        "zero2 on 2 ranks, then 1; zero1 refused",
        "moe_tiny",
        Job("distributed=zero2", nproc=2, stop_at=3),
        (Job("distributed=zero2"),),
        CLOSE,
        refused=((Job("distributed=zero1"), "holds ZeRO-2 state but this job runs ZeRO-1"),),
        after=the_universal_copy_was_made_from_the_shards,
    ),
    # No ZeRO-3 run of its own as the reference (one more 2-rank start): the single process's, at CLOSE, as
    # test_distributed holds a straight ZeRO-3 run to it.
    Case(
        "zero3 on 2 ranks, again on 2; 1 refused",
        "moe_tiny",
        Job("distributed=zero3", nproc=2, stop_at=3),
        (Job("distributed=zero3", nproc=2),),
        CLOSE,
        refused=((Job("distributed=zero3"), "ZeRO-3 resumes on the same world size only"),),
    ),
    Case(
        "deepseek_v3_like_tiny, zero2 on 2 ranks, again on 2",
        "deepseek_v3_like_tiny",
        Job(*DEEPSEEK, nproc=2, stop_at=3),
        (Job(*DEEPSEEK, nproc=2),),
        BIT_FOR_BIT,
        weights=True,
        printed="2 rank(s), DEEPSPEED, model wrapped as DeepSpeedEngine",
        after=deepseek_trains_and_its_balancing_bias_comes_back,
    ),
    Case(
        "ddp, EP 2 on 4 ranks, EP 1 on 2, EP 4 on 4",
        "routing",
        Job(*ROUTING, "distributed=ddp", ep(2), nproc=4, stop_at=4),
        (
            Job(*ROUTING, "distributed=ddp", nproc=2, stop_at=9),
            Job(*ROUTING, "distributed=ddp", ep(4), "trainer.save_final=true", "trainer.eval_every=20", nproc=4),
        ),
        EP_CLOSE,
        after_stop=experts_are_stored_by_global_id,
        after=the_ep_4_checkpoint_exports_whole,
    ),
    # EP 2 on 4 ranks twice: DeepSpeed reloads the module from rank 0's file, EP rank 0's experts, so the other EP
    # ranks must get their own block back or the first resumed step is silently wrong. The last two resumes go
    # through the universal copy written on save.
    Case(
        "zero2, EP 2 on 4 ranks, again, EP 4 on 4, EP 1 on 2",
        "routing",
        Job(*ROUTING, "distributed=zero2", ep(2), nproc=4, stop_at=8),
        (
            Job(*ROUTING, "distributed=zero2", ep(2), nproc=4, stop_at=10),
            Job(*ROUTING, "distributed=zero2", ep(4), nproc=4, stop_at=14),
            Job(*ROUTING, "distributed=zero2", ep(1), "trainer.save_final=true", nproc=2),
        ),
        EP_CLOSE,
        after_stop=a_universal_copy_is_written_on_save,
        after=zero2_ep_checkpoints_export_whole,
    ),
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Callable[[str], tuple[Path, str]]:
    """(run dir, stdout) of each config's uninterrupted run, started the first time a case asks for it."""
    runs: dict[str, tuple[Path, str]] = {}

    def run(name: str) -> tuple[Path, str]:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(name)
            runs[name] = (run_dir, UNINTERRUPTED[name].run(run_dir).stdout)
        return runs[name]

    return run


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_stopped_run_resumes_exactly(tmp_path: Path, uninterrupted, case: Case) -> None:
    reference, printed = uninterrupted(case.uninterrupted)
    assert case.printed in printed
    run_dir = tmp_path / "run"
    case.first.run(run_dir)
    if case.after_stop:
        case.after_stop(run_dir)
    for job, sentence in case.refused:
        metrics = (run_dir / "metrics.jsonl").read_text()
        result = job.run(run_dir, "resume=auto", check=False)
        assert result.returncode == 2 and sentence in result.stderr, result.stderr[-3000:]
        assert (run_dir / "metrics.jsonl").read_text() == metrics, "the refused start left the run as it was"
    stops = assert_resumes_exactly(run_dir, reference, *case.resumes, match=case.match, weights=case.weights)
    assert stops == [case.first.stop_at, *(job.stop_at for job in case.resumes[:-1])]
    if case.after:
        case.after(run_dir, reference)
