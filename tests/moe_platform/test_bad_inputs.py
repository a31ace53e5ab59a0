"""The bad-input corpus: every bad config and every bad data set, given to the real `moe-train`, exits 2 before any
process group starts, with exactly one line on stderr that names the key (or the file and row) and the fix, no
traceback, and no half-made run directory.

A start costs seconds of imports, so the cases do not each start a process: `cli_cases.py` imports the CLI once and
forks a child per case (one subprocess for the whole module), and each test below asserts its case from the
results. Two cases also run as real, separate `moe-train` processes, as a check that the fork matches a real start.

Multi-rank cases set WORLD_SIZE=2 with RANK=0 and a MASTER_PORT where nothing listens; in the fork harness
`init_process_group` is a tripwire, so a case that reached it would show it, not hang.
"""

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_platform.parallel.accelerator import free_port
from moe_platform.testing import BIN, subprocess_env

HARNESS = Path(__file__).with_name("cli_cases.py")
MULTI_RANK = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # "there is no GPU" must hold on a GPU machine too


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    needle: str  # the key it must name (for a bad row: the file and row)
    fix: str  # words of the fix it must give
    kind: str = "config"  # the line starts "<kind> error: "
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, Union[str, bytes]] = field(default_factory=dict)  # written into the case's directory first
    run_dir: Optional[str] = "run"  # hydra.run.dir, relative to the case's directory; None: Hydra's default


def config(id: str, argv: list[str], needle: str, fix: str, **kwargs) -> Case:
    return Case(id, tuple(argv), needle, fix, **kwargs)


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


GOOD = jsonl([{"text": f"document {i} " * 12, "id": i} for i in range(300)])  # ~48 KB, 1400 windows of 33 tokens
# hf_local with the small shapes of moe_platform.testing.FAST; the datasets cache lives outside the case directory.
HF = ["data=hf_local", "data.seq_len=32", "data.global_batch_size=8", "trainer.micro_batch_size=2",
      "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_final=false", "logging.progress_bar=false",
      "data.hf.cache_dir=${oc.env:CASES_CACHE}"]  # fmt: skip


def data(id: str, argv: list[str], needle: str, fix: str, files: Optional[dict] = None, **kwargs) -> Case:
    files = {"corpus.jsonl": GOOD} if files is None else files
    return Case(id, (*HF, "data.hf.data_files=[corpus.jsonl]", *argv), needle, fix, "data", files=files, **kwargs)


