"""Exact conversion between `moe.Transformer` state dicts and Hugging Face transformers causal LMs: one module per
architecture family, behind one table of families (registry.py).

Which architecture (`hf_architecture`): `model.attention=mla` → DeepSeek-V3 (dense or MoE); otherwise dense →
Llama; MoE on every layer, no shared experts, renormalised top-k, no attention bias → Mixtral; any other
representable softmax-routed MoE → Qwen2-MoE. The table tries the families in that order and each one's
`represents` refuses what only it could compute but does not: DeepSeek-V3's router features (sigmoid scores, the
selection bias, group limits, routed scaling) exist in no other architecture, and DeepSeek-V3 has only MLA, so a
GQA model with one of them is refused. A config that no architecture computes exactly is refused with one sentence
(`ConversionError`), never exported approximately. On import, config.json's `model_type` picks the family: llama
or qwen2 (dense), mixtral, qwen2_moe, deepseek_v3.

Each family maps its config (`config_to_hf` / `config_from_hf`) apart from its weights (`weights_to_hf` /
`weights_from_hf`); its decisions are in its module's docstring (llama.py for Llama and Qwen2, mixtral.py,
qwen2_moe.py, deepseek_v3.py), and what they all share in common.py. An import maps weights to readers
(tensors.py): a model directory is read one of our tensors at a time from its safetensors shards, when that tensor
is asked for (`read_hf_dir`), so `init.from_path` learns the model from config.json alone (`hf_model_config`) and a
rank under expert parallelism reads only its own experts.
"""

from moe_platform.interop.hf.common import ConversionError
from moe_platform.interop.hf.deepseek_v3 import DEEPSEEK_V3
from moe_platform.interop.hf.llama import LLAMA, QWEN2
from moe_platform.interop.hf.mixtral import MIXTRAL
from moe_platform.interop.hf.qwen2_moe import QWEN2_MOE
from moe_platform.interop.hf.registry import (
    config_from_hf,
    from_hf,
    hf_architecture,
    hf_config,
    hf_model_config,
    load_hf_model_dir,
    read_hf_dir,
    to_hf,
)
from moe_platform.interop.hf.tensors import LazyStateDict

__all__ = [
    "DEEPSEEK_V3",
    "LLAMA",
    "MIXTRAL",
    "QWEN2",
    "QWEN2_MOE",
    "ConversionError",
    "LazyStateDict",
    "config_from_hf",
    "from_hf",
    "hf_architecture",
    "hf_config",
    "hf_model_config",
    "load_hf_model_dir",
    "read_hf_dir",
    "to_hf",
]
