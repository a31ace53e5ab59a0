"""Synthetic token language: the embedded default corpus (no download), with an exact entropy floor.

Vocabulary: symbols ``0 .. S-1`` with ``S = num_domains · symbols_per_domain``, then ``EOS = S`` and
``PAD = S + 1`` (PAD is never emitted). The defaults give S = 256, EOS = 256, PAD = 257, vocab 258:
the same ids as the byte-level tokenizer, so one model config fits either source.

The language is a first-order Markov chain over symbols ∪ {EOS}:

- Domain d owns the symbol block ``[d·Sd, (d+1)·Sd)`` and its own sparse transition table: every
  symbol has ``branching`` successors inside its block, with probabilities that are exact multiples
  of ``1/PROB_DENOMINATOR`` (so sampling by table lookup is exact, not an approximation).
- A document starts with a symbol drawn uniformly from all S symbols (this picks the domain,
  uniformly, and the start state). After each symbol the document ends (EOS is emitted) with
  probability ``p = 1/mean_doc_len``, else the chain moves to a successor. Document lengths are
  therefore geometric; being memoryless is what keeps the floor exact without knowing positions.
- Because the blocks are disjoint, the previous token alone reveals the domain and the exact
  next-token distribution; experts have distinct domains to specialise on, and a tiny transformer
  only has to learn a sparse bigram table (learnable in a few hundred steps).

Entropy floor (``entropy_floor``, nats per token): the entropy rate of the chain,
``h = Σ_i μ_i H(P_i)`` over the stationary distribution μ. It is the expected loss of the true
next-token distribution, i.e. the minimum achievable expected cross-entropy of any predictor that
sees at least the previous token. In a packed window ``labels[t] = window[t+1]`` and
``input_ids[t] = window[t]``, so every label has its previous token in the input, and h is exactly
the best achievable mean loss over packed batches (up to an O(1/corpus length) transient, because
the corpus starts at a document start rather than in μ). The domain is unknown at a document start:
the token after EOS costs ``log S`` nats (``log num_domains`` for the domain, ``log symbols_per_domain``
for the start symbol), and that cost is included; so is the cost of predicting EOS, ``H_b(p)`` per
symbol. ``unigram_entropy`` is the loss of the best context-free predictor, for reference.

The floor is computed from renewal theory, one document being one cycle: with ``v_s`` the expected
visits to symbol s per document, ``h = (log S + Σ_s v_s H(P_s)) / (1/p + 1)``, where
``v = π0 (I - (1-p) Q)^{-1}`` per domain, ``π0`` the uniform start and Q the within-domain table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from data_pipeline.errors import DataConfigError

PROB_DENOMINATOR = 256  # transition probabilities are multiples of 1/256: exact sampling by table lookup
_DOCS_PER_CHUNK = 8192  # generation unit; fixed so the corpus is the same whatever num_tokens is asked for
_MAX_SYMBOLS_PER_DOMAIN = 4096  # the floor solves one dense Sd×Sd system per domain


@dataclass
class SyntheticConfig:
    """A Markov-domain token language; the corpus is a pure function of these fields."""

    num_domains: int = 4
    symbols_per_domain: int = 64
    branching: int = 4  # successors per symbol: sparse tables keep the language learnable
    mean_doc_len: float = 128.0  # mean symbols per document (EOS excluded); geometric lengths
    num_tokens: int = 2**23  # corpus size (train + held-out validation documents)
    seed: int = 0  # seed of the language (its tables) and of the sampled corpus; the data order has its own

    def __post_init__(self) -> None:
        if self.num_domains < 1:
            raise DataConfigError(f"data.synthetic.num_domains={self.num_domains} must be >= 1")
        if not 1 <= self.symbols_per_domain <= _MAX_SYMBOLS_PER_DOMAIN:
            raise DataConfigError(
                f"data.synthetic.symbols_per_domain={self.symbols_per_domain} must be in [1, {_MAX_SYMBOLS_PER_DOMAIN}]"
            )
        if self.num_domains * self.symbols_per_domain + 2 > 2**16:
            raise DataConfigError(
                f"synthetic vocab num_domains*symbols_per_domain+2="
                f"{self.num_domains * self.symbols_per_domain + 2} exceeds 65536: use fewer domains or symbols"
            )
        if not 1 <= self.branching <= min(self.symbols_per_domain, PROB_DENOMINATOR):
            raise DataConfigError(
                f"data.synthetic.branching={self.branching} must be in [1, min(symbols_per_domain, "
                f"{PROB_DENOMINATOR})]: lower branching or raise symbols_per_domain"
            )
        if not self.mean_doc_len >= 1.0:
            raise DataConfigError(
                f"data.synthetic.mean_doc_len={self.mean_doc_len} must be >= 1 (documents hold >= 1 symbol)"
            )
        if self.num_tokens < 1:
            raise DataConfigError(f"data.synthetic.num_tokens={self.num_tokens} must be >= 1")
        if self.seed < 0:
            raise DataConfigError(f"data.synthetic.seed={self.seed} must be >= 0")

    @property
    def vocab_size(self) -> int:
        """Every domain's symbols, then EOS and PAD."""
        return self.num_domains * self.symbols_per_domain + 2


