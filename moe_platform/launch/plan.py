"""`moe-plan [hydra overrides] --nodes N --gpus-per-node G --gpu NAME [options]`: the layouts that fit, fastest first.

    moe-plan model=mixtral_like trainer.precision=bf16 data.seq_len=4096 data.global_batch_size=512 \\
        --nodes 8 --gpus-per-node 8 --gpu H100

1. The config is composed as moe-train composes it (the user's overrides, --config-dir) and validated.
2. Every layout (plan/layouts.py: strategy, EP, PP and schedule, micro-batch, activation checkpointing) is applied
   to it, checked by the platform's own start-up validation, given a predicted peak memory per rank
   (plan/memory.py) and step time (plan/time_model.py), and those that fit the GPU are ranked by step time.
3. The best `--top` are printed: memory per rank by part, step time by term, tokens/s, MFU, and the `moe-submit`
   command that launches each. `--explain K` prints the K-th one's whole ledger; `--json` the table for scripts.
`--calibrate [overrides]` measures this machine instead (matmul rate, memory and gloo bandwidth, and with overrides
the rate of that model's own blocks: plan/calibrate.py) and writes the file `--this-machine` plans with (a CPU
"cluster" of --gpus-per-node processes).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict

from moe.ledger import format_ledger
from moe_platform.config import ConfigError, TrainConfig
from moe_platform.launch.bad_input import BAD_INPUT
from moe_platform.launch.compose import composition_error, plain_run, train_config
from moe_platform.plan import imbalance as imbalances
from moe_platform.plan.hardware import GIB, Cluster, cluster_of
from moe_platform.plan.layouts import (
    DEFAULT_HEADROOM,
    LAYOUT_KEYS,
    Headroom,
    Plan,
    Planning,
    plan_layouts,
    smallest_fitting_nodes,
)
from moe_platform.plan.memory import rank_memory
from moe_platform.plan.time_model import DEFAULT_ASSUMPTIONS, Assumptions


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-plan",
        description=__doc__.splitlines()[0],
        epilog="Arguments it does not know are moe-train's Hydra overrides (and --config-dir=DIR).",
    )
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="H100", help="a catalog name: H100-SXM, H100-PCIe, H200, H800, A100-40GB, …")
    p.add_argument("--gpu-memory", type=float, help="GiB per GPU, instead of the catalog's")
    p.add_argument("--peak-tflops", type=float, help="dense matmul TFLOP/s per GPU, instead of the catalog's")
    p.add_argument("--intra-node-gbps", type=float, help="Gbit/s one way per GPU inside a node (NVLink 4: 3600)")
    p.add_argument("--inter-node-gbps", type=float, help="Gbit/s one way per GPU across nodes (NDR: 400)")
    p.add_argument("--top", type=int, default=5, help="how many layouts to print")
    p.add_argument("--explain", type=int, metavar="K", help="print the K-th layout's whole ledger")
    p.add_argument("--json", action="store_true", help="the ranked layouts as JSON")
    p.add_argument("--imbalance", type=float, help="busiest EP rank's load / mean (default: the config's)")
    p.add_argument("--from-run", metavar="RUN_DIR", help="measure the imbalance from a run's expert counts")
    p.add_argument("--assume", action="append", default=[], metavar="NAME=VALUE", help="a time-model constant")
    p.add_argument(
        "--reserve-gib", type=float, help=f"memory no tensor counts (default {DEFAULT_HEADROOM.reserved_bytes / GIB:g})"
    )
    p.add_argument("--fragmentation", type=float, help=f"allocator's share (default {DEFAULT_HEADROOM.fragmentation})")
    p.add_argument("--calibrate", action="store_true", help="measure this machine and write the calibration file")
    p.add_argument("--this-machine", action="store_true", help="plan --gpus-per-node processes on this CPU")
    p.add_argument("--calibration", metavar="FILE", help="the calibration file (default: calibrate.py's)")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parser().parse_known_args(argv)
    try:
        run = plain_run(rest)
        if run is None:
            raise ConfigError(
                f"moe-plan does not know {' '.join(rest)}: give moe-plan's options (--help) and moe-train's overrides"
            )
        if args.calibrate:
            _calibrate(args, train_config(run.overrides, run.config_dir) if run.overrides else None)
            return
        config = train_config(run.overrides, run.config_dir)
        cluster, assumptions = _cluster(args)
        headroom = Headroom(
            reserved_bytes=DEFAULT_HEADROOM.reserved_bytes if args.reserve_gib is None else args.reserve_gib * GIB,
            fragmentation=DEFAULT_HEADROOM.fragmentation if args.fragmentation is None else args.fragmentation,
        )
        imbalance = _imbalance(args, config)
        on_gpu = not args.this_machine
        planning = plan_layouts(config, cluster, assumptions, headroom, imbalance=imbalance, on_gpu=on_gpu)
    except Exception as err:
        sentence = str(err) if isinstance(err, (ValueError, *BAD_INPUT)) else composition_error(err, rest)
        if sentence is None:
            raise
        print(f"config error: {sentence}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    command = _Command(args, run.overrides, run.config_dir)
    if args.json:
        print(json.dumps(_as_json(planning, cluster, imbalance, command, args.top), indent=2))
    elif args.explain is not None:
        _explain(planning, args.explain, command)
    else:
        _print_table(config, cluster, planning, imbalance, command, args.top)
    if planning.best is None:
        _no_fit(config, cluster, assumptions, headroom, imbalance)
        sys.exit(1)


def _calibrate(args: argparse.Namespace, config: TrainConfig | None) -> None:
    """The probe; with overrides, also the blocks of the model they compose (the rate a CPU run of it meets)."""
    from moe_platform.plan import calibrate

    calibration = calibrate.measure(config=config)
    path = calibrate.save(calibration, args.calibration)
    print(f"wrote {path}:\n{json.dumps(asdict(calibration), indent=2)}")


def _cluster(args: argparse.Namespace) -> tuple[Cluster, Assumptions]:
    """The catalog's cluster with the command line's figures, or (--this-machine) this CPU as calibrated."""
    if args.this_machine:
        from moe_platform.plan import calibrate

        calibration = calibrate.load(args.calibration)
        cluster = calibrate.this_machine_cluster(calibration, args.gpus_per_node)
        return cluster, calibrate.this_machine_assumptions(calibration).with_overrides(args.assume)
    cluster = cluster_of(
        args.nodes, args.gpus_per_node, args.gpu, memory_gb=args.gpu_memory, peak_tflops=args.peak_tflops,
        intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
    )  # fmt: skip
    return cluster, DEFAULT_ASSUMPTIONS.with_overrides(args.assume)


def _imbalance(args: argparse.Namespace, config: TrainConfig) -> imbalances.Imbalance:
    if args.imbalance is not None and args.from_run is not None:
        raise ConfigError("--imbalance and --from-run both say how uneven expert load is: give one")
    if args.imbalance is not None:
        return imbalances.Imbalance("given by --imbalance", constant=args.imbalance)
    if args.from_run is not None:
        return imbalances.from_run(args.from_run)
    return imbalances.from_config(config.model)


class _Command:
    """The `moe-submit` command of a plan: the user's overrides without the keys a layout sets, then the layout's."""

    def __init__(self, args: argparse.Namespace, overrides: list[str], config_dir: str | None) -> None:
        self.args = args
        self.kept = [o for o in overrides if not _layout_key(o)]
        self.config_dir = config_dir

    def overrides(self, plan: Plan) -> list[str]:
        return [*([f"--config-dir={self.config_dir}"] if self.config_dir else []), *self.kept, *plan.layout.overrides()]

    def line(self, plan: Plan) -> str:
        a = self.args
        if a.this_machine:
            head = ["torchrun", f"--nproc_per_node={a.gpus_per_node}", "--no-python", "moe-train"]
            return shlex.join([*head, *self.overrides(plan)])
        head = ["moe-submit", f"--nodes={a.nodes}", f"--gpus-per-node={a.gpus_per_node}", f"--gpu={a.gpu}"]
        return shlex.join([*head, "--", *self.overrides(plan)])


def _layout_key(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return any(key == k or key.startswith(f"{k}.") for k in LAYOUT_KEYS)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


def _seconds(s: float) -> str:
    return f"{s:.3f}" if s < 10 else f"{s:.1f}"


COLUMNS = (
    "#", "layout", "micro×acc", "ckpt", "weights", "grads", "optim", "acts", "buffers", "peak GiB", "free GiB",
    "step s", "compute", "a2a", "dp", "p2p", "bubble", "tok/s/GPU", "MFU",
)  # fmt: skip


def _columns(muon: bool) -> tuple[str, ...]:
    """The table's columns; under optim=muon a "muon" one after "bubble" (its Newton–Schulz and FSDP gathers)."""
    at = COLUMNS.index("bubble") + 1
    return (*COLUMNS[:at], "muon", *COLUMNS[at:]) if muon else COLUMNS


