"""The synthetic language: its sampler follows its tables, and its entropy floor is exact."""

from __future__ import annotations

import math
from collections import Counter
from itertools import islice

import numpy as np
import pytest

from data_pipeline import DataConfig, SyntheticConfig, SyntheticLanguage, ValConfig, build_loaders


def _standard_error(per_token: np.ndarray, num_blocks: int = 100) -> float:
    """Standard error of a mean of correlated per-token values, by batch means over contiguous blocks."""
    blocks = per_token[: len(per_token) // num_blocks * num_blocks].reshape(num_blocks, -1).mean(axis=1)
    return float(blocks.std(ddof=1) / math.sqrt(num_blocks))


def test_floor_matches_closed_form_of_a_one_symbol_language():
    # One symbol that repeats until EOS with p = 1/2; EOS is always followed by the symbol.
    # Per document (1/p symbols + EOS) only the end-or-continue choices carry entropy: (1/p) H_b(p).
    p = 0.5
    language = SyntheticLanguage(SyntheticConfig(num_domains=1, symbols_per_domain=1, branching=1, mean_doc_len=1 / p))
    expected = (1 / p) * -(p * math.log(p) + (1 - p) * math.log(1 - p)) / (1 / p + 1)
    assert language.entropy_floor == pytest.approx(expected, rel=1e-12)


def test_transition_matrix_is_stochastic_and_domains_are_disjoint():
    config = SyntheticConfig(num_domains=3, symbols_per_domain=10, branching=3)
    language = SyntheticLanguage(config)
    matrix = language.transition_matrix()
    assert matrix.shape == (language.vocab_size, language.vocab_size)
    np.testing.assert_allclose(matrix[: language.eos_id + 1].sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert matrix[language.pad_id].sum() == 0 and matrix[:, language.pad_id].sum() == 0
    domain = np.arange(language.num_symbols) // config.symbols_per_domain
    symbol_to_symbol = matrix[: language.num_symbols, : language.num_symbols]
    assert np.all(symbol_to_symbol[domain[:, None] != domain[None, :]] == 0)
    assert np.all((symbol_to_symbol > 0).sum(axis=1) == config.branching)


def test_sample_is_a_pure_function_of_seed_and_a_growing_prefix():
    language = SyntheticLanguage(SyntheticConfig(seed=3))
    tokens, lengths = language.sample(50_000)
    again, _ = SyntheticLanguage(SyntheticConfig(seed=3)).sample(50_000)
    longer, longer_lengths = language.sample(120_000)
    other, _ = SyntheticLanguage(SyntheticConfig(seed=4)).sample(50_000)
    assert np.array_equal(tokens, again)
    assert np.array_equal(longer[: len(tokens)], tokens)
    assert np.array_equal(longer_lengths[: len(lengths)], lengths)
    assert not np.array_equal(other[: len(tokens)], tokens)
    # documents are whole: each ends in EOS and holds none inside
    assert len(tokens) >= 50_000 and lengths.sum() == len(tokens)
    ends = np.cumsum(lengths) - 1
    assert np.all(tokens[ends] == language.eos_id)
    assert (tokens == language.eos_id).sum() == len(lengths)


def test_entropy_floor_matches_an_empirical_estimate_on_a_long_sample():
    """Two estimates from 4M sampled tokens must agree with the analytic floor:

    - the mean log-loss of the true next-token distribution (unbiased for the entropy rate);
    - the plug-in conditional entropy from bigram counts, which uses none of the tables, so it also
      checks that the sampler follows them. Its bias is below K/(2N) nats (Miller-Madow, K nonzero
      bigrams), about 2e-4 here.
    The tolerance is 5 standard errors, measured by batch means (about 3e-3 nats at N = 4M), plus that bias.
    """
    language = SyntheticLanguage(SyntheticConfig())
    tokens, _ = language.sample(4_000_000)
    prev, nxt = tokens[:-1].astype(np.int64), tokens[1:].astype(np.int64)
    true_loss = -np.log(language.transition_matrix()[prev, nxt])
    standard_error = _standard_error(true_loss)
    assert abs(true_loss.mean() - language.entropy_floor) < 5 * standard_error

    vocab = language.vocab_size
    counts = np.bincount(prev * vocab + nxt, minlength=vocab * vocab).reshape(vocab, vocab).astype(float)
    nonzero = counts > 0
    row_totals = np.broadcast_to(counts.sum(axis=1, keepdims=True), counts.shape)
    plug_in = -(counts[nonzero] * np.log(counts[nonzero] / row_totals[nonzero])).sum() / counts.sum()
    bias_bound = nonzero.sum() / (2 * len(prev))
    assert abs(plug_in - language.entropy_floor) < 5 * standard_error + bias_bound
    # and the floor is far below the context-free loss, so a model has something to learn
    assert language.entropy_floor < language.unigram_entropy - 2.0


def test_true_model_loss_on_packed_batches_equals_the_floor():
    """Every label in a packed window has its previous token in the input, so the true model's mean
    loss over loader batches estimates the floor (tolerance: 5 batch-means standard errors)."""
    config = DataConfig(synthetic=SyntheticConfig(num_tokens=600_000), seq_len=127, global_batch_size=16)
    loaders = build_loaders(config)
    matrix = loaders.language.transition_matrix()
    losses = []
    for batch in islice(loaders.train, 250):
        losses.append(-np.log(matrix[batch["input_ids"].numpy(), batch["labels"].numpy()]).ravel())
    losses = np.concatenate(losses)
    assert loaders.entropy_floor == loaders.language.entropy_floor
    assert abs(losses.mean() - loaders.entropy_floor) < 5 * _standard_error(losses)


def _documents(tokens: np.ndarray, eos_id: int) -> Counter:
    ends = np.flatnonzero(tokens == eos_id) + 1
    return Counter(doc.tobytes() for doc in np.split(tokens, ends) if len(doc))


def test_synthetic_holdout_splits_documents_without_loss_or_overlap():
    config = DataConfig(synthetic=SyntheticConfig(num_tokens=300_000), seq_len=63, val=ValConfig(fraction=0.2))
    loaders = build_loaders(config)
    (train_tokens,) = loaders.train.samples.tokens.chunks
    (val_tokens,) = loaders.val.samples.tokens.chunks
    tokens, _ = loaders.language.sample(300_000)
    eos = loaders.eos_id
    assert _documents(train_tokens, eos) + _documents(val_tokens, eos) == _documents(tokens, eos)
    assert 0.15 < len(val_tokens) / len(tokens) < 0.25
