"""`ModelConfig`: the shape of a decoder-only transformer, validated once at construction.

Every check raises ModelConfigError (a ValueError) with one sentence that names the field and the fix, so a bad
Hydra override fails at start-up instead of deep inside a matmul. Types are plain (int/float/str/bool/Optional)
so Hydra's ConfigStore can hold the dataclass as a structured config.
"""

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

from moe.errors import ModelConfigError
from moe.ffn import ffn_num_params
from moe.mla_config import MLAConfig
from moe.moe_config import MoEConfig
from moe.mtp_config import MTPConfig

ATTENTIONS = ("gqa", "mla")
POS_ENCODINGS = ("learned", "rope", "alibi")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ModelConfigError(message)


@dataclass
class ModelConfig:
    """A decoder-only transformer; `moe=None` is a dense model, otherwise `moe.first_dense_layers` and
    `moe.moe_layer_interval` pick the MoE layers.

    attention="gqa" covers MHA, GQA and MQA (by n_kv_heads); "mla" is multi-head latent attention, shaped by `mla`
    (moe/mla.py), which has no KV heads to group and needs RoPE for its decoupled position branch.
    """

    vocab_size: int = 258
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None = n_heads (MHA); 1 = MQA; a divisor in between = GQA
    head_dim: Optional[int] = None  # None = d_model // n_heads
    attention: str = "gqa"
    mla: MLAConfig = field(default_factory=MLAConfig)
    d_ff: int = 512
    max_seq_len: int = 256
    pos_encoding: str = "rope"
    rope_theta: float = 10000.0
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "swiglu"
    attention_bias: bool = False
    ffn_bias: bool = False
    tie_embeddings: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    moe: Optional[MoEConfig] = None
    mtp: MTPConfig = field(default_factory=MTPConfig)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"model.{name}={value!r} must be a positive integer")
        _require(
            self.attention in ATTENTIONS,
            f"model.attention={self.attention!r} is unknown: use one of {ATTENTIONS} (gqa covers MHA/GQA/MQA)",
        )
        if isinstance(self.mla, dict):  # e.g. ModelConfig(**yaml_dict); Hydra itself passes an MLAConfig
            self.mla = MLAConfig(**self.mla)
        _require(
            self.attention == "mla" or self.mla == MLAConfig(),
            f"model.mla is set ({self.mla}) but model.attention={self.attention!r} ignores it: "
            "set model.attention=mla or drop the model.mla overrides",
        )
        _require(
            self.attention != "mla" or self.n_kv_heads in (None, self.n_heads),
            f"model.n_kv_heads={self.n_kv_heads} has no meaning under model.attention=mla (every head reads the "
            "shared latent): leave n_kv_heads unset",
        )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _require(
            1 <= self.n_kv_heads <= self.n_heads,
            f"model.n_kv_heads={self.n_kv_heads} must lie in [1, n_heads={self.n_heads}]: "
            "use n_heads for MHA, 1 for MQA, or a divisor of n_heads for GQA",
        )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}: "
            "choose n_kv_heads that divides n_heads so each KV head serves a whole group of query heads",
        )
        if self.head_dim is None:
            _require(
                self.d_model % self.n_heads == 0,
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                "change one of them or set model.head_dim explicitly",
            )
            self.head_dim = self.d_model // self.n_heads
        _require(self.head_dim >= 1, f"model.head_dim={self.head_dim} must be a positive integer")
        _require(
            self.pos_encoding in POS_ENCODINGS,
            f"model.pos_encoding={self.pos_encoding!r} is unknown: use one of {POS_ENCODINGS}",
        )
        _require(self.norm in NORMS, f"model.norm={self.norm!r} is unknown: use one of {NORMS}")
        _require(
            self.activation in ACTIVATIONS,
            f"model.activation={self.activation!r} is unknown: use one of {ACTIVATIONS}",
        )
        if self.attention == "mla":
            _require(
                self.pos_encoding == "rope",
                f"model.attention=mla carries positions in its decoupled RoPE branch, not "
                f"model.pos_encoding={self.pos_encoding!r}: set model.pos_encoding=rope",
            )
            self.mla.resolve(self.head_dim)
        if self.pos_encoding == "rope" and self.attention == "gqa":
            _require(
                self.head_dim % 2 == 0,
                f"model.head_dim={self.head_dim} is odd but RoPE rotates coordinate pairs: use an even head_dim",
            )
        if self.pos_encoding == "rope":
            _require(self.rope_theta > 0, f"model.rope_theta={self.rope_theta} must be positive, e.g. 10000")
        _require(self.norm_eps > 0, f"model.norm_eps={self.norm_eps} must be positive, e.g. 1e-5")
        _require(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must lie in [0, 1)")
        _require(self.init_std > 0, f"model.init_std={self.init_std} must be positive, e.g. 0.02")
        if isinstance(self.mtp, dict):  # as for mla above
            self.mtp = MTPConfig(**self.mtp)
        _require(
            self.mtp.depth < self.max_seq_len,
            f"model.mtp.depth={self.mtp.depth} predicts past the model.max_seq_len={self.max_seq_len} positions of a "
            "window: lower the depth",
        )
        if self.moe is not None:
            _require(
                self.moe.first_dense_layers < self.n_layers,
                f"moe.first_dense_layers={self.moe.first_dense_layers} leaves no MoE layer in a {self.n_layers}-layer "
                "model: lower first_dense_layers or set model.moe=null for a dense model",
            )

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates: each head under GQA, the decoupled position branch under MLA."""
        return self.mla.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head: query head h reads KV head h // group_size."""
        return self.n_heads // self.n_kv_heads

    @property
    def num_blocks(self) -> int:
        """Transformer blocks the model builds: the L layers, then one per MTP module (moe/mtp.py)."""
        return self.n_layers + self.mtp.depth

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block `layer_idx` has an MoE FFN. Indices L … L + D - 1 are the MTP modules' blocks (numbered as
        Hugging Face's DeepSeek-V3 checkpoints number them), each built like the last layer, as DeepSeek-V3's."""
        if self.n_layers <= layer_idx < self.num_blocks:
            layer_idx = self.n_layers - 1
        return self.moe is not None and self.moe.is_moe_layer(layer_idx, self.n_layers)

    def num_params(self) -> int:
        """Total parameters, computed from the config alone (a test checks it against the real module)."""
        return count_parameters(self).total

    def num_active_params(self) -> int:
        """Parameters touched by one token: MoE layers count only the router, top-k experts and shared experts."""
        return count_parameters(self).active


@dataclass(frozen=True)
class ParameterCount:
    embedding: int  # token embedding + learned positions (+ untied output matrix, counted separately below)
    lm_head: int  # 0 when tied to the embedding
    attention: int  # all layers
    ffn_total: int  # all dense FFNs + all experts, routers and shared experts
    ffn_active: int  # what one token touches: dense FFNs + per MoE layer router, top-k experts, shared experts
    norms: int
    # The E routed experts of every MoE layer (the MTP modules' too), a part of ffn_total and mtp_total: what
    # expert parallelism divides among ranks (routers and shared experts stay replicated).
    routed_experts: int = 0
    # The MTP modules (moe/mtp.py) without the embedding and head they share with the main model: per module two
    # input norms, M_k (2D·D), one block, and the norm before the head. All the fields above are the main model's.
    mtp_total: int = 0
    mtp_active: int = 0  # their part of what one training token touches: the block's router, top-k, shared experts

    @property
    def main_total(self) -> int:
        """The main model alone: what inference runs (and what DeepSeek-V3's 671B counts)."""
        return self.embedding + self.lm_head + self.attention + self.ffn_total + self.norms

    @property
    def main_active(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.ffn_active + self.norms

    @property
    def total(self) -> int:
        return self.main_total + self.mtp_total

    @property
    def active(self) -> int:
        return self.main_active + self.mtp_active


def attention_num_params(config: ModelConfig) -> int:
    """One layer: W_Q, W_O are D×H·d_h; W_K, W_V are D×H_kv·d_h (seed 000: 2d² + 2d·h_kv·d_h without bias).
    MLA: `mla_num_params`."""
    if config.attention == "mla":
        return mla_num_params(config)
    q_width, kv_width = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    weights = 2 * config.d_model * q_width + 2 * config.d_model * kv_width
    biases = (q_width + 2 * kv_width + config.d_model) if config.attention_bias else 0
    return weights + biases


def mla_num_params(config: ModelConfig) -> int:
    """One MLA layer (moe/mla.py): queries D·H·(n+r), or through a latent D·Q + Q (its RMSNorm) + Q·H·(n+r);
    W_DKV and W_KR D·(C+r); the latent's RMSNorm C; W_UK and W_UV C·H·(n+v); W_O H·v·D. Biases (attention_bias)
    on the down projections and W_O only, as DeepSeek-V3."""
    mla, D, H = config.mla, config.d_model, config.n_heads
    q_width = H * mla.qk_head_dim
    if mla.q_lora_rank is None:
        query = D * q_width
    else:
        query = D * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * q_width
    kv = (
        D * (mla.kv_lora_rank + mla.qk_rope_head_dim)
        + mla.kv_lora_rank
        + mla.kv_lora_rank * H * (mla.qk_nope_head_dim + mla.v_head_dim)
    )
    out = H * mla.v_head_dim * D
    biases = 0
    if config.attention_bias:
        biases = (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim + D
    return query + kv + out + biases


def norm_num_params(config: ModelConfig) -> int:
    return 2 * config.d_model if config.norm == "layernorm" else config.d_model


_FROZEN_KEYS: dict[int, tuple[object, str]] | None = None  # id → (config, its repr) inside `configs_frozen`


@contextlib.contextmanager
def configs_frozen() -> Iterator[None]:
    """Inside, `memoized_by_config` keys a config by its identity, its repr taken once: for a caller that asks
    thousands of questions of configs it does not change meanwhile (the planner). Outside, by repr each call."""
    global _FROZEN_KEYS
    outer = _FROZEN_KEYS
    _FROZEN_KEYS = {} if outer is None else outer
    try:
        yield
    finally:
        _FROZEN_KEYS = outer


def _config_key(config) -> str:
    if _FROZEN_KEYS is None:
        return repr(config)
    entry = _FROZEN_KEYS.get(id(config))
    if entry is None or entry[0] is not config:
        entry = _FROZEN_KEYS[id(config)] = (config, repr(config))  # holding the config keeps its id unique
    return entry[1]


def _hashable(value):
    """Lists (a stage's layers) as tuples, inside tuples too, so they can be part of a key."""
    if type(value) is list:
        return tuple(value)
    if type(value) is tuple and any(type(v) in (list, tuple) for v in value):
        return tuple(_hashable(v) for v in value)
    return value


def memoized_by_config(function):
    """Cache a pure function of a ModelConfig (and hashable arguments) by the config's repr, which a dataclass
    spells from every field, nested ones too: ModelConfig is mutable, so it cannot be a dict key itself, and the
    planner (moe_platform/plan) asks the same questions of one model thousands of times (`configs_frozen`)."""
    cache: dict = {}

    @functools.wraps(function)
    def cached(config, *args, **kwargs):
        key = (_config_key(config), args, tuple(sorted(kwargs.items())) if kwargs else ())
        try:
            return cache[key]
        except KeyError:
            pass
        except TypeError:  # a list among the arguments (a stage's layers): keyed as a tuple. Hashing the plain key
            # first, and converting only where it fails, keeps the planner's ~10^5 hits a plan cheap.
            key = (key[0], _hashable(args), _hashable(key[2]))
            if key in cache:
                return cache[key]
        if len(cache) >= 4096:
            cache.clear()
        value = cache[key] = function(config, *args, **kwargs)
        return value

    return cached


def ffn_num_params_of_block(config: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(total, active, routed experts) of block `layer`'s FFN: a dense FFN, or router + experts + shared experts."""
    if not config.is_moe_layer(layer):
        dense = ffn_num_params(config.d_model, config.d_ff, config.activation, bias=config.ffn_bias)
        return dense, dense, 0
    moe = config.moe
    routed = moe.num_experts * ffn_num_params(config.d_model, moe.expert_d_ff, config.activation)
    return (
        moe.num_params(config.d_model, config.activation),
        moe.num_active_params(config.d_model, config.activation),
        routed,
    )


def mtp_projection_num_params(config: ModelConfig) -> int:
    """M_k of one MTP module: the [2D -> D] matrix over [h ; Emb(t_{i+k})], without bias."""
    return 2 * config.d_model**2


def mtp_module_num_params(config: ModelConfig) -> tuple[int, int]:
    """(total, active) of one MTP module's own parameters: RMSNorm(h) and RMSNorm(Emb) (2 norms), M_k 2D·D, one
    block like the last layer (attention, 2 norms, FFN), and the norm before the shared head."""
    ffn_total, ffn_active, _ = ffn_num_params_of_block(config, config.n_layers - 1)  # built like the last layer
    outside_ffn = mtp_projection_num_params(config) + attention_num_params(config) + 5 * norm_num_params(config)
    return outside_ffn + ffn_total, outside_ffn + ffn_active


@memoized_by_config
def count_parameters(config: ModelConfig) -> ParameterCount:
    ffn_total = ffn_active = routed_experts = 0
    for layer in range(config.n_layers):
        total, active, routed = ffn_num_params_of_block(config, layer)
        ffn_total, ffn_active, routed_experts = ffn_total + total, ffn_active + active, routed_experts + routed
    mtp_total, mtp_active = (config.mtp.depth * n for n in mtp_module_num_params(config))
    routed_experts += config.mtp.depth * ffn_num_params_of_block(config, config.n_layers - 1)[2]
    learned_positions = config.max_seq_len * config.d_model if config.pos_encoding == "learned" else 0
    return ParameterCount(
        embedding=config.vocab_size * config.d_model + learned_positions,
        lm_head=0 if config.tie_embeddings else config.vocab_size * config.d_model,
        attention=config.n_layers * attention_num_params(config),
        ffn_total=ffn_total,
        ffn_active=ffn_active,
        norms=(2 * config.n_layers + 1) * norm_num_params(config),
        routed_experts=routed_experts,
        mtp_total=mtp_total,
        mtp_active=mtp_active,
    )
