"""A rich progress bar with the numbers a person watches: loss, tokens/s, MFU (or TFLOP/s), the worst MoE layer's
MaxVio (models with MoE layers) and ETA (rank 0 only)."""

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total_steps: int, start_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.console = Console(stderr=True)
        self._bar = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not enabled,
        )
        self._task = self._bar.add_task("train", total=total_steps, completed=start_step, metrics="")

    def __enter__(self) -> "Progress":
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def update(self, step: int, record: dict[str, Any]) -> None:
        metrics = f"loss {record['loss']:.4f}  tok/s {record['tokens_per_s']:,.0f}"
        if "mfu" in record:
            metrics += f"  MFU {100 * record['mfu']:.1f}%"
        else:
            metrics += f"  {record['model_tflops_per_device']:.3g} TFLOP/s"
        if "moe/all/maxvio_max" in record:  # routing health in one number: 0 is even load (see moe/stats.py)
            metrics += f"  maxvio {record['moe/all/maxvio_max']:.2f} (L{record['moe/all/maxvio_worst_layer']})"
        self._bar.update(self._task, completed=step, metrics=metrics)
        if self.enabled and not self.console.is_terminal:
            # Piped output (Slurm logs, CI) gets no live bar: print the same numbers as a line.
            self.console.print(f"step {step}  {metrics}")
