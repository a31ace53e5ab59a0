"""Fixtures for data_pipeline tests: small local corpora and tokenizers built in temp dirs, never downloads."""

from __future__ import annotations

import json
import os

# datasets reads these at import time; nothing in these tests may touch the network.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from data_pipeline import DataConfig, HFSourceConfig, ValConfig, build_loaders

WORDS = ["alpha", "beta", "gamma", "delta", "épée", "naïve", "日本語", "data", "token", "expert", "router", "😀"]


def make_documents(num_docs: int, seed: int = 0) -> list[str]:
    """Documents of varied length with multi-byte UTF-8, plus the odd empty one."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(num_docs):
        n_words = 0 if i % 97 == 13 else int(rng.integers(1, 60))
        docs.append(f"doc{i} " * (n_words > 0) + " ".join(rng.choice(WORDS, n_words)))
    return docs


def write_jsonl(path, docs, field: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({field: doc, "meta": len(doc)}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Two jsonl files (read in this order) and their documents, plus a datasets cache dir."""
    root = tmp_path_factory.mktemp("corpus")
    docs = make_documents(1200)
    files = [write_jsonl(root / "part0.jsonl", docs[:700]), write_jsonl(root / "part1.jsonl", docs[700:])]
    return {"docs": docs, "files": files, "cache_dir": str(root / "cache")}


@pytest.fixture()
def hf_config(corpus):
    """A DataConfig over the jsonl corpus; keyword overrides go to HFSourceConfig, ValConfig or DataConfig."""

    def make(hf: dict | None = None, val: dict | None = None, **data) -> DataConfig:
        hf_kwargs = {"path": "json", "data_files": corpus["files"], "cache_dir": corpus["cache_dir"]} | (hf or {})
        data = {"seq_len": 31, "global_batch_size": 8, "seed": 0} | data
        val_config = ValConfig(**(val or {"fraction": 0.0}))
        return DataConfig(source="hf", hf=HFSourceConfig(**hf_kwargs), val=val_config, **data)

    return make


@pytest.fixture(scope="session")
def trained_tokenizer(tmp_path_factory, corpus):
    """A small BPE tokenizer trained on the corpus: its tokenizer.json and a transformers directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizer")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<eos>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus["docs"], trainer)
    json_path = str(root / "tokenizer.json")
    tokenizer.save(json_path)
    auto_dir = root / "auto"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>").save_pretrained(auto_dir)
    return {"json": json_path, "dir": str(auto_dir), "vocab_size": tokenizer.get_vocab_size()}


def _global_steps(config: DataConfig, world_size: int, micro_batch_size: int, num_steps: int, state=None):
    """Sample ids of ``num_steps`` global steps, reassembled from every rank's micro-batches in (rank, micro) order.

    Returns (steps, windows): steps[g] is the list of sample ids of step g; windows[g] their token windows.
    """
    per_rank = []
    for rank in range(world_size):
        train = build_loaders(config, rank, world_size, micro_batch_size).train
        if state is not None:
            train.load_state_dict(state)
        micro_batches = iter(train)
        rank_steps = []
        for _ in range(num_steps):
            batches = [next(micro_batches) for _ in range(train.accumulation_steps)]
            ids = np.concatenate([b["sample_ids"].numpy() for b in batches])
            windows = np.concatenate(
                [np.concatenate([b["input_ids"].numpy(), b["labels"].numpy()[:, -1:]], axis=1) for b in batches]
            )
            rank_steps.append((ids, windows))
        per_rank.append(rank_steps)
    steps = [np.concatenate([per_rank[r][g][0] for r in range(world_size)]).tolist() for g in range(num_steps)]
    windows = [np.concatenate([per_rank[r][g][1] for r in range(world_size)]) for g in range(num_steps)]
    return steps, windows


@pytest.fixture()
def global_steps():
    return _global_steps
