"""`init.from_path` on a sharded Hugging Face directory: config.json alone first, then the weights read one tensor at
a time from the safetensors shards, each expert-parallel rank reading only its own block of experts.

Properties: the lazy import gives the whole-model path's weights bit for bit and transformers' logits; its peak host
memory is about the model plus one shard where the whole-model path holds twice the model; every tensor is read
once, and under EP a rank reads exactly its block's expert rows; reading the config touches no weight file; a
broken directory is refused in one sentence. Every model is tiny, random and made here; nothing is downloaded.
"""

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from moe import Transformer
from moe.expert_parallel import ExpertParallel
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.config import DistributedConfig, InitConfig, TrainConfig, load_run_config
from moe_platform.interop.hf import ConversionError, LazyStateDict, from_hf, hf_model_config, tensors
from moe_platform.interop.init_from import adopt_source_model, initial_state_dict, load_initial_weights
from moe_platform.parallel.accelerator import free_port
from moe_platform.parallel.expert_parallel import shard_experts
from moe_platform.testing import BIN, FAST, lm_loss_on_the_first_batch, read_metrics, subprocess_env
from moe_platform.train.model_build import build_model

VOCAB, ATOL = 96, 1e-5
HF_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,  # the default data.seq_len, which TrainConfig checks against
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
FAMILIES = {
    "mixtral": lambda **changes: transformers.MixtralConfig(
        **{**HF_COMMON, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2, **changes}
    ),
    "qwen2_moe": lambda **changes: transformers.Qwen2MoeConfig(
        **{
            **HF_COMMON,
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [0],
            **changes,
        }
    ),
}


