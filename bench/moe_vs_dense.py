"""Does our MoE learn better than a dense FFN? Held-out loss on real text, the same tokens for every model (issue 26).

The anchor (arXiv 2605.13769: sub-25 M parameters, 4 experts top-2, load-balancing + z-loss, 3 seeds) reports
validation loss 1.6545 ± 0.0012 for the dense model of equal ACTIVE parameters, 1.5788 ± 0.0020 for the MoE (4.6%
lower) and 1.5608 ± 0.0025 for the dense model of equal TOTAL parameters (the MoE within 1.2%). This bench asks
the same question of our platform, at CPU size, through the real `moe-train`:

    dense-active     dense FFN of width K·F: the MoE's active parameters (it lacks only the router's E·D per layer)
    moe-4x2          4 routed experts of width F, top-2; load-balancing loss 0.01 and z-loss 0.001 (moe_tiny's)
    dense-total      dense FFN of width E·F: the MoE's total parameters
    moe-fine-shared  1 shared + 7 routed experts of width F/2, top-3: the same active (4·F/2) and total (8·F/2)
                     widths as moe-4x2, cut finer (DeepSeekMoE's segmentation and shared expert)
    moe-4x2-muon     moe-4x2 trained with `optim=muon` (conf/optim/muon.yaml: its lr and schedule)
    dense-active-muon, dense-total-muon
                     the dense rows under `optim=muon`: the MoE-vs-dense question asked again with Muon for every row
    moe-8x2, dense-total-8x2
                     8 routed experts of width F, top-2 (the active width of moe-4x2, twice its total) and the dense
                     FFN of width 8·F; only when --rows names them (a pilot: bench/README.md says what it showed)
    moe-2x1          2 routed experts of width 2·F, top-1 (Switch's routing: the gate is the chosen expert's
                     softmax probability, not renormalised to 1, so the router learns from the loss): the active
                     (2·F) and total (4·F) widths of moe-4x2 and of the dense rows, in whole-width experts; only when
                     --rows names it (a pilot: bench/README.md says what it showed)
    balanced-8x2     8 routed experts of width F, top-2, aux 0.01: the collapse row's control (one seed, short)
    collapse         balanced-8x2 with model.moe.aux_loss_coef=0 and no balancing bias (one seed, short): the routing
                     alert (moe_platform/monitor/alerts.py) must fire within the run, and moe-report's HTML show it.
                     Not moe-4x2: a layer's MaxVio is at most E/K - 1, which is 1 for 4 experts top-2, so the default
                     logging.alert_maxvio=1.0 can never fire there (only a dead expert could); 8 top-2 goes up to 3

Corpus: the Python standard library's own source (`sysconfig.get_paths()["stdlib"]`, every *.py outside
site-packages, tests included), read in sorted path order: human-written code and docstrings that every Python
install, and so every CI clone with a venv, has on disk without a network (~31 MB in 3.11). The synthetic corpus
would not do: its Markov domains are what the experts were designed to split. Its identity (Python version, file
count, bytes, a sha256 over every path and its bytes) is printed, since another Python has another stdlib. One
file is one document; the few files that are not UTF-8 (test fixtures in other encodings) are left out and counted.
It is tokenized byte-level (vocab 258: no tokenizer to train or download, and the embedding stays small, so the FFN
whose variants are compared holds most of the parameters) into shards by `data_pipeline.prepare` (what `moe-data
prepare data=hf_local` runs), and `moe-train data=tokenized` holds out `data.val.fraction` of the documents by hash
of their bytes (data_pipeline/holdout.py): whole files, never seen in training, the same for every run.
`--set bpe_vocab=N` tokenizes with a byte-level BPE of N tokens instead, trained on the training files alone (a pilot:
bench/README.md says what it showed).
`--text prose` trains on each file's docstrings and comments alone (`prose_of`: English, where the same question
about code asks mostly about copying identifiers); files with neither are left out.

Every run has the same tokens, schedule and seed set: seed s sets both trainer.seed (init) and data.seed (sample
order), so row A and row B of seed s see the same batches in the same order (`--set data_seed=N`: every seed reads
order N, and only the init differs); AdamW with warmup then cosine decay.
Printed per row: eval loss on the held-out files after the last step (mean ± std, min–max over seeds), tokens/s
(median log window after the first), parameters total/active (the run's own config through moe.count_parameters,
the ledger's source), and routing health from metrics.jsonl (MaxVio of the worst layer, averaged over the second
half of the logs; the most dead experts any layer had in a log; alert records). Then the gaps between rows in nats
and percent, whether the seeds' min–max ranges overlap, the gap seed by seed (same batches: a paired figure), and
the steps each seed's run took to reach the reference's final training loss over the reference's own (min–max over
seeds; `steps_to_match`: within one epoch every batch is new, so the training loss is a held-out loss too).

    .venv/bin/python bench/moe_vs_dense.py                 # the full bench: 4 rows x 3 seeds + collapse, 2 jobs
    .venv/bin/python bench/moe_vs_dense.py --quick         # tiny model, 24 steps, 1 seed, 2 rows + collapse
    .venv/bin/python bench/moe_vs_dense.py --rows dense-active,moe-4x2 --seeds 0 --jobs 1   # the pilot
    .venv/bin/python bench/moe_vs_dense.py --summarize outputs/a --summarize outputs/b   # earlier runs together

Runs go to --out (default outputs/moe_vs_dense, git-ignored), each in runs/<row>_seed<s>; the collapse run's report
is runs/collapse_seed0/report.html. Each run is forked from a process with moe-train's imports done
(moe_platform/launch/prestarted.py, as the tests launch it: the same command without ~4 s of imports per run); --jobs
runs that many at once, each on --threads threads (2 x 1 fills a 2-core machine, and tiny models gain more from a
second process than from a second thread).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import math
import shutil
import statistics
import sys
import sysconfig
import time
import tokenize
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from queue import Queue

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from moe import count_parameters  # noqa: E402
from moe_platform.config import load_run_config  # noqa: E402
from moe_platform.testing import Prestarted, subprocess_env  # noqa: E402


@dataclass(frozen=True)
class Size:
    """One bench size: the model's shape, the data's shape and the schedule every row shares."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    expert_d_ff: int  # F: moe-4x2's expert width; the other rows' widths follow from it (module docstring)
    seq_len: int
    global_batch: int
    steps: int
    lr: float
    warmup_steps: int
    log_every: int
    eval_every: int  # the last step always evaluates
    val_fraction: float  # documents held out by hash
    val_max_batches: int | None  # None: the whole held-out part
    seeds: tuple[int, ...]
    max_files: int | None  # the first N stdlib files in sorted order; None: all of them
    collapse_steps: int
    alert_consecutive_logs: int = 3  # logging's default
    bpe_vocab: int = 0  # 0: byte-level (vocab 258); N: a byte-level BPE of N tokens trained on the training files
    data_seed: int = -1  # -1: seed s samples in order s; N >= 0: every seed samples in order N (only the init differs)


