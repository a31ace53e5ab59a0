"""Bad input said in one sentence, and no trace of it left on disk.

Hydra reports a mistake met while composing the config (a misspelt key, a value of the wrong type, a config group
option that does not exist, an override it cannot parse) in several lines, with a hint about HYDRA_FULL_ERROR, and
exits 1. The entry point (the one module that knows Hydra's exceptions) hands what each says to the functions here,
which say it in one sentence naming the key and the fix, with the closest key or option when it looks like a typo.
`RunDirBefore` notes what the run directory held before Hydra made it, so that a start refused for bad input removes
what it added (Hydra's .hydra/ and log, our config.yaml) and nothing else. `BAD_INPUT` is which errors are the user's
input, for every command (moe-train, moe-data, moe-plan, moe-submit).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, ValidationError

from data_pipeline import DataConfigError, DataError
from moe import ModelConfigError
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.config import ConfigError, not_a_key

HELP = "`moe-train --help` lists the config groups and keys"

# The error types that mean bad input (a config, a checkpoint, the data), and the word that introduces each.
BAD_INPUT = {
    ConfigError: "config",
    ModelConfigError: "config",
    DataConfigError: "config",
    CheckpointError: "checkpoint",
    DataError: "data",
}


def bad_input_line(err: Exception) -> str:
    """`<config|checkpoint|data> error: <the sentence>` on one line, for an error of one of BAD_INPUT's types."""
    kind = next(kind for error_type, kind in BAD_INPUT.items() if isinstance(err, error_type))
    return f"{kind} error: {err}".replace("\n", " ")


def no_live_progress_bars_off_a_terminal() -> None:
    """datasets' progress bars (loading, tokenizing) redraw one line with carriage returns: progress on a terminal,
    noise in a Slurm or CI log, where they would also come before an error's one sentence on stderr. So they are
    off when stderr is not a terminal, unless HF_DATASETS_DISABLE_PROGRESS_BARS says otherwise."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def unparsable(message: str) -> str:
    """An override Hydra's grammar refuses, from the lines of its OverrideParseException."""
    lines = [line.strip() for line in message.splitlines() if line.strip()] or ["an override"]
    if lines[0].startswith("Error parsing override '") and lines[0].endswith("'"):
        line, detail = lines[0][len("Error parsing override '") : -1], lines[1] if len(lines) > 1 else "no detail"
    else:  # the lexer's: "LexerNoViableAltException: <the override>"
        line, detail = lines[0].partition(": ")[2] or lines[0], "a character the override grammar does not allow"
    key = line.partition("=")[0].strip() or "key"
    return (
        f"the override {line!r} cannot be parsed ({detail}): write it as key=value, e.g. {key}=VALUE, and quote a "
        "value that holds spaces or special characters"
    )


def missing_option(group: str, option: str, options: Optional[list[str]], summary: str) -> str:
    """A config group option with no file: the closest option, and the list of them."""
    if not group or not options:
        return f"{summary}: {HELP}"
    close = difflib.get_close_matches(option, options, n=1)
    guess = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={option} is not an option of {group}: {guess}the options are {', '.join(options)}"


def composition_cause(cause: Optional[BaseException], summary: str, overrides: list[str]) -> str:
    """A composition failure by what OmegaConf said caused it: an unknown key, a value of the wrong type, ...; a
    mistake in a config file (a user's own, under --config-dir) rather than an override names the file, which
    Hydra's summary starts with (`In 'experiment/mine': ...`)."""
    sentence = _cause(cause, summary, overrides)
    in_file = re.match(r"In '([^']+)': ", summary)
    if in_file is None or sentence.startswith(summary):
        return sentence
    return f"in {in_file.group(1)}.yaml, {sentence}"


