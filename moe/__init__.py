"""moe: the model library — decoder-only transformer, top-k routed expert layers, resource ledger. No I/O."""

from moe.attention import Attention, build_attention_mask, grouped_attention
from moe.config import ModelConfig, ParameterCount, count_parameters
from moe.errors import ModelConfigError
from moe.ffn import FeedForward
from moe.flops import FlopsPerToken, matmul_flops_per_token
from moe.kv_cache import KVCache
from moe.ledger import (
    ActivationBytes,
    PipelineActivationBytes,
    RunShape,
    TrainingStateBytes,
    activation_bytes,
    activation_bytes_per_rank,
    activations_in_flight,
    all_to_all_bytes_per_step,
    expert_params_per_rank,
    format_ledger,
    kv_cache_bytes,
    params_per_rank,
    pipeline_activation_bytes,
    pipeline_layout,
    training_state_bytes,
    training_state_bytes_per_rank,
)
from moe.model import ModelOutput, Transformer
from moe.moe_config import MoEConfig
from moe.moe_layer import MoELayer, MoEOutput

__all__ = [
    "ActivationBytes",
    "Attention",
    "FeedForward",
    "FlopsPerToken",
    "KVCache",
    "MoEConfig",
    "MoELayer",
    "MoEOutput",
    "ModelConfig",
    "ModelConfigError",
    "ModelOutput",
    "ParameterCount",
    "PipelineActivationBytes",
    "RunShape",
    "TrainingStateBytes",
    "Transformer",
    "activation_bytes",
    "activation_bytes_per_rank",
    "activations_in_flight",
    "all_to_all_bytes_per_step",
    "build_attention_mask",
    "count_parameters",
    "expert_params_per_rank",
    "format_ledger",
    "grouped_attention",
    "kv_cache_bytes",
    "matmul_flops_per_token",
    "params_per_rank",
    "pipeline_activation_bytes",
    "pipeline_layout",
    "training_state_bytes",
    "training_state_bytes_per_rank",
]
