"""The run's config schema: one small dataclass per component, composed by Hydra, validated before anything runs.

`TrainConfig` nests the model's `ModelConfig` and the data pipeline's `DataConfig` next to the runtime's own
`OptimConfig`, `DistributedConfig`, `LoggingConfig` and `TrainerConfig`. The entry point puts the schema in
Hydra's ConfigStore, so every YAML under conf/ is merged onto typed nodes: an unknown or misspelt key is an error
at composition. Cross-field checks that need the launch (world size, GPU presence) live in `validate_launch`,
which runs before any process group or allocation. Loading a saved config.yaml needs OmegaConf only, not Hydra.
"""

import dataclasses
import difflib
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from data_pipeline import DataConfig, DataConfigError
from moe import ModelConfig, ModelConfigError, RunShape
from moe.checkpointing import MODES as ACTIVATION_CHECKPOINTING
from moe.stages import SCHEDULES as PIPELINE_SCHEDULES
from moe.stages import V_SHAPED, parse_layout

SCHEDULES = ("cosine", "linear", "constant")
STRATEGIES = ("single", "ddp", "deepspeed", "fsdp")
PRECISIONS = ("fp32", "bf16")
ADAMW_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
OPTIMIZERS = ("adamw", "muon")
MUON_LR_ADJUSTMENTS = ("match_rms_adamw", "original")
NS_DTYPES = ("bfloat16", "float32")
MOE_DETAILS = ("brief", "detailed")
BACKENDS = ("nccl", "gloo", "mpi", "ucc")  # torch.distributed's; null picks nccl with GPUs, gloo without
WANDB_MODES = ("online", "offline", "disabled", "shared")


