"""Throughput of the data pipeline (tokenize + pack + batch) on CPU, next to what the default model consumes.

Measured, in one process, with a fresh datasets cache:
  synthetic   generate the default corpus (+ holdout split), then iterate micro-batches
  jsonl       a generated corpus of >= 50 MB: load (jsonl -> Arrow), tokenize + pack (datasets.map,
              num_proc), batch; byte-level, and a BPE tokenizer trained here on a 5 MB sample
  streaming   the same corpus streamed: tokenize + pack + batch on the fly (what every rank does)
  prepare     `moe-data prepare` of the same corpus (data_pipeline.prepare, from the warm datasets cache: tokenize,
              write and hash the shards) with 1 and 2 workers, --repeats times each into a fresh directory
  tokenized   the loader on those shards (data.source=tokenized, val fraction 0.01): build, then micro-batches,
              --repeats times; the prepare and tokenized rows give the median [min-max] over the repeats
  mixture     three sources (60/30/10) over those shards, data.source=mixture: build, then micro-batches
  wait        the real trainer (moe_tiny at the rows' shape, 24 steps) on the shards, the mixture and the hf stream,
              with data.prefetch=0 and 2, interleaved: `data_wait_frac`, its seconds in the loader's next() over
              its training seconds (goal with prefetch: <= 1%)
  model       the real trainer: `moe-train` with its defaults (conf/model/moe_tiny.yaml on
              conf/data/synthetic.yaml) at the pipeline rows' shape (data.seq_len = --seq-len,
              data.global_batch_size = --global-batch), tokens/s between its log records' time stamps after
              warm-up: the trainer's consumption. The goal is pipeline >= 20x this, and >= 50x for
              tokenized shards.

    .venv/bin/python bench/data_pipeline.py                 # 50 MB corpus, everything
    .venv/bin/python bench/data_pipeline.py --mb 10 --no-bpe --no-model
    .venv/bin/python bench/data_pipeline.py --mb 10 --no-model --repeats 3 --rows-per-shard 1024
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# First on the path: run as a script, this file's own directory would make `data_pipeline` mean this file.
sys.path.insert(0, str(ROOT))

from data_pipeline import (  # noqa: E402
    DataConfig,
    HFSourceConfig,
    SyntheticConfig,
    TokenizedConfig,
    TokenizerConfig,
    ValConfig,
    build_loaders,
    prepare,
)
from data_pipeline.mixture import MixtureSourceConfig  # noqa: E402

BATCH_SECONDS = 3.0  # how long to iterate micro-batches for the batching rate


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> tuple[int, int]:
    """Zipf-distributed pseudo-words (a few accented) in documents of 20-400 words; returns (bytes, documents)."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyzéèàüöñ")
    vocab = ["".join(rng.choice(letters, int(rng.integers(2, 10)))) for _ in range(20_000)]
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    target, written, docs = int(megabytes * 2**20), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            words = rng.choice(len(vocab), size=(1000, 400), p=weights)
            lengths = rng.integers(20, 400, size=1000)
            lines = "".join(
                json.dumps({"text": " ".join(vocab[w] for w in row[:n]), "id": docs + i}, ensure_ascii=False) + "\n"
                for i, (row, n) in enumerate(zip(words, lengths, strict=True))
            )
            f.write(lines)
            written += len(lines.encode("utf-8"))
            docs += 1000
    return written, docs


def batch_rate(train, seq_len: int, seconds: float = BATCH_SECONDS) -> float:
    """Label tokens per second delivered by iterating micro-batches (reading + tensor conversion)."""
    batches = iter(train)
    next(batches)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for batch in islice(batches, 20):
            count += batch["labels"].numel()
    return count / (time.perf_counter() - start)


def corpus_tokens(loaders) -> int:
    tokens = loaders.train.samples.tokens.num_tokens
    return tokens + (loaders.val.samples.tokens.num_tokens if loaders.val is not None else 0)


def bench_synthetic(seq_len: int, global_batch: int, num_tokens: int) -> dict:
    config = DataConfig(
        synthetic=SyntheticConfig(num_tokens=num_tokens), seq_len=seq_len, global_batch_size=global_batch
    )
    start = time.perf_counter()
    loaders = build_loaders(config)
    build = time.perf_counter() - start
    return {
        "name": f"synthetic ({num_tokens / 1e6:.1f}M tokens)",
        "prepare_tok_s": corpus_tokens(loaders) / build,
        "prepare_s": build,
        "batch_tok_s": batch_rate(loaders.train, seq_len),
        "floor": loaders.entropy_floor,
    }


