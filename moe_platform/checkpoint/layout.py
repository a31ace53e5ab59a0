"""How a checkpoint's state is sharded, saved as layout.json beside it: what a resume must match, or re-partition.

ZeRO shards are partitioned for the world size (and expert-parallel size) that wrote them. DDP and single-process
checkpoints hold whole tensors (experts by global id, checkpoint/experts.py) and load at any layout of the same kind.
ZeRO-1/2 shards load at another world or EP size through DeepSpeed's universal copy (checkpoint/universal.py);
ZeRO-3 only at its own world size (`check_resumable_as` says why).

FSDP (and HSDP) checkpoints are DCP's (checkpoint/sharded.py): every tensor under its global shape, experts [E, …]
by global id, so they load at any world size, EP size or replicate size, and into DDP or one process; an FSDP run
loads a DDP or single-process checkpoint the same way, each rank keeping its shard of the whole tensors. Both sides
hold the same state (fp32 weights, AdamW's moments and step per parameter, buffers, RNG, data position), so such a
resume continues as a resize within either kind does: only the order of floating-point reductions changes.
DeepSpeed's ZeRO shards and these do not load into each other (`check_resumable_as`): moe-export bridges them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_platform.checkpoint import manifest
from moe_platform.checkpoint.errors import CheckpointError
from moe_platform.checkpoint.universal import DEEPSPEED_TAG, UNIVERSAL_DIRNAME
from moe_platform.config import DistributedConfig

LAYOUT_FILE = "layout.json"
# How a checkpoint's model and optimizer state are stored (`CheckpointLayout.format`).
ACCELERATE, DCP, DEEPSPEED = "accelerate", "dcp", "deepspeed"


@dataclass(frozen=True)
class CheckpointLayout:
    """The sharding a checkpoint was written with (or a run would write with)."""

    strategy: str  # distributed.strategy: single, ddp, fsdp or deepspeed
    zero_stage: int  # DeepSpeed's ZeRO stage; 0 for any other strategy
    world_size: int
    expert_parallel_size: int
    pipeline_parallel_size: int = 1

    @classmethod
    def of_run(cls, distributed: DistributedConfig, world_size: int) -> CheckpointLayout:
        return cls(
            distributed.strategy, distributed.zero_stage, world_size, distributed.expert_parallel_size,
            distributed.pipeline_parallel_size,
        )  # fmt: skip

    @classmethod
    def read(cls, checkpoint: Path) -> CheckpointLayout:
        """The layout of a complete checkpoint; one sentence naming the file when it cannot be read."""
        checkpoint = Path(checkpoint)
        if not (checkpoint / manifest.MANIFEST).is_file():
            raise CheckpointError(
                f"{checkpoint} is not a complete checkpoint ({manifest.MANIFEST} missing): pick another or resume=none"
            )
        path = checkpoint / LAYOUT_FILE
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path} cannot be read ({err}): the checkpoint is damaged") from None
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path} is not a JSON object: it was written by another program")
        # Checkpoints written before expert parallelism existed have no expert_parallel_size: they were EP 1.
        saved.setdefault("expert_parallel_size", 1)
        saved.setdefault("pipeline_parallel_size", 1)  # and before pipeline parallelism: PP 1
        fields = {field.name: field.type for field in dataclasses.fields(cls)}
        for name, kind in fields.items():
            wanted = str if kind == "str" else int
            value = saved.get(name)
            if not isinstance(value, wanted) or isinstance(value, bool):
                raise CheckpointError(f"{path} has {name}={value!r}, not a {wanted.__name__}: the file is damaged")
        return cls(**{name: saved[name] for name in fields})

    def write(self, directory: Path) -> None:
        (Path(directory) / LAYOUT_FILE).write_text(json.dumps(self.as_dict()))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def deepspeed(self) -> bool:
        return self.strategy == "deepspeed"

    @property
    def format(self) -> str:
        """How the state is stored: DCP (FSDP, and any pipeline-parallel run: every rank's shards or stage through
        torch.distributed.checkpoint, sharded.py), DEEPSPEED (ZeRO's files) or ACCELERATE (whole-tensor files)."""
        if self.pipeline_parallel_size > 1:
            return DCP
        return {"fsdp": DCP, "deepspeed": DEEPSPEED}.get(self.strategy, ACCELERATE)

    @property
    def zero_sharded(self) -> bool:
        """Optimizer state (and from stage 3 the weights) split over the ranks that wrote it."""
        return self.deepspeed and self.zero_stage >= 1

    def check_resumable_as(self, current: CheckpointLayout, path: Path) -> None:
        """Refuse, in one sentence, to load this checkpoint (at `path`) into a run of the `current` layout: the same
        kind of engine, ZeRO shards into the same stage, and re-partitioning only where it continues exactly."""
        if self.deepspeed != current.deepspeed:
            kind = "distributed=zero1/zero2/zero3" if self.deepspeed else "distributed=single, ddp, fsdp or hsdp"
            raise CheckpointError(
                f"{path} was saved with distributed.strategy={self.strategy} but this job uses {current.strategy}, "
                f"and ZeRO shards and the other strategies' checkpoints do not load into each other: resume with "
                f"{kind}, or moe-export the weights and start from them with init.from_path"
            )
        if self.deepspeed and self.zero_stage != current.zero_stage:
            raise CheckpointError(
                f"{path} holds ZeRO-{self.zero_stage} state but this job runs ZeRO-{current.zero_stage}: "
                f"resume with distributed=zero{self.zero_stage}"
            )
        self._check_expert_parallel_resize(current, path)
        if self.deepspeed and self.zero_stage == 3 and self.world_size != current.world_size:
            # Measured with deepspeed 0.19.8: a ZeRO-3 universal load continues the losses only to ~3e-4, not exactly
            # (ZeRO-1/2 continue to 1e-5), so it is refused rather than silently perturbing the run.
            raise CheckpointError(
                f"{path} holds ZeRO-3 shards of {self.world_size} ranks but this job has {current.world_size}: "
                "ZeRO-3 resumes on the same world size only (ZeRO-1/2 re-partition); or moe-export the weights"
            )

    def _check_expert_parallel_resize(self, current: CheckpointLayout, path: Path) -> None:
        """DDP checkpoints store experts by global id and resume at any EP size; ZeRO-1/2 checkpoints of an EP run
        resume at another world or EP size through the universal copy written on save."""
        if not self.deepspeed or (self.expert_parallel_size == 1 and current.expert_parallel_size == 1):
            return
        if (self.expert_parallel_size, self.world_size) == (current.expert_parallel_size, current.world_size):
            return
        if not (Path(path) / UNIVERSAL_DIRNAME / DEEPSPEED_TAG / "zero").is_dir():
            # ds_to_universal cannot convert these shards (measured with deepspeed 0.19.8: it mis-reads the experts)
            raise CheckpointError(
                f"{path} holds ZeRO shards of {self.world_size} ranks with expert_parallel_size="
                f"{self.expert_parallel_size} and no universal copy (saved without expert parallelism, or by an older "
                f"version), so it resumes only on {self.world_size} ranks with expert_parallel_size="
                f"{self.expert_parallel_size}, not {current.world_size} with {current.expert_parallel_size}"
            )

    def needs_universal_load(self, current: CheckpointLayout) -> bool:
        """ZeRO optimizer shards written by another number of ranks, or another EP size, are re-partitioned on load."""
        resized = (self.world_size, self.expert_parallel_size) != (current.world_size, current.expert_parallel_size)
        return self.zero_sharded and resized
