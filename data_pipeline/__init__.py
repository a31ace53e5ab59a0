"""Text to deterministic, resumable packed token batches; nothing here imports Hydra or the model.

Entry point: ``build_loaders(DataConfig(...), rank, world_size, micro_batch_size)``, after ``preflight`` (the checks
that need no tokenization, for the start of a run, before any process group). See ``loader``
for batch layout and resume semantics, ``synthetic`` for the default corpus and its entropy floor,
``hf_source`` for Hugging Face datasets, ``packing`` for how documents become windows, ``prepare`` and ``shards``
for a corpus tokenized once into memory-mapped shards (``moe-data prepare``, ``data.source=tokenized``).
"""

from data_pipeline.errors import DataConfigError, DataError
from data_pipeline.hf_source import HFSourceConfig
from data_pipeline.loader import DataConfig, DataLoaders, TrainLoader, ValConfig, ValLoader, build_loaders
from data_pipeline.order import BatchLayout
from data_pipeline.packing import TokenBuffer, pack_stream
from data_pipeline.preflight import preflight
from data_pipeline.prepare import Prepared, prepare
from data_pipeline.shards import TokenizedConfig, TokenizedCorpus
from data_pipeline.synthetic import SyntheticConfig, SyntheticLanguage
from data_pipeline.tokenizer import ByteTokenizer, HFTokenizer, TokenizerConfig, build_tokenizer, check_vocab_fits

__all__ = [
    "BatchLayout",
    "ByteTokenizer",
    "DataConfig",
    "DataConfigError",
    "DataError",
    "DataLoaders",
    "HFSourceConfig",
    "HFTokenizer",
    "Prepared",
    "SyntheticConfig",
    "SyntheticLanguage",
    "TokenBuffer",
    "TokenizedConfig",
    "TokenizedCorpus",
    "TokenizerConfig",
    "TrainLoader",
    "ValConfig",
    "ValLoader",
    "build_loaders",
    "build_tokenizer",
    "check_vocab_fits",
    "pack_stream",
    "preflight",
    "prepare",
]