def with_bad_row(row: int, line: bytes) -> bytes:
    lines = GOOD.encode().splitlines(keepends=True)
    lines[row] = line + b"\n"
    return b"".join(lines)


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def tokenizer_json(vocab_size: int) -> str:
    """A word-level tokenizer.json whose vocab is larger than the models' 258, built offline."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"w{i}": i for i in range(vocab_size - 2)} | {"UNK": vocab_size - 2, "EOS": vocab_size - 1}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="UNK"))
    tokenizer.pre_tokenizer = Whitespace()
    return tokenizer.to_str()


CONFIG_CASES = [
    # Hydra's composition: typos, wrong types, unknown options, overrides it cannot parse.
    config(
        "typo_key",
        ["trainer.max_step=3"],
        "trainer.max_step is not a key of trainer",
        "did you mean trainer.max_steps?",
    ),
    config("typo_group", ["modle=moe_small"], "modle is not a key", "did you mean model?"),
    config("typo_nested_key", ["model.moe.top_kk=2"], "model.moe.top_kk", "did you mean model.moe.top_k?"),
    config("typo_hydra_key", ["hydra.job.chdirr=true"], "hydra.job.chdirr", "did you mean hydra.job.chdir?"),
    config(
        "unknown_model",
        ["model=moe_tinyy"],
        "model=moe_tinyy is not an option of model",
        "did you mean model=moe_tiny?",
    ),
    config("unknown_experiment", ["experiment=smok"], "experiment=smok", "did you mean experiment=smoke?"),
    config(
        "unknown_distributed",
        ["distributed=zero4"],
        "distributed=zero4",
        "the options are ddp, fsdp, hsdp, single, zero1",
    ),
    config(
        "added_unknown_key",
        ["+trainer.max_stepz=3"],
        "trainer.max_stepz is not a key",
        "did you mean trainer.max_steps?",
    ),
    config(
        "free_form_key_without_plus",
        ["data.hf.load_kwargs.sample_by=line"],
        "data.hf.load_kwargs.sample_by",
        "+data.hf.load_kwargs.sample_by=line",
    ),
    config(
        "int_as_text",
        ["trainer.max_steps=abc"],
        "trainer.max_steps=abc is not a whole number",
        "e.g. trainer.max_steps=200",
    ),
    config("float_as_text", ["optim.lr=fast"], "optim.lr=fast is not a number", "give optim.lr a number"),
    config("bool_as_text", ["trainer.save_final=maybe"], "trainer.save_final=maybe", "true or false"),
    config(
        "int_as_float",
        ["model.moe.top_k=1.5"],
        "model.moe.top_k=1.5 is not a whole number",
        "give model.moe.top_k a whole number",
    ),
    config(
        "list_as_text",
        ["data.hf.data_files=corpus.jsonl"],
        "data.hf.data_files=corpus.jsonl is not a list",
        "data.hf.data_files=[corpus.jsonl]",
    ),
    config(
        "null_for_a_number", ["trainer.max_steps=null"], "trainer.max_steps cannot be null", "give it a whole number"
    ),
    config("value_for_a_group_of_keys", ["model.moe=4"], "model.moe=4 cannot replace", "set them one at a time"),
    config("key_below_null", ["model=dense_tiny", "model.moe.top_k=2"], "model.moe is null", "pick a model option"),
    config("no_equals_sign", ["trainer.max_steps"], "'trainer.max_steps' cannot be parsed", "write it as key=value"),
    config("sweep_without_multirun", ["trainer.max_steps=1,2"], "trainer.max_steps=1,2 is ambiguous", "add --multirun"),
    config(
        "unknown_interpolation",
        ["trainer.max_steps=${steps}"],
        "trainer.max_steps: Interpolation key 'steps'",
        "fix the ${...} reference",
    ),
    config("delete_a_schema_key", ["~model.vocab_size"], "~model.vocab_size cannot remove", "override its value"),
    # Impossible combinations: the schema's and the launch's checks.
    config(
        "top_k_over_experts",
        ["model.moe.top_k=5"],
        "moe.top_k=5 exceeds moe.num_experts=4",
        "lower top_k or add experts",
    ),
    config(
        "heads_not_divisible_by_kv_heads",
        ["model.n_kv_heads=3"],
        "model.n_kv_heads=3",
        "choose n_kv_heads that divides n_heads",
    ),
    config(
        "global_batch_vs_micro_times_ranks",
        ["distributed=ddp", "data.global_batch_size=12", "trainer.micro_batch_size=4"],
        "data.global_batch_size=12 is not a multiple of trainer.micro_batch_size × world size = 4 × 2",
        "change the global or micro batch size",
        env=MULTI_RANK,
    ),
    config(
        "zero_stage_4",
        ["distributed=zero2", "distributed.zero_stage=4"],
        "distributed.zero_stage=4",
        "must be 0, 1, 2 or 3",
    ),
    config(
        "offload_without_zero",
        ["distributed=ddp", "distributed.offload_optimizer=true"],
        "distributed.zero_stage/offload need distributed.strategy=deepspeed",
        "pick distributed=zero1",
    ),
    config(
        "offload_with_zero_stage_0",
        ["distributed=zero1", "distributed.zero_stage=0", "distributed.offload_optimizer=true"],
        "distributed.offload_optimizer needs distributed.zero_stage >= 1",
        "raise the stage or drop the offload",
    ),
    config(
        "zero_stage_0_in_fp32",
        ["distributed=zero1", "distributed.zero_stage=0"],
        "distributed.zero_stage=0 with trainer.precision=fp32",
        "use distributed=zero1 or ddp",
    ),
    config(
        "offload_params_without_gpu",
        ["distributed=zero3_offload"],
        "distributed.offload_params",
        "use distributed=zero3",
        env=MULTI_RANK | NO_GPU,
    ),
    config(
        "capacity_zero",
        ["model.moe.capacity_factor=0"],
        "moe.capacity_factor=0.0 must be positive",
        "or null for dropless",
    ),
    config(
        "eval_capacity_negative",
        ["model.moe.eval_capacity_factor=-1"],
        "moe.eval_capacity_factor=-1.0",
        "use e.g. 1.25",
    ),
    config(
        "seq_len_over_max_positions",
        ["data.seq_len=512"],
        "data.seq_len=512 exceeds model.max_seq_len=256",
        "raise model.max_seq_len",
    ),
    config(
        "ep_not_dividing_experts",
        ["distributed=ddp", "distributed.expert_parallel_size=3"],
        "distributed.expert_parallel_size=3 does not divide model.moe.num_experts=4",
        "pick an EP size that divides",
    ),
    config(
        "ep_not_dividing_ranks",
        ["distributed=ddp", "distributed.expert_parallel_size=4"],
        "distributed.expert_parallel_size=4 does not divide the 2 ranks",
        "launch a multiple of the EP size",
        env=MULTI_RANK,
    ),
    config(
        "ep_with_zero3",
        ["distributed=zero3", "distributed.expert_parallel_size=2"],
        "does not work with ZeRO-3",
        "use distributed=fsdp (PyTorch FSDP2), or distributed=zero2",
    ),
    # FSDP2 (EP under FSDP takes the same checks as under DDP above: test_configs.py)
    config(
        "fsdp_with_deepspeeds_optimizer_offload",
        ["distributed=fsdp", "distributed.offload_optimizer=true"],
        "distributed.offload_optimizer=true is DeepSpeed's, but distributed.strategy=fsdp",
        "drop it (FSDP2 offloads with distributed.fsdp.cpu_offload=true)",
    ),
    config(
        "fsdp_with_deepspeeds_parameter_offload",
        ["distributed=fsdp", "distributed.zero_stage=3", "distributed.offload_params=true"],
        "distributed.zero_stage=3 and distributed.offload_params=true are DeepSpeed's",
        "drop them (FSDP2 offloads with distributed.fsdp.cpu_offload=true)",
    ),
    config(
        "fsdp_keys_with_another_strategy",
        ["distributed=ddp", "distributed.fsdp.replicate_size=2"],
        "distributed.fsdp.replicate_size=2 sets FSDP2 up but distributed.strategy='ddp'",
        "use distributed=fsdp or distributed=hsdp, or drop it",
    ),
    config(
        "hsdp_replicas_not_dividing_ranks",
        ["distributed=hsdp", "distributed.fsdp.replicate_size=4"],
        "distributed.fsdp.replicate_size=4 does not divide the 2 ranks",
        "launch a multiple of it, or change it",
        env=MULTI_RANK,
    ),
    # Pipeline parallelism (moe_platform/config.py's pipeline checks, moe/stages.py's layout)
    config(
        "pipeline_more_stages_than_layers",
        ["distributed=ddp", "distributed.pipeline_parallel_size=8"],
        "distributed.pipeline_parallel_size=8 × 1 stage(s) per rank = 8 stages, more than model.n_layers=4",
        "lower the pipeline size or the virtual stages",
    ),
    config(
        "pipeline_layout_misses_a_layer",
        [
            "distributed=ddp",
            "distributed.pipeline_parallel_size=2",
            "distributed.pipeline.layout=[[embed,0,1],[3,norm,head]]",
        ],
        "distributed.pipeline.layout: it misses layer(s) [2]",
        "the stages must spell embed, 0, …, 3, norm, head",
    ),
    config(
        "pipeline_layout_repeats_a_layer",
        [
            "distributed=ddp",
            "distributed.pipeline_parallel_size=2",
            "distributed.pipeline.layout=[[embed,0,1,2],[2,3,norm,head]]",
        ],
        "distributed.pipeline.layout: it repeats layer(s) [2]",
        "the stages must spell embed, 0, …, 3, norm, head",
    ),
    config(
        "pipeline_fewer_microbatches_than_stages",
        ["distributed=ddp", "distributed.pipeline_parallel_size=2", "distributed.pipeline.microbatches=1"],
        "distributed.pipeline.microbatches=1 is fewer than pipeline_parallel_size=2",
        "raise it (or data.global_batch_size), or lower the pipeline size",
        env=MULTI_RANK,
    ),
    config(
        "pipeline_virtual_stages_without_such_a_schedule",
        ["distributed=ddp", "distributed.pipeline_parallel_size=2", "distributed.pipeline.virtual_stages=2"],
        "distributed.pipeline.virtual_stages=2 needs a schedule with several stages per rank, but 1f1b has one",
        "use schedule=interleaved_1f1b, or drop virtual_stages",
    ),
    config(
        "pipeline_under_deepspeed",
        ["distributed=zero1", "distributed.pipeline_parallel_size=2"],
        "distributed.pipeline_parallel_size=2 does not run under DeepSpeed's ZeRO",
        "use distributed=ddp, fsdp or hsdp",
    ),
    config(
        "pipeline_not_dividing_ranks",
        ["distributed=ddp", "distributed.pipeline_parallel_size=4"],
        "distributed.pipeline_parallel_size=4 does not divide the 2 ranks the launcher started",
        "launch a multiple of the pipeline size, or change it",
        env=MULTI_RANK,
    ),
    config(
        "pipeline_keys_without_a_pipeline",
        ["distributed=ddp", "distributed.pipeline.schedule=gpipe"],
        "distributed.pipeline.schedule=gpipe sets a pipeline up but distributed.pipeline_parallel_size=1",
        "set it above 1, or drop it",
    ),
    config(
        "pipeline_with_tied_embeddings",
        ["distributed=ddp", "distributed.pipeline_parallel_size=2", "model.tie_embeddings=true"],
        "so they cannot share one tied weight",
        "set model.tie_embeddings=false",
    ),
    config(
        "fsdp_cpu_offload_without_gpu",
        ["distributed=fsdp", "distributed.fsdp.cpu_offload=true"],
        "distributed.fsdp.cpu_offload=true",
        "set distributed.fsdp.cpu_offload=false",
        env=MULTI_RANK | NO_GPU,
    ),
    config("negative_learning_rate", ["optim.lr=-0.001"], "optim.lr=-0.001 must be positive", "e.g. 3e-4"),
    config(
        "save_every_past_max_steps_without_final_save",
        ["trainer.max_steps=10", "trainer.save_every=50", "trainer.save_final=false"],
        "trainer.save_every=50 exceeds trainer.max_steps=10",
        "set trainer.save_final=true",
    ),
    config("keep_last_zero", ["trainer.keep_last=0"], "trainer.keep_last=0", "must be >= 1"),
    config(
        "single_strategy_two_ranks",
        [],
        "distributed=single but the launcher started 2 processes",
        "use distributed=ddp",
        env=MULTI_RANK,
    ),
    config(
        "unknown_backend",
        ["distributed=ddp", "distributed.backend=ncll"],
        "distributed.backend='ncll'",
        "use one of ('nccl', 'gloo'",
    ),
    config(
        "unknown_wandb_mode",
        ["logging.wandb_mode=ofline"],
        "logging.wandb_mode='ofline'",
        "use one of ('online', 'offline'",
    ),
    config(
        "val_batch_not_split_over_ranks",
        ["distributed=ddp", "data.val.global_batch_size=3"],
        "data.val.global_batch_size",
        "change micro_batch_size or global_batch_size",
        env=MULTI_RANK,
    ),
    config(
        "unknown_activation_checkpointing",
        ["trainer.activation_checkpointing=selective"],
        "trainer.activation_checkpointing='selective' is unknown",
        "use one of ('none', 'moe', 'full')",
    ),
    config(
        "moe_checkpointing_of_a_dense_model",
        ["model=dense_tiny", "trainer.activation_checkpointing=moe"],
        "trainer.activation_checkpointing=moe",
        "use full or none",
    ),
    config("compile_with_zero3", ["distributed=zero3", "trainer.compile=true"], "trainer.compile=true", "zero2"),
    config("unknown_adamw_kernel", ["optim.implementation=apex"], "optim.implementation='apex'", "'fused'"),
    config(
        "muon_under_deepspeed", ["optim=muon", "distributed=zero2"], "optim.name=muon", "use distributed=ddp or fsdp"
    ),
    config("muon_keys_under_adamw", ["optim.muon.momentum=0.9"], "optim.muon.momentum=0.9", "use optim=muon"),
    config(
        "unknown_muon_lr_adjustment",
        ["optim=muon", "optim.muon.adjust_lr=spectral"],
        "optim.muon.adjust_lr",
        "'match_rms_adamw'",
    ),
    config(
        "unknown_data_source",
        ["data.source=web"],
        "data.source='web'",
        "must be one of ('synthetic', 'hf', 'tokenized', 'mixture')",
    ),
    config(
        "mixture_weights_summing_to_zero",
        ["data=mixture", "data.mixture=[{name: web, weight: 0, synthetic: {}}, {name: b, weight: 0, synthetic: {}}]"],
        "data.mixture weights [0.0, 0.0] do not sum to a positive number",
        "give a source a weight > 0",
    ),
    config(
        "mixture_source_missing",
        ["data=mixture", "data.mixture=[{name: web, weight: 1, path: no/such/shards}]"],
        "data.mixture[0].path='no/such/shards' does not exist",
        "moe-data prepare",
        kind="data",
    ),
    config(
        "mixture_source_past_its_cap",
        [
            "data=mixture",
            "data.seq_len=32",
            "data.global_batch_size=8",
            "trainer.micro_batch_size=2",
            "trainer.max_steps=400",
            "data.val.fraction=0",
            "data.mixture=[{name: web, weight: 0.9, max_epochs: 1, synthetic: {num_tokens: 65536}},"
            " {name: code, weight: 0.1, synthetic: {num_tokens: 65536, seed: 2}}]",
        ],
        "source 'web' would give 2880 samples to 3200 global samples",
        "past its max_epochs=1.0: lower its weight or trainer.max_steps",
        kind="data",
    ),
    config("synthetic_with_a_tokenizer", ["data.tokenizer.name_or_path=gpt2"], "data.tokenizer is unused", "remove it"),
    config(
        "tokenized_with_a_val_split",
        ["data=tokenized", "data.val.split=validation", "data.val.fraction=null"],
        "data.val.split needs data.source=hf",
        "the tokenized source holds out data.val.fraction",
    ),
    config("resume_from_nothing", ["resume=no/such/checkpoint"], "resume=", "does not exist", kind="checkpoint"),
    # Where the run directory is: Hydra's default time-stamped one goes with the parents it made.
    config("default_run_dir", ["trainer.max_steps=0"], "trainer.max_steps=0", "must be >= 1", run_dir=None),
]

DATA_CASES = [
    data(
        "missing_data_file",
        ["data.hf.data_files=[nope.jsonl]"],
        "data.hf.data_files: data file 'nope.jsonl' does not exist",
        "fix the path",
    ),
    data(
        "default_data_file_missing",
        ["data.hf.data_files=[data/train.jsonl]"],
        "data file 'data/train.jsonl' does not exist",
        "fix the path",
        files={},
    ),
    data(
        "empty_data_file",
        ["data.hf.data_files=[corpus.jsonl,empty.jsonl]"],
        "data file 'empty.jsonl' is empty",
        "remove it from data.hf.data_files",
        files={"corpus.jsonl": GOOD, "empty.jsonl": ""},
    ),
    data(
        "glob_matching_nothing",
        ["data.hf.data_files=[shards/*.jsonl]"],
        "pattern 'shards/*.jsonl' matches nothing",
        "fix the pattern",
    ),
    data(
        "missing_dataset_directory",
        ["data.hf.path=/no/such/corpus"],
        "data.hf.path='/no/such/corpus' does not exist",
        "give an existing directory",
    ),
    data(
        "val_file_missing",
        ["data.val.split=validation", "data.val.fraction=null", "data.val.data_files=[val.jsonl]"],
        "data.val.data_files: data file 'val.jsonl' does not exist",
        "fix the path",
    ),
    data(
        "no_text_field_in_the_file",
        [],
        "corpus.jsonl: line 1: no text field 'text'",
        "set data.hf.text_field",
        files={"corpus.jsonl": GOOD.replace('"text"', '"body"')},
    ),
    data(
        "text_field_misnamed",
        ["data.hf.text_field=content"],
        "corpus.jsonl: line 1: no text field 'content'",
        "set data.hf.text_field",
    ),
    data(
        "parquet_without_the_text_column",
        ["data.hf.path=parquet", "data.hf.data_files=[corpus.parquet]"],
        "corpus.parquet: no text field 'text'",
        "set data.hf.text_field to one of them",
        files={"corpus.parquet": parquet_bytes(pa.table({"body": [f"document {i}" for i in range(50)]}))},
    ),
    data(
        "tokenizer_missing",
        ["data.tokenizer.name_or_path=/no/such/tokenizer"],
        "data.tokenizer.name_or_path='/no/such/tokenizer' could not be loaded",
        "give a local directory or tokenizer.json",
    ),
    data(
        "tokenizer_file_corrupt",
        ["data.tokenizer.name_or_path=tokenizer.json", "data.tokenizer.eos_token=EOS"],
        "data.tokenizer.name_or_path='tokenizer.json' could not be read",
        "give a tokenizer.json",
        files={"corpus.jsonl": GOOD, "tokenizer.json": "{not json"},
    ),
    data(
        "tokenizer_vocab_over_the_models",
        ["data.tokenizer.name_or_path=tokenizer.json", "data.tokenizer.eos_token=EOS"],
        "has vocab_size 300",
        "raise model.vocab_size to >= 300",
        files={"corpus.jsonl": GOOD, "tokenizer.json": tokenizer_json(300)},
    ),
    config(
        "synthetic_vocab_over_the_models",
        ["model.vocab_size=100"],
        "tokenizer 'synthetic' has vocab_size 258",
        "raise model.vocab_size to >= 258",
        kind="data",
    ),
    config(
        "synthetic_corpus_under_one_sample",
        ["data.synthetic.num_tokens=20"],
        "data.synthetic.num_tokens=20 cannot fill one packed sample",
        "raise data.synthetic.num_tokens",
        kind="data",
    ),
    data(
        "corpus_under_one_sample",
        [],
        "data.hf.data_files (at most 16 byte-level tokens) cannot fill one packed sample",
        "add data or lower data.seq_len",
        files={"corpus.jsonl": jsonl([{"text": "hi"}])},
    ),
    config(
        "tokenized_directory_missing",
        ["data=tokenized", "data.tokenized.path=no/such/shards"],
        "data.tokenized.path='no/such/shards' does not exist",
        "write it with `moe-data prepare ... --out no/such/shards`",
        kind="data",
    ),
    config(
        "tokenized_prepare_interrupted",
        ["data=tokenized", "data.tokenized.path=shards"],
        "data.tokenized.path='shards' holds shard files (1 shard(s) finished) but no header.json",
        "re-run the same command to resume it",
        kind="data",
        files={"shards/shard_00000.bin": b"\x01\x00", "shards/shard_00000.done.json": "{}"},
    ),
    data(
        "missing_file_on_two_ranks",
        ["distributed=ddp", "data.hf.data_files=[nope.jsonl]"],
        "data file 'nope.jsonl' does not exist",
        "fix the path",
        env=MULTI_RANK,
    ),
    # Found only while tokenizing (for a single process, still before any process group: strategy=single has none).
    data(
        "non_utf8_row",
        [],
        "corpus.jsonl, row 200 (0-based): text field 'text' is not valid UTF-8",
        "re-encode it as UTF-8",
        files={"corpus.jsonl": with_bad_row(200, b'{"text": "caf\xe9 au lait", "id": 200}')},
    ),
    data(
        "row_without_the_text_field",
        [],
        "corpus.jsonl, row 17 (0-based): text field 'text' is missing or null",
        "fix or remove the row",
        files={"corpus.jsonl": with_bad_row(17, b'{"id": 17}')},
    ),
    data(
        "row_that_is_not_json",
        [],
        "corpus.jsonl: line 9: not valid JSON",
        "fix the line",
        files={"corpus.jsonl": with_bad_row(8, b'{"text": "unclosed')},
    ),
    data(
        "corpus_under_one_validation_batch",
        ["data.val.fraction=0.001"],
        "packed samples, fewer than one global batch of 8",
        "raise data.val.fraction",
        files={"corpus.jsonl": jsonl([{"text": f"document {i} " * 12} for i in range(30)])},
    ),
]

PREVIOUS_RUN = {  # what a finished run left in its directory; a refused start in it must change none of it
    ".hydra/config.yaml": "trainer:\n  max_steps: 6\n",
    ".hydra/overrides.yaml": "- trainer.max_steps=6\n",
    "cli.log": "[2025-01-01 00:00:00] step 6 done\n",
    "config.yaml": "trainer:\n  max_steps: 6\n",
    "metrics.jsonl": '{"step": 6, "loss": 3.1}\n',
    "checkpoints/step_6/model.safetensors": b"\x00weights",
}
RUN_DIR_CASES = [
    # A refused config (Hydra has written .hydra/ and its log), and a bad row (the config.yaml is written too).
    config(
        "previous_run_kept_on_config_error",
        ["trainer.max_steps=0"],
        "trainer.max_steps=0",
        "must be >= 1",
        files={f"run/{name}": content for name, content in PREVIOUS_RUN.items()},
    ),
    data(
        "previous_run_kept_on_data_error",
        [],
        "row 17 (0-based)",
        "fix or remove the row",
        files={"corpus.jsonl": with_bad_row(17, b'{"id": 17}')} | {f"run/{k}": v for k, v in PREVIOUS_RUN.items()},
    ),
    config("empty_run_dir_given", ["trainer.max_steps=0"], "trainer.max_steps=0", "must be >= 1", files={"run/": ""}),
]
ALL_CASES = CONFIG_CASES + DATA_CASES + RUN_DIR_CASES


def write_files(case_dir: Path, files: dict[str, Union[str, bytes]]) -> None:
    for name, content in files.items():
        path = case_dir / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file and directory under root, with the files' bytes."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


def invocation(case: Case, case_dir: Path, dead_port: int) -> dict:
    argv = list(case.argv) + ([f"hydra.run.dir={case.run_dir}"] if case.run_dir else [])
    env = dict(case.env) | ({"MASTER_PORT": str(dead_port)} if "WORLD_SIZE" in case.env else {})
    return {"id": case.id, "argv": argv, "env": env, "cwd": str(case_dir), "run_dir": case.run_dir, "timeout": 120}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every case run once through the harness: case id → exit code, output, files before and after."""
    root = tmp_path_factory.mktemp("bad_inputs")
    dead_port = free_port()  # nothing listens there
    invocations, before = [], {}
    for case in ALL_CASES:
        case_dir = root / case.id
        case_dir.mkdir()
        write_files(case_dir, case.files)
        before[case.id] = snapshot(case_dir)
        invocations.append(invocation(case, case_dir, dead_port))
    (root / "cases.json").write_text(json.dumps(invocations))
    env = subprocess_env() | {"CASES_CACHE": str(root / "datasets_cache")}
    harness = subprocess.run(
        [sys.executable, str(HARNESS), str(root / "cases.json"), str(root / "results.json")],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert harness.returncode == 0, harness.stderr[-6000:]
    outcome = json.loads((root / "results.json").read_text())
    for case in ALL_CASES:
        outcome[case.id]["before"] = before[case.id]
        outcome[case.id]["after"] = snapshot(root / case.id)
    return outcome


def assert_refused(case: Case, result: dict) -> None:
    """Exit 2, before any process group, one line `<kind> error: ...` naming the key and the fix, no traceback."""
    output = f"exit {result['exit_code']}\n--- stderr\n{result['stderr']}\n--- stdout (end)\n{result['stdout'][-2000:]}"
    assert result["exit_code"] == 2, output
    assert not result["process_group_started"], output
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith(f"{case.kind} error: "), output
    assert case.needle in lines[0], f"the key {case.needle!r} is not named:\n{lines[0]}"
    assert case.fix in lines[0], f"the fix {case.fix!r} is not given:\n{lines[0]}"
    assert "Traceback" not in result["stderr"] + result["stdout"], output


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda case: case.id)
def test_a_bad_config_is_one_sentence_before_any_process_group(case: Case, results: dict) -> None:
    assert_refused(case, results[case.id])
    assert results[case.id]["after"] == results[case.id]["before"], "the start left files behind"