def _cause(cause: Optional[BaseException], summary: str, overrides: list[str]) -> str:
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        return _unknown_key(cause.full_key, cause.object_type, overrides)
    if isinstance(cause, ValidationError) and cause.full_key:
        return _wrong_value(cause, overrides)
    if isinstance(cause, ConfigTypeError) and cause.full_key and "deletion" in str(cause):
        key = cause.full_key
        return f"~{key} cannot remove a key of the schema, which needs them all: override its value, e.g. {key}=..."
    if summary.startswith("Ambiguous value for argument"):
        argument = summary.split("'")[1] if summary.count("'") >= 2 else summary
        return (
            f"{argument} is ambiguous: write a list as key=[a,b], quote a string that holds commas, or add "
            "--multirun to sweep over the values"
        )
    return f"{summary}: {HELP}"


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _override_value(key: str, overrides: list[str]) -> Optional[str]:
    """The value as the user wrote it in the last override of `key`."""
    for line in reversed(overrides):
        name, sep, value = line.partition("=")
        if sep and name.lstrip("+~") == key:
            return value
    return None


def _unknown_key(key: str, schema: Any, overrides: list[str]) -> str:
    if dataclasses.is_dataclass(schema):
        return not_a_key(key, schema)
    parent = key.rpartition(".")[0]
    if schema is dict:  # a free-form mapping (e.g. data.hf.load_kwargs) takes new keys, but only when asked
        value = _override_value(key, overrides) or "..."
        return f"{key} is not in {parent} yet, which takes any key: add it with a leading +, as +{key}={value}"
    return f"{key} is not a key of the config: {HELP}"


def _wrong_value(cause: ValidationError, overrides: list[str]) -> str:
    key, schema = cause.full_key, cause.object_type
    leaf = key.rpartition(".")[2]
    text = _override_value(key, overrides) or str(cause.value)
    hints = typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
    if leaf not in hints:
        return f"{key}={text}: {first_line(cause)}: {HELP}"
    declared = hints[leaf]
    wanted, example = _describe(declared), _example(schema, key, leaf)
    if "is not Optional" in str(cause):
        return f"{key} cannot be null: give it {wanted}{example}"
    inner = _non_null(declared)
    if typing.get_origin(inner) in (list, tuple) and not text.lstrip().startswith("["):
        return f"{key}={text} is not a list: write it as one, {key}=[{text}]"
    if dataclasses.is_dataclass(inner):
        first = dataclasses.fields(inner)[0].name
        return (
            f"{key}={text} cannot replace the whole of {key}, which holds {inner.__name__}'s keys: set them one "
            f"at a time, e.g. {key}.{first}=..."
        )
    return f"{key}={text} is not {wanted}: give {key} {wanted}{example}"


def _non_null(declared: Any) -> Any:
    args = [arg for arg in typing.get_args(declared) if arg is not type(None)]
    return args[0] if type(None) in typing.get_args(declared) and len(args) == 1 else declared


def _describe(declared: Any) -> str:
    inner = _non_null(declared)
    words = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    origin = typing.get_origin(inner)
    if inner in words:
        word = words[inner]
    elif origin in (list, tuple):
        word = "a list such as [a,b]"
    elif origin is dict or inner is dict:
        word = "a mapping such as {a:1}"
    elif dataclasses.is_dataclass(inner):
        word = f"{inner.__name__}'s keys"
    else:
        word = "a value of the declared type"
    return f"{word} or null" if inner is not declared else word


def _example(schema: Any, key: str, leaf: str) -> str:
    """', e.g. key=<default>' when the schema's default is a plain value."""
    default = next((f.default for f in dataclasses.fields(schema) if f.name == leaf), MISSING)
    if default is MISSING or default is dataclasses.MISSING or isinstance(default, (list, dict)):
        return ""
    shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
    return f", e.g. {key}={shown}"