# Sized by the pilot in bench/README.md: dense-active measured ~3 min of CPU on one thread (0.44 s a step); the
# others estimated from their FLOPs at up to ~1.4x that; 2 jobs on a quiet 2-core machine:
# ~25-35 min in all (~35-45 with the dense Muon rows).
FULL = Size(
    d_model=96, n_layers=4, n_heads=4, n_kv_heads=2, expert_d_ff=128, seq_len=256, global_batch=16, steps=400,
    lr=3e-3, warmup_steps=20, log_every=20, eval_every=0, val_fraction=0.01, val_max_batches=None,
    seeds=(0, 1, 2), max_files=None, collapse_steps=200,
)  # fmt: skip
QUICK = Size(
    d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, expert_d_ff=32, seq_len=64, global_batch=8, steps=24,
    lr=3e-3, warmup_steps=4, log_every=4, eval_every=0, val_fraction=0.2, val_max_batches=4,
    seeds=(0,), max_files=60, collapse_steps=12, alert_consecutive_logs=2,
)  # fmt: skip


def row_overrides(size: Size) -> dict[str, list[str]]:
    """Each row's model (and optimizer) overrides; the widths keep active and total parameters as the docstring says."""
    F = size.expert_d_ff
    moe_4x2 = ["model=moe_tiny", "model.moe.num_experts=4", "model.moe.top_k=2", f"model.moe.expert_d_ff={F}"]
    fine_shared = ["model=moe_tiny", "model.moe.num_experts=7", "model.moe.top_k=3", "model.moe.num_shared_experts=1"]
    moe_8x2 = ["model=moe_tiny", "model.moe.num_experts=8", "model.moe.top_k=2", f"model.moe.expert_d_ff={F}"]
    top_1 = ["model.moe.top_k=1", "model.moe.router.renormalize_topk=false"]  # Switch's gate: p of the one chosen
    switch_2x1 = ["model=moe_tiny", "model.moe.num_experts=2", *top_1]
    rows = {
        "dense-active": ["model=dense_tiny", f"model.d_ff={2 * F}"],
        "moe-4x2": moe_4x2,
        "dense-total": ["model=dense_tiny", f"model.d_ff={4 * F}"],
        "moe-fine-shared": [*fine_shared, f"model.moe.expert_d_ff={F // 2}"],
        "moe-4x2-muon": [*moe_4x2, "optim=muon"],  # Muon's own lr from its yaml; the same warmup and steps
        "dense-active-muon": ["model=dense_tiny", f"model.d_ff={2 * F}", "optim=muon"],
        "dense-total-muon": ["model=dense_tiny", f"model.d_ff={4 * F}", "optim=muon"],
        "moe-8x2": moe_8x2,
        "moe-2x1": [*switch_2x1, f"model.moe.expert_d_ff={2 * F}"],
        "dense-total-8x2": ["model=dense_tiny", f"model.d_ff={8 * F}"],
        "balanced-8x2": moe_8x2,
        "collapse": [*moe_8x2, "model.moe.aux_loss_coef=0", "model.moe.router.bias_update_rate=0"],
    }
    return rows


