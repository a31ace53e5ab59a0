"""Build train/validation loaders of packed token batches from a ``DataConfig``.

Each loader yields this rank's micro-batches as dicts of int64 tensors:
``input_ids [m, seq_len]``, ``labels [m, seq_len]`` (inputs shifted by one inside the packed window),
and ``sample_ids [m]`` (the packed-sample index within the corpus, for tests and logging; when
streaming, the window's index in its epoch's stream, since windows are re-cut every epoch).
With ``document_mask``, also ``document_ids [m, seq_len]``: which document of the window each input
token belongs to, counted from 0 at the window's first token and raised by one after every EOS
(``document_ids[t] = #{s < t : input_ids[s] = EOS}``), so an EOS belongs to the document it closes. The
model uses them to keep attention inside each document (block-diagonal causal). They are a function of
the window alone, so determinism and resuming are those of the windows.

Slicing (details in ``data_pipeline.order``): global step g is positions ``[g·G, (g+1)·G)`` of the
global sample sequence; rank r of W takes the contiguous block ``[r·G/W, (r+1)·G/W)`` and its
micro-batch j of ``a = G/(m·W)`` is ``[j·m, (j+1)·m)`` of that block. The samples in a step are
therefore the same for any world size W and any split G = m·a·W, and the order of samples is a
pure function of (corpus, seed, epoch).

Resuming: ``TrainLoader.state_dict()`` is the number of global samples consumed by completed
global steps (plus the seed and corpus size, checked on load). A global step that was only partly
iterated (some of its micro-batches) does not count: after a resume it is replayed from its first
micro-batch, which is right because its optimizer step never happened. World size and micro-batch
size may change across a resume.

Source selection is Hydra-friendly without ``_target_``: ``source`` names which of the sub-configs
``synthetic`` / ``hf`` / ``tokenized`` is used, and the unused ones must be left at their defaults (so no key is
ever silently ignored). ``tokenized`` reads a directory ``moe-data prepare`` wrote (``shards``): the same windows,
in the same order, as ``hf`` map-style on the source it was prepared from.

In a multi-process job, call ``build_loaders`` on the main process first (e.g. under Accelerate's
``main_process_first()``): map-style tokenization is then done once and the other ranks read the
``datasets`` cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import NamedTuple, Optional

import numpy as np
import torch

from data_pipeline.errors import DataConfigError, DataError
from data_pipeline.hf_source import HFSourceConfig, describe, load_split, stream_tokens, tokenize_dataset
from data_pipeline.holdout import holdout_mask_from_index
from data_pipeline.mixture import BlendSchedule, MixedSamples, MixtureSourceConfig, check_sources, normalised_weights
from data_pipeline.order import BatchLayout, IndexedSamples, SampleSequence, StreamedSamples
from data_pipeline.packing import TokenBuffer, pack_stream
from data_pipeline.prefetch import Prefetched
from data_pipeline.shards import TokenizedConfig, TokenizedCorpus
from data_pipeline.synthetic import SyntheticConfig, SyntheticLanguage
from data_pipeline.tokenizer import Tokenizer, TokenizerConfig, build_tokenizer, check_vocab_fits

SOURCES = ("synthetic", "hf", "tokenized", "mixture")
log = logging.getLogger(__name__)
DEFAULT_HOLDOUT_FRACTION = 0.01


@dataclass
class ValConfig:
    """Held-out validation: a given split, or a deterministic fraction of the training documents."""

    split: Optional[str] = None  # hf only: a held-out split, e.g. "validation"
    data_files: Optional[list[str]] = None  # files of ``split`` when the train split is given as hf.data_files
    fraction: Optional[float] = None  # without ``split``: share of documents held out by hash (default 0.01;
    # 0 disables validation)
    global_batch_size: Optional[int] = None  # default: the training global batch size
    max_batches: Optional[int] = None  # cap on global batches per evaluation (default: the whole split). A
    # streamed validation set is read once into memory, up to this cap.

    def __post_init__(self) -> None:
        if self.fraction is not None and not 0.0 <= self.fraction < 1.0:
            raise DataConfigError(f"data.val.fraction={self.fraction} must be in [0, 1)")
        if self.split is not None and self.fraction is not None:
            raise DataConfigError(
                f"data.val.fraction is unused when data.val.split={self.split!r} is given: set one of them, "
                "the other to null"
            )
        if self.data_files is not None and self.split is None:
            raise DataConfigError("data.val.data_files needs data.val.split (the split those files hold)")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise DataConfigError(f"data.val.global_batch_size={self.global_batch_size} must be >= 1")
        if self.max_batches is not None and self.max_batches < 1:
            raise DataConfigError(f"data.val.max_batches={self.max_batches} must be >= 1 or null")

    @property
    def holdout_fraction(self) -> float:
        """Share of training documents held out: 0 when a split is given."""
        if self.split is not None:
            return 0.0
        return DEFAULT_HOLDOUT_FRACTION if self.fraction is None else self.fraction

    @property
    def enabled(self) -> bool:
        return self.split is not None or self.holdout_fraction > 0


@dataclass
class DataConfig:
    """Everything that defines the token batches: source, tokenizer, packing, batching, order."""

    source: str = "synthetic"  # "synthetic", "hf", "tokenized" or "mixture": which sub-config below is used
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    hf: HFSourceConfig = field(default_factory=HFSourceConfig)
    tokenized: TokenizedConfig = field(default_factory=TokenizedConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # tokenized: optional, must be the header's
    val: ValConfig = field(default_factory=ValConfig)
    seq_len: int = 256
    global_batch_size: int = 32  # packed samples per optimizer step, over all ranks
    seed: int = 0  # sample order; the corpus itself does not depend on it
    document_mask: bool = False  # batches carry document_ids: attention stays inside each packed document
    mixture: list[MixtureSourceConfig] = field(default_factory=list)  # data.source=mixture: the weighted sources
    allow_changed_mixture: bool = False  # a resume may continue a changed mixture from the consumed counts
    prefetch: int = 2  # micro-batches built ahead in a background thread (0: built when the step asks)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise DataConfigError(f"data.source={self.source!r} must be one of {SOURCES}")
        if self.source == "mixture":
            check_sources(self.mixture)
        elif self.mixture:
            raise DataConfigError(f"data.mixture is set but data.source={self.source!r}: set data.source=mixture")
        if self.prefetch < 0:
            raise DataConfigError(f"data.prefetch={self.prefetch} must be >= 0 (0: no prefetch)")
        for name, default in (
            ("synthetic", SyntheticConfig()),
            ("hf", HFSourceConfig()),
            ("tokenized", TokenizedConfig()),
        ):
            if name != self.source and getattr(self, name) != default:
                raise DataConfigError(
                    f"data.{name} is set but data.source={self.source!r}: set data.source={name} or remove data.{name}"
                )
        if self.source != "hf" and self.val.split is not None:
            raise DataConfigError(
                f"data.val.split needs data.source=hf; the {self.source} source holds out data.val.fraction"
            )
        if self.source == "synthetic":
            if self.tokenizer != TokenizerConfig():
                raise DataConfigError(
                    "data.tokenizer is unused by data.source='synthetic' (it emits token ids): remove it"
                )
        elif self.source == "mixture":
            kinds = {source.kind for source in self.mixture}
            if self.tokenizer != TokenizerConfig() and not kinds & {"hf", "tokenized"}:
                raise DataConfigError("data.tokenizer is unused by a mixture of synthetic sources: remove it")
        elif self.source == "tokenized":
            if not self.tokenized.path:
                raise DataConfigError(
                    "data.tokenized.path is empty: give a directory that `moe-data prepare ... --out DIR` wrote"
                )
        else:
            if not self.hf.path:
                raise DataConfigError(
                    "data.hf.path is empty: name a hub dataset, a local directory, or 'json'/'parquet'/'text'"
                )
            if self.val.split is not None and self.hf.data_files and not self.val.data_files:
                raise DataConfigError(
                    "data.val.split with data.hf.data_files needs data.val.data_files (that split's files)"
                )
        if self.seq_len < 1:
            raise DataConfigError(f"data.seq_len={self.seq_len} must be >= 1")
        if self.global_batch_size < 1:
            raise DataConfigError(f"data.global_batch_size={self.global_batch_size} must be >= 1")
        if self.seed < 0:
            raise DataConfigError(f"data.seed={self.seed} must be >= 0")


def _to_batch(sample_ids: np.ndarray, windows: np.ndarray, eos_id: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The micro-batch of these windows; with ``eos_id``, plus the inputs' ``document_ids`` (module docstring)."""
    windows_BW = torch.from_numpy(windows.astype(np.int64))  # (m, seq_len + 1)
    batch = {
        "input_ids": windows_BW[:, :-1].contiguous(),  # (m, seq_len)
        "labels": windows_BW[:, 1:].contiguous(),  # (m, seq_len)
        "sample_ids": torch.from_numpy(sample_ids.astype(np.int64)),  # (m,)
    }
    if eos_id is not None:
        is_eos_BT = (batch["input_ids"] == eos_id).long()
        batch["document_ids"] = is_eos_BT.cumsum(dim=1) - is_eos_BT  # EOS before t, not at t: (m, seq_len)
    return batch


