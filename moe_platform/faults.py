"""Fault injection for the reliability tests: nothing happens unless the environment variable MOE_FAULTS names one.

The runtime calls `point(name, step)` where a real fault could strike, and `poison_outputs(model, …)` once; a test
starts a real run with MOE_FAULTS set and checks what survives. MOE_FAULTS is a comma-separated list of

    <kind>@<where>[:step=N][:rank=R][:times=K][:seconds=S]

    kill@backward:step=3:rank=1     SIGKILL this process when rank 1 reaches `backward` in step 3
    eio@checkpoint_write:times=2    raise OSError(EIO) the first 2 times a checkpoint file is written
    enospc@checkpoint_write         raise OSError(ENOSPC) there (a full disk without filling one)
    nan@blocks.1.attn:step=4        the output of module `blocks.1.attn` is NaN in step 4 (only that step)
    stall@step_end:step=2:seconds=8 this process sleeps 8 s there (a straggler; or a window a test's signal must hit)

Points the runtime passes: `forward`, `backward`, `step_end` (trainer: inside step N, after its optimizer step),
and `checkpoint_write`, `checkpoint_rename`, `checkpoint_pointer` (checkpoint/checkpointer.py: before this rank writes
its files, before the directory is renamed complete, between that rename and the `latest` pointer), and
`checkpoint_shards` (checkpoint/sharded.py: inside a DCP save, after this rank's shard file is written and before
DCP's index), and `checkpoint_prune` (checkpointer.py, rank 0: an old checkpoint renamed for deletion, its files not
yet deleted). `step` is the optimizer step being run (1-based) or the step of the checkpoint being written (for
`checkpoint_prune`, of the one being deleted). `rank` is the launcher's RANK.
"""

import errno
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

ENV = "MOE_FAULTS"
KINDS = ("kill", "eio", "enospc", "nan", "stall")


@dataclass
class Fault:
    kind: str
    where: str
    step: Optional[int] = None
    rank: Optional[int] = None
    times: Optional[int] = None  # None: every time it matches
    seconds: int = 0  # how long a stall lasts
    fired: int = 0

    def matches(self, where: str, step: int) -> bool:
        return (
            self.where == where
            and (self.step is None or self.step == step)
            and (self.rank is None or self.rank == int(os.environ.get("RANK", "0")))
            and (self.times is None or self.fired < self.times)
        )


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        head, *options = item.split(":")
        kind, _, where = head.partition("@")
        if kind not in KINDS or not where:
            expected = "<kind>@<where>[:step=N][:rank=R][:times=K][:seconds=S]"
            raise ValueError(f"{ENV} entry {item!r}: expected {expected} with kind in {KINDS}")
        fields = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("step", "rank", "times", "seconds") or not value.isdigit():
                raise ValueError(f"{ENV} entry {item!r}: unknown option {option!r}")
            fields[key] = int(value)
        if (kind == "stall") != ("seconds" in fields):
            raise ValueError(f"{ENV} entry {item!r}: `seconds=S` goes with a stall, and only with a stall")
        faults.append(Fault(kind, where, **fields))
    return faults


_faults: Optional[list[Fault]] = None


def active() -> list[Fault]:
    """The faults MOE_FAULTS names, parsed once per process (empty in every normal run)."""
    global _faults
    if _faults is None:
        _faults = parse(os.environ.get(ENV, ""))
    return _faults


def point(where: str, step: int) -> None:
    """Strike here if a fault names this point (and step and rank): a kill never returns, an I/O error raises, a
    stall sleeps and returns."""
    for fault in active():
        if fault.kind == "nan" or not fault.matches(where, step):
            continue
        fault.fired += 1
        if fault.kind == "kill":
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "stall":
            time.sleep(fault.seconds)
            continue
        code = errno.EIO if fault.kind == "eio" else errno.ENOSPC
        raise OSError(code, f"{os.strerror(code)} (injected by {ENV} at {where}, step {step})")


def poison_outputs(model: torch.nn.Module, current_step: Callable[[], int]) -> None:
    """Forward hooks that turn the named modules' tensor outputs into NaN in the named step."""
    modules = dict(model.named_modules())
    for fault in active():
        if fault.kind != "nan":
            continue
        if fault.where not in modules:
            if _on_another_stage(model, fault.where):
                continue
            raise ValueError(f"{ENV}: the model has no module {fault.where!r} to poison")

        def hook(module, inputs, output, fault=fault):
            if isinstance(output, torch.Tensor) and fault.matches(fault.where, current_step()):
                return output * float("nan")
            return output

        modules[fault.where].register_forward_hook(hook)


def _on_another_stage(model: torch.nn.Module, name: str) -> bool:
    """A module of a block, the embedding or the head that another pipeline stage runs (parallel/pipeline.py)."""
    parts = name.split(".")
    if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) < len(model.blocks):
        return type(model.blocks[int(parts[1])]).__name__ == "AbsentBlock"
    return parts[0] in ("embed", "pos_embed", "final_norm", "lm_head") and getattr(model, parts[0], 0) is None