@pytest.mark.parametrize("case", DATA_CASES, ids=lambda case: case.id)
def test_bad_data_is_one_sentence_before_any_process_group(case: Case, results: dict) -> None:
    assert_refused(case, results[case.id])
    assert results[case.id]["after"] == results[case.id]["before"], "the start left files behind"


@pytest.mark.parametrize("case", RUN_DIR_CASES, ids=lambda case: case.id)
def test_a_refused_start_leaves_a_run_dir_it_did_not_make_as_it_was(case: Case, results: dict) -> None:
    """Hydra rewrote .hydra/ and appended to the log, run() rewrote config.yaml: all of it is put back."""
    result = results[case.id]
    assert_refused(case, result)
    assert result["run_dir_exists"]
    assert result["after"] == result["before"]


def test_no_case_repeats_another_refusal_by_the_same_path(results: dict) -> None:
    """Each case checks something no other case does: cases refused in the same sentence differ in the way the start
    is made (the launch environment: one rank or several; the run directory: Hydra's default, a new one, one that
    holds a previous run), so a case that only repeats another's refusal, costing a fork and checking nothing more,
    is caught. Each id is its own too: the results are looked up by it."""
    assert len({case.id for case in ALL_CASES}) == len(ALL_CASES)
    by_sentence: dict[str, list[Case]] = {}
    for case in ALL_CASES:
        by_sentence.setdefault(results[case.id]["stderr"].strip(), []).append(case)
    for sentence, cases in by_sentence.items():
        paths = {(tuple(sorted(case.env.items())), case.run_dir, run_dir_files(case)) for case in cases}
        assert len(paths) == len(cases), f"{[case.id for case in cases]} are all refused the same way: {sentence}"