class ConfigError(ValueError):
    """A config that cannot run; the message is one sentence naming the field and the fix."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _changed(node, prefix: str, names: tuple[str, ...] | None = None) -> list[str]:
    """`prefix.key=value`, spelled as on the command line, for each field of dataclass `node` (of `names`, or all of
    them) that differs from its default: the keys a refusal names."""
    spelled = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if (names is None or f.name in names) and value != f.default:
            spelled.append(f"{prefix}{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    return spelled


def _these(keys: list[str], one: str, several: str) -> str:
    """'<keys joined by and> <one or several>': the subject and verb of a refusal naming one key or more."""
    return f"{' and '.join(keys)} {one if len(keys) == 1 else several}"


def _set_up_but(keys: list[str], what: str, but: str, fix: str) -> str:
    """'<keys> set(s) <what> up but <but>: <fix>, or drop it/them': the refusal of keys set for a component the
    config leaves off."""
    return f"{_these(keys, 'sets', 'set')} {what} up but {but}: {fix}, or drop {'it' if len(keys) == 1 else 'them'}"


@dataclass
class MuonConfig:
    """Muon's own settings (optim.name=muon, train/optimizers.py): it steps the hidden weight matrices, AdamW (the
    rest of optim.*) the embeddings, the head, norms, biases and routers."""

    lr: Optional[float] = None  # peak lr of the Muon group, scheduled like optim.lr; None: optim.lr
    weight_decay: Optional[float] = None  # decoupled, p ← p·(1 − lr·wd); None: optim.weight_decay
    momentum: float = 0.95  # μ of B ← μ·B + (1 − μ)·g
    nesterov: bool = True  # orthogonalise (1 − μ)·g + μ·B instead of B
    ns_steps: int = 5  # Newton–Schulz iterations
    # The update's scale for an A×B matrix: "match_rms_adamw" lr·0.2·√max(A, B) (Moonlight: the RMS of an AdamW
    # update, so AdamW's lr and weight decay carry over), "original" lr·√max(1, fan_out/fan_in) (Keller Jordan's)
    adjust_lr: str = "match_rms_adamw"
    # Newton–Schulz in bf16 (torch.optim.Muon's, Keller Jordan's: tensor-core speed) or fp32. Under bf16 another
    # layout's last-bit gradient differences flip roundings that NS amplifies (DDP on 2 ranks vs one process, moe_tiny:
    # grad norms 1e-3 apart after 10 steps); under fp32 layouts agree to fp32 rounding (test_muon.py, 1e-5).
    ns_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _require(self.lr is None or self.lr > 0, f"optim.muon.lr={self.lr} must be positive, or null for optim.lr")
        _require(
            self.weight_decay is None or self.weight_decay >= 0,
            f"optim.muon.weight_decay={self.weight_decay} must be >= 0, or null for optim.weight_decay",
        )
        _require(0 <= self.momentum < 1, f"optim.muon.momentum={self.momentum} must lie in [0, 1), e.g. 0.95")
        _require(1 <= self.ns_steps < 100, f"optim.muon.ns_steps={self.ns_steps} must lie in [1, 100), e.g. 5")
        _require(
            self.adjust_lr in MUON_LR_ADJUSTMENTS,
            f"optim.muon.adjust_lr={self.adjust_lr!r} is unknown: use one of {MUON_LR_ADJUSTMENTS}",
        )
        _require(
            self.ns_dtype in NS_DTYPES, f"optim.muon.ns_dtype={self.ns_dtype!r} is unknown: use one of {NS_DTYPES}"
        )


@dataclass
class OptimConfig:
    """AdamW (or Muon for the hidden matrices with AdamW for the rest: name=muon) with linear warmup then
    cosine/linear decay to min_lr_ratio·lr, or constant."""

    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    warmup_steps: int = 20
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    # torch AdamW's kernel: "fused" (one kernel over all parameters; CPU and CUDA), "foreach" (a few batched ops
    # per step), "for_loop" (ops per parameter), or "auto" (fused where the device has it, else foreach). The
    # three compute the same update up to rounding; fused measured ~4x faster than the others on CPU here.
    implementation: str = "auto"
    muon: MuonConfig = field(default_factory=MuonConfig)
    # QK-clip (Kimi K2's MuonClip, train/qk_clip.py): after each step, a head whose largest attention logit
    # exceeded τ gets W_Q, W_K rescaled so that it is τ; K2 ran τ = 100. None: off. Works with AdamW too.
    qk_clip: Optional[float] = None

    def __post_init__(self) -> None:
        _require(self.name in OPTIMIZERS, f"optim.name={self.name!r} is unknown: use one of {OPTIMIZERS}")
        muon_keys = _changed(self.muon, "optim.muon.")
        _require(
            self.name == "muon" or not muon_keys,
            _set_up_but(muon_keys, "Muon", f"optim.name={self.name!r}", "use optim=muon"),
        )
        _require(
            self.qk_clip is None or self.qk_clip > 0,
            f"optim.qk_clip={self.qk_clip} must be a positive logit threshold τ (Kimi K2: 100), or null for off",
        )
        _require(
            self.implementation in ADAMW_IMPLEMENTATIONS,
            f"optim.implementation={self.implementation!r} is unknown: use one of {ADAMW_IMPLEMENTATIONS}",
        )
        _require(self.lr > 0, f"optim.lr={self.lr} must be positive, e.g. 3e-4")
        _require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must lie in [0, 1)")
        _require(self.eps > 0, f"optim.eps={self.eps} must be positive, e.g. 1e-8")
        _require(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _require(self.schedule in SCHEDULES, f"optim.schedule={self.schedule!r} is unknown: use one of {SCHEDULES}")
        _require(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")

    @property
    def muon_lr(self) -> float:
        return self.lr if self.muon.lr is None else self.muon.lr

    @property
    def muon_weight_decay(self) -> float:
        return self.weight_decay if self.muon.weight_decay is None else self.muon.weight_decay

    def lr_at(self, step: int, max_steps: int, peak: float | None = None) -> float:
        """Learning rate for optimizer step `step` (0-based) of a parameter group whose peak is `peak` (None:
        optim.lr): a pure function of the step, so the step alone restores the schedule on resume."""
        peak = self.lr if peak is None else peak
        if step < self.warmup_steps:
            return peak * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return peak
        progress = min(1.0, (step - self.warmup_steps) / max(1, max_steps - self.warmup_steps))
        if self.schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return peak * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay)


@dataclass
class FSDPConfig:
    """PyTorch FSDP2 (distributed.strategy=fsdp, parallel/fsdp.py): parameters, gradients and optimizer state
    sharded over the ranks; with `replicate_size` R > 1 it is HSDP, R replicas of a shard over W/R ranks."""

    replicate_size: int = 1
    reshard_after_forward: bool = True  # free each block's gathered parameters after its forward (gather again)
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer state in host memory (needs GPUs)

    def __post_init__(self) -> None:
        _require(
            self.replicate_size >= 1,
            f"distributed.fsdp.replicate_size={self.replicate_size} must be >= 1 (1: FSDP, R > 1: HSDP)",
        )


@dataclass
class PipelineConfig:
    """Pipeline parallelism (distributed.pipeline_parallel_size > 1, parallel/pipeline.py, moe/stages.py): the
    torch.distributed.pipelining schedule, micro-batches per step, stages per rank, and an explicit stage layout."""

    schedule: str = "1f1b"
    microbatches: Optional[int] = None  # per step and pipeline; None: the step's accumulation count (≥ PP)
    virtual_stages: Optional[int] = None  # stages per rank; None: 2 for interleaved_1f1b, zbv, dualpipev, else 1
    layout: Optional[list] = None  # e.g. [[embed,0,1],[2,3,norm,head]]; None: balanced by each layer's FLOPs

    def __post_init__(self) -> None:
        _require(
            self.schedule in PIPELINE_SCHEDULES,
            f"distributed.pipeline.schedule={self.schedule!r} is unknown: use one of {PIPELINE_SCHEDULES}",
        )
        _require(
            self.microbatches is None or self.microbatches >= 1,
            f"distributed.pipeline.microbatches={self.microbatches} must be >= 1, or null for the accumulation count",
        )
        virtual = self.virtual_stages
        _require(virtual is None or virtual >= 1, f"distributed.pipeline.virtual_stages={virtual} must be >= 1")
        _require(
            virtual in (None, 1) or self.schedule not in ("1f1b", "gpipe"),
            f"distributed.pipeline.virtual_stages={virtual} needs a schedule with several stages per rank, but "
            f"{self.schedule} has one: use schedule=interleaved_1f1b, or drop virtual_stages",
        )
        _require(
            virtual in (None, 2) or self.schedule not in V_SHAPED,
            f"distributed.pipeline.virtual_stages={virtual}: schedule={self.schedule} runs exactly 2 stages per rank "
            "(a V): set it to 2 or drop it",
        )

    @property
    def stages_per_rank(self) -> int:
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 1 if self.schedule in ("1f1b", "gpipe") else 2


@dataclass
class DistributedConfig:
    """How ranks cooperate: one process, plain DDP, DeepSpeed ZeRO (stage 0–3, optional CPU offload), or FSDP2
    (`fsdp`: fully sharded, or hybrid sharded with `fsdp.replicate_size` > 1)."""

    strategy: str = "single"
    zero_stage: int = 0  # deepspeed only
    offload_optimizer: bool = False  # deepspeed stage >= 1: optimizer state in host memory
    offload_params: bool = False  # deepspeed stage 3: parameters in host memory
    backend: Optional[str] = None  # None: nccl with GPUs, gloo on CPU
    # How long a collective waits for a dead or hung rank before failing; the survivors then name it (train/liveness.py)
    timeout_s: int = 600
    check_memory: bool = True  # refuse at start-up a training state the ledger says cannot fit (see launch/memory.py)
    # EP: each group of this many consecutive ranks splits every MoE layer's experts (parallel/expert_parallel.py)
    expert_parallel_size: int = 1
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    # PP: consecutive blocks of W/PP ranks each run one pipeline stage (parallel/pipeline.py)
    pipeline_parallel_size: int = 1
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        _require(
            self.strategy in STRATEGIES,
            f"distributed.strategy={self.strategy!r} is unknown: use one of {STRATEGIES}",
        )
        _require(self.zero_stage in (0, 1, 2, 3), f"distributed.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.strategy == "fsdp":
            deepspeed = _changed(self, "distributed.", ("zero_stage", "offload_optimizer", "offload_params"))
            _require(
                not deepspeed,
                f"{_these(deepspeed, 'is', 'are')} DeepSpeed's, but distributed.strategy=fsdp shards parameters, "
                f"gradients and optimizer state already: drop {'it' if len(deepspeed) == 1 else 'them'} (FSDP2 "
                "offloads with distributed.fsdp.cpu_offload=true)",
            )
        elif self.strategy != "deepspeed":
            _require(
                self.zero_stage == 0 and not self.offload_optimizer and not self.offload_params,
                f"distributed.zero_stage/offload need distributed.strategy=deepspeed, not {self.strategy!r}: "
                "pick distributed=zero1/zero2/zero3/zero3_offload",
            )
        fsdp_keys = _changed(self.fsdp, "distributed.fsdp.")
        strategy = f"distributed.strategy={self.strategy!r}"
        _require(
            self.strategy == "fsdp" or not fsdp_keys,
            _set_up_but(fsdp_keys, "FSDP2", strategy, "use distributed=fsdp or distributed=hsdp"),
        )
        _require(
            not self.offload_optimizer or self.zero_stage >= 1,
            "distributed.offload_optimizer needs distributed.zero_stage >= 1: raise the stage or drop the offload",
        )
        _require(
            not self.offload_params or self.zero_stage == 3,
            "distributed.offload_params needs distributed.zero_stage=3: use distributed=zero3_offload",
        )
        _require(
            self.backend is None or self.backend in BACKENDS,
            f"distributed.backend={self.backend!r} is unknown: use one of {BACKENDS}, or null for nccl/gloo by device",
        )
        _require(self.timeout_s > 0, f"distributed.timeout_s={self.timeout_s} must be positive")
        _require(
            self.expert_parallel_size >= 1,
            f"distributed.expert_parallel_size={self.expert_parallel_size} must be >= 1 (1: no expert parallelism)",
        )
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        pp = self.pipeline_parallel_size
        _require(pp >= 1, f"distributed.pipeline_parallel_size={pp} must be >= 1 (1: no pipeline parallelism)")
        pipeline_keys = _changed(self.pipeline, "distributed.pipeline.")
        _require(
            pp > 1 or not pipeline_keys,
            _set_up_but(pipeline_keys, "a pipeline", "distributed.pipeline_parallel_size=1", "set it above 1"),
        )
        if pp == 1:
            return
        why = {
            "deepspeed": "DeepSpeed's ZeRO, whose engine runs the backward that the pipeline schedule must drive",
            "single": "distributed=single, which starts no process group for the stages to talk over",
        }
        _require(
            self.strategy in ("ddp", "fsdp"),
            f"distributed.pipeline_parallel_size={pp} does not run under {why.get(self.strategy, self.strategy)}: "
            "use distributed=ddp, fsdp or hsdp (FSDP2 shards more than ZeRO-1/2)",
        )


@dataclass
class LoggingConfig:
    """metrics.jsonl is always written; wandb and TensorBoard are opt-in sinks of the same records."""

    wandb: bool = False
    wandb_project: str = "moe-platform"
    wandb_mode: Optional[str] = None  # None: wandb's own default (WANDB_MODE); "offline" needs no network
    tensorboard: bool = False
    progress_bar: bool = True
    peak_tflops: Optional[float] = (
        None  # dense peak per device, for MFU; None: the datasheet of a known GPU, else no MFU
    )
    # What reaches wandb/TensorBoard as scalar keys: "brief" = the moe/all/* summaries across layers only;
    # "detailed" = also each layer's scalars. metrics.jsonl always has every key.
    moe_detail: str = "brief"
    visuals_every: int = 10  # expert × layer heatmap image and histograms every N log steps (0: never)
    wandb_entity: Optional[str] = None
    wandb_group: Optional[str] = None
    wandb_tags: list[str] = field(default_factory=list)
    wandb_name: Optional[str] = None  # None: the run directory's name
    # Routing alerts (monitor/alerts.py): a layer's MaxVio or drop fraction above its threshold, or an expert with no
    # tokens, for this many consecutive logs prints one warning and writes one alert record.
    alert_maxvio: float = 1.0
    alert_drop_frac: float = 0.2
    alert_consecutive_logs: int = 3
    # Measure one training step's peak memory (a run's second) and print it beside the ledger's prediction at the
    # end (moe_platform/monitor/peak_memory.py); on CPU that step runs under torch.profiler, several times slower.
    peak_memory: bool = True
    # Log each layer's largest attention logit (attn/max_logit/layer_i, moe/max_logit.py), the signal of attention
    # logits blowing up; one more Q·Kᵀ per forward. On whenever optim.qk_clip is set.
    attention_max_logit: bool = False

    def __post_init__(self) -> None:
        _require(
            self.moe_detail in MOE_DETAILS,
            f"logging.moe_detail={self.moe_detail!r} is unknown: use one of {MOE_DETAILS}",
        )
        _require(
            self.wandb_mode is None or self.wandb_mode in WANDB_MODES,
            f"logging.wandb_mode={self.wandb_mode!r} is unknown: use one of {WANDB_MODES}, or null for WANDB_MODE",
        )
        _require(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"logging.peak_tflops={self.peak_tflops} must be positive (the device's dense peak), or null",
        )
        _require(self.visuals_every >= 0, f"logging.visuals_every={self.visuals_every} must be >= 0 (0: never)")
        _require(self.alert_maxvio > 0, f"logging.alert_maxvio={self.alert_maxvio} must be positive, e.g. 1.0")
        _require(
            0 <= self.alert_drop_frac < 1,
            f"logging.alert_drop_frac={self.alert_drop_frac} must lie in [0, 1), e.g. 0.2",
        )
        _require(
            self.alert_consecutive_logs >= 1,
            f"logging.alert_consecutive_logs={self.alert_consecutive_logs} must be >= 1",
        )


@dataclass
class PreemptionConfig:
    """What a preemption or time-limit signal does: checkpoint at the next step boundary, then (under Slurm)
    requeue the job, which resumes from that checkpoint. See train/preemption.py."""

    enabled: bool = True
    # SIGUSR1: Slurm's warning before the time limit; SIGTERM: preempted or cancelled; SIGINT: Ctrl-C on a local run
    signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM", "SIGINT"])
    requeue: bool = True  # under Slurm: `scontrol requeue` once the checkpoint is complete
    max_requeues: int = 20  # Slurm's SLURM_RESTART_COUNT at which the job stops instead of requeueing again

    def __post_init__(self) -> None:
        for name in self.signals:
            _require(
                name in signal.Signals.__members__ and name not in ("SIGKILL", "SIGSTOP"),
                f"preemption.signals has {name!r}, which is not a signal a process can catch: use e.g. SIGUSR1",
            )
        _require(self.max_requeues >= 0, f"preemption.max_requeues={self.max_requeues} must be >= 0")


@dataclass
class TrainerConfig:
    max_steps: int = 200  # the schedule's length
    stop_at: Optional[int] = None  # end this job after this step (checkpointed), schedule unchanged: time slices
    micro_batch_size: int = 8  # per rank; gradient accumulation = global / (micro · world)
    precision: str = "fp32"
    seed: int = 0  # model init (same on every rank), dropout and router jitter (per rank); data order: data.seed
    log_every: int = 20
    eval_every: int = 50  # 0 disables periodic eval; a final eval runs when validation is enabled
    # How much each evaluation reads is data.val.max_batches (the data pipeline must know it to cap a stream).
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2  # besides these, pruning keeps the checkpoint a run resumed from
    save_retries: int = 3  # a transient I/O error while saving (EIO, ESTALE, …) is retried this many times
    save_final: bool = True
    # A NaN/Inf loss or gradient (train/nan_guard.py): "halt" stops the run at once (a NaN usually means bad data,
    # divergence or a faulty device, which skipping would hide); "skip" drops the step, and halts at the
    # nan_max_consecutive-th such step in a row.
    on_nan: str = "halt"
    nan_max_consecutive: int = 5
    # Recompute activations in backward instead of keeping them (moe/checkpointing.py): "none", "moe" (each MoE
    # layer) or "full" (each block). Same gradients, less memory, one more forward of what is recomputed.
    activation_checkpointing: str = "none"
    compile: bool = False  # torch.compile each transformer block (first steps pay the compilation)

    def __post_init__(self) -> None:
        _require(
            self.activation_checkpointing in ACTIVATION_CHECKPOINTING,
            f"trainer.activation_checkpointing={self.activation_checkpointing!r} is unknown: use one of "
            f"{ACTIVATION_CHECKPOINTING}",
        )
        for name in ("max_steps", "micro_batch_size", "log_every", "keep_last", "nan_max_consecutive"):
            value = getattr(self, name)
            _require(value >= 1, f"trainer.{name}={value} must be >= 1")
        _require(
            self.on_nan in ("halt", "skip"),
            f"trainer.on_nan={self.on_nan!r} is unknown: use 'halt' (stop at a NaN/Inf loss or gradient) or 'skip'",
        )
        for name in ("eval_every", "save_every", "save_retries"):
            value = getattr(self, name)
            _require(value >= 0, f"trainer.{name}={value} must be >= 0 (0 disables it)")
        _require(
            self.stop_at is None or 1 <= self.stop_at <= self.max_steps,
            f"trainer.stop_at={self.stop_at} must lie in [1, trainer.max_steps={self.max_steps}] or be null",
        )
        _require(
            self.precision in PRECISIONS,
            f"trainer.precision={self.precision!r} is unsupported: use one of {PRECISIONS} "
            "(fp16 is left out on purpose: bf16 needs no loss scaling)",
        )
        _require(
            self.save_final or self.save_every <= self.max_steps,
            f"trainer.save_every={self.save_every} exceeds trainer.max_steps={self.max_steps} and "
            "trainer.save_final=false, so the run would never write a checkpoint: lower trainer.save_every or set "
            "trainer.save_final=true",
        )


@dataclass
class InitConfig:
    """Where a fresh run's weights come from (train/model_build.py, interop/init_from.py); a resumed run takes its
    checkpoint's.

    from_path: null (random init), one of our checkpoint dirs (checkpoints/step_XXXXXXXX, or a run dir: its latest
    complete one), a `moe-export` .pt file, or a Hugging Face model dir. Its model config must agree with
    `model.*`; with upcycle=true the source is dense and only the FFN may differ (see interop/upcycle.py).
    """

    from_path: Optional[str] = None
    upcycle: bool = False  # each MoE layer's experts start as copies of the dense source's FFN of that layer

    def __post_init__(self) -> None:
        _require(
            self.from_path is None or bool(self.from_path),
            "init.from_path is empty: give a checkpoint, .pt or Hugging Face directory, or null for a random init",
        )
        _require(
            not self.upcycle or self.from_path is not None,
            "init.upcycle=true needs a dense model to upcycle: set init.from_path to its checkpoint",
        )


@dataclass
class TrainConfig:
    # MISSING, not a default instance: ModelConfig.__post_init__ resolves head_dim/n_kv_heads, and a resolved
    # default would leak into every model YAML that leaves them unset. The model/ group always supplies it.
    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    init: InitConfig = field(default_factory=InitConfig)
    resume: str = "none"  # "none", "auto" (latest complete checkpoint in the run dir, if any), or a path

    def __post_init__(self) -> None:
        _require(
            self.data.seq_len <= self.model.max_seq_len,
            f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}: "
            "lower data.seq_len or raise model.max_seq_len",
        )
        _require(
            self.data.global_batch_size % self.trainer.micro_batch_size == 0,
            f"data.global_batch_size={self.data.global_batch_size} is not a multiple of trainer.micro_batch_size="
            f"{self.trainer.micro_batch_size}: make the global batch a multiple of the micro batch",
        )
        _require(
            self.resume == "none" or self.resume == "auto" or bool(self.resume),
            "resume must be 'none', 'auto' or a checkpoint path",
        )
        _require(
            not (self.distributed.strategy == "deepspeed" and self.distributed.zero_stage == 0)
            or self.trainer.precision == "bf16",
            "distributed.zero_stage=0 with trainer.precision=fp32 steps DeepSpeed's plain optimizer without checking "
            "the gradients, so a NaN would reach the weights (train/nan_guard.py): use distributed=zero1 or ddp",
        )
        _require(
            not self.init.upcycle or self.model.moe is not None,
            "init.upcycle=true turns dense FFNs into experts but model.moe is null: pick an MoE model, e.g. "
            "model=moe_tiny",
        )
        _require(
            not (self.trainer.activation_checkpointing == "moe" and self.model.moe is None),
            "trainer.activation_checkpointing=moe recomputes MoE layers but this model is dense (model.moe is null): "
            "use full or none",
        )
        _require(
            not (self.trainer.compile and self.distributed.zero_stage == 3),
            "trainer.compile=true is not supported with ZeRO-3 (its parameter hooks gather inside the blocks that "
            "would be compiled): use distributed=zero2 or set trainer.compile=false",
        )
        _require(
            not (self.optim.name == "muon" and self.distributed.strategy == "deepspeed"),
            "optim.name=muon does not run under distributed.strategy=deepspeed (DeepSpeed's own ZeRO Muon is another "
            "optimizer: it clips the orthogonalised updates instead of the gradients, bench/deepspeed_muon.py): use "
            "distributed=ddp or fsdp, or optim=adamw_cosine",
        )
        _require(
            self.model.mtp.depth < self.data.seq_len,
            f"model.mtp.depth={self.model.mtp.depth} leaves no position with a target in a window of "
            f"data.seq_len={self.data.seq_len} tokens: lower the depth or lengthen the windows",
        )
        self._check_attention_logits()
        self._check_expert_parallel()
        self._check_pipeline()

    def _check_attention_logits(self) -> None:
        watched = "optim.qk_clip" if self.optim.qk_clip is not None else "logging.attention_max_logit=true"
        _require(
            not (self.optim.qk_clip is not None and self.distributed.strategy == "deepspeed"),
            "optim.qk_clip rescales the module's W_Q and W_K, which DeepSpeed's fp32 master copy would overwrite at "
            "the next step: use distributed=ddp, fsdp or hsdp",
        )
        _require(
            not (self.trainer.compile and (self.optim.qk_clip is not None or self.logging.attention_max_logit)),
            f"{watched} records logits beside the attention that trainer.compile=true would compile: set "
            "trainer.compile=false",
        )

    def _check_pipeline(self) -> None:
        pp, pipeline = self.distributed.pipeline_parallel_size, self.distributed.pipeline
        if pp == 1:
            return
        # Module k ≥ 2 embeds its tokens with the weight module 1 did and runs on module 1's output, so in torch 2.13's
        # split backward (stage_backward_weight) one parameter group's intermediates feed each other and its one
        # autograd pass frees what the next group's needs ("backward through the graph a second time").
        _require(
            self.model.mtp.depth <= 1 or pipeline.schedule not in V_SHAPED,
            f"distributed.pipeline.schedule={pipeline.schedule} splits each backward into input and weight gradients, "
            f"which torch cannot do through the model.mtp.depth={self.model.mtp.depth} MTP modules that share one "
            "embedding: use model.mtp.depth=1 or schedule 1f1b, gpipe or interleaved_1f1b",
        )
        # The V schedules run the first and the last stage on one rank, each stage an FSDP2 root of its own, and a
        # module two roots hold is refused by FSDP2 at the first forward ("already been lazily initialized").
        _require(
            not (self.model.mtp.depth and pipeline.schedule in V_SHAPED and self.distributed.strategy == "fsdp"),
            f"distributed.pipeline.schedule={pipeline.schedule} runs the first and the last stage on one rank, whose "
            f"two FSDP2 roots cannot share the embedding that model.mtp.depth={self.model.mtp.depth} reads on both: "
            "use distributed=ddp, or schedule 1f1b, gpipe or interleaved_1f1b",
        )
        stages = pp * pipeline.stages_per_rank
        layers = self.model.n_layers
        _require(
            stages <= layers or pipeline.layout is not None,
            f"distributed.pipeline_parallel_size={pp} × {pipeline.stages_per_rank} stage(s) per rank = {stages} "
            f"stages, more than model.n_layers={layers}: lower the pipeline size or the virtual stages",
        )
        _require(
            not self.model.tie_embeddings,
            f"distributed.pipeline_parallel_size={pp} puts the embedding on the first stage and the head on the last, "
            "so they cannot share one tied weight: set model.tie_embeddings=false",
        )
        if pipeline.layout is not None:
            try:
                layout = parse_layout(pipeline.layout, layers, pp, pipeline.schedule)
            except ValueError as err:
                raise ConfigError(f"distributed.pipeline.layout: {err}") from None
            _require(
                layout.num_stages == stages,
                f"distributed.pipeline.layout has {layout.num_stages} stages but pipeline_parallel_size={pp} × "
                f"{pipeline.stages_per_rank} stage(s) per rank makes {stages}: give {stages} stages, or set "
                f"distributed.pipeline.virtual_stages={layout.num_stages // pp}",
            )

    @property
    def samples_to_train(self) -> int:
        """Global samples the whole run reads (trainer.max_steps global batches): a mixture's caps are checked on it."""
        return self.trainer.max_steps * self.data.global_batch_size

    def run_shape(self, world_size: int) -> RunShape:
        """The ledger's view of this run on `world_size` ranks (the start-up ledger, the predicted peak, the report):
        one spelling of what the model's memory and traffic depend on besides the model."""
        micro = self.trainer.micro_batch_size
        pp, pipeline = self.distributed.pipeline_parallel_size, self.distributed.pipeline
        dp_size = max(world_size // pp, 1)  # the data-parallel ranks of one stage; all ranks without PP
        grad_accum = self.data.global_batch_size // (micro * dp_size)
        return RunShape(
            micro_batch_size=micro,
            seq_len=self.data.seq_len,
            precision=self.trainer.precision,
            zero_stage=self.distributed.zero_stage,
            dp_size=dp_size,
            fsdp=self.distributed.strategy == "fsdp",
            replicate_size=self.distributed.fsdp.replicate_size,
            ep_size=self.distributed.expert_parallel_size,
            grad_accum=grad_accum,
            checkpointing=self.trainer.activation_checkpointing,
            attention_mask=self.data.document_mask,
            pipeline_size=pp,
            schedule=pipeline.schedule,
            virtual_stages=pipeline.stages_per_rank if pp > 1 else 1,
            microbatches=(pipeline.microbatches or grad_accum) if pp > 1 else 1,
            layout=None if pipeline.layout is None else tuple(tuple(stage) for stage in pipeline.layout),
            optimizer=self.optim.name,
        )

    def _check_expert_parallel(self) -> None:
        ep = self.distributed.expert_parallel_size
        if ep == 1:
            return
        moe = self.model.moe
        _require(
            moe is not None,
            f"distributed.expert_parallel_size={ep} needs MoE layers but this model is dense (model.moe is null): "
            "set distributed.expert_parallel_size=1 or pick an MoE model",
        )
        _require(
            moe.num_experts % ep == 0,
            f"distributed.expert_parallel_size={ep} does not divide model.moe.num_experts={moe.num_experts}: "
            "pick an EP size that divides the number of experts",
        )
        _require(
            self.distributed.strategy != "single",
            f"distributed.expert_parallel_size={ep} needs several ranks: use distributed=fsdp, ddp, zero1 or zero2",
        )
        _require(
            self.distributed.zero_stage != 3,
            f"distributed.expert_parallel_size={ep} does not work with ZeRO-3 (DeepSpeed 0.19 partitions every "
            "parameter over all ranks except for its own AutoEP layer, so expert blocks would mix): for ZeRO-3 "
            "sharding with experts split use distributed=fsdp (PyTorch FSDP2), or distributed=zero2",
        )


def world_size_from_env() -> int:
    """The launcher's world size (torchrun/accelerate/Slurm set WORLD_SIZE), known before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_launch(config: TrainConfig, world_size: int, has_gpu: bool) -> int:
    """Checks that need the launch; returns gradient-accumulation steps = global / (micro · world)."""
    strategy = config.distributed.strategy
    _require(
        not (strategy == "single" and world_size > 1),
        f"distributed=single but the launcher started {world_size} processes: use distributed=ddp, fsdp or zero1/2/3",
    )
    replicas = config.distributed.fsdp.replicate_size
    _require(
        strategy != "fsdp" or (world_size // config.distributed.pipeline_parallel_size) % replicas == 0,
        f"distributed.fsdp.replicate_size={replicas} does not divide the {world_size} ranks the launcher started: "
        "launch a multiple of it, or change it (1 shards over all ranks)",
    )
    pp = config.distributed.pipeline_parallel_size
    _require(
        world_size % pp == 0,
        f"distributed.pipeline_parallel_size={pp} does not divide the {world_size} ranks the launcher started: "
        "launch a multiple of the pipeline size, or change it",
    )
    dp_size = world_size // pp  # the ranks of one stage
    per_step = config.trainer.micro_batch_size * dp_size
    ranks = "world size" if pp == 1 else "data-parallel ranks per stage"
    _require(
        config.data.global_batch_size % per_step == 0,
        f"data.global_batch_size={config.data.global_batch_size} is not a multiple of trainer.micro_batch_size × "
        f"{ranks} = {config.trainer.micro_batch_size} × {dp_size}: change the global or micro batch size",
    )
    ep = config.distributed.expert_parallel_size
    _require(
        dp_size % ep == 0,
        f"distributed.expert_parallel_size={ep} does not divide the {dp_size} ranks "
        + ("the launcher started" if pp == 1 else f"of each pipeline stage ({world_size} / pipeline_parallel_size)")
        + ": launch a multiple of the EP size, or change it",
    )
    if pp > 1:
        _check_pipeline_launch(config, world_size)
    _require(
        not (config.distributed.offload_params and not has_gpu),
        "distributed.offload_params moves parameters from GPU to host memory, but there is no GPU: "
        "use distributed=zero3",
    )
    _require(
        not (config.distributed.fsdp.cpu_offload and not has_gpu),
        "distributed.fsdp.cpu_offload=true moves the shards from GPU to host memory, but there is no GPU: "
        "set distributed.fsdp.cpu_offload=false",
    )
    return config.run_shape(world_size).grad_accum


def _check_pipeline_launch(config: TrainConfig, world_size: int) -> None:
    """The pipeline's micro-batches: at least one per stage rank, and a whole number of rows each."""
    run = config.run_shape(world_size)
    pp, m = run.pipeline_size, run.microbatches
    _require(
        m >= pp,
        f"distributed.pipeline.microbatches={m} is fewer than pipeline_parallel_size={pp}: the schedule would "
        "leave stages without work; raise it (or data.global_batch_size), or lower the pipeline size",
    )
    rows = config.trainer.micro_batch_size * run.grad_accum  # one step's rows on each pipeline
    _require(
        rows % m == 0,
        f"distributed.pipeline.microbatches={m} does not divide the {rows} rows each pipeline takes per step "
        "(data.global_batch_size / data-parallel ranks per stage): pick a divisor, or null",
    )
    rounds = max(1, m // pp)  # torch's interleaved schedules run the micro-batches in equal rounds
    _require(
        run.schedule != "interleaved_1f1b" or m % rounds == 0,
        f"distributed.pipeline.schedule=interleaved_1f1b runs micro-batches in {rounds} equal rounds of about "
        f"pipeline_parallel_size={pp}, and {m} does not split so: pick microbatches = a multiple of {pp}",
    )
    stages = pp * run.virtual_stages
    _require(
        run.schedule != "dualpipev" or m >= stages,
        f"distributed.pipeline.schedule=dualpipev needs a micro-batch per stage, and {m} micro-batches are fewer "
        f"than its {stages} stages (2 × pipeline_parallel_size): raise microbatches or the global batch",
    )


# A user's mistake in the config, from any component's checks or from OmegaConf's own typing; anything else raised
# while building the config (a TypeError in a __post_init__, say) is a bug and keeps its traceback.
USER_CONFIG_ERRORS = (
    ConfigError, ModelConfigError, DataConfigError, ValidationError, MissingMandatoryValue, InterpolationResolutionError
)  # fmt: skip


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The typed, validated config; a user's config mistake becomes one ConfigError sentence."""
    reject_added_keys(cfg)
    try:
        return OmegaConf.to_object(cfg)
    except USER_CONFIG_ERRORS as err:
        raise ConfigError(_one_sentence(err)) from None


def to_data_config(cfg: DictConfig) -> DataConfig:
    """The `data` node alone, typed and validated, for a command that reads nothing else (moe-data): a model or
    trainer the data would not suit is a training run's concern, checked when one starts."""
    reject_added_keys(cfg.data, "data.")
    try:
        return OmegaConf.to_object(cfg.data)
    except USER_CONFIG_ERRORS as err:
        raise ConfigError(_one_sentence(err)) from None


def _one_sentence(err: Exception) -> str:
    """The error's first line; OmegaConf's own errors name their key only on a later line and suggest no fix."""
    first = str(err).split("\n")[0].strip()
    if not isinstance(err, OmegaConfBaseException):
        return first
    key = err.full_key or "the config"
    if isinstance(err, InterpolationResolutionError):
        return f"{key}: {first}: fix the ${{...}} reference or give {key} a plain value"
    if isinstance(err, MissingMandatoryValue):
        return f"{key} has no value (???): give it one, e.g. on the command line as {key}=..."
    return f"{key}: {first}: give {key} a value of the type its schema declares"


def reject_added_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Refuse a key added with `+` that the schema lacks: `OmegaConf.to_object` would silently drop it."""
    schema = OmegaConf.get_type(cfg)
    for key in cfg.keys():
        if dataclasses.is_dataclass(schema) and key not in {f.name for f in dataclasses.fields(schema)}:
            raise ConfigError(not_a_key(f"{prefix}{key}", schema))
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not (node._is_none() or node._is_missing() or node._is_interpolation()):
            reject_added_keys(node, f"{prefix}{key}.")


def not_a_key(full_key: str, schema: type) -> str:
    """'<key> is not a key of <parent>: did you mean <the closest key>?' for a key that dataclass `schema` lacks."""
    parent, _, leaf = full_key.rpartition(".")
    names = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(leaf, names, n=1)
    fix = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else f"use one of {', '.join(names)}"
    return f"{full_key} is not a key of {parent or 'the top level'}: {fix}"


def load_run_config(config_yaml: Path) -> TrainConfig:
    """The validated config of a run from its saved config.yaml (a run dir's or a checkpoint's)."""
    saved = OmegaConf.load(config_yaml)
    _upgrade_saved_config(saved)
    return to_train_config(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))


def _upgrade_saved_config(saved: DictConfig) -> None:
    """Keys that older runs saved and this schema has replaced, moved to where they live now."""
    trainer = saved.get("trainer") or {}
    if "eval_batches" in trainer:  # one knob since: data.val.max_batches (global batches per evaluation)
        eval_batches = trainer.pop("eval_batches")
        if OmegaConf.select(saved, "data.val.max_batches") is None:
            OmegaConf.update(saved, "data.val.max_batches", eval_batches, force_add=True)