def jsonl_config(hf: HFSourceConfig, tokenizer: dict, seq_len: int, global_batch: int, val_fraction: float):
    return DataConfig(
        source="hf",
        hf=hf,
        tokenizer=TokenizerConfig(**tokenizer),
        seq_len=seq_len,
        global_batch_size=global_batch,
        val=ValConfig(fraction=val_fraction),
    )


def bench_jsonl(corpus: Path, cache: Path, seq_len: int, global_batch: int, num_proc: int, tokenizer) -> dict:
    import datasets

    hf = HFSourceConfig(path="json", data_files=[str(corpus)], cache_dir=str(cache), num_proc=num_proc)
    config = jsonl_config(hf, tokenizer, seq_len, global_batch, val_fraction=0.01)
    start = time.perf_counter()
    datasets.load_dataset("json", data_files={"train": [str(corpus)]}, split="train", cache_dir=str(cache))
    load = time.perf_counter() - start
    start = time.perf_counter()
    loaders = build_loaders(config)  # load is now cached: this is tokenize + pack (train and val maps)
    tokenize = time.perf_counter() - start
    start = time.perf_counter()
    build_loaders(config)
    cached = time.perf_counter() - start
    tokens = corpus_tokens(loaders)
    name = "byte-level" if not tokenizer else f"BPE vocab {loaders.vocab_size}"
    return {
        "name": f"jsonl map-style, {name}, num_proc={num_proc}",
        "prepare_tok_s": tokens / (load + tokenize),
        "prepare_s": load + tokenize,
        "detail": f"load {load:.1f}s + tokenize/pack {tokenize:.1f}s for {tokens / 1e6:.1f}M tokens; "
        f"cached rebuild {cached:.1f}s",
        "batch_tok_s": batch_rate(loaders.train, seq_len),
    }


def bench_streaming(corpus: Path, cache: Path, seq_len: int, global_batch: int, tokenizer) -> dict:
    hf = HFSourceConfig(path="json", data_files=[str(corpus)], cache_dir=str(cache), streaming=True)
    config = jsonl_config(hf, tokenizer, seq_len, global_batch, val_fraction=0.0)
    loaders = build_loaders(config)
    name = "byte-level" if not tokenizer else f"BPE vocab {loaders.vocab_size}"
    return {"name": f"jsonl streaming, {name}", "batch_tok_s": batch_rate(loaders.train, seq_len, seconds=8.0)}


def spread(values: list[float]) -> str:
    """median [min-max] of rates, in millions."""
    return f"{statistics.median(values) / 1e6:.2f}M [{min(values) / 1e6:.2f}-{max(values) / 1e6:.2f}M]"


def bench_prepare(corpus: Path, work: Path, tokenizer: dict, workers: int, repeats: int, rows_per_shard: int):
    """`moe-data prepare`'s tokens/s: the source already in the datasets cache (as on any run after the first), each
    repeat into a fresh directory. Returns the row and the last directory written."""
    from data_pipeline.hf_source import load_split

    hf = HFSourceConfig(path="json", data_files=[str(corpus)], cache_dir=str(work / "cache_prepare"))
    load_split(hf, hf.split, hf.data_files)  # jsonl -> Arrow once, outside the timing
    rates, out = [], None
    for repeat in range(repeats):
        out = work / f"shards_{workers}_{repeat}"
        start = time.perf_counter()
        result = prepare(hf, TokenizerConfig(**tokenizer), str(out), workers, rows_per_shard=rows_per_shard,
                         progress=False)  # fmt: skip
        rates.append(result.header.num_tokens / (time.perf_counter() - start))
        if repeat:
            shutil.rmtree(work / f"shards_{workers}_{repeat - 1}")
    header = result.header
    name = "byte-level" if not tokenizer else f"BPE vocab {header.vocab_size}"
    return {
        "name": f"moe-data prepare, {name}, workers={workers}",
        "prepare_tok_s": statistics.median(rates),
        "detail": f"{spread(rates)} tok/s over {repeats} repeat(s); {header.num_tokens / 1e6:.1f}M tokens in "
        f"{len(header.shards)} shards of {rows_per_shard} rows ({header.dtype})",
    }, out