def run_dir_files(case: Case) -> tuple[str, ...]:
    """What the case puts in its run directory before the start."""
    return tuple(sorted(name for name in case.files if case.run_dir and name.startswith(f"{case.run_dir}/")))


@pytest.mark.parametrize("case_id", ["global_batch_vs_micro_times_ranks", "non_utf8_row"])
def test_the_harness_answers_as_a_real_start_does(case_id: str, results: dict, tmp_path: Path) -> None:
    """The same case as its own `moe-train` process, no fork and no tripwire: a process group started on the dead
    port would hang until the timeout instead of exiting 2."""
    case = next(case for case in ALL_CASES if case.id == case_id)
    write_files(tmp_path, case.files)
    before = snapshot(tmp_path)
    run = invocation(case, tmp_path, free_port())
    env = subprocess_env() | run["env"] | {"CASES_CACHE": str(tmp_path.parent / f"{case_id}_cache")}
    real = subprocess.run(
        [str(BIN / "moe-train"), *run["argv"]], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert_refused(case, {"exit_code": real.returncode, "stderr": real.stderr, "stdout": real.stdout,
                          "process_group_started": False})  # fmt: skip
    assert real.stderr == results[case_id]["stderr"]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("argv", "composed_first"),
    [
        (["trainer.max_steps=3", "hydra.run.dir=x"], True),
        (["--help"], False),
        (["--cfg", "job", "trainer.max_step=3"], False),
        (["-m", "trainer.max_steps=1,2"], False),
        (["hydra.mode=MULTIRUN", "trainer.max_steps=1,2"], False),
        (["--config-name", "other"], False),
        (["--version"], False),
    ],
)
def test_only_a_plain_run_is_composed_before_hydra(argv: list[str], composed_first: bool) -> None:
    """Help, --cfg, sweeps and other configs are Hydra's to answer, exactly as before."""
    from moe_platform.launch.compose import plain_run

    assert (plain_run(argv) is not None) == composed_first
