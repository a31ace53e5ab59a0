"""Checkpoints of FSDP runs (DCP, checkpoint/sharded.py): every rank writes its shards, and a checkpoint resumes at
another layout (world size, EP size, FSDP or HSDP, DDP or one process) as if the run had never stopped; moe-export
and init.from_path read it whole; a pickle planted in DCP's index never runs.

Every 4-rank start costs ~20 s on two cores, so one chain of runs serves every assertion but the Hugging Face
export's (whose run must leave out the balancing bias):
  fsdp_ep2     FSDP + EP 2 on 4 ranks, steps 1–6, a checkpoint every 2 steps: the uninterrupted run of that layout
  one_process  the same training in one process, 20 steps: the uninterrupted run every layout must match
  the chain    a copy of fsdp_ep2 resumed from its step 4 at the same layout to step 6 (bit for bit fsdp_ep2); ZeRO-2
               refused; its step-6 index replaced by a pickle that would create a file (resume=auto takes step 4) → HSDP
               on 2 ranks to step 9 → one process to 12 → DDP + EP 2 on 2 ranks to 15 → FSDP + EP 4 on 4 ranks to 20:
               one_process's losses within 1e-6 at every step, its tokens per expert exactly, its data position
"""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from moe import Transformer
from moe_platform.checkpoint import manifest
from moe_platform.checkpoint.catalog import step_dirname
from moe_platform.checkpoint.checkpointer import TRAINER_STATE
from moe_platform.checkpoint.consolidate import export_fp32_state_dict
from moe_platform.config import load_run_config
from moe_platform.interop.export import load_exported_model
from moe_platform.interop.export import main as moe_export
from moe_platform.testing import EXACT, ROUTING, Job, assert_resumes_exactly, read_metrics

pytestmark = pytest.mark.slow

SAVING = ("trainer.save_every=2", "trainer.keep_last=3")
FSDP_EP2 = Job(*ROUTING, *SAVING, "distributed=fsdp", "distributed.expert_parallel_size=2", nproc=4, stop_at=6)
# Another layout changes only the order of floating-point reductions: within 1e-6 of the one-process run, routing
# alike (capacity drops and the balancing bias included).
CLOSE = {
    "loss": (1e-6, 1e-6),
    "grad_norm": (1e-5, 1e-6),
    "aux_loss": (1e-5, 1e-7),
    **{f"moe/layer_{layer}/tokens_per_expert": EXACT for layer in range(4)},
}
BIT_FOR_BIT = ("loss", "grad_norm", "aux_loss", *(f"moe/layer_{layer}/tokens_per_expert" for layer in range(4)))


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / step_dirname(step)


@pytest.fixture(scope="module")
def fsdp_ep2(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fsdp_ep2")
    FSDP_EP2.run(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one_process")
    Job(*ROUTING, "trainer.save_every=6", "trainer.keep_last=4", "trainer.save_final=true").run(run_dir)
    return run_dir


def test_the_checkpoint_holds_every_ranks_shards_and_an_index_of_safe_globals(fsdp_ep2: Path) -> None:
    path = checkpoint(fsdp_ep2, 6)
    files = manifest.read(path)["files"]
    assert {"dcp/.metadata", *(f"dcp/__{rank}_0.distcp" for rank in range(4))} <= set(files)
    assert not any(name.endswith((".safetensors", "optimizer.bin")) for name in files), "no whole-tensor file"
    assert manifest.unsafe_globals(path / "dcp" / ".metadata") == set()


def test_moe_export_and_init_from_read_an_fsdp_ep_checkpoint_whole(
    tmp_path: Path, fsdp_ep2: Path, one_process: Path
) -> None:
    """The export has the one-process model's keys and shapes (it loads strictly) and its weights after the same 6
    steps; init.from_path starts from the same tensors."""
    path = checkpoint(fsdp_ep2, 6)
    moe_export([str(path), str(tmp_path / "model.pt")])
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    single = export_fp32_state_dict(checkpoint(one_process, 6))
    model = Transformer(load_run_config(path / "config.yaml").model)
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in model.state_dict().items()}
    model.load_state_dict(exported, strict=True)
    assert exported["blocks.0.ffn.experts.w_up"].shape[0] == 4, "the experts of both EP blocks, by global id"
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, single[name], rtol=1e-5, atol=1e-6, msg=name)

    from moe_platform.interop.init_from import initial_state_dict

    config = load_run_config(path / "config.yaml")
    config.init.from_path = str(fsdp_ep2)  # a run dir: its newest checkpoint
    state = initial_state_dict(config)
    assert state.keys() == exported.keys() and all(torch.equal(state[k], exported[k]) for k in state)