COLLAPSE_ROWS = ("balanced-8x2", "collapse")  # one seed, collapse_steps, an HTML report each
OPT_IN_ROWS = ("moe-8x2", "dense-total-8x2", "moe-2x1")  # run only when --rows names them
# (row, reference): the gaps printed, row − reference.
GAPS = (
    ("moe-4x2", "dense-active"),
    ("moe-4x2", "dense-total"),
    ("moe-fine-shared", "dense-active"),
    ("moe-fine-shared", "moe-4x2"),
    ("dense-total", "dense-active"),
    ("moe-4x2-muon", "moe-4x2"),
    ("moe-4x2-muon", "dense-active-muon"),
    ("moe-4x2-muon", "dense-total-muon"),
    ("dense-active-muon", "dense-active"),
    ("moe-8x2", "dense-active"),
    ("moe-8x2", "dense-total-8x2"),
    ("moe-8x2", "moe-4x2"),
    ("moe-2x1", "dense-active"),
    ("moe-2x1", "dense-total"),
    ("moe-2x1", "moe-4x2"),
)


@dataclass(frozen=True)
class Corpus:
    """What the runs trained on: enough to tell whether two bench results used the same text."""

    source: str
    python: str
    files: int
    skipped_not_utf8: int
    bytes: int
    held_out_files: int  # by data.val.fraction, as moe-train carves them (hash of each document's bytes)
    held_out_bytes: int
    sha256: str
    shards: str
    bpe_vocab: int = 0  # 0: byte-level
    text: str = "code"  # "code": each file's source; "prose": its docstrings and comments only (`prose_of`)


def prose_of(source: str) -> str:
    """The English in a Python file: its docstrings (cleaned of indentation) and comments (without the `#`), in source
    order, consecutive comment lines kept as one paragraph; comment lines with no letter (rulers, `#!`) left out.
    Empty when the file has neither, or does not parse (a test fixture of broken syntax)."""
    try:
        tree = ast.parse(source)
        comments = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    except (SyntaxError, ValueError, tokenize.TokenError):
        return ""
    pieces: list[tuple[int, str]] = []  # (first line, text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=True)
            if docstring:
                pieces.append((node.body[0].lineno, docstring))
    paragraphs: list[list[tuple[int, str]]] = []  # runs of comment lines on consecutive source lines
    for token in comments:
        line_no, line = token.start[0], token.string.lstrip("#").strip()
        if not any(c.isalpha() for c in line) or line.startswith("!"):
            continue
        if paragraphs and paragraphs[-1][-1][0] == line_no - 1:
            paragraphs[-1].append((line_no, line))
        else:
            paragraphs.append([(line_no, line)])
    pieces += [(lines[0][0], "\n".join(text for _, text in lines)) for lines in paragraphs]
    return "\n\n".join(text for _, text in sorted(pieces, key=lambda piece: piece[0]))