class TrainLoader:
    """Endless iterator over this rank's micro-batches, ``accumulation_steps`` per global step."""

    def __init__(
        self,
        samples: SampleSequence,
        layout: BatchLayout,
        seed: int,
        eos_id: Optional[int] = None,
        prefetch: int = 0,
        allow_changed_mixture: bool = False,
    ):
        self.samples = samples
        self.layout = layout
        self.seed = seed
        self.eos_id = eos_id  # set: batches carry document_ids (data.document_mask)
        self.prefetch = prefetch  # micro-batches built ahead in a thread (data.prefetch; 0: none)
        self.allow_changed_mixture = allow_changed_mixture  # data.allow_changed_mixture (a mixture's resume)
        self._prefetched: Optional[Prefetched] = None
        self._start = 0  # global samples consumed when the current iterator began
        self._yielded = 0  # micro-batches yielded by the current iterator

    @property
    def accumulation_steps(self) -> int:
        return self.layout.accumulation_steps

    @property
    def num_samples(self) -> Optional[int]:
        """Packed samples per epoch (None for a stream not yet read to its end)."""
        return self.samples.num_samples

    @property
    def samples_consumed(self) -> int:
        """Global samples in completed global steps: the position a resume continues from."""
        return self._start + (self._yielded // self.accumulation_steps) * self.layout.global_batch_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start = self.samples_consumed
        self._start, self._yielded = start, 0
        if self._prefetched is not None:
            self._prefetched.close()  # the previous iterator's thread
        batches = self._micro_batches(start)
        if self.prefetch:
            batches = self._prefetched = Prefetched(batches, self.prefetch)
        return self._counted(batches)

    def _counted(self, batches: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """Counts a micro-batch when the loop takes it (a prefetched one is not consumed yet)."""
        for batch in batches:
            self._yielded += 1  # before yielding: after the last micro-batch the step counts as done
            yield batch

    def _micro_batches(self, start: int) -> Iterator[dict[str, torch.Tensor]]:
        step = 0
        while True:
            for micro in range(self.accumulation_steps):
                position = start + self.layout.micro_batch_start(step, micro)
                yield _to_batch(*self.samples.read(position, self.layout.micro_batch_size), self.eos_id)
            step += 1

    def source_counts(self) -> Optional[dict[str, int]]:
        """A mixture's samples per source in completed global steps (None for a single source)."""
        return self.samples.consumed(self.samples_consumed) if isinstance(self.samples, MixedSamples) else None

    def source_weights(self) -> dict[str, float]:
        """A mixture's normalised weights by source name (empty for a single source)."""
        return self.samples.weights if isinstance(self.samples, MixedSamples) else {}

    def state_dict(self) -> dict:
        state = {"samples_consumed": self.samples_consumed, "seed": self.seed, "num_samples": self.num_samples}
        if isinstance(self.samples, MixedSamples):
            state["mixture"] = self.samples.state_at(self.samples_consumed)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the next ``iter()`` starts there."""
        if state["seed"] != self.seed:
            raise DataError(
                f"data state was saved with seed {state['seed']} but data.seed={self.seed}: resume with the same seed"
            )
        saved, now = state.get("num_samples"), self.num_samples
        if saved is not None and now is not None and saved != now:
            raise DataError(
                f"data state was saved for a corpus of {saved} packed samples, this one has {now}: "
                "resume with the same data, tokenizer and seq_len"
            )
        mixed = isinstance(self.samples, MixedSamples)
        if mixed != ("mixture" in state):
            saved, now = ("a mixture", "one source") if not mixed else ("one source", "a mixture")
            raise DataError(
                f"data state was saved reading {saved} but this run reads {now}: resume with the data it was saved "
                "with, or start afresh with resume=none"
            )
        position = int(state["samples_consumed"])
        if mixed:
            for change in self.samples.resume(position, state["mixture"], self.allow_changed_mixture):
                log.warning("data.allow_changed_mixture: %s; the new mixture continues from global sample %d",
                            change, position)  # fmt: skip
        self._start, self._yielded = position, 0


class ValLoader:
    """One deterministic pass over the validation samples (in corpus order), this rank's micro-batches.

    Only whole global batches are evaluated (at most ``max_batches``), so every world size sees the
    same validation samples.
    """

    def __init__(
        self,
        load_tokens: Callable[[], TokenBuffer],
        config: DataConfig,
        layout: BatchLayout,
        where: str,
        *,
        lazy: bool,
        eos_id: Optional[int] = None,
    ):
        # lazy: load on first use, so a streamed validation set is read from the stream at the first
        # evaluation rather than at build time; otherwise load now and fail early if it is too small.
        self._load_tokens = load_tokens
        self._config = config
        self.layout = layout
        self.where = where
        self.eos_id = eos_id  # set: batches carry document_ids (data.document_mask)
        self._num_batches: Optional[int] = None if lazy else self._count_batches()

    @cached_property
    def samples(self) -> IndexedSamples:
        return IndexedSamples(self._load_tokens(), self._config.seq_len + 1, self._config.seed, shuffle=False)

    @property
    def num_batches(self) -> int:
        """Whole global batches evaluated per pass (at least one, else a DataError)."""
        if self._num_batches is None:
            self._num_batches = self._count_batches()
        return self._num_batches

    def _count_batches(self) -> int:
        num_batches = self.samples.num_samples // self.layout.global_batch_size
        if self._config.val.max_batches is not None:
            num_batches = min(num_batches, self._config.val.max_batches)
        if num_batches == 0:
            raise DataError(
                f"{self.where}: validation holds {self.samples.num_samples} packed samples, fewer than one global "
                f"batch of {self.layout.global_batch_size}: raise data.val.fraction, lower data.val.global_batch_size "
                "or data.seq_len"
            )
        return num_batches

    def __len__(self) -> int:
        return self.num_batches * self.layout.accumulation_steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for step in range(self.num_batches):
            for micro in range(self.layout.accumulation_steps):
                position = self.layout.micro_batch_start(step, micro)
                yield _to_batch(*self.samples.read(position, self.layout.micro_batch_size), self.eos_id)


@dataclass
class DataLoaders:
    """What ``build_loaders`` returns: the loaders and the token facts a model and trainer need."""

    train: TrainLoader
    val: Optional[ValLoader]
    vocab_size: int
    eos_id: int
    pad_id: int
    entropy_floor: Optional[float] = None  # synthetic only: best achievable loss, nats/token
    tokenizer: Optional[Tokenizer] = None  # hf, and tokenized when data.tokenizer is set (for decoding)
    language: Optional[SyntheticLanguage] = None  # synthetic only (its tables)
    val_by_source: dict[str, ValLoader] = field(default_factory=dict)  # a mixture's: each source's held-out part

    @property
    def evaluates(self) -> bool:
        return self.val is not None or bool(self.val_by_source)


def build_loaders(
    config: DataConfig,
    rank: int = 0,
    world_size: int = 1,
    micro_batch_size: Optional[int] = None,
    *,
    model_vocab_size: Optional[int] = None,
    total_samples: Optional[int] = None,
) -> DataLoaders:
    """Train and validation loaders for rank ``rank`` of ``world_size``.

    ``micro_batch_size`` defaults to ``global_batch_size // world_size`` (no accumulation). With
    ``model_vocab_size`` a tokenizer whose ids would not fit the model raises a DataError; with ``total_samples``
    (global samples the run will read) a mixture source that would pass its ``max_epochs`` does.
    """
    if micro_batch_size is None:
        micro_batch_size = max(1, config.global_batch_size // world_size)
    layout = BatchLayout(config.global_batch_size, world_size, rank, micro_batch_size)
    val_layout = _val_layout(config, layout)
    if config.source == "mixture":
        return _mixture_loaders(config, layout, model_vocab_size, total_samples)
    if config.source == "tokenized":
        corpus = TokenizedCorpus.open(config.tokenized.path, verify=config.tokenized.verify)
        if model_vocab_size is not None:
            corpus.check_vocab_fits(model_vocab_size)
        return _tokenized_loaders(config, corpus, layout, val_layout)
    if config.source == "synthetic":
        loaders = _synthetic_loaders(config, layout, val_layout)
        name = "synthetic"
    else:
        loaders = _hf_loaders(config, layout, val_layout)
        name = loaders.tokenizer.name
    if model_vocab_size is not None:
        check_vocab_fits(name, loaders.vocab_size, model_vocab_size)
    return loaders


def _val_layout(config: DataConfig, layout: BatchLayout) -> BatchLayout:
    """Validation batches use the training micro-batch size (same memory), capped by a smaller val batch."""
    val_global = config.val.global_batch_size or config.global_batch_size
    micro = min(layout.micro_batch_size, max(1, val_global // layout.world_size))
    try:
        return BatchLayout(val_global, layout.world_size, layout.rank, micro)
    except ValueError as err:
        raise DataConfigError(f"data.val.global_batch_size: {err}") from None


def _synthetic_loaders(config: DataConfig, layout: BatchLayout, val_layout: BatchLayout) -> DataLoaders:
    language = SyntheticLanguage(config.synthetic)
    tokens, doc_lengths = language.sample(config.synthetic.num_tokens)
    held_out = holdout_mask_from_index(np.arange(len(doc_lengths)), config.val.holdout_fraction)
    held_out_tokens = np.repeat(held_out, doc_lengths)
    train, val = _in_memory_loaders(
        config, layout, val_layout, "synthetic corpus", language.eos_id,
        TokenBuffer([tokens[~held_out_tokens]]), lambda: TokenBuffer([tokens[held_out_tokens]]),
    )  # fmt: skip
    return DataLoaders(
        train=train,
        val=val,
        vocab_size=language.vocab_size,
        eos_id=language.eos_id,
        pad_id=language.pad_id,
        entropy_floor=language.entropy_floor,
        language=language,
    )


class _Part(NamedTuple):
    """Which documents one loader reads: a split (its files) and a holdout role: "all", "train" or "val"."""

    split: str
    data_files: Optional[list[str]]
    role: str


def _hf_loaders(config: DataConfig, layout: BatchLayout, val_layout: BatchLayout) -> DataLoaders:
    hf, val = config.hf, config.val
    tokenizer = build_tokenizer(config.tokenizer)
    carve = val.holdout_fraction > 0  # validation documents are held out of the train split by hash
    train = _Part(hf.split, hf.data_files, "train" if carve else "all")
    held_out = None
    if val.split is not None:
        held_out = _Part(val.split, val.data_files, "all")
    elif carve:
        held_out = _Part(hf.split, hf.data_files, "val")
    build = _streamed_hf if hf.streaming else _indexed_hf
    train_samples, load_val_tokens = build(config, tokenizer, train, held_out, val_layout)
    eos_id = tokenizer.eos_id if config.document_mask else None
    val_loader = None
    if load_val_tokens is not None:
        where = describe(hf, *held_out[:2])
        val_loader = ValLoader(load_val_tokens, config, val_layout, where, lazy=hf.streaming, eos_id=eos_id)
    return DataLoaders(
        train=TrainLoader(train_samples, layout, config.seed, eos_id, config.prefetch),
        val=val_loader,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        tokenizer=tokenizer,
    )


def _indexed_hf(
    config: DataConfig, tokenizer: Tokenizer, train: _Part, held_out: Optional[_Part], val_layout: BatchLayout
) -> tuple[SampleSequence, Optional[Callable[[], TokenBuffer]]]:
    """Map-style: tokenize (cached) both parts up front; train samples are randomly accessed."""
    hf, fraction = config.hf, config.val.holdout_fraction
    train_dataset = load_split(hf, train.split, train.data_files)
    where = describe(hf, train.split, train.data_files)
    train_tokens = tokenize_dataset(
        train_dataset, hf, train.data_files, tokenizer, role=train.role, val_fraction=fraction, where=where
    )
    _check_fills_a_window(train_tokens, config.seq_len + 1, where)
    load_val_tokens = None
    if held_out is not None:
        val_dataset = train_dataset if held_out.role == "val" else load_split(hf, held_out.split, held_out.data_files)
        val_tokens = tokenize_dataset(
            val_dataset, hf, held_out.data_files, tokenizer, role=held_out.role, val_fraction=fraction,
            where=describe(hf, held_out.split, held_out.data_files),
        )  # fmt: skip
        load_val_tokens = lambda: val_tokens  # noqa: E731
    return IndexedSamples(train_tokens, config.seq_len + 1, config.seed), load_val_tokens


def _streamed_hf(
    config: DataConfig, tokenizer: Tokenizer, train: _Part, held_out: Optional[_Part], val_layout: BatchLayout
) -> tuple[SampleSequence, Optional[Callable[[], TokenBuffer]]]:
    """Streaming: train windows are produced while iterating; validation is read into memory on first use."""
    hf, fraction, seed, width = config.hf, config.val.holdout_fraction, config.seed, config.seq_len + 1

    def open_train_epoch(epoch: int) -> Iterator[np.ndarray]:
        return stream_tokens(
            hf, train.split, train.data_files, tokenizer,
            role=train.role, val_fraction=fraction, seed=seed, epoch=epoch, shuffle=True,
        )  # fmt: skip

    train_samples = StreamedSamples(open_train_epoch, width, describe(hf, train.split, train.data_files))
    if held_out is None:
        return train_samples, None
    max_batches = config.val.max_batches
    limit = None if max_batches is None else max_batches * val_layout.global_batch_size

    def load_val_tokens() -> TokenBuffer:
        val_stream = stream_tokens(
            hf, held_out.split, held_out.data_files, tokenizer,
            role=held_out.role, val_fraction=fraction, seed=seed, epoch=0, shuffle=False,
        )  # fmt: skip
        return _collect_windows(val_stream, width, limit)

    return train_samples, load_val_tokens


def _collect_windows(token_batches: Iterator[np.ndarray], width: int, limit: Optional[int]) -> TokenBuffer:
    """Read up to ``limit`` packed windows of a stream into memory (validation is read once, then reused)."""
    blocks, count = [], 0
    for block in pack_stream(token_batches, width):
        blocks.append(block.ravel())
        count += len(block)
        if limit is not None and count >= limit:
            break
    return TokenBuffer(blocks)


def _tokenized_loaders(
    config: DataConfig, corpus: TokenizedCorpus, layout: BatchLayout, val_layout: BatchLayout
) -> DataLoaders:
    """Prepared shards, carved and packed as ``_indexed_hf`` carves and packs the source they were prepared from."""
    tokenizer = corpus.check_tokenizer(config.tokenizer)
    fraction = config.val.holdout_fraction
    train, val = _in_memory_loaders(
        config, layout, val_layout, f"tokenized corpus {corpus.path!r}", corpus.eos_id,
        corpus.tokens("train" if fraction > 0 else "all", fraction), lambda: corpus.tokens("val", fraction),
    )  # fmt: skip
    return DataLoaders(
        train=train,
        val=val,
        vocab_size=corpus.vocab_size,
        eos_id=corpus.eos_id,
        pad_id=corpus.pad_id,
        tokenizer=tokenizer,
    )


def _in_memory_loaders(
    config: DataConfig,
    layout: BatchLayout,
    val_layout: BatchLayout,
    where: str,
    eos_id: int,
    train_tokens: TokenBuffer,
    val_tokens: Callable[[], TokenBuffer],
) -> tuple[TrainLoader, Optional[ValLoader]]:
    """The loaders of a corpus whose parts are token buffers at hand (synthetic, prepared shards): randomly
    accessed training windows, and validation (its tokens taken only when it is enabled), read at once."""
    width = config.seq_len + 1
    _check_fills_a_window(train_tokens, width, where)
    eos_id = eos_id if config.document_mask else None
    val = None
    if config.val.enabled:
        held_out = val_tokens()
        val = ValLoader(lambda: held_out, config, val_layout, where, lazy=False, eos_id=eos_id)
    samples = IndexedSamples(train_tokens, width, config.seed)
    return TrainLoader(samples, layout, config.seed, eos_id, config.prefetch), val


def _check_fills_a_window(tokens: TokenBuffer, width: int, where: str) -> None:
    if tokens.num_windows(width) == 0:
        raise DataError(
            f"{where} holds {tokens.num_tokens} tokens after tokenization, fewer than one packed sample of "
            f"seq_len+1={width}: add data or lower data.seq_len"
        )


def _mixture_loaders(
    config: DataConfig, layout: BatchLayout, model_vocab_size: Optional[int], total_samples: Optional[int]
) -> DataLoaders:
    """Each source built as a source of its own (its samples, its held-out part, this rank's layouts), blended by
    the mixture's schedule (``mixture``); every source must speak the same token ids."""
    names = [source.name for source in config.mixture]
    corpora = {  # opened first so that their errors name the mixture's key, not data.tokenized.path
        index: TokenizedCorpus.open(source.path, verify=False, key=f"data.mixture[{index}].path")
        for index, source in enumerate(config.mixture)
        if source.kind == "tokenized"
    }
    built = [
        build_loaders(_source_config(config, source), layout.rank, layout.world_size, layout.micro_batch_size,
                      model_vocab_size=model_vocab_size)
        for source in config.mixture
    ]  # fmt: skip
    first = built[0]
    for name, loaders in zip(names[1:], built[1:], strict=True):
        if (loaders.vocab_size, loaders.eos_id) != (first.vocab_size, first.eos_id):
            raise DataError(
                f"data.mixture: source {name!r} has a vocabulary of {loaders.vocab_size} with EOS {loaders.eos_id}, "
                f"source {names[0]!r} {first.vocab_size} with EOS {first.eos_id}: prepare every source with one "
                "tokenizer"
            )
    weights = normalised_weights(names, [source.weight for source in config.mixture])
    samples = MixedSamples(
        names,
        [loaders.train.samples for loaders in built],
        BlendSchedule(weights),
        fingerprints=[
            _source_fingerprint(config, source, loaders, corpora.get(index))
            for index, (source, loaders) in enumerate(zip(config.mixture, built, strict=True))
        ],
    )
    if total_samples is not None:
        samples.check_capacity(total_samples, [source.max_epochs for source in config.mixture])
    train = TrainLoader(samples, layout, config.seed, first.train.eos_id, config.prefetch, config.allow_changed_mixture)
    return DataLoaders(
        train=train,
        val=None,
        vocab_size=first.vocab_size,
        eos_id=first.eos_id,
        pad_id=first.pad_id,
        tokenizer=next((loaders.tokenizer for loaders in built if loaders.tokenizer is not None), None),
        val_by_source={name: loaders.val for name, loaders in zip(names, built, strict=True) if loaders.val},
    )


def _source_config(config: DataConfig, source: MixtureSourceConfig) -> DataConfig:
    """The mixture source as a data config of its own: the mixture's packing, batches and held-out fraction, its
    own order (a seed drawn from data.seed and its name, so two sources of the same data shuffle apart)."""
    seed = int.from_bytes(hashlib.blake2b(f"{config.seed}/{source.name}".encode(), digest_size=4).digest(), "little")
    common = dict(tokenizer=config.tokenizer if source.kind != "synthetic" else TokenizerConfig(), seed=seed,
                  mixture=[], source=source.kind)  # fmt: skip
    if source.kind == "tokenized":
        return replace(config, tokenized=TokenizedConfig(path=source.path), **common)
    if source.kind == "synthetic":
        return replace(config, synthetic=source.synthetic, **common)
    return replace(config, hf=source.hf, **common)


def _source_fingerprint(
    config: DataConfig, source: MixtureSourceConfig, loaders: DataLoaders, corpus: Optional[TokenizedCorpus]
) -> str:
    """Changes whenever the source's sample sequence could: its data (a prepared corpus's shard checksums; an
    inline source's config and tokenizer), the packing width, the held-out fraction and the order's seed."""
    if corpus is not None:
        data = corpus.fingerprint
    else:
        data = asdict(source.synthetic if source.kind == "synthetic" else source.hf)
    tokenizer = loaders.tokenizer.fingerprint if loaders.tokenizer is not None else None
    identity = [source.kind, data, tokenizer, config.seq_len, config.val.holdout_fraction, config.seed]
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