def below_null(overrides: list[str], compose: Callable[[list[str]], DictConfig]) -> Optional[str]:
    """The override that sets a key below a node that is null in the config the other overrides compose (OmegaConf
    only asserts there); `compose` composes a list of overrides."""
    for i, line in enumerate(overrides):
        key = line.partition("=")[0].lstrip("+~")
        if "." not in key:
            continue
        try:
            others = compose(overrides[:i] + overrides[i + 1 :])
        except Exception:  # another override fails too: not the one to name
            continue
        parts = key.split(".")
        for n in range(1, len(parts)):
            parent = ".".join(parts[:n])
            if OmegaConf.select(others, parent, default=MISSING) is None:
                return (
                    f"{key} cannot be set because {parent} is null in this config: pick a {parts[0]} option in "
                    f"which {parent} is set, or drop the override"
                )
    return None


@dataclass
class RunDirBefore:
    """The run directory as it was before Hydra made it or wrote into it, so that a start refused for bad input
    leaves it as it found it: a directory it made goes, with the parents it made; in one that held an earlier run
    (metrics.jsonl, checkpoints/), Hydra's .hydra/ files and our config.yaml get their old bytes back and the logs
    their old length, and nothing else is touched."""

    path: Path  # absolute
    entries: Optional[dict[str, tuple[int, int]]]  # name → (size, mtime_ns) of what it held; None: it did not exist
    absent_parents: list[Path]  # the parents that did not exist either, nearest first
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)  # .hydra/* and config.yaml: small, rewritten

    @classmethod
    def look(cls, run_dir: str, output_subdir: Optional[str]) -> RunDirBefore:
        path = Path(os.path.abspath(run_dir))
        absent = []
        for parent in path.parents:
            if parent.exists():
                break
            absent.append(parent)
        if not path.is_dir():
            return cls(path, None, absent)
        entries = {entry.name: _stamp(entry) for entry in os.scandir(path)}
        small = [path / "config.yaml"]
        if output_subdir and (path / output_subdir).is_dir():
            small += sorted((path / output_subdir).iterdir())
        files = {str(f.relative_to(path)): f.read_bytes() for f in small if f.is_file() and not f.is_symlink()}
        return cls(path, entries, absent, files)

    def undo(self, output_dir: str, ours: set[str]) -> None:
        """Undo what this start did to `output_dir`, where it may have written the entries named in `ours`; an
        entry not in `ours` that is new or changed means the run got further than its start: then nothing."""
        made = Path(os.path.abspath(output_dir))
        try:
            now = {entry.name: _stamp(entry) for entry in os.scandir(made)}
        except OSError:
            return  # already gone (another rank of this start removed it)
        if made == self.path and self.entries is not None:
            if {k: v for k, v in now.items() if k not in ours} != {
                k: v for k, v in self.entries.items() if k not in ours
            }:
                return
            for name in ours & now.keys():
                self._restore(made, name)
            return
        # Made by this start: the noted path, or its time-stamped twin when the clock turned a second in between.
        if now.keys() - ours:
            return
        shutil.rmtree(made, ignore_errors=True)
        existed = set(self.path.parents) - set(self.absent_parents)
        for parent in made.parents:
            if parent in existed:
                break
            try:
                parent.rmdir()
            except OSError:
                break  # not empty: it holds other runs

    def _restore(self, made: Path, name: str) -> None:
        target = made / name
        if name not in self.entries:
            _remove(target)
        elif name.endswith(".log") and target.is_file():
            os.truncate(target, min(self.entries[name][0], target.stat().st_size))  # drop only what was appended
        elif target.is_dir():
            for child in target.iterdir():
                if f"{name}/{child.name}" not in self.files:
                    _remove(child)
        if target.is_dir() or name in self.files:
            for rel, content in self.files.items():
                if rel == name or rel.startswith(f"{name}/"):
                    (made / rel).write_bytes(content)


def _stamp(entry: os.DirEntry) -> tuple[int, int]:
    stat = entry.stat(follow_symlinks=False)
    return stat.st_size, stat.st_mtime_ns


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
