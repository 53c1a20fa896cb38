"""The Llama 3 transformer: GQA attention with RoPE, RMSNorm, SwiGLU.

Attribute names follow Meta's reference (tok_embeddings, layers.N.attention.wq, feed_forward.w1,
attention_norm, ffn_norm, norm, output) so that parallelism plans and key maps read naturally.
The model knows nothing of parallelism: heads are reshaped with -1 so a tensor-parallel shard
sees its local heads, layers live in a ModuleDict keyed by index, and weights are filled by
`init_weights()` after the model was built on the meta device and materialized.

RoPE uses the "rotate half" layout of Hugging Face checkpoints (the first and second half of each
head form the pairs), so HF weights load without permutation; Meta checkpoints are permuted
once on import (hf.py).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.llama.args import ModelArgs


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama 3.1 scaling when configured."""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band
    # between blends the two smoothly (Llama 3.1 "llama3" rope scaling).
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [batch or 1, seq, head_dim] for integer positions [batch or 1, seq]."""
    angles = positions[..., None].float() * inv_freq.float()  # [b, s, head_dim/2]
    angles = torch.cat((angles, angles), dim=-1)  # [b, s, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, head_dim]; cos/sin [b, s, head_dim] broadcast over heads."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def select_positions(h: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """h [b, s, dim] at the True positions of `at` [b, s] -> [n, dim]. Under sequence
    parallelism h is a DTensor split along s: the selected rows, whole, on every
    tensor-parallel rank (as the output projection's plan expects them: replicated)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(h, DTensor):
        return h[at]
    return DTensor.from_local(h.full_tensor()[at], h.device_mesh, [Replicate()])


def fusable(module: nn.Module, names: list[str]) -> bool:
    """Whether `fuse_linears` can join the linears `names` of `module`: plain, bias-free and
    materialized (not quantized by torchao, sharded or LoRA-wrapped), or inference layers of
    one kind that join themselves (`joinable` / `concatenate`, lmforge/generate/kernels/)."""
    linears = [getattr(module, name, None) for name in names]
    joinable = getattr(linears[0], "joinable", None)
    if joinable is not None:
        return joinable(linears)
    return all(
        type(linear) is nn.Linear
        and linear.bias is None
        and type(linear.weight.data) is torch.Tensor
        and not linear.weight.is_meta
        for linear in linears
    )


def fuse_linears(module: nn.Module, names: list[str], fused_name: str) -> None:
    """Replace the linears `names` of `module` (`fusable`) by one, `fused_name`, whose output
    is theirs concatenated (for inference: one matmul instead of several). The state dict keeps
    the original names: split on `state_dict()`, joined on `load_state_dict()`."""
    linears = [getattr(module, name) for name in names]
    if hasattr(linears[0], "concatenate"):  # an inference layer (see `fusable`)
        for name in names:
            delattr(module, name)
        setattr(module, fused_name, type(linears[0]).concatenate(linears))
        module.fused_sizes = [linear.out_features for linear in linears]
        return
    sizes = [linear.weight.shape[0] for linear in linears]  # a TP shard: its own rows
    weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum(sizes), in]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=linears[0].weight.requires_grad)
    for name in names:
        delattr(module, name)
    setattr(module, fused_name, fused)
    module.fused_sizes = sizes

    def split(_, state_dict, prefix, local_metadata) -> None:
        parts = state_dict.pop(f"{prefix}{fused_name}.weight").split(sizes)
        for name, part in zip(names, parts, strict=True):
            state_dict[f"{prefix}{name}.weight"] = part.clone()  # files refuse shared storage

    def join(_, state_dict, prefix, *args) -> None:
        keys = [f"{prefix}{name}.weight" for name in names]
        if all(key in state_dict for key in keys):
            state_dict[f"{prefix}{fused_name}.weight"] = torch.cat(
                [state_dict.pop(k) for k in keys]
            )

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Grouped-query attention: num_kv_heads key/value heads shared by num_heads query heads.

    qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3); Llama has none.
    bias: the four projections add a bias (gpt-oss); Llama's and Qwen3's have none.
    """

    def __init__(self, args: ModelArgs, *, qk_norm: bool = False, bias: bool = False) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.num_groups = args.num_heads // args.num_kv_heads  # query heads per kv head
        self.wq = nn.Linear(args.dim, args.q_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.kv_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.kv_dim, bias=bias)
        self.wo = nn.Linear(args.q_dim, args.dim, bias=bias)
        self.wqkv: nn.Linear | None = None  # wq, wk, wv as one (fuse_projections)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        kv_cache=None,
    ) -> torch.Tensor:
        return self.wo(self.attend(*self.project(x), cos, sin, attn_mask, kv_cache))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, dim] -> q [b, s, q_dim], k and v [b, s, kv_dim]."""
        if self.wqkv is None:
            return self.wq(x), self.wk(x), self.wv(x)
        return self.wqkv(x).split(self.fused_sizes, dim=-1)

    def attend(self, q, k, v, cos, sin, attn_mask=None, kv_cache=None) -> torch.Tensor:
        """Attention of projected q, k, v (`project`) -> [b, s, heads * hd], before `wo`."""
        batch, seq, _ = q.shape
        q = q.view(batch, seq, -1, self.head_dim)  # [b, s, heads, hd]
        k = k.view(batch, seq, -1, self.head_dim)  # [b, s, kv_heads, hd]
        v = v.view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:  # per head: the norm runs over head_dim
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # [b, kv_heads, cache_len, hd]
        out = self.scores(q, k, v, attn_mask)
        return out.transpose(1, 2).reshape(batch, seq, -1)  # [b, s, heads * hd]

    def scores(self, q, k, v, attn_mask=None) -> torch.Tensor:
        """q [b, heads, s, hd], k and v [b, kv_heads, keys, hd] -> [b, heads, s, hd]: causal,
        or as `attn_mask` allows (a family with other attention overrides this)."""
        # enable_gqa: each kv head serves its group of query heads without being copied.
        gqa = self.num_groups > 1
        if attn_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.wo.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.q_norm is not None:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer, 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w13: nn.Linear | None = None  # w1 and w3 as one (fuse_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is None:
            gate, up = self.w1(x), self.w3(x)
        else:
            gate, up = self.w13(x).split(self.fused_sizes, dim=-1)
        return self.w2(F.silu(gate) * up)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.w1, self.w3):
            nn.init.trunc_normal_(linear.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.w2.weight, std=out_std, a=-3 * out_std, b=3 * out_std)


