"""Speed options of `moe-train` change the speed, not the run: losses stay equal with each of them."""

from pathlib import Path

import pytest
import torch

from moe_platform.testing import moe_train, read_metrics
from moe_platform.train.optimizers import adamw_kernel

# No validation split: the compiled run would compile every block's graphs again for eval (no_grad), ~30 s on a cold
# inductor cache, for losses this file does not compare.
STEPS = [
    "model.n_layers=2",
    "trainer.max_steps=4",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "data.val.fraction=0",
]


def losses(run_dir: Path) -> list[tuple[float, float]]:
    train, _ = read_metrics(run_dir)
    return [(train[step]["loss"], train[step]["grad_norm"]) for step in sorted(train)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[list[tuple[float, float]], str]:
    """moe_tiny with bias balancing and router jitter, no checkpointing, the default AdamW kernel (fused on CPU),
    measuring one step's peak memory: (losses and grad norms, stdout)."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = moe_train(run_dir, *STEPS, *NOISY_ROUTING, "logging.peak_memory=true")
    return losses(run_dir), result.stdout


@pytest.fixture(scope="module")
def reference(reference_run) -> list[tuple[float, float]]:
    return reference_run[0]


NOISY_ROUTING = ["model.moe.router.bias_update_rate=1e-3", "model.moe.router.jitter_eps=0.05"]


@pytest.mark.parametrize("mode", ["moe", "full"])
def test_activation_checkpointing_leaves_every_loss_bit_identical(tmp_path: Path, reference, mode: str) -> None:
    moe_train(tmp_path, *STEPS, *NOISY_ROUTING, f"trainer.activation_checkpointing={mode}")
    assert losses(tmp_path) == reference


@pytest.mark.parametrize("implementation", ["for_loop"])
def test_adamw_kernels_agree_up_to_rounding(tmp_path: Path, reference, implementation: str) -> None:
    moe_train(tmp_path, *STEPS, *NOISY_ROUTING, f"optim.implementation={implementation}")
    for (loss, norm), (ref_loss, ref_norm) in zip(losses(tmp_path), reference, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)


def test_compiled_blocks_train_like_eager_ones(tmp_path: Path, reference) -> None:
    moe_train(tmp_path, *STEPS, *NOISY_ROUTING, "trainer.compile=true", timeout=600)
    for (loss, norm), (ref_loss, ref_norm) in zip(losses(tmp_path), reference, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-4) and norm == pytest.approx(ref_norm, rel=1e-3)


def test_a_run_prints_its_measured_peak_memory_beside_the_ledgers(reference_run) -> None:
    """The reference run measured its second step under the profiler (its losses equal the unmeasured runs', which
    the checkpointing tests above assert bit for bit), and measured / predicted lies within the ledger's 20%."""
    stdout = reference_run[1]
    line = next(line for line in stdout.splitlines() if line.startswith("peak memory per rank"))
    ratio = float(line.rsplit("measured / predicted = ", 1)[1])
    assert 0.8 <= ratio <= 1.2, line


def test_auto_picks_the_fused_kernel_where_the_device_has_it() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert adamw_kernel("auto", params) == {"fused": True}  # CPU has it since torch 2.4
    meta = [torch.nn.Parameter(torch.zeros(3, device="meta"))]
    assert adamw_kernel("auto", meta) == {"foreach": True}
    assert adamw_kernel("for_loop", params) == {"foreach": False}