def build_corpus(
    out: Path, max_files: int | None, val_fraction: float, bpe_vocab: int = 0, text: str = "code"
) -> Corpus:
    """The stdlib's *.py files as one jsonl (sorted paths, one document each: the source, or with text="prose" its
    docstrings and comments), tokenized into shards in out/shards: byte-level, or with a BPE of `bpe_vocab` tokens
    trained on the documents not held out (`train_bpe`). Held out by the hash of each document's bytes, as
    moe-train carves them."""
    from data_pipeline import HFSourceConfig, TokenizerConfig, prepare
    from data_pipeline.holdout import holdout_mask_from_bytes

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.relative_to(stdlib).parts)
    paths = paths[:max_files] if max_files is not None else paths
    digest, files, skipped, total, held_out_files, held_out_bytes = hashlib.sha256(), 0, 0, 0, 0, 0
    training_texts: list[str] = []  # what a BPE may learn from: never a held-out file
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "stdlib.jsonl"
    with open(jsonl, "w", encoding="utf-8") as sink:
        for path in paths:
            raw = path.read_bytes()
            try:
                document = raw.decode("utf-8")
            except UnicodeDecodeError:
                skipped += 1
                continue
            if text == "prose":
                document = prose_of(document)
                if not document:
                    continue  # no docstring or comment: nothing to train on
                raw = document.encode("utf-8")  # for "code" the document's UTF-8 bytes are the file's bytes
            relative = path.relative_to(stdlib).as_posix()
            digest.update(relative.encode() + b"\0" + raw + b"\0")
            files, total = files + 1, total + len(raw)
            if holdout_mask_from_bytes([raw], val_fraction)[0]:
                held_out_files, held_out_bytes = held_out_files + 1, held_out_bytes + len(raw)
            else:
                training_texts.append(document)
            sink.write(json.dumps({"text": document, "path": relative}) + "\n")
    tokenizer = TokenizerConfig()  # byte-level
    if bpe_vocab:
        bpe_file = train_bpe(training_texts, bpe_vocab, out / "tokenizer.json")
        tokenizer = TokenizerConfig(name_or_path=str(bpe_file), eos_token=EOS)
    shards = out / "shards"
    prepare(
        HFSourceConfig(path="json", data_files=[str(jsonl)], cache_dir=str(out / "hf_cache")),
        tokenizer,
        str(shards),
        workers=1,
        progress=False,
    )
    python = f"{sys.implementation.name} {sys.version.split()[0]}"
    held_out = (held_out_files, held_out_bytes)
    return Corpus(
        str(stdlib), python, files, skipped, total, *held_out, digest.hexdigest(), str(shards), bpe_vocab, text
    )


EOS = "<|endoftext|>"


def train_bpe(texts: list[str], vocab_size: int, path: Path) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenizer: every byte has a token, so nothing is unknown) of `vocab_size` tokens,
    EOS included, learned from `texts` alone: the held-out files never shape the vocabulary they are scored in."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    bpe.save(str(path))
    return path


def common_overrides(size: Size, corpus: Corpus, seed: int) -> list[str]:
    """What every row shares: the shape, the data, the schedule and the seed."""
    val_max = "null" if size.val_max_batches is None else size.val_max_batches
    vocab = [f"model.vocab_size={corpus.bpe_vocab}"] if corpus.bpe_vocab else []
    return [*vocab,
        f"model.d_model={size.d_model}", f"model.n_layers={size.n_layers}", f"model.n_heads={size.n_heads}",
        f"model.n_kv_heads={size.n_kv_heads}", f"model.max_seq_len={size.seq_len}",
        "data=tokenized", f"data.tokenized.path={corpus.shards}", f"data.seq_len={size.seq_len}",
        f"data.global_batch_size={size.global_batch}", f"trainer.micro_batch_size={size.global_batch}",
        f"data.val.fraction={size.val_fraction}", f"data.val.max_batches={val_max}",
        f"data.seed={seed if size.data_seed < 0 else size.data_seed}",
        f"optim.warmup_steps={size.warmup_steps}",
        f"trainer.max_steps={size.steps}", f"trainer.log_every={size.log_every}",
        f"trainer.eval_every={size.eval_every}", f"trainer.seed={seed}", "trainer.save_final=false",
        f"logging.alert_consecutive_logs={size.alert_consecutive_logs}",
        "logging.progress_bar=false", "logging.peak_memory=false",
    ]  # fmt: skip


@dataclass
class RunResult:
    row: str
    seed: int
    eval_loss: float
    train_loss: float  # the last log window's
    tokens_per_s: float
    total_params: int
    active_params: int
    wall_s: float
    maxvio: float | None = None  # worst layer's, mean over the second half of the logs (None: dense)
    dead_experts: int | None = None  # most dead experts of any layer in any log of the second half
    alerts: list[dict] = field(default_factory=list)
    report: str | None = None  # the HTML report (collapse row)
    train_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss) of every log


SMOOTH_LOGS = 10  # training-loss logs averaged before comparing levels: 200 steps at the full size's log_every


