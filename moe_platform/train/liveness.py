"""Liveness: when a rank dies or hangs, the other ranks exit within `distributed.timeout_s` and name it.

What the survivors see (gloo, torch 2.13, measured on CPU):
  * a rank that exits or is killed: their next collective fails at once ("Connection closed by peer"), and torchrun,
    which watches its workers, SIGTERMs the rest and names the dead rank ("Root Cause … exitcode -9");
  * a rank that is alive but stuck (SIGSTOP, a hung file system, a deadlock), or a node gone together with its
    agent: they block in their next collective until the process group's timeout (`distributed.timeout_s`, which
    parallel/accelerator.py hands to the group) and fail with "Timed out waiting 15000ms for recv operation"; torchrun
    then names the first rank that exited, a survivor, as the root cause.
What this module adds: every rank writes where it runs (pid, host) once and its last completed step at every step
boundary (one `set`) into the c10d store. A rank whose collective fails reports that in the store, waits a few
seconds for the other survivors' reports, and names the ranks that sent none, in one line:

    distributed error: rank 1 (pid 4321 on node07) stopped responding after step 7 (this rank 0 waited
    distributed.timeout_s=20 s in a collective); the last complete checkpoint is …/step_00000005; resume with …

then leaves with EXIT_CODE through os._exit, so that the exit depends neither on tearing down a group whose peer
is gone (gloo's returned at once when measured; NCCL's may block) nor on Python's teardown, which can abort while
gloo threads run (cli.leave_without_interpreter_teardown).

The store is torchrun's agent's on the first node (workers get TORCHELASTIC_USE_AGENT_STORE=True; measured), which
outlives its workers; without torchrun it is rank 0's. A store that does not answer is reported as such: its host is
what is gone. Under NCCL a timed-out collective is ended by NCCL's watchdog thread, which by default
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3) takes the process down before Python sees an error: there torchrun's summary and
the watchdog's log (TORCH_NCCL_DESYNC_DEBUG=1 names the rank that fell behind) are what remain.
"""

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator

from moe_platform.checkpoint.catalog import latest_checkpoint

EXIT_CODE = 5  # beside 2 (bad input), 3 (requeue limit), 4 (numerical fault)
PREFIX = "moe_liveness"
REPORT_GRACE_S = 5.0  # how long a survivor waits for the others' reports: they time out within a step of each other
STORE_DEADLINE_S = 15.0  # a store that has not answered the whole exchange by then is taken as gone
# Gloo's errors reach Python as plain RuntimeErrors when raised inside autograd (DDP's gradient all-reduce), and a
# pipeline schedule's timed-out send or receive as gloo's "Application timeout caused pair closure".
MARKERS = ("gloo", "nccl", "c10d", "connection closed by peer", "connection reset by peer", "pair closure")
# A collective or send that waited out the timeout, as torch says it, or as gloo's transport closing the pair says it.
TIMED_OUT = ("timed out", "application timeout")


def is_distributed_error(err: BaseException) -> bool:
    """A failed or timed-out collective, or an unreachable store, as torch, DDP or DeepSpeed raise it."""
    while err is not None:
        if isinstance(err, torch.distributed.DistError):
            return True
        if isinstance(err, RuntimeError) and any(marker in str(err).lower() for marker in MARKERS):
            return True
        err = err.__cause__ or err.__context__
    return False


class Liveness:
    """Each rank's last completed step in the c10d store (`step_done`, at step boundaries), and the exit that names a
    dead or hung rank when a collective fails (`exit_on_distributed_error`, around the training loop)."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, timeout_s: int) -> None:
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.run_dir, self.timeout_s = Path(run_dir), timeout_s
        self.step: int | None = None  # the last step this rank completed in this job
        self.store = None
        if self.world_size > 1:
            self.store = torch.distributed.distributed_c10d._get_default_store()  # no public getter in torch 2.13
            self.store.set(self._key("where", self.rank), f"pid {os.getpid()} on {socket.gethostname()}")

    def step_done(self, step: int) -> None:
        """Called by every rank once `step` is complete."""
        self.step = step
        if self.store is not None:
            self.store.set(self._key("step", self.rank), str(step))

    @contextlib.contextmanager
    def exit_on_distributed_error(self) -> Iterator[None]:
        """A distributed error in the block ends the process with one line naming the failed rank and EXIT_CODE;
        any other error, or any error of a one-rank run, passes through."""
        try:
            yield
        except Exception as err:
            if self.store is None or not is_distributed_error(err):
                raise
            try:
                line = self.describe(err)
            except Exception as describe_err:  # the report must not hide the failure
                line = f"distributed error: {_first_line(err)} (naming the failed rank failed: {describe_err!r})"
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)

    def describe(self, err: BaseException) -> str:
        """The one line: who stopped responding, what this rank saw, and where to resume from."""
        found: list[str] = []
        # In a thread with a deadline: a store whose host is stopped (not dead) accepts the connection and never
        # answers, and the store's own timeout is the process group's.
        thread = threading.Thread(target=lambda: found.append(self._whom_to_blame()), daemon=True)
        thread.start()
        thread.join(STORE_DEADLINE_S)
        blame = found[0] if found else self._store_gone(f"did not answer within {STORE_DEADLINE_S:.0f} s")
        if any(words in str(err).lower() for words in TIMED_OUT):
            saw = f"this rank {self.rank} waited distributed.timeout_s={self.timeout_s} s in a collective"
        else:
            saw = f"this rank {self.rank} saw a collective fail: {_first_line(err)}"
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is None:
            then = "no checkpoint is complete yet: resume=auto starts afresh"
        else:
            then = f"the last complete checkpoint is {checkpoint}; resume with resume=auto"
        return f"distributed error: {blame} ({saw}); {then}"

    def _whom_to_blame(self) -> str:
        store = self.store
        try:
            store.set(self._key("failed", self.rank), "1")
            reported = store.add(self._key("failed"), 1)
            deadline = time.monotonic() + REPORT_GRACE_S
            while reported < self.world_size and time.monotonic() < deadline:
                time.sleep(0.2)
                reported = store.add(self._key("failed"), 0)
            silent = [r for r in range(self.world_size) if not store.check([self._key("failed", r)])]
            if not silent:
                return f"every rank saw the failure {_after(self.step)}, none stopped responding"
            return "; ".join(self._last_seen(rank) for rank in silent[:8]) + (
                f" (and {len(silent) - 8} more ranks)" if len(silent) > 8 else ""
            )
        except Exception as store_err:  # the store's host is dead: connection refused or reset
            return self._store_gone(f"failed: {_first_line(store_err)}")

    def _last_seen(self, rank: int) -> str:
        where = self.store.get(self._key("where", rank)).decode()
        step_key = self._key("step", rank)
        step = int(self.store.get(step_key)) if self.store.check([step_key]) else None
        return f"rank {rank} ({where}) stopped responding {_after(step)}"

    def _store_gone(self, what: str) -> str:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            host = f"the c10d store of torchrun's agent at {address}"
            return f"{host} {what}: the first node or its torchrun agent is gone"
        return f"rank 0 (the store host, {address}) is unreachable: the store {what}"

    @staticmethod
    def _key(kind: str, rank: int | None = None) -> str:
        return f"{PREFIX}/{kind}" if rank is None else f"{PREFIX}/{kind}/{rank}"


def _after(step: int | None) -> str:
    return f"after step {step}" if step is not None else "before completing a step in this job"


def _first_line(err: BaseException) -> str:
    """The error's first sentence without gloo's source location ("[…/pair.cc:553] ") and advice."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    line = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
    return line.split(". ", 1)[0]