def bench_tokenized(shards: Path, seq_len: int, global_batch: int, repeats: int, name: str) -> dict:
    config = DataConfig(source="tokenized", tokenized=TokenizedConfig(path=str(shards)), seq_len=seq_len,
                        global_batch_size=global_batch, val=ValConfig(fraction=0.01))  # fmt: skip
    builds, rates = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        loaders = build_loaders(config)  # header, sizes and sha256 of every shard file, memory maps, holdout carving
        builds.append(time.perf_counter() - start)
        rates.append(batch_rate(loaders.train, seq_len))
    return {
        "name": f"tokenized shards, {name}",
        "batch_tok_s": statistics.median(rates),
        "detail": f"batches {spread(rates)} tok/s over {repeats} repeat(s); build (verify=true) "
        f"{statistics.median(builds):.2f} s median",
    }


MIXTURE_WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def mixture_sources(shards: Path) -> list[MixtureSourceConfig]:
    """Three sources over the same prepared shards (each reads its own permutation), weighted 60/30/10."""
    return [MixtureSourceConfig(name=name, weight=w, path=str(shards)) for name, w in MIXTURE_WEIGHTS.items()]


def bench_mixture(shards: Path, seq_len: int, global_batch: int, repeats: int, name: str) -> dict:
    config = DataConfig(source="mixture", mixture=mixture_sources(shards), seq_len=seq_len,
                        global_batch_size=global_batch, val=ValConfig(fraction=0.01))  # fmt: skip
    rates = [batch_rate(build_loaders(config).train, seq_len) for _ in range(repeats)]
    return {
        "name": f"3-source mixture of tokenized shards, {name}",
        "batch_tok_s": statistics.median(rates),
        "detail": f"batches {spread(rates)} tok/s over {repeats} repeat(s), prefetch off",
    }


def bench_data_wait(sources: dict[str, list[str]], seq_len: int, global_batch: int, repeats: int) -> list[dict]:
    """The share of training time the real trainer waits for its batches (`data_wait_frac`, monitor/data_mix.py)
    with data.prefetch=0 and 2, runs interleaved: the records after the first window (warm-up), median [min-max]
    over the repeats of each run's mean."""
    import subprocess

    fractions: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for name, overrides in sources.items():
            for prefetch in (0, 2):
                with tempfile.TemporaryDirectory() as run_dir:
                    command = [
                        str(Path(sys.executable).parent / "moe-train"), f"hydra.run.dir={run_dir}", *overrides,
                        f"data.seq_len={seq_len}", f"data.global_batch_size={global_batch}",
                        f"data.prefetch={prefetch}",
                        "trainer.max_steps=24", "trainer.log_every=4", "trainer.eval_every=0",
                        "trainer.save_final=false", "logging.progress_bar=false", "logging.peak_memory=false",
                    ]  # fmt: skip
                    subprocess.run(command, check=True, capture_output=True, text=True)
                    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
                waits = [r["data_wait_frac"] for r in map(json.loads, lines) if "data_wait_frac" in r][1:]
                fractions.setdefault((name, prefetch), []).append(statistics.mean(waits))
    rows = []
    for (name, prefetch), values in fractions.items():
        rows.append({
            "name": f"trainer waits for data, {name}, data.prefetch={prefetch}",
            "wait": values,
            "detail": f"{100 * statistics.median(values):.3f}% of step time [{100 * min(values):.3f}-"
            f"{100 * max(values):.3f}%] over {repeats} repeat(s) (moe_tiny, 24 steps)",
        })  # fmt: skip
    return rows


def train_bpe(corpus: Path, out_dir: Path, vocab_size: int = 8192, sample_mb: float = 5.0) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        budget = int(sample_mb * 2**20)
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                budget -= len(line)
                if budget < 0:
                    return
                yield json.loads(line)["text"]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(sample(), trainer)
    path = out_dir / "bpe.json"
    tokenizer.save(str(path))
    return {"name_or_path": str(path), "eos_token": "<eos>"}