def make_hf(name: str, **changes) -> transformers.PreTrainedModel:
    """A random model of family `name` (its config with `changes`), every parameter random (Qwen2-MoE's
    shared-expert gate zero: ungated)."""
    torch.manual_seed(0)
    made = transformers.AutoModelForCausalLM.from_config(FAMILIES[name](**changes), dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in made.named_parameters():
            if param_name.endswith("shared_expert_gate.weight"):
                param.zero_()
            else:
                param.normal_(0.0, 0.2)
    return made


def save_sharded(model: transformers.PreTrainedModel, directory: Path, fused: bool = False) -> Path:
    """`save_pretrained` into several shards and an index (one 2-D file tensor per expert), or, with `fused`, the
    same tensors in transformers' in-memory layout (gate_up_proj [E, 2F, D]) written as two shards by hand."""
    if not fused:
        model.save_pretrained(directory, max_shard_size="20KB")
    else:
        model.config.save_pretrained(directory)
        state = {name: t.contiguous() for name, t in model.state_dict().items()}
        names = sorted(state)
        weight_map = {}
        for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            file = f"model-{part + 1:05d}-of-00002.safetensors"
            save_file({name: state[name] for name in chunk}, directory / file, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(chunk, file)
        (directory / tensors.SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(list(directory.glob("*.safetensors"))) > 1 and (directory / tensors.SAFETENSORS_INDEX).is_file()
    return directory


def train_config(directory: Path, **distributed) -> TrainConfig:
    return TrainConfig(
        model=hf_model_config(directory),
        init=InitConfig(from_path=str(directory)),
        distributed=DistributedConfig(**distributed),
    )


@pytest.mark.parametrize(
    ("name", "fused"),
    [("mixtral", False), ("qwen2_moe", False), ("mixtral", True)],
    ids=["mixtral", "qwen2_moe", "mixtral_fused"],
)
def test_the_lazy_import_is_the_whole_model_import(tmp_path, name, fused):
    made = make_hf(name)
    directory = save_sharded(made, tmp_path, fused)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    config = train_config(directory)
    state = initial_state_dict(config)
    assert isinstance(state, LazyStateDict)
    ours = Transformer(config.model)
    load_initial_weights(ours, state, partitioned=False)

    # The whole-model path: transformers loads everything, from_hf converts its in-memory state dict.
    whole_config, whole = from_hf(theirs.config, theirs.state_dict())
    assert whole_config == config.model
    assert ours.state_dict().keys() == whole.keys()
    for key, tensor in ours.state_dict().items():
        assert torch.equal(tensor, whole[key]), key
    ids_BT = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.eval()(ids_BT).logits - theirs(ids_BT).logits).abs().max().item()
    assert diff <= ATOL, diff


class CountingSafeOpen:
    """safetensors' own safe_open, recording every read: (file key, the (start, stop) of each sliced dim; () = all)."""

    reads: list[tuple[str, tuple[tuple[int, int], ...]]]

    def __init__(self, *args, **kwargs) -> None:
        self._file = safe_open(*args, **kwargs)

    def __enter__(self):
        self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def keys(self):
        return self._file.keys()

    def get_tensor(self, key):
        CountingSafeOpen.reads.append((key, ()))
        return self._file.get_tensor(key)

    def get_slice(self, key):
        return _CountingSlice(self._file.get_slice(key), key)


class _CountingSlice:
    def __init__(self, inner, key: str) -> None:
        self._inner, self._key = inner, key

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()

    def __getitem__(self, index):
        slices = index if isinstance(index, tuple) else (index,)
        CountingSafeOpen.reads.append((self._key, tuple((s.start, s.stop) for s in slices)))
        return self._inner[index]


def experts_read(reads: list[tuple[str, tuple]], num_experts: int) -> dict[int, set[int]]:
    """Layer → the expert ids whose rows were read, from per-expert file tensors or fused tensors' dim-0 rows."""
    read: dict[int, set[int]] = {}
    for key, slices in reads:
        if m := re.match(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.", key):
            read.setdefault(int(m[1]), set()).add(int(m[2]))
        elif m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", key):
            rows = range(*slices[0]) if slices else range(num_experts)
            read.setdefault(int(m[1]), set()).update(rows)
    return read


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_under_expert_parallelism_a_rank_reads_only_its_experts(tmp_path, monkeypatch, fused):
    """build_model on rank r of EP=2 reads each tensor once and, of the experts, exactly its block's rows; the
    block it keeps after `shard_experts` is the whole-model path's block."""
    directory = save_sharded(make_hf("mixtral"), tmp_path, fused)
    config = train_config(directory, strategy="ddp", expert_parallel_size=2)
    E = config.model.moe.num_experts
    _, whole = from_hf(directory)
    monkeypatch.setattr(tensors, "safe_open", CountingSafeOpen)
    for rank in (0, 1):
        CountingSafeOpen.reads = []
        model = build_model(config, types.SimpleNamespace(process_index=rank))
        assert len(CountingSafeOpen.reads) == len(set(CountingSafeOpen.reads))  # nothing read twice
        block = ExpertParallel(size=2, rank=rank).local_experts(E)
        assert experts_read(CountingSafeOpen.reads, E) == {i: set(block) for i in range(config.model.n_layers)}
        shard_experts(model, ExpertParallel(size=2, rank=rank))
        for key, tensor in model.state_dict().items():
            expected = whole[key][block.start : block.stop] if ".experts." in key else whole[key]
            assert torch.equal(tensor, expected), key


# Peak host memory of one import, in a fresh process: the growth of its peak RSS (reset through clear_refs) while
# the import runs. MALLOC_MMAP_THRESHOLD_ makes glibc return every freed block of 64 KiB or more to the system, so
# that RSS follows the bytes alive instead of what the allocator keeps for later.
MEASURE = """
import gc, json, sys
import torch, transformers
from moe import Transformer
from moe_platform.config import InitConfig, TrainConfig
from moe_platform.interop.hf import from_hf, hf_model_config
from moe_platform.interop.init_from import initial_state_dict, load_initial_weights


def kib(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])


def peak_growth(import_):
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    start = kib("VmRSS")
    import_()
    return (kib("VmHWM") - start) * 1024


def lazy(directory):
    config = TrainConfig(model=hf_model_config(directory), init=InitConfig(from_path=directory))
    load_initial_weights(Transformer(config.model), initial_state_dict(config), partitioned=False)


def whole(directory):
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    config, state = from_hf(theirs.config, theirs.state_dict())
    Transformer(config).load_state_dict(state, strict=True)


warm, directory = sys.argv[1:]
lazy(warm), whole(warm)  # once on a tiny model: first-touched code pages and lazy imports are not the import's
model = Transformer(hf_model_config(directory))
print(json.dumps({
    "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    "lazy": peak_growth(lambda: lazy(directory)),
    "whole": peak_growth(lambda: whole(directory)),
}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resetting the peak RSS needs Linux's /proc")
def test_the_import_holds_the_model_and_about_one_shard(tmp_path):
    torch.manual_seed(0)
    big = FAMILIES["mixtral"](
        vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=512,
        num_local_experts=8,
    )  # fmt: skip  # 14.3 M parameters: 54.5 MiB in fp32, in 13 shards of at most 4.6 MiB
    transformers.AutoModelForCausalLM.from_config(big, dtype=torch.float32).save_pretrained(
        tmp_path / "big", max_shard_size="8MB"
    )
    save_sharded(make_hf("mixtral"), tmp_path / "warm")
    largest_shard = max(file.stat().st_size for file in (tmp_path / "big").glob("*.safetensors"))
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "warm"), str(tmp_path / "big")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**subprocess_env(), "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    peak = json.loads(result.stdout.strip().splitlines()[-1])
    model_bytes = peak["param_bytes"]
    print(f"peak host memory: lazy {peak['lazy'] / 2**20:.1f} MiB, whole-model path {peak['whole'] / 2**20:.1f} MiB, "
          f"model {model_bytes / 2**20:.1f} MiB, largest shard {largest_shard / 2**20:.1f} MiB")  # fmt: skip
    assert peak["lazy"] <= (model_bytes + largest_shard) * 1.2
    assert peak["whole"] >= 1.8 * model_bytes  # the measurement does see a second copy of the model


def test_the_config_is_read_without_touching_a_weight(tmp_path):
    """adopt_source_model (the CLI's step before the memory check) and hf_model_config read config.json alone: the
    same model config comes out of a directory whose every shard is garbage, which the weight read then refuses."""
    directory = save_sharded(make_hf("qwen2_moe"), tmp_path / "hf")
    expected = hf_model_config(directory)
    for shard in directory.glob("*.safetensors"):
        shard.write_bytes(shard.read_bytes()[:100])  # a truncated header: not readable as safetensors
    assert hf_model_config(directory) == expected
    cfg = OmegaConf.create({"init": {"from_path": str(directory), "upcycle": False}, "model": {}})
    assert adopt_source_model(cfg, [])
    adopted = OmegaConf.merge(OmegaConf.structured(TrainConfig), {"model": cfg.model})
    assert OmegaConf.to_object(adopted).model == expected
    refused = r"is not a readable safetensors file .*: re-save or re-download it"
    with pytest.raises(CheckpointError, match=refused) as err:
        initial_state_dict(TrainConfig(model=expected, init=InitConfig(from_path=str(directory))))
    assert "\n" not in str(err.value)


def test_a_missing_shard_is_refused_naming_the_key_and_the_fix(tmp_path):
    directory = save_sharded(make_hf("mixtral"), tmp_path)
    index = json.loads((directory / tensors.SAFETENSORS_INDEX).read_text())
    key, file = next(iter(index["weight_map"].items()))
    (directory / file).unlink()
    with pytest.raises(CheckpointError) as err:
        initial_state_dict(train_config(directory))
    assert str(err.value) == (
        f"{directory / tensors.SAFETENSORS_INDEX} puts {key} in {file}, which is not in {directory}: copy that shard "
        "into the directory or re-save the model"
    )


def test_a_quantized_checkpoint_is_refused_before_any_read(tmp_path):
    directory = save_sharded(make_hf("mixtral"), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"quant_method='fp8'.*: dequantize the checkpoint") as err:
        hf_model_config(directory)
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [["distributed=ddp", "distributed.expert_parallel_size=2"], ["distributed=zero3"]],
    ids=["ep2", "zero3"],
)
def test_a_two_rank_run_starts_at_the_hf_models_loss(tmp_path, strategy):
    """No `model=...`: the run adopts the sharded Mixtral's config and fills its weights from the files (each EP
    rank its own experts; under ZeRO-3 one gathered parameter at a time), and its first loss is transformers' own
    on that batch."""
    made = make_hf("mixtral", vocab_size=258)  # the synthetic data's byte-level vocabulary
    directory = save_sharded(made, tmp_path / "hf")
    args = [a for a in FAST if not a.startswith("model=")] + [
        f"init.from_path={directory}", *strategy, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"
    ]  # fmt: skip
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    result = subprocess.run(
        [*torchrun, "--no-python", str(BIN / "moe-train"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = load_run_config(tmp_path / "run" / "config.yaml")
    assert config.model.moe.num_experts == 4
    hf_loss = lm_loss_on_the_first_batch(lambda input_ids: made(input_ids).logits, config)
    assert read_metrics(tmp_path / "run")[0][1]["loss"] == pytest.approx(hf_loss, rel=1e-5)