class TransformerBlock(nn.Module):
    """attention: the block's attention (an `Attention`, or a family's subclass of it).
    feed_forward: the block's MLP (default Llama's `FeedForward`; a MoE family passes its
    sparse one: any module x [b, s, dim] -> [b, s, dim] with `init_weights(std, out_std)`)."""

    def __init__(
        self, args: ModelArgs, *, attention: Attention, feed_forward: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(args)

    def forward(self, x, cos, sin, attn_mask=None, kv_cache=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, attn_mask, kv_cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)


class Transformer(nn.Module):
    """tokens [batch, seq] (int64) -> logits [batch, seq, vocab]."""

    qk_norm: ClassVar[bool] = False  # a family whose attention norms q and k sets it

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    args, attention=self.block_attention(i), feed_forward=self.block_feed_forward(i)
                )
                for i in range(args.num_layers)
            }
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", self.rope_frequencies(), persistent=False)

    def rope_frequencies(self) -> torch.Tensor:
        """RoPE's inverse frequencies [head_dim // 2] (a family with another scaling overrides
        it, and `rope_cos_sin`)."""
        return rope_inv_freq(self.args)

    def rope_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [b or 1, s, head_dim] of `positions` [b or 1, s]."""
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def block_attention(self, layer: int) -> Attention:
        """Block `layer`'s attention: Llama's (with q/k head norms where the family sets
        `qk_norm`) in every block."""
        return Attention(self.args, qk_norm=self.qk_norm)

    def block_feed_forward(self, layer: int) -> nn.Module:
        """Block `layer`'s MLP: Llama's SwiGLU in every block (a MoE family overrides it)."""
        return FeedForward(self.args)

    def tie_weights(self) -> None:
        """Share the input table with the output projection (again: `to_empty` unties them)."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def fuse_projections(self) -> bool:
        """For inference: wq/wk/wv and w1/w3 of every block become one matmul each (batch-1
        decoding is a chain of small matmuls; fewer, larger ones run faster). The state dict
        keeps Meta's names. Returns whether the model is fused: False (nothing changed) unless
        every block's weights are plain tensors or inference layers that join themselves
        (the engine's quantized kernels); torchao-quantized, sharded and LoRA models stay as
        they are."""
        # (module, its linears, their fused name); a block's MLP that is not `FeedForward` (a
        # MoE's experts are already stacked) keeps its own.
        groups = [(block.attention, ["wq", "wk", "wv"], "wqkv") for block in self.layers.values()]
        groups += [
            (block.feed_forward, ["w1", "w3"], "w13")
            for block in self.layers.values()
            if isinstance(block.feed_forward, FeedForward)
        ]
        if all(getattr(module, fused) is not None for module, _, fused in groups):
            return True  # already fused
        if not all(fusable(module, names) for module, names, _ in groups):
            return False
        for module, names, fused in groups:
            fuse_linears(module, names, fused)
        return True

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute non-persistent buffers (needed after `to_empty` from the meta device)."""
        self.inv_freq = self.rope_frequencies().to(device or self.inv_freq.device)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Fresh weights: truncated normal std 0.02, residual output projections scaled by
        1/sqrt(2·layers) (GPT-2), norms at one."""
        self.init_buffers()
        out_std = std / math.sqrt(2 * self.args.num_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for block in self.layers.values():
            block.init_weights(std, out_std)
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_caches=None,
        return_hidden: bool = False,
        labels: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args:
        tokens: [b, s] token ids.
        positions: [b or 1, s] RoPE positions (default 0..s-1).
        attn_mask: optional bool mask broadcastable to [b, heads, s, kv_len], True = attend
            (per-document masking, decoding against a cache); default is causal.
        kv_caches: optional per-layer caches (generation), indexable by layer index.
        return_hidden: return the final normed hidden states [b, s, dim] instead of logits
            (for losses that fuse the output projection).
        labels: [b, s] next-token ids: return the sum of the cross entropy over labels !=
            IGNORE_INDEX instead of logits, the output projection and the loss fused on a GPU
            (`output_cross_entropy`: the logits' gradient is made in the forward).
        logits_at: bool [b, s]: the logits (or hidden states) of those positions only ->
            [n, vocab] in row-major order (GRPO's completion tokens: the output projection
            skips the prompts).
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        h = self.tok_embeddings(tokens)  # [b, s, dim]
        cos, sin = self.rope_cos_sin(positions, h.dtype)
        for index, block in self.layers.items():
            cache = kv_caches[int(index)] if kv_caches is not None else None
            h = block(h, cos, sin, attn_mask, cache)
        h = self.norm(h)
        if logits_at is not None:
            h = select_positions(h, logits_at)  # [n, dim]
        if labels is not None:
            from lmforge.modules.cross_entropy import output_cross_entropy  # imports Triton

            return output_cross_entropy(h, self.output, labels)
        return h if return_hidden else self.output(h)
