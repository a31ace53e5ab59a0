"""Every CUDA branch of the platform against its CPU/fp32 reference (issue 27): bf16 SDPA with our masks, grouped_mm,
MLA's absorbed decode, fused AdamW, bf16 training through the real trainer (one process, DeepSpeed ZeRO-2 and FSDP2
at world size 1, trainer.compile), the peak-memory line against the ledger, the MFU label, the NaN guard, and a
checkpoint written on the GPU resumed on the CPU and back.

Run by bench/gpu_check.sh on a GPU (`pytest -m gpu`); without one skipped (tests/gpu/conftest.py), unless
MOE_GPU_SMOKE=1 runs the same code on CPU (fp32 where the GPU runs bf16 kernels), as `gpu_check.sh --cpu-smoke` does
in CI. Tolerances: bf16 rounds at 2^-8 relative per op, so bf16 results are compared with fp32 references to a few
percent; fp32 paths to 1e-5."""

import copy
import math
from pathlib import Path

import pytest
import torch

from moe import MoEConfig, MoELayer, Transformer
from moe_platform.launch.compose import train_config
from moe_platform.testing import Job, assert_resumes_exactly, moe_train, read_metrics

pytestmark = pytest.mark.gpu

HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # a run on the CPU of a GPU machine


def train(run_dir: Path, device: torch.device, *overrides: str, env: dict | None = None, **kwargs):
    """`moe-train` on `device`: through torchrun on a GPU (a fresh process initialises CUDA; the prestarted server
    forks, which CUDA does not survive), forked from the prestarted server on CPU. trainer.precision=bf16 runs fp32
    on the CPU smoke run, whose bf16 matmuls are several times slower: the run's logic is the same."""
    launcher = "torchrun" if device.type == "cuda" else None
    if device.type != "cuda":
        overrides = tuple(o.replace("trainer.precision=bf16", "trainer.precision=fp32") for o in overrides)
    return moe_train(run_dir, *overrides, launcher=launcher, env=env, **kwargs)


def train_records(run_dir: Path) -> list[dict]:
    return list(read_metrics(run_dir)[0].values())


