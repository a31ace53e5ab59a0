"""Throughput of the data pipeline (tokenize + pack + batch) on CPU, next to what the default model consumes.

Measured, in one process, with a fresh datasets cache:
  synthetic   generate the default corpus (+ holdout split), then iterate micro-batches
  jsonl       a generated corpus of >= 50 MB: load (jsonl -> Arrow), tokenize + pack (datasets.map,
              num_proc), batch; byte-level, and a BPE tokenizer trained here on a 5 MB sample
  streaming   the same corpus streamed: tokenize + pack + batch on the fly (what every rank does)
  model       one optimizer step (forward + backward + AdamW) of the default model (conf/model/moe_tiny.yaml)
              on the default data (conf/data/synthetic.yaml) at the default micro batch: the trainer's
              consumption. The goal is pipeline >= 20x this.

    .venv/bin/python bench/data_pipeline.py                 # 50 MB corpus, everything
    .venv/bin/python bench/data_pipeline.py --mb 10 --no-bpe --no-model
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    TokenizerConfig,
    ValConfig,
    build_loaders,
)

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


def bench_jsonl(corpus: Path, cache: Path, seq_len: int, global_batch: int, num_proc: int, tokenizer) -> dict:
    import datasets

    hf = HFSourceConfig(path="json", data_files=[str(corpus)], cache_dir=str(cache), num_proc=num_proc)
    config = DataConfig(
        source="hf",
        hf=hf,
        tokenizer=TokenizerConfig(**tokenizer),
        seq_len=seq_len,
        global_batch_size=global_batch,
        val=ValConfig(fraction=0.01),
    )
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
    config = DataConfig(
        source="hf",
        hf=hf,
        tokenizer=TokenizerConfig(**tokenizer),
        seq_len=seq_len,
        global_batch_size=global_batch,
        val=ValConfig(fraction=0.0),
    )
    loaders = build_loaders(config)
    name = "byte-level" if not tokenizer else f"BPE vocab {loaders.vocab_size}"
    return {"name": f"jsonl streaming, {name}", "batch_tok_s": batch_rate(loaders.train, seq_len, seconds=8.0)}


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


def bench_model(data_yaml: Path, model_yaml: Path) -> dict:
    """Tokens/s of forward + backward + AdamW of the default model on the default data, default micro batch."""
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from moe.config import ModelConfig
    from moe.model import Transformer

    try:
        from moe_platform.config import TrainerConfig

        micro = TrainerConfig().micro_batch_size
    except Exception:  # the trainer's config is optional here
        micro = 8
    model_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(model_yaml)))
    data_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(data_yaml)))
    loaders = build_loaders(data_config, micro_batch_size=micro)
    model = Transformer(model_config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(loaders.train)

    def step() -> None:
        batch = next(batches)
        out = model(batch["input_ids"])
        loss = F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten()) + out.aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up
        step()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 10.0:
        step()
        steps += 1
    elapsed = time.perf_counter() - start
    return {
        "name": f"model step ({model_yaml.stem}, micro {micro} x seq {data_config.seq_len}, "
        f"{torch.get_num_threads()} threads)",
        "batch_tok_s": steps * micro * data_config.seq_len / elapsed,
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
        model = None
        if not args.no_model:
            try:
                model = bench_model(ROOT / "conf/data/synthetic.yaml", ROOT / "conf/model/moe_tiny.yaml")
            except Exception as exc:  # the data figures stand on their own
                print(f"model step not measured: {type(exc).__name__}: {exc}")
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'':58s} {'prepare tok/s':>14s} {'batch tok/s':>14s}")
    for r in results:
        prepare = f"{r['prepare_tok_s']:14,.0f}" if "prepare_tok_s" in r else f"{'-':>14s}"
        print(f"{r['name']:58s} {prepare} {r['batch_tok_s']:14,.0f}")
        if "detail" in r:
            print(f"{'':4s}{r['detail']}")
    if model is not None:
        print(f"{model['name']:58s} {'-':>14s} {model['batch_tok_s']:14,.0f}")
        print("\npipeline / model consumption (goal >= 20x):")
        for r in results:
            rate = min(r["batch_tok_s"], r.get("prepare_tok_s", float("inf")))
            print(f"  {r['name']:56s} {rate / model['batch_tok_s']:8.0f}x")
        print(
            "  (prepare = one-time generation or tokenization+packing; batch = steady-state micro-batches; "
            "the ratio takes the slower of the two)"
        )


if __name__ == "__main__":
    main()
