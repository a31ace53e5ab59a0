"""Preemption and time limits: signal → flag → the ranks agree at a step boundary → every rank saves → requeue.

Who is told, and how:
  * A signal in `preemption.signals` (SIGUSR1: Slurm's `--signal=B:USR1@grace` warning before the time limit;
    SIGTERM: Slurm preempting or cancelling the job) reaching a training process only sets a flag: a handler must not
    save in the middle of a step.
  * Under a launcher (torchrun) the batch shell, not the training processes, receives `--signal=B:USR1`; the
    sbatch template's trap writes the request file `RUN_DIR/.preempt` instead, which every rank reads at the step
    boundary (the run directory is shared by all nodes).
  * At each step boundary the ranks all-reduce (sum) their flags, so all of them stop after the same step: a
    checkpoint of ZeRO shards needs every rank's save, not rank 0's alone. No rank waits for that sum: it is
    read at the next boundary, so the ranks stop one step after the first of them knew (a lone process: after
    the step it knew in), and the flag adds no barrier to the step (a blocking all-reduce would make every rank
    wait at every boundary for the slowest, on top of the gradients' all-reduce).
Then every rank writes the checkpoint, rank 0 removes the request file and, under Slurm, requeues the job
(`scontrol requeue $SLURM_JOB_ID`); the requeued job starts the same script with `resume=auto` in the same run
directory, so no step is lost or repeated. Slurm counts requeues in SLURM_RESTART_COUNT: past
`preemption.max_requeues` the job stops with a message instead of requeueing.

Ctrl-C (SIGINT, in the default `preemption.signals`) on a local run is a preemption too: checkpoint at the next step
boundary, exit 0, continue with `resume=auto`. The first signal puts every watched signal back to its default action,
so a second one is handled by the kernel and ends the process at once, even inside a long checkpoint write or a
collective; a checkpoint it interrupts stays a `.tmp_step_…` directory, which `resume=auto` never takes.

Under torchrun (measured with torch 2.13): the workers run in sessions of their own, so a terminal's Ctrl-C reaches
only the agent, which sends each worker the signal it got (SIGINT) once and waits up to `--shutdown_timeout`
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default) before it SIGKILLs the workers that are left. The workers stop
after the next step with a complete checkpoint and exit 0, provided a step and a save fit in that time (raise it for
big models; a save cut short leaves the previous checkpoint the latest); torchrun itself still exits 1 with a
`SignalException` traceback, as it does for any signal. A second Ctrl-C makes torchrun SIGTERM the workers, which
the first signal left at the default action: they end at once, wherever they are, and torchrun with them.
"""

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from moe_platform.config import PreemptionConfig

STDERR = 2  # the descriptor: sys.stderr may be a wrapper without one (pytest's capture)
REQUEST_FILE = ".preempt"  # written by slurm/train.sbatch's trap; read by every rank at step boundaries


class RequeueLimitReached(RuntimeError):
    """Preempted with a complete checkpoint, but the job has used its allowed requeues: it stops here."""


class PreemptionWatch:
    """Installs the signal handlers; `requested()` (collective) says at a step boundary whether to stop."""

    def __init__(self, config: PreemptionConfig, run_dir: Path, accelerator: Accelerator) -> None:
        self.config, self.accelerator = config, accelerator
        self.request_file = Path(run_dir) / REQUEST_FILE
        self.signalled: str | None = None
        self._previous_handlers: dict[int, object] = {}
        self._sent: tuple[torch.Tensor, Any] | None = None  # the flags summed at the last boundary, in flight
        if not config.enabled:
            return
        if accelerator.is_main_process and self.request_file.exists():
            # Left by a job that died before acting on it; honouring it would stop this job after one step.
            self.request_file.unlink()
        accelerator.wait_for_everyone()
        for name in config.signals:
            signum = signal.Signals[name]
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signalled is not None:  # two signals were pending at once: the second one stops the process now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signalled = name
        # From now on the kernel acts on a second signal: this handler runs only when the main thread is back in
        # Python, which a long save or a collective waiting on a hung rank can delay for minutes.
        for watched in self._previous_handlers:
            signal.signal(watched, signal.SIG_DFL)
        if self.accelerator.is_main_process:  # os.write: print() from a handler can hit a half-written stdout buffer
            when = "this step" if self.accelerator.num_processes == 1 else "the next step"  # see `requested`
            message = f"{name}: stopping after {when} with a checkpoint (send {name} again to stop at once)\n"
            with contextlib.suppress(OSError):
                os.write(STDERR, message.encode())

    def requested(self) -> bool:
        """Collective, at every step boundary: True on every rank at the same boundary once any rank was signalled
        or saw the request file, at the boundary after it did when there are several ranks (module docstring)."""
        if not self.config.enabled:
            return False
        local = self.signalled is not None or self.request_file.exists()
        if self.accelerator.num_processes == 1:
            return local
        agreed = self._receive()
        if not agreed:  # the same verdict on every rank: all of them send again, or none
            flag = torch.tensor([float(local)], device=self.accelerator.device)
            self._sent = (flag, torch.distributed.all_reduce(flag, async_op=True))
        return agreed

    def _receive(self) -> bool:
        """Whether any rank's flag was up at the last boundary (False before the first)."""
        if self._sent is None:
            return False
        flag, work = self._sent
        self._sent = None
        work.wait()
        return bool(flag.item() > 0)

    def after_checkpoint(self, step: int, checkpoint: Path) -> str:
        """Rank 0 clears the request and, under Slurm, requeues the job; returns what happened in one line.
        Raises RequeueLimitReached when the job may not be requeued again."""
        if self.signalled:
            why = self.signalled
        elif self.request_file.exists():
            why = f"{REQUEST_FILE} request"
        else:  # the ranks' flags agreed on a stop that another rank's signal raised
            why = "a signal to another rank"
        what = f"stopped at step {step} ({why}); checkpoint {checkpoint} is complete"
        if self.accelerator.is_main_process:
            self.request_file.unlink(missing_ok=True)
        job_id = os.environ.get("SLURM_JOB_ID")
        if not (self.config.requeue and job_id):
            return f"{what}: continue with resume=auto in the same run directory"
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if restarts >= self.config.max_requeues:
            raise RequeueLimitReached(
                f"{what}, but job {job_id} was already requeued {restarts} times (preemption.max_requeues="
                f"{self.config.max_requeues}): it is not requeued again; resubmit with resume=auto to continue"
            )
        if self.accelerator.is_main_process:
            result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{what}, but `scontrol requeue {job_id}` failed: {result.stderr.strip()}")
        return f"{what}: requeued Slurm job {job_id} (requeue {restarts + 1} of at most {self.config.max_requeues})"

    def close(self) -> None:
        """Collective with several ranks: take in the last boundary's sum (a process group must not be torn down
        under it), then put back the handlers that were there before."""
        self._receive()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