def test_moe_export_writes_an_fsdp_ep_checkpoint_in_hugging_face_format(tmp_path: Path) -> None:
    """In its own short run: ROUTING's balancing bias has no Hugging Face counterpart (the export refuses it)."""
    import transformers

    Job("distributed=fsdp", "distributed.expert_parallel_size=2", "trainer.max_steps=2", "trainer.save_final=true",
        nproc=2).run(tmp_path / "run")  # fmt: skip
    path = checkpoint(tmp_path / "run", 2)
    moe_export([str(path), str(tmp_path / "hf"), "--format", "hf"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = load_exported_model(path).eval()
    assert theirs.config.num_local_experts == ours.config.moe.num_experts
    ids = torch.randint(0, ours.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-5)


def test_the_pickle_scan_follows_names_fetched_back_from_the_memo(tmp_path: Path) -> None:
    """DCP's index names `torch` once and fetches it from the memo for every later dtype; a pickler does the same
    with any module, so a refused call behind a memoized name is still seen."""
    path = tmp_path / "index"
    path.write_bytes(pickle.dumps([torch.float32, torch.int64, os.getcwd, os.system], protocol=4))
    assert manifest.unsafe_globals(path) == {"posix.getcwd", "posix.system"}


class _RunsCode:
    """Unpickling this creates `marker`: what a tampered index would do when DCP calls pickle.load on it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant_pickle(index: Path, marker: Path) -> None:
    """Replace DCP's index with a pickle that runs code, and rewrite the manifest to match (as an attacker with
    write access to the checkpoint could): only the opcode scan can tell."""
    index.write_bytes(pickle.dumps(_RunsCode(marker), protocol=4))
    directory = index.parent.parent
    saved = json.loads((directory / manifest.MANIFEST).read_text())
    saved["files"]["dcp/.metadata"] = {"bytes": index.stat().st_size, "sha256": manifest.sha256(index)}
    (directory / manifest.MANIFEST).write_text(json.dumps(saved))


def test_a_chain_of_layouts_continues_the_uninterrupted_runs(tmp_path: Path, fsdp_ep2: Path, one_process: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_ep2, run_dir)

    # The same layout, from the step-4 checkpoint: steps 5 and 6 and the weights bit for bit.
    FSDP_EP2.run(run_dir, f"resume={checkpoint(run_dir, 4)}")
    ours, theirs = read_metrics(run_dir)[0], read_metrics(fsdp_ep2)[0]
    assert sorted(ours) == list(range(1, 7))
    assert [[ours[step][key] for key in BIT_FOR_BIT] for step in (5, 6)] == [
        [theirs[step][key] for key in BIT_FOR_BIT] for step in (5, 6)
    ]
    resumed, straight = (export_fp32_state_dict(checkpoint(run, 6)) for run in (run_dir, fsdp_ep2))
    assert [name for name in straight if not torch.equal(resumed[name], straight[name])] == []
    assert (checkpoint(run_dir, 6) / TRAINER_STATE).read_text() == (checkpoint(fsdp_ep2, 6) / TRAINER_STATE).read_text()

    # DeepSpeed is refused in one sentence, before any process group, the run left as it was.
    metrics = (run_dir / "metrics.jsonl").read_text()
    refused = Job(*ROUTING, "distributed=zero2").run(run_dir, "resume=auto", check=False)
    assert refused.returncode == 2 and "moe-export the weights" in refused.stderr, refused.stderr[-2000:]
    assert (run_dir / "metrics.jsonl").read_text() == metrics

    # A pickle planted in the newest index never runs; resume=auto takes the previous checkpoint, at another layout.
    marker = tmp_path / "code_ran"
    plant_pickle(checkpoint(run_dir, 6) / "dcp" / ".metadata", marker)
    hsdp = Job(*ROUTING, *SAVING, "distributed=hsdp", nproc=2, stop_at=9)
    result = hsdp.run(run_dir, "resume=auto")
    output = result.stdout + result.stderr
    assert not marker.exists(), "the planted pickle ran"
    assert "would call io.open" in output and f"resumed from {checkpoint(run_dir, 4)} at step 4" in output
    assert (run_dir / "checkpoints" / "abandoned" / step_dirname(6)).is_dir(), "the refused one is set aside"

    stops = assert_resumes_exactly(
        run_dir,
        one_process,
        Job(*ROUTING, *SAVING, stop_at=12),
        Job(*ROUTING, *SAVING, "distributed=ddp", "distributed.expert_parallel_size=2", nproc=2, stop_at=15),
        Job(*ROUTING, *SAVING, "distributed=fsdp", "distributed.expert_parallel_size=4", "trainer.save_final=true",
            nproc=4),
        match=CLOSE,
    )  # fmt: skip
    assert stops == [9, 12, 15]
    assert not marker.exists()
    final = [json.loads((checkpoint(run, 20) / TRAINER_STATE).read_text()) for run in (run_dir, one_process)]
    assert final[0] == final[1], "the same step, tokens seen and data position: the same global sample order"
    ours, theirs = (export_fp32_state_dict(checkpoint(run, 20)) for run in (run_dir, one_process))
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
