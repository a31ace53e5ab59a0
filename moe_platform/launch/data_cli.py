"""`moe-data`: tokenize a corpus once into shards that `data.source=tokenized` reads (data_pipeline/prepare.py).

    moe-data prepare data=hf_local 'data.hf.data_files=[corpus/*.jsonl]' data.tokenizer.name_or_path=tok/ \
        --out shards/web --workers 8
    moe-train data=tokenized data.tokenized.path=shards/web
    moe-data verify shards/web   # every shard file's sha256 against its header

`prepare` takes moe-train's data overrides (and --config-dir), composed as moe-train composes them (compose.py); only
the `data` node is read, and it must be a data.source=hf corpus. Re-running it on the same input is a no-op and an
interrupted run resumes; its progress goes to stderr, its one-line summary to stdout. Bad input ends it with exit 2 and
one line on stderr, `<config|data> error: <key or file>...: <fix>`, as moe-train's.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from data_pipeline import DataConfig, TokenizedCorpus, prepare
from data_pipeline.prepare import DEFAULT_ROWS_PER_SHARD
from moe_platform.config import ConfigError, to_data_config
from moe_platform.launch.bad_input import BAD_INPUT, bad_input_line, no_live_progress_bars_off_a_terminal
from moe_platform.launch.compose import compose_train, composition_error


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"moe-data {command}", description=__doc__.split("\n")[0])
    if command == "prepare":
        parser.add_argument("overrides", nargs="*", help="moe-train's data overrides, e.g. data=hf_local")
        parser.add_argument("--out", required=True, help="the directory to write the shards into")
        parser.add_argument("--workers", type=int, help="tokenizing processes (default: data.hf.num_proc, else 1)")
        parser.add_argument("--rows-per-shard", type=int, default=DEFAULT_ROWS_PER_SHARD, help="source rows per shard")
        parser.add_argument("--overwrite", action="store_true", help="replace what --out holds, whatever its input")
        parser.add_argument("--config-dir", default=None, help="configs of your own, as moe-train's --config-dir")
    else:
        parser.add_argument("path", help="a directory `moe-data prepare` wrote")
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("prepare", "verify"):
        asked = bool(argv) and argv[0] in ("-h", "--help")
        usage = f"usage: moe-data {{prepare,verify}} ... (--help after either)\n\n{__doc__}"
        print(usage, file=sys.stdout if asked else sys.stderr)
        sys.exit(0 if asked else 2)
    no_live_progress_bars_off_a_terminal()
    args = _parser(argv[0]).parse_intermixed_args(argv[1:])
    try:
        print(_prepare(args) if argv[0] == "prepare" else _verify(args.path))
    except tuple(BAD_INPUT) as err:  # a user's mistake: one sentence, no trace; anything else keeps its traceback
        print(bad_input_line(err), file=sys.stderr)
        sys.exit(2)


def _prepare(args: argparse.Namespace) -> str:
    try:
        cfg = compose_train(args.overrides, args.config_dir)
    except Exception as err:
        sentence = composition_error(err, args.overrides, args.config_dir)
        if sentence is None:
            raise  # not a mistake in the input: it keeps its traceback
        raise ConfigError(sentence) from None
    data = to_data_config(cfg)
    _check_preparable(data)
    result = prepare(
        data.hf, data.tokenizer, args.out, args.workers, rows_per_shard=args.rows_per_shard, overwrite=args.overwrite
    )
    return result.summary


def _check_preparable(data: DataConfig) -> None:
    if data.source != "hf":
        raise ConfigError(
            f"data.source={data.source!r}, but moe-data prepare tokenizes a data.source=hf corpus: pass data=hf_local "
            "or data=hf_hub with its overrides"
        )
    if data.val.split is not None:
        raise ConfigError(
            f"data.val.split={data.val.split!r}, but moe-data prepare writes data.hf.split={data.hf.split!r} only "
            "(data.source=tokenized holds out data.val.fraction of it): drop data.val.split"
        )


def _verify(path: str) -> str:
    corpus = TokenizedCorpus.open(path, verify=True, key="DIR")
    return (
        f"{path}: {corpus.num_documents:,} documents, {corpus.num_tokens:,} tokens in {len(corpus.header.shards)} "
        f"shard(s), every file as its header says (fingerprint {corpus.fingerprint[:16]})"
    )


if __name__ == "__main__":
    main()
