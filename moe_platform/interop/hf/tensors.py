"""Hugging Face tensors as the weight mappings read them: in memory (a loaded model's state dict) or in a model
directory's safetensors files, read tensor by tensor; and our state dict as a lazy mapping of readers over them.

A directory's tensors are found through `model.safetensors.index.json` (sharded; every shard's header is checked up
front, so a missing or damaged shard is refused before any weight is read) or in `model.safetensors`. They are read
from the memory-mapped files one at a time (`safe_open` / `get_slice`), only the rows needed when that is a block:
a rank under expert parallelism reads only its own experts' rows. One shard is open at a time, so the mapped pages a
read touched leave the process when the next shard is opened: an import holds about one shard beside the model it
fills. Floating tensors are read as fp32 (what `from_pretrained(dtype=torch.float32)` gives). Names are
transformers' in-memory ones; `renames` maps a family's file names to them (Mixtral's `block_sparse_moe.experts.{e}.w1`
…). Nothing is read until a reader is called, but a reader is made only for a tensor the files hold, so an
incomplete directory is refused before anything large is read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moe_platform.checkpoint.errors import CheckpointError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"

Reader = Callable[[], torch.Tensor]  # one of our tensors, read and converted when called


@dataclass(frozen=True)
class ExpertRows:
    """One of our [E, …] expert tensors, read a block of experts at a time: `read(a, b)` gives experts [a, b)."""

    num_experts: int
    read: Callable[[int, int], torch.Tensor]

    def __call__(self) -> torch.Tensor:
        return self.read(0, self.num_experts)


class LazyStateDict(Mapping[str, torch.Tensor]):
    """Our state dict over HF tensors: `state[name]` reads and converts that one tensor now (and again on the next
    lookup: nothing is kept), `expert_rows(name)` reads an expert tensor a block of experts at a time."""

    def __init__(self, readers: dict[str, Reader]) -> None:
        self._readers = readers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)

    def expert_rows(self, name: str) -> ExpertRows | None:
        reader = self._readers[name]
        return reader if isinstance(reader, ExpertRows) else None

    def materialize(self) -> dict[str, torch.Tensor]:
        """Every tensor in memory; names that share a reader (a tied head) share the tensor, as in a module."""
        read: dict[int, torch.Tensor] = {}
        for reader in self._readers.values():
            if id(reader) not in read:
                read[id(reader)] = reader()
        return {name: read[id(reader)] for name, reader in self._readers.items()}


class HFTensors:
    """Named HF tensors (transformers' in-memory names); subclasses say where they are and how they are read."""

    where: str  # named in refusals: the directory, or "the Hugging Face state dict"

    def names(self) -> Iterable[str]:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def read(self, name: str, *index: slice) -> torch.Tensor:
        """The tensor, or the part `index` selects (one slice per leading dim): only that part is read."""
        raise NotImplementedError

    def require(self, name: str) -> str:
        """`name`, refused in one sentence if the weights lack it."""
        if name not in self:
            raise CheckpointError(
                f"{self.where} has no tensor {name}, which its config.json implies: re-save the model with "
                "save_pretrained or correct config.json"
            )
        return name

    def reader(self, name: str) -> Reader:
        self.require(name)
        return lambda: self.read(name)

    def zero_rows(self, weight: str) -> Reader:
        """A zero bias for `weight` (one per output row), for a bias the HF family does not have."""
        rows, dtype = self.shape(self.require(weight))[0], self.dtype(weight)
        return lambda: torch.zeros(rows, dtype=dtype)


class InMemoryTensors(HFTensors):
    """A loaded transformers model's `state_dict()`: reads are the tensors themselves (no copy)."""

    where = "the Hugging Face state dict"

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._sd = state_dict

    def names(self) -> Iterable[str]:
        return self._sd.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._sd

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sd[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._sd[name].dtype

    def read(self, name: str, *index: slice) -> torch.Tensor:
        return self._sd[name][index] if index else self._sd[name]


# The dtypes a read keeps; every other safetensors dtype is floating and read as fp32.
_KEPT_DTYPES = {
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsTensors(HFTensors):
    """The safetensors files of a model directory, read tensor by tensor from the memory-mapped shards (module
    docstring); floating tensors come back as fp32."""

    def __init__(self, directory: Path, renames: tuple[tuple[str, str], ...] = ()) -> None:
        self.where = str(directory)
        self._open_file: Path | None = None
        self._open = None
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise CheckpointError(
                    f"{index} has no weight_map ({type(err).__name__}: {err}): re-save the model with save_pretrained"
                ) from None
            keys_by_file: dict[Path, list[str]] = {}
            for key, file in weight_map.items():
                keys_by_file.setdefault(directory / file, []).append(key)
            for file, keys in sorted(keys_by_file.items()):
                if not file.is_file():
                    raise CheckpointError(
                        f"{index} puts {keys[0]} in {file.name}, which is not in {directory}: copy that shard into "
                        "the directory or re-save the model"
                    )
                held = set(self._handle(file).keys())  # the header only: a damaged shard is refused before any read
                if missing := [key for key in keys if key not in held]:
                    raise CheckpointError(
                        f"{index} puts {missing[0]} in {file.name}, which does not hold it: re-save the model with "
                        "save_pretrained"
                    )
            self.close()
            files = {key: file for file, keys in keys_by_file.items() for key in keys}
        else:
            file = directory / SAFETENSORS
            files = {key: file for key in self._handle(file).keys()}
        self._where = {_renamed(key, renames): (file, key) for key, file in files.items()}

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _KEPT_DTYPES.get(self._slice(name).get_dtype(), torch.float32)

    def read(self, name: str, *index: slice) -> torch.Tensor:
        file, key = self._where[name]
        try:
            tensor = self._handle(file).get_slice(key)[index] if index else self._handle(file).get_tensor(key)
        except (SafetensorError, OSError) as err:  # a damaged file
            raise CheckpointError(f"{file} could not be read at {key} ({err}): re-save or re-download it") from None
        return tensor.float() if tensor.is_floating_point() else tensor

    def _slice(self, name: str):
        file, key = self._where[name]
        return self._handle(file).get_slice(key)

    def _handle(self, file: Path):
        """The open shard `file`. One at a time: closing the previous one unmaps the pages its reads touched."""
        if file != self._open_file:
            self.close()
            try:
                self._open = safe_open(file, framework="pt").__enter__()
            except (SafetensorError, OSError) as err:  # a truncated or foreign file
                raise CheckpointError(
                    f"{file} is not a readable safetensors file ({err}): re-save or re-download it"
                ) from None
            self._open_file = file
        return self._open

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
        self._open, self._open_file = None, None


def _renamed(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in renames:
        key = re.sub(pattern, replacement, key)
    return key