def _row(k: int, plan: Plan, muon: bool = False) -> list[str]:
    m, t = plan.memory, plan.time
    return [
        str(k), plan.layout.describe(), f"{plan.layout.micro_batch_size}×{plan.grad_accum}", plan.layout.checkpointing,
        _gib(m.weights), _gib(m.gradients), _gib(m.optimizer), _gib(m.activations), _gib(m.buffers + m.gathered),
        _gib(m.total), _gib(plan.headroom_bytes), _seconds(t.total), _seconds(t.compute), _seconds(t.all_to_all),
        _seconds(t.data_parallel), _seconds(t.pipeline_p2p), _seconds(t.bubble), *([_seconds(t.muon)] if muon else []),
        f"{t.tokens_per_s / t.world_size:,.0f}", f"{t.mfu:.1%}",
    ]  # fmt: skip


def _print_table(
    config: TrainConfig, cluster: Cluster, planning: Planning, imbalance, command: _Command, top: int
) -> None:
    gpu = cluster.gpu
    print(
        f"{config.model.num_params() / 1e9:.2f} B parameters ({config.model.num_active_params() / 1e9:.2f} B "
        f"active), {config.trainer.precision}, global batch {config.data.global_batch_size} × "
        f"{config.data.seq_len} tokens\n"
        f"{cluster.nodes} node(s) × {cluster.gpus_per_node} {gpu.name} ({gpu.memory_bytes / GIB:.0f} GiB, "
        f"links {cluster.intra_node_bandwidth / 1e9:.0f} GB/s in a node, {cluster.inter_node_bandwidth / 1e9:.0f} "
        f"GB/s across, one way); expert load: {imbalance.source}"
    )
    total = len(planning.fitting) + planning.not_fitting + sum(planning.refused.values())
    print(
        f"{total} layouts: {len(planning.fitting)} fit, {planning.not_fitting} do not fit, "
        f"{sum(planning.refused.values())} refused by the platform's checks"
    )
    shown = planning.fitting[:top]
    if not shown:
        return
    muon = config.optim.name == "muon"
    columns = _columns(muon)
    rows = [_row(k, plan, muon) for k, plan in enumerate(shown, 1)]
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(*columns, title="memory per rank (GiB) and step time (s) by part, the slowest rank")
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    else:
        widths = [max(len(r[i]) for r in [list(columns), *rows]) for i in range(len(columns))]
        for row in [list(columns), *rows]:
            cells = [c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
            print("  ".join(cells).rstrip())
    print("\nto launch:")
    for k, plan in enumerate(shown, 1):
        print(f"  {k}. {command.line(plan)}")


def _explain(planning: Planning, k: int, command: _Command) -> None:
    if not 1 <= k <= len(planning.fitting):
        raise SystemExit(f"--explain {k}: there are {len(planning.fitting)} layouts that fit; give 1 … that")
    plan = planning.fitting[k - 1]
    W = plan.world_size
    config = plan.config
    print(f"layout {k}: {plan.layout.describe()}, micro-batch {plan.layout.micro_batch_size} × accumulation "
          f"{plan.grad_accum}, checkpointing {plan.layout.checkpointing}\n  {command.line(plan)}\n")  # fmt: skip
    print(format_ledger(config.model, config.run_shape(W)) + "\n")
    pp = config.distributed.pipeline_parallel_size
    print(f"Peak memory per rank (GiB; usable {_gib(plan.usable_bytes)})")
    print("  rank  weights  grads  optim  acts  gathered  buffers  total")
    for p in range(pp):
        m = rank_memory(config, W, pipeline_rank=p if pp > 1 else None)
        print(f"  {p:>4}  {_gib(m.weights):>7}  {_gib(m.gradients):>5}  {_gib(m.optimizer):>5}  "
              f"{_gib(m.activations):>4}  {_gib(m.gathered):>8}  {_gib(m.buffers):>7}  {_gib(m.total):>5}")  # fmt: skip
    t = plan.time
    print("\nStep time (s, the slowest rank; plan/time_model.py has every formula)")
    for name in ("compute", "all_to_all", "data_parallel", "pipeline_p2p", "bubble", "muon", "total"):
        print(f"  {name:<14} {getattr(t, name):10.4f}")
    print(f"  tokens/s       {t.tokens_per_s:10,.0f}  ({t.tokens_per_s / W:,.0f} per GPU), MFU {t.mfu:.1%}")


def _as_json(planning: Planning, cluster: Cluster, imbalance, command: _Command, top: int) -> dict:
    def one(plan: Plan) -> dict:
        t = plan.time
        return {
            "layout": asdict(plan.layout),
            "overrides": command.overrides(plan),
            "command": command.line(plan),
            "grad_accum": plan.grad_accum,
            "memory_bytes": {**asdict(plan.memory), "total": plan.memory.total, "usable": plan.usable_bytes},
            "step_seconds": {
                "compute": t.compute,
                "all_to_all": t.all_to_all,
                "data_parallel": t.data_parallel,
                "pipeline_p2p": t.pipeline_p2p,
                "bubble": t.bubble,
                "muon": t.muon,
                "total": t.total,
            },
            "tokens_per_s": t.tokens_per_s,
            "mfu": t.mfu,
        }

    return {
        "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node, "gpu": cluster.gpu.name},
        "imbalance": imbalance.source,
        "fit": len(planning.fitting),
        "too_large": planning.not_fitting,
        "refused": dict(planning.refused),
        "layouts": [one(plan) for plan in planning.fitting[:top]],
    }


def _no_fit(config, cluster, assumptions, headroom, imbalance) -> None:
    found = smallest_fitting_nodes(config, cluster, assumptions, headroom, imbalance=imbalance)
    if found is None:
        print("no layout fits, on any number of nodes up to 4096: pick a smaller model", file=sys.stderr)
        return
    nodes, plan = found
    print(
        f"no layout fits on {cluster.nodes} node(s) of {cluster.gpus_per_node} {cluster.gpu.name}; the fewest that "
        f"fit: {nodes} node(s), best {plan.layout.describe()} ({_gib(plan.memory.total)} GiB per rank): rerun with "
        f"--nodes {nodes}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