def bench_model(data_yaml: Path, model_yaml: Path, seq_len: int, global_batch: int) -> dict:
    """Tokens/s the real trainer consumes: `moe-train` with its defaults (the tiny MoE on the synthetic data) at the
    shape the pipeline rows are measured at, from its log records after warm-up: the whole loop (logs included: the
    span between two records' time stamps), not a bare forward/backward."""
    import subprocess
    from datetime import datetime

    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            str(Path(sys.executable).parent / "moe-train"),
            f"hydra.run.dir={run_dir}",
            f"data.seq_len={seq_len}",
            f"data.global_batch_size={global_batch}",
            "trainer.max_steps=40",
            "trainer.log_every=10",
            "trainer.eval_every=0",
            "trainer.save_final=false",
            "logging.progress_bar=false",
        ]
        subprocess.run(command, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "tokens_per_s" in r]
    first, last = train[0], train[-1]  # the first window includes warm-up: from the end of step 10
    seconds = datetime.fromisoformat(last["time"]).timestamp() - datetime.fromisoformat(first["time"]).timestamp()
    return {
        "name": f"trainer ({model_yaml.stem} on {data_yaml.stem}, seq_len {seq_len}, batch {global_batch})",
        "batch_tok_s": (last["tokens_seen"] - first["tokens_seen"]) / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=50.0, help="size of the generated jsonl corpus (MB)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--synthetic-tokens", type=int, default=10_000_000)
    parser.add_argument("--no-bpe", action="store_true", help="skip the BPE tokenizer runs")
    parser.add_argument("--no-model", action="store_true", help="skip the model-step measurement")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the prepare and tokenized rows")
    parser.add_argument("--rows-per-shard", type=int, default=4096, help="prepare's shard size (documents)")
    parser.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir, removed after)")
    args = parser.parse_args()

    work = args.dir or Path(tempfile.mkdtemp(prefix="bench_data_pipeline_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        results.append(bench_synthetic(args.seq_len, args.global_batch, args.synthetic_tokens))
        corpus = work / "corpus.jsonl"
        size, docs = write_corpus(corpus, args.mb)
        print(f"corpus: {corpus} {size / 2**20:.1f} MB, {docs} documents", flush=True)
        tokenizers = [{}] + ([] if args.no_bpe else [train_bpe(corpus, work)])
        for i, tokenizer in enumerate(tokenizers):
            cache = work / f"cache{i}"
            results.append(bench_jsonl(corpus, cache, args.seq_len, args.global_batch, args.num_proc, tokenizer))
            results.append(bench_streaming(corpus, cache, args.seq_len, args.global_batch, tokenizer))
            for workers in (1, 2):
                row, shards = bench_prepare(corpus, work, tokenizer, workers, args.repeats, args.rows_per_shard)
                results.append(row)
            name = row["name"].split(", ")[1]
            results.append(bench_tokenized(shards, args.seq_len, args.global_batch, args.repeats, name))
            results.append(bench_mixture(shards, args.seq_len, args.global_batch, args.repeats, name))
            if i == 0 and not args.no_model:
                kept = work / "shards_wait"
                shutil.copytree(shards, kept, dirs_exist_ok=True)
                mixture = ",".join(f"{{name: {n}, weight: {w}, path: {kept}}}" for n, w in MIXTURE_WEIGHTS.items())
                streamed = ["data=hf_local", f"data.hf.data_files=[{corpus}]", "data.hf.streaming=true",
                            f"data.hf.cache_dir={work / 'cache_wait'}"]  # fmt: skip
                waits = {
                    "tokenized shards": ["data=tokenized", f"data.tokenized.path={kept}"],
                    "3-source mixture": ["data=mixture", f"data.mixture=[{mixture}]"],
                    "hf streaming (tokenized on the fly)": streamed,
                }
                results.extend(bench_data_wait(waits, args.seq_len, args.global_batch, args.repeats))
            shutil.rmtree(work / "cache_prepare", ignore_errors=True)
            for stale in work.glob("shards_*"):
                shutil.rmtree(stale)
        model = None
        if not args.no_model:
            try:
                model = bench_model(
                    ROOT / "conf/data/synthetic.yaml",
                    ROOT / "conf/model/moe_tiny.yaml",
                    args.seq_len,
                    args.global_batch,
                )
            except Exception as exc:  # the data figures stand on their own
                print(f"model step not measured: {type(exc).__name__}: {exc}")
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'':58s} {'prepare tok/s':>14s} {'batch tok/s':>14s}")
    for r in results:
        prepare = f"{r['prepare_tok_s']:14,.0f}" if "prepare_tok_s" in r else f"{'-':>14s}"
        batch = f"{r['batch_tok_s']:14,.0f}" if "batch_tok_s" in r else f"{'-':>14s}"
        print(f"{r['name']:58s} {prepare} {batch}")
        if "detail" in r:
            print(f"{'':4s}{r['detail']}")
    if model is not None:
        print(f"{model['name']:58s} {'-':>14s} {model['batch_tok_s']:14,.0f}")
        print("\npipeline / model consumption (goal >= 20x):")
        for r in results:
            if "wait" in r:
                continue
            rate = min(r.get("batch_tok_s", float("inf")), r.get("prepare_tok_s", float("inf")))
            print(f"  {r['name']:56s} {rate / model['batch_tok_s']:8.0f}x")
        print(
            "  (prepare = one-time generation or tokenization+packing; batch = steady-state micro-batches; "
            "the ratio takes the slower of the two)"
        )


if __name__ == "__main__":
    main()
