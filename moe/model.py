"""Decoder-only transformer whose FFN per layer is dense or a top-k routed expert layer (seed 001 §1.1–1.3).

Legend: B batch, T tokens in this step, S keys (cached prefix + step), D model width, V vocabulary.

    X = Embed(ids) (+ learned positions)
    U = X + Attention(Norm(X))        Y = U + FFN(Norm(U))        (pre-norm block, repeated L times)
    logits = Norm(Y) W_U
    (+ with model.mtp.depth = K and labels: K multi-token-prediction modules after it, moe/mtp.py)
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moe.alibi import alibi_bias
from moe.attention import Attention, build_attention_mask, require_a_visible_key
from moe.checkpointing import recompute_in_backward
from moe.config import ModelConfig
from moe.ffn import FeedForward
from moe.kv_cache import KVCache, LatentKVCache
from moe.mla import MultiHeadLatentAttention
from moe.moe_layer import MoELayer, MoEOutput
from moe.mtp import mtp_loss, mtp_targets
from moe.rope import rope_tables


def build_norm(config: ModelConfig) -> nn.Module:
    """LayerNorm carries γ and β (the seeds' definition); RMSNorm only γ."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps)
    return nn.RMSNorm(config.d_model, eps=config.norm_eps)


@dataclass
class ModelOutput:
    """`logits` (B, T, V); `aux_loss` sums every MoE layer's balancing and z losses (0 for a dense model);
    `moe_outputs[i]` is block i's MoEOutput (None for dense blocks; the MTP modules' blocks follow the L layers) so
    the trainer can log per-layer terms. Given labels, `mtp_loss` is L_MTP (moe/mtp.py; 0 without MTP) and
    `mtp_logits[k - 1]` depth k's (B, T - k, V) logits."""

    logits: torch.Tensor
    aux_loss: torch.Tensor
    moe_outputs: list[MoEOutput | None] = field(default_factory=list)
    mtp_loss: torch.Tensor | None = None
    mtp_logits: list[torch.Tensor] = field(default_factory=list)


def total_aux_loss(moe_outputs: list[MoEOutput | None], like: torch.Tensor) -> torch.Tensor:
    """Σ over MoE layers of balancing + z loss; a zero scalar (of `like`'s dtype and device) without any."""
    aux_terms = [out.aux_loss + out.z_loss for out in moe_outputs if out is not None]
    return torch.stack(aux_terms).sum() if aux_terms else like.new_zeros(())


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = build_norm(config)
        self.attn = (
            MultiHeadLatentAttention(config, layer_idx) if config.attention == "mla" else Attention(config, layer_idx)
        )
        self.ffn_norm = build_norm(config)
        if config.is_moe_layer(layer_idx):
            self.ffn: nn.Module = MoELayer(config.d_model, config.moe, config.activation, config.init_std)
        else:
            self.ffn = FeedForward(config.d_model, config.d_ff, config.activation, bias=config.ffn_bias)
        self.residual_dropout = nn.Dropout(config.dropout)
        self.checkpointing = "none"  # see moe/checkpointing.py; set by Transformer.set_activation_checkpointing

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        token_mask_BT: torch.Tensor | None,
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        if self.checkpointing == "full" and torch.is_grad_enabled() and kv_cache is None:
            return recompute_in_backward(self._forward, x_BTD, rope_cos_sin, mask, kv_cache, token_mask_BT)
        return self._forward(x_BTD, rope_cos_sin, mask, kv_cache, token_mask_BT)

    def _forward(self, x_BTD, rope_cos_sin, mask, kv_cache, token_mask_BT) -> tuple[torch.Tensor, MoEOutput | None]:
        x_BTD = x_BTD + self.residual_dropout(self.attn(self.attn_norm(x_BTD), rope_cos_sin, mask, kv_cache))
        if isinstance(self.ffn, MoELayer):
            if self.checkpointing == "moe" and torch.is_grad_enabled():
                moe_output = recompute_in_backward(self._moe_ffn, x_BTD, token_mask_BT)
            else:
                moe_output = self._moe_ffn(x_BTD, token_mask_BT)
            # The layer's output reaches the loss through the residual only; the record handed on (aux terms,
            # statistics) keeps a detached copy: FSDP2 hooks every tensor a sharded block returns, and warns at this
            # one, a view of the layer's output.
            out_BTD = moe_output.output
            return x_BTD + self.residual_dropout(out_BTD), moe_output._replace(output=out_BTD.detach())
        return x_BTD + self.residual_dropout(self.ffn(self.ffn_norm(x_BTD))), None

    def _moe_ffn(self, x_BTD: torch.Tensor, token_mask_BT: torch.Tensor | None) -> MoEOutput:
        return self.ffn(self.ffn_norm(x_BTD), token_mask_BT)


class MTPModule(nn.Module):
    """Multi-token prediction module k (moe/mtp.py): h^k = Norm_k(Block_k(M_k [RMSNorm(h^{k-1}) ; RMSNorm(e)])) with
    e the shared embedding of the token k ahead; the block is built like the last layer (dense or MoE)."""

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__()
        self.hidden_norm = build_norm(config)
        self.embed_norm = build_norm(config)
        self.proj = nn.Linear(2 * config.d_model, config.d_model, bias=False)  # M_k
        self.block = Block(config, config.n_layers + depth - 1)
        self.norm = build_norm(config)

    def forward(
        self,
        h_BND: torch.Tensor,
        e_BND: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        token_mask_BN: torch.Tensor | None,
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        x_BND = self.proj(torch.cat((self.hidden_norm(h_BND), self.embed_norm(e_BND)), dim=-1))
        x_BND, moe_output = self.block(x_BND, rope_cos_sin, mask, None, token_mask_BN)
        return self.norm(x_BND), moe_output


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embed = nn.Embedding(config.max_seq_len, config.d_model) if config.pos_encoding == "learned" else None
        self.embed_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.final_norm = build_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Last, so that a model without MTP draws its initial weights exactly as before MTP existed.
        self.mtp = nn.ModuleList(MTPModule(config, k) for k in range(1, config.mtp.depth + 1)) or None
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def set_activation_checkpointing(self, mode: str) -> None:
        """Recompute in backward: each MoE layer ("moe"), each block ("full"), or nothing ("none"): one of
        moe/checkpointing.py's MODES, which trainer.activation_checkpointing is checked against at start-up."""
        for block in self.blocks:
            block.checkpointing = mode
        for module in self.mtp or ():
            module.block.checkpointing = mode

    def reset_parameters(self) -> None:
        """Every matrix ~ N(0, init_std²), biases 0, norms γ=1 β=0 (MoE layers initialise their own experts).
        Through `Module.apply`, not a loop over `modules()`: under ZeRO-3's partitioned construction (zero.Init)
        the sub-modules' weights are already split among ranks here, and `apply` is the hook that gathers them."""
        self.apply(self._init_module)

    def _init_module(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.init_std)
        elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
            module.reset_parameters()

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids_BT: torch.Tensor | None = None,
        labels_BT: torch.Tensor | None = None,
    ) -> ModelOutput:
        """`attention_mask_BT` marks real tokens (1) vs padding (0); a padding key is never attended by a real
        query and padding tokens are not routed. With `kv_cache`, positions continue after the cached prefix.

        `document_ids_BT` (packed windows, e.g. the loader's `document_ids`) restricts attention to earlier tokens
        of the token's own document: block-diagonal causal. Positions stay absolute window positions: under RoPE
        a score depends only on the distance between query and key, so this equals restarting positions at each
        document; learned position embeddings do see where a document starts in its window.

        `labels_BT` (the window's next tokens, as the LM loss reads them) runs the MTP modules, if the model has
        any, and gives their loss; decoding (`kv_cache`, `generate`) never passes them, so it ignores MTP."""
        B, T = input_ids_BT.shape
        prefix = kv_cache.length if kv_cache is not None else 0
        if prefix + T > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {prefix + T} positions exceeds model.max_seq_len={self.config.max_seq_len}: "
                "shorten the input or raise max_seq_len"
            )
        if kv_cache is not None and attention_mask_BT is not None:
            raise ValueError("padding masks are not supported with a KV cache: decode unpadded prompts")
        if kv_cache is not None and document_ids_BT is not None:
            raise ValueError("document_ids_BT is not supported with a KV cache: decode one document per row")
        if kv_cache is not None and labels_BT is not None:
            raise ValueError("labels_BT is not supported with a KV cache: decoding ignores multi-token prediction")
        if document_ids_BT is not None and document_ids_BT.shape != input_ids_BT.shape:
            raise ValueError(
                f"document_ids_BT of shape {tuple(document_ids_BT.shape)} must match input_ids_BT's "
                f"{tuple(input_ids_BT.shape)}: pass one document id per token"
            )
        positions_T = torch.arange(prefix, prefix + T, device=input_ids_BT.device)

        x_BTD = self.embed_tokens(input_ids_BT, positions_T)
        rope_cos_sin, mask = self.attention_context(
            positions_T, x_BTD.dtype, prefix, attention_mask_BT, document_ids_BT
        )

        moe_outputs: list[MoEOutput | None] = []
        for block in self.blocks:
            x_BTD, moe_output = block(x_BTD, rope_cos_sin, mask, kv_cache, attention_mask_BT)
            moe_outputs.append(moe_output)
        if kv_cache is not None:
            kv_cache.advance(T)

        h_BTD = self.final_norm(x_BTD)
        logits_BTV = self.lm_head(h_BTD)
        output = ModelOutput(logits_BTV, logits_BTV.new_zeros(()), moe_outputs, mtp_loss=logits_BTV.new_zeros(()))
        if self.mtp is not None and labels_BT is not None:
            output.mtp_logits = self._predict_further(h_BTD, labels_BT, positions_T, attention_mask_BT,
                                                      document_ids_BT, moe_outputs)  # fmt: skip
            targets = mtp_targets(labels_BT, document_ids_BT, len(self.mtp))
            output.mtp_loss = mtp_loss(output.mtp_logits, targets, loss_weight=self.config.mtp.loss_weight)
        output.aux_loss = total_aux_loss(moe_outputs, logits_BTV)
        return output

    def _predict_further(
        self,
        h_BTD: torch.Tensor,
        labels_BT: torch.Tensor,
        positions_T: torch.Tensor,
        attention_mask_BT: torch.Tensor | None,
        document_ids_BT: torch.Tensor | None,
        moe_outputs: list[MoEOutput | None],
    ) -> list[torch.Tensor]:
        """Each MTP module k in turn over the N = T - k positions with a token k ahead (moe/mtp.py): its logits, and
        its block's MoEOutput appended to `moe_outputs`. Labels are t_{i+1}, so t_{i+k} = labels[i + k - 1]."""
        T, logits = labels_BT.shape[1], []
        for k, module in enumerate(self.mtp, start=1):
            N = T - k
            token_mask_BN = attention_mask_BT[:, :N] if attention_mask_BT is not None else None
            documents_BN = document_ids_BT[:, :N] if document_ids_BT is not None else None
            # Positions 0 … N-1 rather than the shifted token's k … T-1: RoPE and ALiBi see only distances.
            rope_cos_sin, mask = self.attention_context(positions_T[:N], h_BTD.dtype, 0, token_mask_BN, documents_BN)
            # An ignored label (IGNORE_INDEX) is embedded as token 0: no target reads that position (mtp_targets).
            e_BND = self.embed_tokens(labels_BT[:, k - 1 : T - 1].clamp(min=0), positions_T[k:])
            h_BTD, moe_output = module(h_BTD[:, :N], e_BND, rope_cos_sin, mask, token_mask_BN)
            moe_outputs.append(moe_output)
            logits.append(self.lm_head(h_BTD))
        return logits

    def embed_tokens(self, input_ids_BT: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """X = Embed(ids) (+ learned positions), then dropout: what the first block reads."""
        x_BTD = self.embed(input_ids_BT)
        if self.pos_embed is not None:
            x_BTD = x_BTD + self.pos_embed(positions_T)
        return self.embed_dropout(x_BTD)

    def attention_context(
        self,
        positions_T: torch.Tensor,
        dtype: torch.dtype,
        prefix: int = 0,
        attention_mask_BT: torch.Tensor | None = None,
        document_ids_BT: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """What every block's attention takes besides its input, the same for all layers: RoPE's (cos, sin)
        tables, and the mask (padding, documents, a cached prefix; ALiBi's distance bias), or None for plain
        causal attention. A pipeline stage builds it again from the positions and the micro-batch's ids."""
        rope_cos_sin = None
        if self.config.pos_encoding == "rope":
            rope_cos_sin = rope_tables(positions_T, self.config.rope_dim, self.config.rope_theta, dtype)
        T = positions_T.numel()
        mask = None
        if document_ids_BT is not None:
            document_ids_BT = document_ids_BT.to(positions_T.device)  # batches arrive on the host
        if attention_mask_BT is not None or document_ids_BT is not None or (prefix > 0 and T > 1):
            mask = build_attention_mask(positions_T, prefix + T, attention_mask_BT, document_ids_BT)
        if self.config.pos_encoding == "alibi":  # the distance bias, -inf where `mask` (or causality) forbids
            mask = alibi_bias(positions_T, prefix + T, self.config.n_heads, dtype, mask)
        if mask is not None:
            require_a_visible_key(mask)  # once per forward; the layers trust it
        return rope_cos_sin, mask

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache | LatentKVCache:
        """An empty cache on this model's device and dtype, sized for `max_len` positions (default max_seq_len):
        per-head K and V, or MLA's latents."""
        weight = self.embed.weight
        if self.config.attention == "mla":
            return LatentKVCache(
                n_layers=self.config.n_layers,
                batch_size=batch_size,
                latent_dim=self.config.mla.kv_lora_rank,
                rope_dim=self.config.mla.qk_rope_head_dim,
                max_len=max_len or self.config.max_seq_len,
                dtype=weight.dtype,
                device=weight.device,
            )
        return KVCache(
            n_layers=self.config.n_layers,
            batch_size=batch_size,
            n_kv_heads=self.config.n_kv_heads,
            head_dim=self.config.head_dim,
            max_len=max_len or self.config.max_seq_len,
            dtype=weight.dtype,
            device=weight.device,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids_BT: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Prefill the prompt once, then decode one token per step from the KV cache.

        temperature=0 is greedy; otherwise sample from softmax(logits / temperature), restricted to the top_k
        largest logits when top_k is set. Rows that emitted `eos_id` keep emitting it. Returns (B, T + new).
        """
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
        if top_k is not None and not 1 <= top_k <= self.config.vocab_size:
            raise ValueError(f"top_k={top_k} must lie in [1, vocab_size={self.config.vocab_size}]")
        B, T = input_ids_BT.shape
        total = T + max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(
                f"prompt of {T} tokens + {max_new_tokens} new tokens exceeds model.max_seq_len="
                f"{self.config.max_seq_len}: generate fewer tokens or shorten the prompt"
            )
        was_training = self.training
        self.eval()
        kv_cache = self.new_kv_cache(B, total)
        tokens_BT = input_ids_BT
        step_input_BT = input_ids_BT
        finished_B = torch.zeros(B, dtype=torch.bool, device=input_ids_BT.device)
        for _ in range(max_new_tokens):
            last_logits_BV = self(step_input_BT, kv_cache=kv_cache).logits[:, -1].float()
            next_B = self._select_next_token(last_logits_BV, temperature, top_k, generator)
            if eos_id is not None:
                next_B = torch.where(finished_B, torch.full_like(next_B, eos_id), next_B)
                finished_B |= next_B == eos_id
            step_input_BT = next_B[:, None]
            tokens_BT = torch.cat((tokens_BT, step_input_BT), dim=1)
            if eos_id is not None and bool(finished_B.all()):
                break
        self.train(was_training)
        return tokens_BT

    @staticmethod
    def _select_next_token(
        logits_BV: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
    ) -> torch.Tensor:
        if temperature == 0:
            return logits_BV.argmax(dim=-1)
        logits_BV = logits_BV / temperature
        if top_k is not None:
            kth_largest_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
            logits_BV = logits_BV.masked_fill(logits_BV < kth_largest_B1, float("-inf"))
        probs_BV = F.softmax(logits_BV, dim=-1)
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