def smoothed(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(step, mean training loss of this log and the SMOOTH_LOGS - 1 before it) for every log."""
    losses = [loss for _, loss in curve]
    return [(step, statistics.mean(losses[max(0, i + 1 - SMOOTH_LOGS) : i + 1])) for i, (step, _) in enumerate(curve)]


def first_step_at(curve: list[tuple[int, float]], level: float) -> int | None:
    """The first step at which the smoothed training loss is at or below `level`; None if it never is."""
    return next((step for step, loss in smoothed(curve) if loss <= level), None)


def steps_to_match(run: RunResult, reference: RunResult) -> float | None:
    """run's steps to reach the reference's final smoothed training loss, over the reference's own steps to reach it.

    Both runs of a seed train on the same batches in the same order, and within the first epoch every batch is new
    to the model, so the training loss is a held-out loss on the training distribution: a ratio r < 1 says `run`
    learns in r of the steps (and tokens) what `reference` learned in all of its. None: `run` never got there.
    """
    level = smoothed(reference.train_curve)[-1][1]
    reached = first_step_at(run.train_curve, level)
    own = first_step_at(reference.train_curve, level)
    return None if reached is None or not own else reached / own


def read_run(row: str, seed: int, run_dir: Path, wall_s: float) -> RunResult:
    """A finished run's figures from its own metrics.jsonl and config.yaml."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r and "alert" not in r]
    evals = [r for r in records if "eval/loss" in r]
    if not train or not evals:
        raise SystemExit(f"{run_dir}/metrics.jsonl holds {len(train)} training and {len(evals)} eval records")
    config = load_run_config(run_dir / "config.yaml")
    counts = count_parameters(config.model)
    rates = [r["tokens_per_s"] for r in train[1:]] or [train[0]["tokens_per_s"]]  # the first holds the start-up
    result = RunResult(
        row, seed, evals[-1]["eval/loss"], train[-1]["loss"], statistics.median(rates), counts.total, counts.active,
        wall_s, alerts=[r for r in records if "alert" in r], train_curve=[(r["step"], r["loss"]) for r in train],
    )  # fmt: skip
    if "moe/all/maxvio_max" in train[0]:
        second_half = train[len(train) // 2 :]
        result.maxvio = statistics.mean(r["moe/all/maxvio_max"] for r in second_half)
        result.dead_experts = int(max(r["moe/all/dead_experts_max"] for r in second_half))
    return result


def run_one(server: Prestarted, row: str, seed: int, overrides: list[str], out: Path, threads: int) -> RunResult:
    """One `moe-train` run (forked from `server`), read back."""
    run_dir = out / "runs" / f"{row}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume of an earlier bench's
    run_dir.mkdir(parents=True)
    args = [*overrides, f"hydra.run.dir={run_dir}"]
    env = {**subprocess_env(), "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    result = server.run(args, 1, env, timeout=3600)
    wall_s = time.monotonic() - start
    (run_dir / "stdout.log").write_text(result.stdout)
    (run_dir / "stderr.log").write_text(result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"moe-train {' '.join(args)} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return read_run(row, seed, run_dir, wall_s)


def render_report(run_dir: Path) -> Path:
    """moe-report's HTML for the run, written next to it."""
    from moe_platform.monitor.report import render

    page = render(run_dir)
    path = run_dir / "report.html"
    path.write_text(page)
    return path


def run_all(
    size: Size, rows: list[str], out: Path, corpus: Corpus, jobs: int, threads: int, extra: tuple[str, ...] = ()
) -> list[RunResult]:
    """Every (row, seed) of `rows`, `jobs` at a time, seeds outermost so a partial bench has whole seeds; `extra`
    overrides follow every row's own (--extra: a pilot's variant)."""
    overrides = row_overrides(size)
    plan = [(row, seed) for seed in size.seeds for row in rows if row not in COLLAPSE_ROWS]
    plan[:0] = [(row, size.seeds[0]) for row in COLLAPSE_ROWS if row in rows]
    servers: Queue[Prestarted] = Queue()
    for _ in range(jobs):
        servers.put(Prestarted())

    def task(row: str, seed: int) -> RunResult:
        server = servers.get()
        try:
            run_size = replace(size, steps=size.collapse_steps, eval_every=0) if row in COLLAPSE_ROWS else size
            adamw = [] if "optim=muon" in overrides[row] else ["optim=adamw_cosine", f"optim.lr={size.lr}"]
            args = [*adamw, *common_overrides(run_size, corpus, seed), *overrides[row], *extra]
            result = run_one(server, row, seed, args, out, threads)
        finally:
            servers.put(server)
        if row in COLLAPSE_ROWS:
            result.report = str(render_report(out / "runs" / f"{row}_seed{seed}"))
        print(
            f"  {row:<16s} seed {seed}: eval loss {result.eval_loss:.4f}, {result.tokens_per_s:,.0f} tok/s, "
            f"{result.wall_s:.0f} s, {len(result.alerts)} alert(s)",
            flush=True,
        )
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(task, row, seed) for row, seed in plan]
        results = [future.result() for future in futures]
    while not servers.empty():  # their stdin closes: each server ends after its last request
        servers.get().server.stdin.close()
    return results


SHARED_SETTINGS = {  # what every row of one bench shares, as a run's config.yaml says it and as the size does
    "trainer.max_steps": "steps", "optim.warmup_steps": "warmup_steps", "data.val.fraction": "val_fraction",
    "data.seq_len": "seq_len", "data.global_batch_size": "global_batch", "model.d_model": "d_model",
    "model.n_layers": "n_layers", "model.n_heads": "n_heads", "model.n_kv_heads": "n_kv_heads",
}  # fmt: skip


def summarize(dirs: list[Path], rows: list[str] | None) -> tuple[Size, Corpus, list[RunResult]]:
    """The runs of earlier benches (each dir an --out), read back together without training: the size and corpus of
    the first dir's summary.json, the seeds found. Refuses runs of another setting or corpus, and a (row, seed) that
    two dirs both hold. The collapse rows are left out (their own, shorter schedule)."""
    saved = [json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None for d in dirs]
    if saved[0] is None:
        raise SystemExit(f"--summarize {dirs[0]}: it holds no summary.json: name first a directory a bench wrote")
    size = Size(**{**saved[0]["size"], "seeds": tuple(saved[0]["size"]["seeds"])})
    corpus = Corpus(**saved[0]["corpus"])
    walls = {(r["row"], r["seed"]): r["wall_s"] for s in saved if s for r in s["runs"]}
    results: dict[tuple[str, int], RunResult] = {}
    for directory, summary in zip(dirs, saved, strict=True):
        if not (directory / "runs").is_dir():
            raise SystemExit(f"--summarize {directory}: it holds no runs/ directory: name an earlier bench's --out")
        if summary and summary["corpus"]["sha256"] != corpus.sha256:
            raise SystemExit(f"--summarize {directory}: its corpus is not {dirs[0]}'s: summarize one corpus's runs")
        for run_dir in sorted((directory / "runs").glob("*_seed*")):
            row, _, seed = run_dir.name.rpartition("_seed")
            if not seed.isdigit() or row in COLLAPSE_ROWS or (rows and row not in rows):  # not a run, or not asked
                continue
            if (row, int(seed)) in results:
                raise SystemExit(f"--summarize: {row} seed {seed} is in two of the directories: name only one")
            config = OmegaConf.load(run_dir / "config.yaml")
            for key, name in SHARED_SETTINGS.items():
                if OmegaConf.select(config, key) != getattr(size, name):
                    raise SystemExit(
                        f"--summarize: {run_dir} ran with {key}={OmegaConf.select(config, key)}, not the "
                        f"{getattr(size, name)} of {dirs[0]}/summary.json: summarize runs of one setting"
                    )
            results[row, int(seed)] = read_run(row, int(seed), run_dir, walls.get((row, int(seed)), math.nan))
    if not results:
        raise SystemExit(f"--summarize: no run of {rows or 'any row'} under {[str(d) for d in dirs]}: check --rows")
    seeds = tuple(sorted({seed for _, seed in results}))
    return replace(size, seeds=seeds), corpus, list(results.values())


def spread(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {std:.4f} [{min(values):.4f}–{max(values):.4f}]"


def print_results(size: Size, corpus: Corpus, rows: list[str], results: list[RunResult], skipped: dict) -> None:
    by_row = {row: [r for r in results if r.row == row] for row in rows}
    tokens = size.steps * size.global_batch * size.seq_len
    print(
        f"\ncorpus: {corpus.python} stdlib ({corpus.source}), {corpus.text}: {corpus.files:,} files "
        f"({corpus.skipped_not_utf8} not UTF-8 left out), {corpus.bytes:,} bytes, sha256 {corpus.sha256[:16]}; "
        f"{f'BPE of {corpus.bpe_vocab} tokens' if corpus.bpe_vocab else 'byte-level'}; held out by hash "
        f"(data.val.fraction={size.val_fraction:g}): {corpus.held_out_files} files, "
        f"{corpus.held_out_bytes:,} bytes"
    )
    print(
        f"model: d_model {size.d_model}, {size.n_layers} layers, {size.n_heads} heads ({size.n_kv_heads} KV), F="
        f"{size.expert_d_ff}; {size.steps} steps x {size.global_batch} x {size.seq_len} = {tokens:,} tokens a run, "
        f"AdamW lr {size.lr:g} (warmup {size.warmup_steps}, cosine), seeds {list(size.seeds)}"
    )
    head = f"  {'row':<16s} {'params total/active':>21s} {'eval loss mean ± std [min–max]':>36s} {'tok/s':>8s}"
    print(head + f" {'MaxVio':>7s} {'dead':>5s} {'alerts':>6s}")
    for row in rows:
        if row in skipped:
            print(f"  {row:<16s} skipped: {skipped[row]}")
            continue
        runs = by_row[row]
        if row in COLLAPSE_ROWS:
            continue
        params = f"{runs[0].total_params:,}/{runs[0].active_params:,}"
        maxvio = f"{statistics.mean(r.maxvio for r in runs):7.3f}" if runs[0].maxvio is not None else f"{'-':>7s}"
        dead = f"{max(r.dead_experts for r in runs):5d}" if runs[0].dead_experts is not None else f"{'-':>5s}"
        rate = statistics.median(r.tokens_per_s for r in runs)
        alerts = sum(len(r.alerts) for r in runs)
        print(f"  {row:<16s} {params:>21s} {spread([r.eval_loss for r in runs]):>36s} {rate:8,.0f} {maxvio} {dead}"
              f" {alerts:6d}")  # fmt: skip
    print("gaps in eval loss (row − reference; paired: the same seed's runs, which saw the same batches):")
    for row, reference in GAPS:
        if not by_row.get(row) or not by_row.get(reference):
            continue
        # over the seeds both rows ran (all of them, but for --summarize of runs with different seed sets)
        seeds = sorted({r.seed for r in by_row[row]} & {r.seed for r in by_row[reference]})
        if not seeds:
            continue
        ours = {r.seed: r.eval_loss for r in by_row[row] if r.seed in seeds}
        theirs = {r.seed: r.eval_loss for r in by_row[reference] if r.seed in seeds}
        gap = statistics.mean(ours.values()) - statistics.mean(theirs.values())
        percent = 100 * gap / statistics.mean(theirs.values())
        overlap = max(min(ours.values()), min(theirs.values())) <= min(max(ours.values()), max(theirs.values()))
        paired = [ours[s] - theirs[s] for s in seeds]
        which = "" if len(seeds) == max(len(by_row[row]), len(by_row[reference])) else f" (seeds {seeds})"
        print(
            f"  {row} vs {reference}{which}: {gap:+.4f} nats ({percent:+.2f}%), seed ranges overlap: "
            f"{'yes' if overlap else 'no'}; paired per seed {min(paired):+.4f} to {max(paired):+.4f}; "
            f"steps to the reference's final training loss {steps_ratios(by_row[row], by_row[reference])}"
        )
    for run in [r for r in results if r.row in COLLAPSE_ROWS]:
        kinds = sorted({a["alert"] for a in run.alerts})
        first = min((a["step"] for a in run.alerts), default=None)
        fired = f"{len(run.alerts)} alert(s) ({', '.join(kinds)}), first at step {first}" if run.alerts else "NO alert"
        print(
            f"{run.row} ({ROUTING[run.row]}, {size.collapse_steps} steps): {fired}; "
            f"MaxVio {run.maxvio:.3f}, dead experts {run.dead_experts}; report {run.report}"
        )


def steps_ratios(runs: list[RunResult], references: list[RunResult]) -> str:
    """`steps_to_match` of each seed's pair, as min–max over seeds (and how many seeds never got there)."""
    by_seed = {r.seed: r for r in references}
    ratios = [steps_to_match(run, by_seed[run.seed]) for run in runs if run.seed in by_seed]
    reached = [r for r in ratios if r is not None]
    span = f"{min(reached):.2f}–{max(reached):.2f}x" if reached else "never reached"
    missed = len(ratios) - len(reached)
    return span + (f", not reached at {missed} seed(s)" if reached and missed else "")


ROUTING = {
    "balanced-8x2": "8 experts top-2, aux 0.01",
    "collapse": "8 experts top-2, model.moe.aux_loss_coef=0, no bias",
}


def size_field(item: str) -> tuple[str, object]:
    """`FIELD=VALUE` of --set, the value parsed as the field's type (int or float)."""
    name, _, value = item.partition("=")
    kinds = {f.name: f.type for f in fields(Size)}
    if name not in kinds or kinds[name] not in ("int", "float"):
        numeric = [n for n, kind in kinds.items() if kind in ("int", "float")]
        raise SystemExit(f"--set {item}: {name!r} is not a numeric field of the size: use one of {numeric}")
    return name, (int if kinds[name] == "int" else float)(value)


def write_summary(size: Size, corpus: Corpus, skipped: dict, results: list[RunResult], paths: list[Path]) -> dict:
    """The corpus, the size, the skipped rows and every run's figures, written as JSON to each of `paths`."""
    summary = {"corpus": asdict(corpus), "size": asdict(size), "skipped": skipped, "runs": [asdict(r) for r in results]}
    text = json.dumps(summary, indent=1)
    for path in paths:
        path.write_text(text)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """Run the bench, print its tables, and return what --json writes."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps, 1 seed, 2 rows + collapse")
    parser.add_argument(
        "--rows",
        help="comma-separated rows (default: all but the opt-in moe-8x2, dense-total-8x2 and moe-2x1; "
        "--quick: dense-active,moe-4x2,collapse)",
    )
    parser.add_argument("--seeds", help="comma-separated seeds (default: 0,1,2; --quick: 0)")
    parser.add_argument("--steps", type=int, help="override the size's training steps")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of the size (e.g. expert_d_ff=256, n_layers=8, lr=1e-3); repeatable",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="a moe-train override added to every row's (a pilot's variant); repeatable",
    )
    parser.add_argument(
        "--text",
        choices=("code", "prose"),
        default="code",
        help="what of each stdlib file to train on: its source (default) or its docstrings and comments",
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="threads per run")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "moe_vs_dense")
    parser.add_argument("--json", type=Path, help="also write the corpus and every run's figures here")
    parser.add_argument(
        "--summarize",
        action="append",
        type=Path,
        metavar="DIR",
        help="train nothing: print the tables over the runs already in these earlier --out directories together "
        "(the first holds a summary.json; repeatable; --rows picks rows; the collapse rows are left out)",
    )
    args = parser.parse_args(argv)
    if args.summarize:
        size, corpus, results = summarize(args.summarize, args.rows.split(",") if args.rows else None)
        rows = [row for row in row_overrides(size) if any(r.row == row for r in results)]
        print_results(size, corpus, rows, results, {})
        return write_summary(size, corpus, {}, results, [args.json] if args.json else [])

    size = QUICK if args.quick else FULL
    if args.seeds:
        size = replace(size, seeds=tuple(int(s) for s in args.seeds.split(",")))
    if args.steps:
        size = replace(size, steps=args.steps, eval_every=min(size.eval_every, args.steps))
    size = replace(size, **dict(size_field(item) for item in args.set))
    all_rows = [row for row in row_overrides(size) if row not in OPT_IN_ROWS]
    default_rows = "dense-active,moe-4x2,collapse" if args.quick else ",".join(all_rows)
    rows = (args.rows or default_rows).split(",")
    unknown = [row for row in rows if row not in row_overrides(size)]
    if unknown:
        raise SystemExit(f"--rows has {unknown}, which are not rows: use some of {list(row_overrides(size))}")
    skipped: dict[str, str] = {}  # rows that cannot run here, with the reason printed in their place
    start = time.monotonic()
    # one corpus directory per file limit: --quick's 60 files and the full stdlib do not overwrite each other
    corpus_dir = args.out / ("corpus" if size.max_files is None else f"corpus_{size.max_files}_files")
    corpus_dir = corpus_dir.with_name(corpus_dir.name + (f"_bpe{size.bpe_vocab}" if size.bpe_vocab else ""))
    corpus_dir = corpus_dir.with_name(corpus_dir.name + ("_prose" if args.text == "prose" else ""))
    corpus = build_corpus(corpus_dir, size.max_files, size.val_fraction, size.bpe_vocab, args.text)
    print(f"corpus built in {time.monotonic() - start:.1f} s: {corpus.files:,} files, {corpus.bytes:,} bytes")
    ran = [r for r in rows if r not in skipped]
    results = run_all(size, ran, args.out, corpus, args.jobs, args.threads, tuple(args.extra))
    print_results(size, corpus, rows, results, skipped)
    print(f"\nbench wall time {time.monotonic() - start:.0f} s ({args.jobs} job(s) x {args.threads} thread(s))")
    # out/summary.json is what --summarize reads back; --json is a copy wherever the user wants it
    summary = write_summary(
        size, corpus, skipped, results, [args.out / "summary.json", *([args.json] if args.json else [])]
    )
    if any(not math.isfinite(r.eval_loss) for r in results):
        raise SystemExit("a run's eval loss is not finite: see its run directory")
    return summary


if __name__ == "__main__":
    main()
