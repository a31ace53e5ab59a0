"""Keep secrets out of everything a run writes: the run dir's and checkpoints' config.yaml, Hydra's .hydra/ files,
the wandb config.

A secret is (1) a config value whose key looks like a credential (`token`, `hf_token`, `api_key`, `*_secret`,
`*password*`, ...; the tokenizer's `eos_token`-style special tokens are not), and (2) the value of an environment
variable whose name looks like one (WANDB_API_KEY, HF_TOKEN, HUGGING_FACE_HUB_TOKEN, any *_TOKEN, *_KEY, *_SECRET,
*PASSWORD*). Key-named values are replaced wherever they sit; known secret values are also replaced inside any other
string (a resolved `${oc.env:HF_TOKEN}`, a Hydra override `data.hf.load_kwargs.token=...`), when at least
MIN_SECRET_LEN characters long, so that an env var such as `FOO_KEY=1` does not blank every "1".
"""

import contextlib
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

REDACTED = "<redacted>"
MIN_SECRET_LEN = 8
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML was built with it
_SECRET_NAME = re.compile(
    r"(^|[_.-])(token|key|apikey|secret|credentials?|passphrase|passwd)$|password|secret|api_?key", re.IGNORECASE
)
# `key=value` in a Hydra override, or in Hydra's comma-joined override_dirname: (prefix up to "=", key, value).
_OVERRIDE = re.compile(r"((?:^|,)[+~]{0,2}([\w./@-]+)=)([^,]*)")
_SPECIAL_TOKEN = re.compile(r"^(bos|eos|pad|unk|sep|cls|mask)_token$", re.IGNORECASE)  # tokenizer fields


def is_secret_name(name: str) -> bool:
    """Whether a config key or environment variable name looks like it holds a credential."""
    last = str(name).rsplit(".", 1)[-1]
    return bool(_SECRET_NAME.search(last)) and not _SPECIAL_TOKEN.match(last)


def secret_values(config: Any = None, environ: Mapping[str, str] | None = None) -> set[str]:
    """The values to hide: those of secret-named environment variables and of secret-named keys in `config` (a
    nested dict/list, or a DictConfig read as written: a secret reached through `${oc.env:...}` is an env value)."""
    environ = os.environ if environ is None else environ
    found = {value for name, value in environ.items() if is_secret_name(name) and value}
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=False)
    _collect(config, found)
    return found


def _collect(node: Any, found: set[str]) -> None:
    items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(key, str) and is_secret_name(key) and isinstance(value, str) and value:
            found.add(value)
        _collect(value, found)


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """`text` with every known secret (of at least MIN_SECRET_LEN characters) replaced, longest first."""
    for secret in sorted((s for s in secrets if len(s) >= MIN_SECRET_LEN), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def redact(node: Any, secrets: Iterable[str]) -> Any:
    """A copy of a nested dict/list with the string values of secret-named keys and known secret values replaced; in
    a string of `key=value` overrides, a secret-named key's value is replaced. Booleans and None stay (datasets'
    `token: true` means "use the stored login", and a loaded config must keep that meaning)."""
    secrets = set(secrets)
    if isinstance(node, Mapping):
        return {
            k: REDACTED if isinstance(k, str) and is_secret_name(k) and isinstance(v, str) and v else redact(v, secrets)
            for k, v in node.items()
        }
    if isinstance(node, list | tuple):
        return [redact(v, secrets) for v in node]
    if isinstance(node, str):
        node = _OVERRIDE.sub(lambda m: m[0] if not is_secret_name(m[2]) else f"{m[1]}{REDACTED}", node)
        return redact_text(node, secrets)
    return node


def redacted_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML with secrets replaced: what config.yaml holds in the run dir and checkpoints."""
    container = OmegaConf.to_container(cfg, resolve=True)
    return OmegaConf.to_yaml(OmegaConf.create(redact(container, secret_values(container))))


def scrub_hydra_dir(hydra_dir: Path, secrets: Iterable[str]) -> None:
    """Rewrite Hydra's own record of the run (.hydra/config.yaml, overrides.yaml, hydra.yaml), which Hydra writes
    before our code runs, with secrets replaced: a secret given as a command-line override lands in all three."""
    for path in sorted(Path(hydra_dir).glob("*.yaml")):
        content = yaml.load(path.read_text(), Loader=SAFE_LOADER)
        cleaned = redact(content, secrets)
        if cleaned != content:  # rewritten only where a secret was found: reading is ~20 ms a file in C, ~100 in Python
            path.write_text(yaml.safe_dump(cleaned, sort_keys=False, allow_unicode=True))


@contextlib.contextmanager
def redacted_argv(secrets: Iterable[str]) -> Iterator[None]:
    """sys.argv with secrets replaced for the duration: wandb records the command line (`args` in the run's
    metadata) from sys.argv at init, and a secret given as an override would otherwise go into the run file."""
    argv = sys.argv
    sys.argv = [argv[0], *redact(argv[1:], secrets)]
    try:
        yield
    finally:
        sys.argv = argv