class SyntheticLanguage:
    """The language of a ``SyntheticConfig``: its tables, exact entropies, and a fast sampler."""

    def __init__(self, config: SyntheticConfig):
        self.config = config
        self.num_symbols = config.num_domains * config.symbols_per_domain
        self.eos_id = self.num_symbols
        self.pad_id = self.num_symbols + 1
        self.vocab_size = config.vocab_size
        self.end_prob = 1.0 / config.mean_doc_len
        self.successors, self.counts = self._make_tables()  # (S, branching) each
        # lookup[s, u] for u uniform in [0, PROB_DENOMINATOR): successor j occupies counts[s, j] slots
        self._lookup = np.stack([np.repeat(self.successors[s], self.counts[s]) for s in range(self.num_symbols)])
        self._lookup = self._lookup.astype(np.uint16)

    def _make_tables(self) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0]))
        successors = np.empty((self.num_symbols, cfg.branching), dtype=np.int64)
        counts = np.empty((self.num_symbols, cfg.branching), dtype=np.int64)
        for s in range(self.num_symbols):
            block_start = (s // cfg.symbols_per_domain) * cfg.symbols_per_domain
            successors[s] = block_start + rng.choice(cfg.symbols_per_domain, cfg.branching, replace=False)
            counts[s] = _quantize(rng.dirichlet(np.ones(cfg.branching)), PROB_DENOMINATOR)
        return successors, counts

    def _symbol_row_entropy(self) -> np.ndarray:
        """H(P_s) for each symbol s: end-or-continue, then which successor."""
        q = self.counts / PROB_DENOMINATOR
        successor_entropy = -(q * np.log(q)).sum(axis=1)
        p = self.end_prob
        end_entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0.0 < p < 1.0 else 0.0
        return end_entropy + (1 - p) * successor_entropy

    def _visits_per_document(self) -> np.ndarray:
        """Expected visits to each symbol in one document: v = π0 (I - (1-p) Q)^{-1}, solved per domain."""
        sd = self.config.symbols_per_domain
        visits = np.empty(self.num_symbols)
        for d in range(self.config.num_domains):
            block = slice(d * sd, (d + 1) * sd)
            q = np.zeros((sd, sd))
            np.add.at(q, (np.arange(sd)[:, None], self.successors[block] - d * sd), self.counts[block])
            q /= PROB_DENOMINATOR
            start = np.full(sd, 1.0 / self.num_symbols)
            visits[block] = np.linalg.solve((np.eye(sd) - (1 - self.end_prob) * q).T, start)
        return visits

    @property
    def entropy_floor(self) -> float:
        """Entropy rate in nats/token: the best achievable mean loss on packed batches (see module doc)."""
        tokens_per_doc = 1.0 / self.end_prob + 1.0  # symbols + EOS
        entropy_per_doc = math.log(self.num_symbols) + float(self._visits_per_document() @ self._symbol_row_entropy())
        return entropy_per_doc / tokens_per_doc

    @property
    def unigram_entropy(self) -> float:
        """Entropy of the stationary token distribution: the best loss of a predictor without context."""
        tokens_per_doc = 1.0 / self.end_prob + 1.0
        mu = np.append(self._visits_per_document(), 1.0) / tokens_per_doc
        mu = mu[mu > 0]
        return float(-(mu * np.log(mu)).sum())

    def transition_matrix(self) -> np.ndarray:
        """P[a, b] = probability that token b follows token a, shape (vocab_size, vocab_size); PAD row is 0."""
        p = np.zeros((self.vocab_size, self.vocab_size))
        rows = np.arange(self.num_symbols)[:, None]
        np.add.at(p, (rows, self.successors), (1 - self.end_prob) * self.counts / PROB_DENOMINATOR)
        p[: self.num_symbols, self.eos_id] = self.end_prob
        p[self.eos_id, : self.num_symbols] = 1.0 / self.num_symbols
        return p

    def sample(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The shortest prefix of whole documents holding >= num_tokens tokens.

        Returns ``(tokens, doc_lengths)``: tokens (uint16) with EOS after every document, and each
        document's length including its EOS. A larger ``num_tokens`` extends, never changes, the prefix.
        """
        tokens, lengths, total, chunk = [], [], 0, 0
        while total < num_tokens:
            chunk_tokens, chunk_lengths = self._sample_chunk(chunk)
            tokens.append(chunk_tokens)
            lengths.append(chunk_lengths)
            total += len(chunk_tokens)
            chunk += 1
        tokens_all, lengths_all = np.concatenate(tokens), np.concatenate(lengths)
        # Trim whole documents past the first one that reaches num_tokens.
        num_docs = int(np.searchsorted(np.cumsum(lengths_all), num_tokens)) + 1
        lengths_all = lengths_all[:num_docs]
        return tokens_all[: int(lengths_all.sum())], lengths_all

    def _sample_chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """_DOCS_PER_CHUNK documents from their own RNG stream, all stepped in lockstep (vectorized)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.config.seed, 1, chunk]))
        num_symbols_per_doc = rng.geometric(self.end_prob, size=_DOCS_PER_CHUNK)  # >= 1
        doc_lengths = num_symbols_per_doc + 1  # + EOS
        doc_starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]])
        out = np.empty(int(doc_lengths.sum()), dtype=np.uint16)
        out[doc_starts + num_symbols_per_doc] = self.eos_id

        # Longest documents first, so the documents still running at step t are a prefix.
        order = np.argsort(-num_symbols_per_doc, kind="stable")
        neg_sorted_len = -num_symbols_per_doc[order]
        position = doc_starts[order]
        state = rng.integers(0, self.num_symbols, size=_DOCS_PER_CHUNK).astype(np.intp)
        out[position] = state
        for t in range(1, int(-neg_sorted_len[0])):
            n_running = int(np.searchsorted(neg_sorted_len, -t, side="left"))  # docs with length > t
            state = self._lookup[state[:n_running], rng.integers(0, PROB_DENOMINATOR, size=n_running)].astype(np.intp)
            out[position[:n_running] + t] = state
        return out, doc_lengths


def _quantize(weights: np.ndarray, denominator: int) -> np.ndarray:
    """Integers >= 1 summing to ``denominator``, proportional to ``weights`` (largest remainder)."""
    spare = denominator - len(weights)
    scaled = weights * spare
    counts = np.floor(scaled).astype(np.int64)
    leftover = spare - int(counts.sum())
    counts[np.argsort(-(scaled - counts), kind="stable")[:leftover]] += 1
    return counts + 1
