"""What each rank really holds, measured by monitor/footprint.py in real 4-rank gloo runs, against the ledger's
per-rank figures: parameters, master weights, gradients and AdamW state under FSDP2, FSDP2 + EP and ZeRO-2 + EP.
(One step each: the optimizer state exists after the first; test_distributed.py and test_expert_parallel.py keep
the older optimizer-state and parameter checks of DDP, ZeRO-1 and ZeRO-3.)"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from moe import ModelConfig, RunShape, Transformer, count_parameters
from moe.experts import GroupedExperts
from moe.ledger import training_state_bytes_per_rank
from moe_platform.launch.compose import conf_dir
from moe_platform.testing import moe_train, read_metrics

pytestmark = pytest.mark.slow
WORLD = 4
FIGURES = {  # record key → bytes per stored parameter element (fp32 runs)
    "params": 1,
    "param_bytes": 4,
    "master_bytes": 4,
    "grad_bytes": 4,
    "optimizer_state_bytes": 8,
}


def moe_tiny() -> ModelConfig:
    """The model `moe_train` trains (model=moe_tiny), as Hydra composes it."""
    yaml = OmegaConf.load(conf_dir() / "model" / "moe_tiny.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml))


def first_record(run_dir: Path, *overrides: str) -> dict:
    moe_train(run_dir, *overrides, "trainer.max_steps=1", nproc=WORLD)
    return read_metrics(run_dir)[0][1]


def uneven_rows(ep: int) -> int:
    """FSDP2 gives each rank ⌈rows/shards⌉ rows of a tensor (torch.chunk), the last ranks fewer, so a rank may hold
    up to (shards - 1) rows more or less than rows/shards of every tensor whose rows the shards do not divide: the
    tolerance, in elements, of one rank's figures against the ledger's mean (moe_tiny: the 258-row embedding and
    head; the sum over ranks must still be exact)."""
    with torch.device("meta"):
        model = Transformer(moe_tiny())
    experts = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    slack = 0
    for p in model.parameters():
        rows, shards = (p.shape[0] // ep, WORLD // ep) if id(p) in experts else (p.shape[0], WORLD)
        if rows % shards:
            slack += (shards - 1) * (p.numel() // p.shape[0])
    return slack


def assert_each_rank_holds_the_ledgers_share(first: dict, slack_elements: int, padded: bool = False) -> None:
    """Each rank's measured figure within `slack_elements` of the ledger's, and (unless DeepSpeed `padded` its
    partitions) their sum exactly W times it: every element is stored once among the shards, or once per copy."""
    for name, bytes_per_element in FIGURES.items():
        measured, ledger = first[f"memory/{name}_per_rank"], first[f"ledger/{name}_per_rank"]
        assert len(measured) == WORLD, name
        if not padded:
            assert sum(measured) == WORLD * ledger, (name, measured, ledger)
        for held in measured:
            assert abs(held - ledger) <= slack_elements * bytes_per_element, (name, measured, ledger)


@pytest.mark.parametrize("ep", [1, 2])
def test_fsdp_ranks_hold_the_ledgers_shards(tmp_path: Path, ep: int) -> None:
    """Every part 1/W of the model (experts: E/EP of them over the W/EP expert-data-parallel ranks, routed / W), no
    master copy (the fp32 shards are the master)."""
    first = first_record(tmp_path, "distributed=fsdp", f"distributed.expert_parallel_size={ep}")
    total = count_parameters(moe_tiny()).total
    assert first["ledger/params_per_rank"] == pytest.approx(total / WORLD)
    assert first["memory/master_bytes_per_rank"] == [0] * WORLD
    assert_each_rank_holds_the_ledgers_share(first, uneven_rows(ep))


def test_zero2_partitions_the_experts_state_over_their_expert_data_parallel_ranks(tmp_path: Path) -> None:
    """EP=2 of W=4: each expert block lives on 2 ranks, and DeepSpeed 0.19.8 partitions its fp32 master, gradients
    and m, v over those 2 (DeepSpeed issue #7156 says it does not): each rank's optimizer state is
    8 B · (replicated / 4 + routed / 2 / 2), not 8 B · (replicated / 4 + routed / 2). Weights are whole (fp32 views
    of DeepSpeed's flat buffer). DeepSpeed pads each parameter to 16 B and each flat group to an alignment: a few
    elements, within the slack of one element per parameter tensor."""
    first = first_record(tmp_path, "distributed=zero2", "distributed.expert_parallel_size=2")
    config = moe_tiny()
    with torch.device("meta"):
        tensors = len(list(Transformer(config).parameters()))
    assert_each_rank_holds_the_ledgers_share(first, tensors, padded=True)
    params = count_parameters(config)
    unpartitioned = 8 * ((params.total - params.routed_experts) / WORLD + params.routed_experts / 2)
    partitioned = training_state_bytes_per_rank(config, RunShape(zero_stage=2, dp_size=WORLD, ep_size=2)).optimizer
    assert partitioned < unpartitioned
    assert first["memory/optimizer_state_bytes_per_rank"] == [pytest.approx(partitioned, abs=4 * tensors)] * WORLD
