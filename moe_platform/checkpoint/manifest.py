"""A checkpoint's manifest: every file with its size and SHA-256, plus what the checkpoint is (step, config hash,
world size, ZeRO stage), written last, just before the directory is renamed complete.

Two checks use it, cheapest first:
  * `check_files` (every rank, before any process group): each listed file exists with its recorded size — a
    truncated copy, a save cut short or a missing shard is caught by a `stat`, before the job commits to it.
  * `verify` (collective, before anything is loaded): the checksums, each file hashed by one rank (`shard`), and
    every pickle scanned for the globals it would call (`unsafe_globals`). DeepSpeed's shards, Accelerate's RNG
    states and DCP's index (`dcp/.metadata`) are pickles that those libraries unpickle themselves (DeepSpeed with
    weights_only=False, DCP with pickle.load); a file that differs from what was saved, or that names anything
    outside `SAFE_GLOBALS`, is refused before it is opened.
"""

import hashlib
import io
import json
import os
import pickletools
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
PICKLE_SUFFIXES = (".pt", ".bin", ".pkl")
# DCP's index (checkpoint/sharded.py), which torch's FileSystemReader.read_metadata unpickles with pickle.load. Its
# .distcp chunks are torch.save files that DCP loads with weights_only=True.
PICKLE_NAMES = (".metadata",)
_CHUNK = 8 << 20

# What the pickles in our checkpoints call, measured (torch 2.13, numpy 2, deepspeed 0.19.8, accelerate 1.15):
# tensor and storage rebuilders, numpy arrays in the RNG states, three small DeepSpeed types in its ZeRO optimizer
# state, and the dataclasses of DCP's index (with torch's layout lookup by name; sharded.py keeps the Path it was
# written at out of it). Anything else (os.system, builtins.eval, subprocess.Popen, …) is refused.
SAFE_GLOBALS = {
    "collections": {"OrderedDict"},
    "_codecs": {"encode"},
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state"},
    "torch._tensor": {"_rebuild_from_type_v2"},
    "torch": {"Tensor", "Size", "device", "dtype"},
    "numpy.core.multiarray": {"_reconstruct"},
    "numpy._core.multiarray": {"_reconstruct"},
    "numpy": {"ndarray", "dtype"},
    "deepspeed.runtime.fp16.loss_scaler": {"LossScaler", "DynamicLossScaler"},
    "deepspeed.runtime.zero.config": {"ZeroStageEnum"},
    "deepspeed.utils.tensor_fragment": {"fragment_address"},
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
}  # fmt: skip
_TORCH_DTYPES = {
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
}  # fmt: skip


class ManifestError(RuntimeError):
    """A checkpoint that does not match its manifest; the message names the file and what differs."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def listed_files(directory: Path) -> list[str]:
    """Regular files under `directory` (relative, sorted), links not followed: the universal copy links the
    shared files rather than copying them, and a link's target is listed where it lives."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not (Path(root) / d).is_symlink())
        for name in files:
            path = Path(root) / name
            if not path.is_symlink() and name != MANIFEST:
                found.append(str(path.relative_to(directory)))
    return sorted(found)


def shard(items: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's share of the files to hash: every world_size-th, so each file is read by one rank only."""
    return items[rank::world_size]


def describe_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256(directory / name)} for name in names}


def write(directory: Path, files: dict[str, dict[str, Any]], about: dict[str, Any]) -> None:
    """The manifest, written through a temporary name so a reader never sees half of it."""
    manifest = {"format": FORMAT, **about, "files": dict(sorted(files.items()))}
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)


def read(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{directory} has no {MANIFEST}: it is incomplete or was written by another tool") from None
    except (OSError, ValueError) as err:
        raise ManifestError(f"{path} cannot be read ({err})") from None
    well_formed = isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)
    if not well_formed or manifest.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a format-{FORMAT} checkpoint manifest")
    return manifest


def check_files(directory: Path) -> dict[str, Any]:
    """The manifest, once every file it lists is present with its recorded size; raises ManifestError otherwise."""
    manifest = read(directory)
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise ManifestError(f"{path} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ManifestError(f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
    return manifest


def verify_share(directory: Path, names: Iterable[str]) -> list[str]:
    """Problems (one line each) with this rank's share of the listed files: a checksum that differs, or a pickle
    that would call something outside SAFE_GLOBALS. Empty when all is well."""
    manifest = read(directory)
    problems = []
    for name in names:
        path = directory / name
        try:
            if sha256(path) != manifest["files"][name]["sha256"]:
                problems.append(f"{path} differs from the checksum in its manifest (corrupted or replaced)")
                continue
            if path.suffix in PICKLE_SUFFIXES or path.name in PICKLE_NAMES:
                unsafe = unsafe_globals(path)
                if unsafe:
                    problems.append(f"{path} would call {', '.join(sorted(unsafe))} when unpickled: refused")
        except OSError as err:
            problems.append(f"{path} cannot be read ({err.strerror})")
    return problems


def unsafe_globals(path: Path) -> set[str]:
    """The globals a pickle (or each pickle inside a torch zip file) would import, outside SAFE_GLOBALS; found by
    reading its opcodes, so nothing in it runs. A global whose name cannot be read statically counts as unsafe."""
    unsafe = set()
    for data in _pickles(path):
        # What the last two pushes put on the stack (a string, or None for anything else), and the memo's strings:
        # STACK_GLOBAL takes the two values pushed right before it, which a pickler may fetch back from the memo
        # (DCP's index names `torch` once and gets it again for every dtype).
        pushed: list[str | None] = []
        memo: dict[int, str | None] = {}
        try:
            for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
                if opcode.name in ("GLOBAL", "INST"):
                    module, name = arg.split(" ", 1) if " " in arg else arg.split("\n", 1)
                    _add_if_unsafe(unsafe, module, name)
                elif opcode.name == "STACK_GLOBAL":
                    if len(pushed) < 2 or None in pushed[-2:]:
                        unsafe.add("<a global built at load time>")
                    else:
                        _add_if_unsafe(unsafe, pushed[-2], pushed[-1])
                if opcode.name == "MEMOIZE":
                    memo[len(memo)] = pushed[-1] if pushed else None
                elif opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[arg] = pushed[-1] if pushed else None
                elif opcode.name in ("GET", "BINGET", "LONG_BINGET"):
                    pushed = [*pushed[-1:], memo.get(arg)]
                elif opcode.name not in ("PROTO", "FRAME"):  # the two that leave the stack alone
                    pushed = [*pushed[-1:], arg if isinstance(arg, str) and "UNICODE" in opcode.name else None]
        except Exception as err:  # a malformed pickle is not loaded either
            unsafe.add(f"<unreadable pickle: {err}>")
    return unsafe


def _add_if_unsafe(unsafe: set[str], module: str, name: str) -> None:
    if name in SAFE_GLOBALS.get(module, ()):
        return
    if module == "torch" and (name.endswith("Storage") or name in _TORCH_DTYPES):
        return
    if module == "numpy.dtypes" and name.endswith("DType"):
        return
    unsafe.add(f"{module}.{name}")


def _pickles(path: Path) -> Iterable[bytes]:
    """torch.save's zip format keeps its pickle in `<archive>/data.pkl`; older files are one plain pickle."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name.endswith(".pkl"):
                    yield archive.read(name)
    else:
        yield Path(path).read_bytes()