def assert_relative_error(got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    """‖got − want‖ / ‖want‖ ≤ bound: bf16's rounding summed over a tensor, not its worst element."""
    error = float((got.float() - want.float()).norm() / want.float().norm())
    assert error <= bound, f"relative error {error:.2e} above {bound:.0e}"


# ---- kernels against their references ------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["causal", "documents", "padding"])
def test_bf16_attention_with_our_masks_matches_fp32(device: torch.device, low_precision, mask: str) -> None:
    """SDPA picks flash (causal, no mask) or the efficient kernel (a boolean mask) on CUDA: the logits of moe_tiny
    under autocast equal the fp32 CPU forward to bf16's precision."""
    config = train_config(["model=moe_tiny"]).model
    model = Transformer(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    kwargs = {}
    if mask == "documents":
        kwargs["document_ids_BT"] = torch.cat([torch.zeros(2, 40), torch.ones(2, 24)], dim=1).long()
    if mask == "padding":
        kwargs["attention_mask_BT"] = torch.cat([torch.ones(2, 50), torch.zeros(2, 14)], dim=1).long()
    with torch.no_grad():
        reference = model(ids, **kwargs).logits
        moved = copy.deepcopy(model).to(device)
        with torch.autocast(device.type, dtype=low_precision, enabled=low_precision != torch.float32):
            logits = moved(ids.to(device), **{k: v.to(device) for k, v in kwargs.items()}).logits
    real = slice(None) if mask != "padding" else slice(0, 50)  # padded queries' logits are not used
    assert_relative_error(logits.cpu()[:, real], reference[:, real], 2e-2 if low_precision == torch.bfloat16 else 1e-5)


def test_grouped_mm_experts_equal_the_per_expert_loop(device: torch.device, low_precision) -> None:
    """The experts' grouped GEMM (torch._grouped_mm, bf16 on CUDA) and the loop over experts give one output and one
    gradient for every weight."""
    outputs, grads = [], []
    for impl in ("grouped_mm", "loop"):
        torch.manual_seed(0)
        config = MoEConfig(num_experts=8, top_k=2, expert_d_ff=128, capacity_factor=None, experts_impl=impl)
        layer = MoELayer(256, config, "swiglu").to(device=device, dtype=low_precision)
        x = torch.randn(4, 64, 256, device=device, dtype=low_precision, requires_grad=True)
        out = layer(x).output
        out.float().pow(2).mean().backward()
        outputs.append(out.float().cpu())
        grads.append([x.grad.float().cpu(), *(p.grad.float().cpu() for p in layer.parameters())])
    bound = 2e-2 if low_precision == torch.bfloat16 else 1e-5
    assert_relative_error(outputs[0], outputs[1], bound)
    for grouped, looped in zip(*grads, strict=True):
        assert_relative_error(grouped, looped, bound)


def test_mla_absorbed_decode_equals_the_expanded_forward(device: torch.device) -> None:
    """Cached decoding with W_UK and W_UV absorbed gives the logits of the plain forward over the whole sequence."""
    config = train_config(["model=deepseek_v3_like_tiny"]).model
    model = Transformer(config).eval().to(device)
    ids = torch.randint(0, config.vocab_size, (2, 24), device=device)
    with torch.no_grad():
        whole = model(ids).logits
        cache = model.new_kv_cache(2, 24)
        prefix = model(ids[:, :16], kv_cache=cache).logits
        steps = [model(ids[:, t : t + 1], kv_cache=cache).logits for t in range(16, 24)]
    decoded = torch.cat([prefix, *steps], dim=1)
    torch.testing.assert_close(decoded, whole, atol=1e-4, rtol=1e-4)


def test_fused_adamw_equals_the_foreach_one(device: torch.device) -> None:
    """optim.implementation=auto takes the fused kernel on CUDA: five steps equal the foreach implementation's."""
    weights = [torch.randn(64, 32, device=device), torch.randn(32, device=device)]
    results = []
    for flags in ({"fused": True}, {"foreach": True}):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **flags)
        for step in range(5):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            optimizer.step()
        results.append([p.detach().cpu() for p in params])
    for fused, foreach in zip(*results, strict=True):
        torch.testing.assert_close(fused, foreach, atol=1e-6, rtol=1e-5)


# ---- the trainer on the device -------------------------------------------------------------------------------------


def assert_learns(records: list[dict]) -> None:
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(loss) for loss in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses  # falling: the last three below the first three


def test_moe_tiny_trains_in_bf16_with_the_peak_memory_line_near_the_ledger(tmp_path: Path, device) -> None:
    """20 bf16 steps of moe_tiny: a falling, finite loss; the measured peak (torch.cuda.max_memory_allocated on a
    GPU) within 20% of the ledger's prediction; MFU against the card's datasheet peak on a GPU."""
    train(tmp_path, device, "trainer.precision=bf16", "trainer.max_steps=20", "logging.peak_memory=true",
          "logging.peak_tflops=null")  # fmt: skip
    records = train_records(tmp_path)
    assert_learns(records)
    memory = next(r for r in records if "memory/peak_bytes_per_rank" in r)
    (measured,), (predicted,) = memory["memory/peak_bytes_per_rank"], memory["plan/peak_bytes_per_rank"]
    assert measured == pytest.approx(predicted, rel=0.2)
    if device.type == "cuda" and torch.cuda.get_device_name() in {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}:
        assert all(0 < r["mfu"] < 1 for r in records), "MFU against the datasheet peak"


def test_a_moe_small_sized_model_trains_in_bf16(tmp_path: Path, device: torch.device) -> None:
    """moe_small (512 wide, 8 layers, 8 experts, vocabulary 32000) for 20 steps of 8 × 128 tokens; the CPU smoke run
    keeps its width and experts at 1 layer, with FFNs 256 wide, a byte vocabulary and 32 tokens."""
    on_cpu = ["model.n_layers=1", "model.vocab_size=258", "model.d_ff=256", "model.moe.expert_d_ff=256"]
    shape = ["data.seq_len=128"] if device.type == "cuda" else on_cpu
    train(tmp_path, device, "model=moe_small", *shape, "trainer.precision=bf16", "trainer.max_steps=20", timeout=600)
    assert_learns(train_records(tmp_path))


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_one_device_trains_under_deepspeed_and_fsdp(tmp_path: Path, device: torch.device, strategy: str) -> None:
    train(tmp_path, device, f"distributed={strategy}", "trainer.precision=bf16", "trainer.max_steps=12", timeout=600)
    assert_learns(train_records(tmp_path))


def test_compiled_blocks_train_on_the_gpu(tmp_path: Path, device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("inductor's CPU path is tests/moe_platform/test_training_options.py's; here it is Triton's")
    train(tmp_path, device, "trainer.compile=true", "trainer.precision=bf16", "trainer.max_steps=12", timeout=600)
    assert_learns(train_records(tmp_path))


def test_the_nan_guard_halts_on_the_device(tmp_path: Path, device: torch.device) -> None:
    """A NaN in one module's output at step 3 halts with exit 4, naming the module, as on CPU (test_nan_policy.py)."""
    result = train(tmp_path, device, "trainer.max_steps=5", "trainer.save_every=1",
                   env={"MOE_FAULTS": "nan@blocks.1.attn:step=3"}, check=False)  # fmt: skip
    assert result.returncode == 4, result.stderr[-3000:]
    assert "non-finite loss at step 3: it first appears in the output of blocks.1.attn" in result.stderr


def test_a_checkpoint_written_on_the_gpu_resumes_on_the_cpu_and_back(tmp_path: Path, device: torch.device) -> None:
    """fp32: device to step 2, CPU to step 4, device to 6, against an uninterrupted run on the device; the losses agree
    to the two devices' rounding (bit for bit in the CPU smoke run)."""
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    train(reference, device)
    train(run_dir, device, "trainer.save_every=2", "trainer.stop_at=2")
    tolerance = (1e-4, 1e-5) if device.type == "cuda" else None  # None: bit for bit
    stops = assert_resumes_exactly(
        run_dir, reference, DeviceJob(torch.device("cpu"), "trainer.save_every=2", stop_at=4, env=HIDE_GPUS),
        DeviceJob(device, "trainer.save_every=2"), match={"loss": tolerance, "grad_norm": tolerance},
    )  # fmt: skip
    assert stops == [2, 4]


class DeviceJob(Job):
    """A Job on `device` (torchrun on a GPU, as `train`), with extra environment."""

    def __init__(self, device: torch.device, *overrides: str, stop_at: int | None = None, env: dict | None = None):
        super().__init__(*overrides, launcher="torchrun" if device.type == "cuda" else None, stop_at=stop_at)
        self.env = env

    def run(self, run_dir: Path, *extra: str, **kwargs):
        return super().run(run_dir, *extra, env=self.env, **kwargs)
