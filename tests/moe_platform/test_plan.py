"""moe-plan: the layouts it prints are ones the platform runs, ranked by the model it documents.

Properties checked: every printed command composes (Hydra, as moe-train and moe-submit compose it) to exactly the
config the planner predicted for, and that config passes start-up validation; what fits fits and what does not does
not, fastest first; the time model's terms move the way their formulas say; a config that fits nowhere names the
fewest nodes; the imbalance factor groups measured expert counts into the EP blocks a layout holds."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moe_platform.config import ConfigError, validate_launch
from moe_platform.launch import plan as moe_plan
from moe_platform.launch.compose import train_config
from moe_platform.launch.submit import main as moe_submit
from moe_platform.monitor.peak_memory import meta_transformer
from moe_platform.plan import imbalance as imbalances
from moe_platform.plan.hardware import GIGA, cluster_of, gpu_named
from moe_platform.plan.layouts import Layout, apply_layout, plan_layouts
from moe_platform.plan.memory import rank_memory
from moe_platform.plan.time_model import DEFAULT_ASSUMPTIONS, Assumptions, newton_schulz_flops, step_time
from moe_platform.train.optimizers import hidden_matrices, newton_schulz

MOE_SMALL = [
    "model=moe_small", "trainer.precision=bf16", "data.seq_len=1024", "data.global_batch_size=64",
    "trainer.micro_batch_size=1",
]  # fmt: skip
MIXTRAL = ["model=mixtral_like", "trainer.precision=bf16", "data.seq_len=4096", "data.global_batch_size=256"]


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        moe_plan.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("overrides", "cluster"),
    [(MOE_SMALL, ["--nodes", "1", "--gpus-per-node", "8", "--gpu", "A100-40GB"]),
     (MIXTRAL, ["--nodes", "2", "--gpus-per-node", "8", "--gpu", "H200"])],
    ids=["moe_small-8xA100", "mixtral-16xH200"],
)  # fmt: skip
def test_every_printed_command_composes_to_the_planned_config_and_passes_start_up(capsys, overrides, cluster) -> None:
    code, out, _ = run_plan(capsys, *overrides, *cluster, "--top", "8", "--json")
    assert code == 0
    planned = json.loads(out)
    assert planned["fit"] >= len(planned["layouts"]) > 0
    world = int(cluster[1]) * int(cluster[3])
    base = train_config(overrides)
    times = []
    for entry in planned["layouts"]:
        assert entry["command"].startswith(f"moe-submit --nodes={cluster[1]} --gpus-per-node={cluster[3]}")
        composed = train_config(entry["overrides"])
        validate_launch(composed, world, has_gpu=True)
        assert composed == apply_layout(base, Layout(**entry["layout"]))
        memory = entry["memory_bytes"]
        assert memory["total"] <= memory["usable"]
        times.append(entry["step_seconds"]["total"])
    assert times == sorted(times)


def test_what_fits_fits_and_what_does_not_does_not() -> None:
    config = train_config(MIXTRAL)
    cluster = cluster_of(2, 8, "H100")
    planning = plan_layouts(config, cluster)
    assert planning.fitting and planning.too_large and planning.refused
    for plan in planning.fitting:
        assert plan.memory.total <= plan.usable_bytes
    for plan in planning.too_large:
        assert plan.memory.total > plan.usable_bytes
    # Plain DDP replicates 46.7 B parameters' 16 B each on every rank: it cannot be among the fitting.
    plain = [p for p in planning.fitting if p.layout == Layout("ddp", micro_batch_size=p.layout.micro_batch_size,
                                                                checkpointing=p.layout.checkpointing)]  # fmt: skip
    assert not plain


def test_time_model_terms_follow_their_formulas() -> None:
    config = train_config([*MOE_SMALL, "distributed=fsdp", "distributed.expert_parallel_size=4"])
    fast, slow = cluster_of(2, 8, "H100"), cluster_of(2, 8, "H100", inter_node_gbps=100, intra_node_gbps=800)
    base = step_time(config, fast)
    assert step_time(config, slow).data_parallel > base.data_parallel  # FSDP over 16 ranks crosses nodes
    assert step_time(config, slow).all_to_all > base.all_to_all  # EP 4 stays in a node: NVLink slowed 4.5×
    assert base.pipeline_p2p == 0 and base.bubble == 0
    busier = step_time(config, fast, imbalance=1.5)
    assert busier.all_to_all == pytest.approx(1.5 * base.all_to_all) and busier.compute > base.compute
    halved = step_time(config, fast, dataclasses.replace(DEFAULT_ASSUMPTIONS, matmul_efficiency=0.3))
    assert halved.compute > base.compute and halved.mfu < base.mfu
    # FSDP's traffic is gathers and reduce-scatters: slowing either kind slows it; an all-reduce-only DDP keeps its.
    slower_rs = step_time(config, slow, dataclasses.replace(DEFAULT_ASSUMPTIONS, reduce_scatter_speed=0.4))
    slower_ag = step_time(config, slow, dataclasses.replace(DEFAULT_ASSUMPTIONS, all_gather_speed=0.4))
    assert min(slower_rs.data_parallel, slower_ag.data_parallel) > step_time(config, slow).data_parallel
    ddp = train_config([*MOE_SMALL, "distributed=ddp"])
    ddp_rs = step_time(ddp, slow, dataclasses.replace(DEFAULT_ASSUMPTIONS, reduce_scatter_speed=0.4))
    assert ddp_rs.data_parallel == step_time(ddp, slow).data_parallel
    # The optimizer's passes over the training state add memory-bound time, linearly.
    passes = [step_time(config, fast, dataclasses.replace(DEFAULT_ASSUMPTIONS, optimizer_passes=n)) for n in (2, 4, 6)]
    assert passes[2].compute - passes[1].compute == pytest.approx(passes[1].compute - passes[0].compute)
    assert passes[1].compute > passes[0].compute
    # The model's MFU is the ratio it documents: training matmul FLOPs per token × tokens/s over W × peak.
    assert base.mfu == pytest.approx(
        base.model_flops_per_token * base.tokens_per_s / (16 * gpu_named("H100").peak("bf16"))
    )
    piped = train_config([*MOE_SMALL, "distributed=ddp", "distributed.pipeline_parallel_size=4"])
    gpipe = step_time(piped, fast)
    assert gpipe.bubble > 0 and gpipe.pipeline_p2p > 0
    single = train_config([*MOE_SMALL, "data.global_batch_size=8", "trainer.micro_batch_size=8"])
    assert step_time(single, cluster_of(1, 1, "H100")).data_parallel == 0


def test_assumptions_and_gpus_are_named_and_refused_in_one_sentence() -> None:
    assert DEFAULT_ASSUMPTIONS.with_overrides(["comm_efficiency=0.5"]).comm_efficiency == 0.5
    assert DEFAULT_ASSUMPTIONS.with_overrides(["matmul_dtype=fp8"]).matmul_dtype == "fp8"
    with pytest.raises(ValueError, match="not name=value for one of"):
        DEFAULT_ASSUMPTIONS.with_overrides(["matmul_speed=2"])
    assert gpu_named("h100") == gpu_named("H100-SXM") and gpu_named("a100_80gb").name == "A100-80GB"
    with pytest.raises(ConfigError, match="not in the catalog"):
        gpu_named("TPU")
    assert cluster_of(1, 8, "H100", inter_node_gbps=400).inter_node_bandwidth == 50 * GIGA
    with pytest.raises(ValueError, match="bf16"):
        gpu_named("A100").peak("fp8")
    assert Assumptions().matmul_efficiency < 1


def test_the_table_the_ledger_and_the_launch_commands_are_printed(capsys) -> None:
    code, out, _ = run_plan(capsys, *MOE_SMALL, "--nodes", "1", "--gpus-per-node", "8", "--top", "3")
    assert code == 0 and "layouts:" in out and "step s" in out and "MFU" in out
    assert out.count("moe-submit --nodes=1 --gpus-per-node=8 --gpu=H100 -- model=moe_small") == 3
    code, out, _ = run_plan(capsys, *MOE_SMALL, "--nodes", "1", "--gpus-per-node", "8", "--explain", "1")
    assert code == 0 and "Training state per rank" in out and "Step time" in out and "Peak memory per rank" in out


def test_a_model_that_fits_nowhere_here_names_the_fewest_nodes(capsys) -> None:
    code, out, err = run_plan(capsys, *MIXTRAL, "--nodes", "1", "--gpus-per-node", "2", "--gpu", "A100-40GB")
    assert code == 1 and "0 fit" in out
    assert "the fewest that fit:" in err and "rerun with --nodes" in err
    code, _, err = run_plan(capsys, "model=no_such_model", "--nodes", "1")
    assert code == 2 and err.startswith("config error:") and "Traceback" not in err


def test_imbalance_groups_measured_counts_into_each_layouts_expert_blocks(tmp_path: Path) -> None:
    # Two MoE layers of 4 experts; layer 1's load is lopsided towards experts 0 and 1.
    records = [{"step": s, "loss": 1.0, "moe/layer_0/tokens_per_expert": [10, 10, 10, 10],
                "moe/layer_1/tokens_per_expert": [30, 10, 0, 0]} for s in range(1, 5)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    measured = imbalances.from_run(tmp_path)
    assert measured.factor(1) == 1.0
    assert measured.factor(2) == pytest.approx(40 / 20)  # blocks {0,1}, {2,3} of layer 1
    assert measured.factor(4) == pytest.approx(30 / 10)  # 1 + MaxVio of layer 1
    with pytest.raises(ValueError, match="does not divide"):
        measured.factor(3)
    capped = train_config(["model=moe_small", "model.moe.capacity_factor=1.25"])
    assert imbalances.from_config(capped.model).factor(4) == 1.25
    with pytest.raises(ValueError, match="no tokens_per_expert"):
        (tmp_path / "dense").mkdir()
        (tmp_path / "dense" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
        imbalances.from_run(tmp_path / "dense")
    # The busiest rank's share enters the memory the plan sizes, and never lowers it.
    config = train_config([*MOE_SMALL, "distributed=fsdp", "distributed.expert_parallel_size=4"])
    assert rank_memory(config, 8, imbalance=2.0).total > rank_memory(config, 8).total


def test_moe_submit_refuses_what_cannot_fit_its_gpus_and_names_what_would(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    options = ["--nodes=1", "--gpus-per-node=8", "--gpu=H200", "--dry-run", "--"]
    with pytest.raises(SystemExit) as exit_:
        moe_submit([*options, *MIXTRAL, "distributed=ddp", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "per GPU at its peak" in err and "nothing was submitted" in err
    named = err.split("run ", 1)[1].split(" instead")[0].split()
    composed = train_config([*MIXTRAL, *named])
    validate_launch(composed, 8, has_gpu=True)
    cluster = cluster_of(1, 8, "H200")
    assert rank_memory(composed, 8).total <= plan_layouts(composed, cluster).fitting[0].usable_bytes
    assert not run_dir.exists()
    moe_submit([*options, *MIXTRAL, *named, f"hydra.run.dir={run_dir}"])
    assert (run_dir / "train.sbatch").is_file()


def newton_schulz_flops_counted(shape: tuple[int, ...], steps: int = 5) -> int:
    """What torch's FLOP counter reads off train/optimizers.py's Newton–Schulz of a tensor of `shape` (on meta)."""
    counter = FlopCounterMode(display=False)
    with counter:
        newton_schulz(torch.empty(shape, device="meta"), steps)
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (64, 64), (3, 32, 96)], ids=str)
def test_the_newton_schulz_flops_are_what_torch_counts_of_the_optimizers_own(shape: tuple[int, ...]) -> None:
    experts = shape[0] if len(shape) == 3 else 1
    assert experts * newton_schulz_flops(shape[-2], shape[-1], 5) == newton_schulz_flops_counted(shape)


def test_muon_adds_its_newton_schulz_and_fsdps_gathers_to_the_step() -> None:
    """Under DDP every rank runs NS on every hidden matrix of the model (the FLOPs torch counts of the optimizer's
    own NS, at the matmul rate); expert parallelism splits the experts' share, a pipeline its layers; FSDP adds the
    gathers of the 2-D matrices; AdamW has no such term."""
    node = cluster_of(1, 8, "H100")

    def timed(*overrides: str, cluster=node):
        return step_time(train_config([*MOE_SMALL, *overrides]), cluster)

    ddp = train_config([*MOE_SMALL, "distributed=ddp", "optim=muon"])
    counted = sum(newton_schulz_flops_counted(tuple(p.shape)) for _, p in hidden_matrices(meta_transformer(ddp.model)))
    peak = gpu_named("H100").peak("bf16") * DEFAULT_ASSUMPTIONS.matmul_efficiency
    muon, adamw = timed("distributed=ddp", "optim=muon"), timed("distributed=ddp")
    assert muon.muon == pytest.approx(counted / peak, rel=1e-9)
    assert adamw.muon == 0 and muon.total > adamw.total  # (Muon's one buffer moves less state: compute is lower)
    terms = muon.compute + muon.all_to_all + muon.data_parallel + muon.pipeline_p2p + muon.bubble + muon.muon
    assert muon.total == pytest.approx(terms)
    assert timed("distributed=ddp", "optim=muon", "distributed.expert_parallel_size=8").muon < muon.muon
    assert timed("distributed=ddp", "optim=muon", "distributed.pipeline_parallel_size=2").muon < muon.muon
    assert timed("distributed=ddp", "optim=muon", "optim.muon.ns_dtype=float32").muon > muon.muon  # the fp32 rate
    fsdp = ("distributed=fsdp", "optim=muon", "data.global_batch_size=128")
    slow_nic = timed(*fsdp, cluster=cluster_of(2, 8, "H100", inter_node_gbps=25))
    assert slow_nic.muon > timed(*fsdp, cluster=cluster_of(2, 8, "H100")).muon  # its gathers cross the NIC
