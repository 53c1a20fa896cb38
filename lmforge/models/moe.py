"""The Mixture-of-Experts feed-forward shared by MoE families: a linear router choosing the top-k
of E SwiGLU experts per token (Shazeer et al., 2017; Fedus et al., 2022), the experts' weights
stacked in two tensors, and the Switch Transformer load-balancing loss.

It lives in models/ (not modules/) because family models build it, and models/ imports nothing
above core. Weights, in Meta's names (llama's FeedForward: w1 gate, w3 up, w2 down):
`router.weight` [E, dim], `experts.w13` [E, 2·moe_ffn_dim, dim] (each expert's gate rows then
its up rows: transformers' in-memory `gate_up_proj`) and `experts.w2` [E, dim, moe_ffn_dim].

Two ways to run the experts here (`expert_outputs`), equal up to float rounding:
- the loop: per expert, the tokens routed to it (data-dependent shapes: a host sync per expert;
  the reference, and the CPU's default);
- grouped: the token-expert assignments sorted by expert (argsort), counts and offsets made on
  the device (no host sync), one grouped GEMM per projection (`torch._grouped_mm`) over the
  sorted rows, then the weighted rows added back to their tokens. Where `_grouped_mm` does not
  take the dtype or alignment, each expert's slice of the sorted rows (by the offsets) is
  multiplied on its own: the same permutation, checkable on any device. CUDA's default.

Both paths take optional per-expert low-rank updates (`ExpertAdapters`: LoRA on the stacked
experts, built by lmforge/modules/lora.py): W_e x + scale · B_e (A_e x) for each projection, in
the loop per expert, in the grouped path as two more grouped products over the same sorted rows.

A third way is the inference engine's, for a few tokens (lmforge/generate/kernels/moe.py): two
Triton kernels indexed by the (token, choice) pairs, so that they read only the chosen experts'
rows, with no sort and no host sync. The engine installs it on CUDA (`FusedExperts`, a subclass
of `Experts`) for forwards without autograd of at most `FUSED_PAIRS` token-expert pairs, never
on LoRA's experts; training and everything else run the two above.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


def keeps_fp32(name: str) -> bool:
    """Whether a state-dict tensor stays fp32 when the weights are cast (saved in bf16, loaded
    in bf16): a sparse MLP's selection bias."""
    return name.endswith("feed_forward.expert_bias")


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    norm_topk_prob: bool,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, E] -> (weights [tokens, k] in the logits' dtype, experts [tokens,
    k] int64): softmax in fp32 over the experts, the k largest, renormalized to sum to one when
    `norm_topk_prob` (else the softmax probabilities as they are); the k in no given order.
    `expert_bias` [E] fp32 (DeepSeek-V3's auxiliary-loss-free balancing): the k are those of
    the probabilities plus the bias, their weights still the probabilities alone."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    # unsorted: every use is a sum over the k or counts; on CUDA sorting them is a kernel more
    if expert_bias is None:
        weights, experts = torch.topk(probs, top_k, dim=-1, sorted=False)
    else:
        experts = torch.topk(probs + expert_bias, top_k, dim=-1, sorted=False).indices
        weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


@dataclass
class ExpertAdapters:
    """Per-expert low-rank updates of the stacked weights (LoRA, Hu et al., 2021): expert e's
    projection W_e becomes W_e + scale · B_e A_e, computed as x W_eᵀ + scale · (x A_eᵀ) B_eᵀ."""

    a13: torch.Tensor  # [E, rank, dim]
    b13: torch.Tensor  # [E, 2·ffn_dim, rank]
    a2: torch.Tensor  # [E, rank, ffn_dim]
    b2: torch.Tensor  # [E, dim, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.a13.shape[1]


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I] gate then up -> silu(gate) * up [n, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation: [n, 2I] gate then up -> (up + 1) · gate · σ(alpha · gate)
    [n, I], gate clamped above at `limit`, up to [-limit, limit]."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


@dataclass(frozen=True)
class ExpertBiases:
    """Per-expert biases of both projections (gpt-oss): b13 [E, 2·ffn_dim] (gate then up),
    b2 [E, dim]; with the experts' activation."""

    b13: torch.Tensor
    b2: torch.Tensor
    activation: Callable[[torch.Tensor], torch.Tensor] = _swiglu


def experts_loop(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    lora: ExpertAdapters | None = None,
    biases: ExpertBiases | None = None,
) -> torch.Tensor:
    """The reference: x [tokens, dim] through each token's experts, weighted and summed ->
    [tokens, dim]. One small matmul pair per expert that got tokens (two more per projection
    with `lora`); `biases`: each projection's bias and the activation (else SwiGLU)."""
    out = torch.zeros_like(x)
    activation = biases.activation if biases is not None else _swiglu
    for expert in range(w13.shape[0]):
        token, slot = torch.where(experts == expert)  # [n] each: who chose it, as which choice
        if token.numel() == 0:
            continue
        rows = x[token]  # [n, dim]
        b13, b2 = (None, None) if biases is None else (biases.b13[expert], biases.b2[expert])
        gate_up = F.linear(rows, w13[expert], b13)  # [n, 2I]
        if lora is not None:
            low = F.linear(rows.to(lora.a13.dtype), lora.a13[expert])  # [n, rank]
            gate_up = gate_up + lora.scale * F.linear(low, lora.b13[expert]).to(gate_up.dtype)
        hidden = activation(gate_up)  # [n, I]
        y = F.linear(hidden, w2[expert], b2)  # [n, dim]
        if lora is not None:
            low = F.linear(hidden.to(lora.a2.dtype), lora.a2[expert])  # [n, rank]
            y = y + lora.scale * F.linear(low, lora.b2[expert]).to(y.dtype)
        y = y * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _grouped_mm_fits(rows: torch.Tensor, *widths: int) -> bool:
    """Whether `torch._grouped_mm` takes these operands: bf16 on CUDA (fp32 and bf16 on the
    CPU), and every row width a multiple of 16 bytes."""
    if rows.device.type == "cuda" and rows.dtype != torch.bfloat16:
        return False
    if rows.device.type not in ("cuda", "cpu"):
        return False
    align = 16 // rows.element_size()
    return all(width % align == 0 for width in widths)


def _grouped_linear(
    rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, use_grouped_mm: bool
) -> torch.Tensor:
    """rows [n, in] sorted by expert, expert e's rows ending at ends[e]; weight [E, out, in] ->
    [n, out], each row times its expert's weight."""
    if use_grouped_mm:
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=ends)
    # The same groups one at a time (host syncs: only where _grouped_mm does not fit).
    bounds = [0, *ends.tolist()]
    parts = [
        rows[start:end] @ weight[expert].T
        for expert, (start, end) in enumerate(itertools.pairwise(bounds))
    ]
    return torch.cat(parts)


def _grouped_lora(
    rows: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    ends: torch.Tensor,
    use_grouped_mm: bool,
) -> torch.Tensor:
    """scale · (rows A_eᵀ) B_eᵀ for rows [n, in] sorted by expert: a [E, rank, in], b [E, out,
    rank] -> [n, out], through the same groups as the base product."""
    low = _grouped_linear(rows.to(a.dtype), a, ends, use_grouped_mm)  # [n, rank]
    return scale * _grouped_linear(low, b, ends, use_grouped_mm)


def combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [tokens·k, dim], the assignments' outputs in `order` (sorted by expert) -> [tokens,
    dim]: each token's k outputs weighted by `weights` [tokens, k] and summed in a fixed order,
    the same on any number of tokens (a batched product is not: its kernel follows the batch,
    and expert parallelism would then drift from one process). An index_add_ of the weighted
    rows keeps a second [tokens·k, dim] copy for backward and adds with atomics on CUDA."""
    top_k = weights.shape[1]
    positions = torch.arange(order.numel(), device=order.device)
    inverse = torch.empty_like(order).scatter_(0, order, positions)  # sorted row of assignment a
    per_token = y[inverse].view(-1, top_k, y.shape[-1])  # [tokens, k, dim]
    return (per_token * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def _autocast_operands(x, w13, w2, lora: ExpertAdapters | None):
    """The grouped products' operands in autocast's dtype, as autocast casts a linear's:
    `torch._grouped_mm` is on none of its lists, so the fp32 rows of an autocast step (the
    residual stream; LoRA on one GPU) would miss its dtype and fall back to a product per
    expert, each a host sync."""
    dtype = torch.get_autocast_dtype(x.device.type)
    if lora is not None:
        lora = replace(
            lora, **{name: getattr(lora, name).to(dtype) for name in ("a13", "b13", "a2", "b2")}
        )
    return x.to(dtype), w13.to(dtype), w2.to(dtype), lora


def experts_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    lora: ExpertAdapters | None = None,
    biases: ExpertBiases | None = None,
    *,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """`experts_loop`'s result by sorting the (token, choice) assignments by expert: fixed
    shapes throughout, so no host sync when `torch._grouped_mm` runs it (`use_grouped_mm`
    None: wherever it fits). `lora`'s products run as grouped products too, where the rank
    fits `_grouped_mm`'s alignment and its dtype is the rows' (else per expert slice)."""
    if torch.is_autocast_enabled(x.device.type):
        x, w13, w2, lora = _autocast_operands(x, w13, w2, lora)
    num_experts, top_k = w13.shape[0], experts.shape[1]
    flat = experts.reshape(-1)  # [tokens * k]: assignment a is token a // k's choice a % k
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // top_k  # [tokens * k]: the token of each sorted assignment
    # Counts by scatter-add of ones: bincount's output size would need the max on the host.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)  # [E]: where each expert's rows end
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_fits(x, x.shape[1], w2.shape[2])
    rows = x[token]  # [tokens * k, dim]
    gate_up = _grouped_linear(rows, w13, ends, use_grouped_mm)  # [tokens * k, 2I]
    if lora is not None:
        lora_grouped = (
            use_grouped_mm
            and lora.a13.dtype == x.dtype
            and _grouped_mm_fits(x, x.shape[1], w2.shape[2], lora.rank)
        )
        gate_up = gate_up + _grouped_lora(
            rows, lora.a13, lora.b13, lora.scale, ends, lora_grouped
        ).to(gate_up.dtype)
    if biases is not None:
        sorted_experts = flat[order]  # [tokens * k]: the expert of each sorted row
        gate_up = gate_up + biases.b13[sorted_experts].to(gate_up.dtype)
    hidden = (biases.activation if biases is not None else _swiglu)(gate_up)  # [tokens * k, I]
    y = _grouped_linear(hidden, w2, ends, use_grouped_mm)  # [tokens * k, dim]
    if lora is not None:
        y = y + _grouped_lora(hidden, lora.a2, lora.b2, lora.scale, ends, lora_grouped).to(y.dtype)
    if biases is not None:
        y = y + biases.b2[sorted_experts].to(y.dtype)
    return combine(y, order, weights).to(x.dtype)


def expert_outputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    *,
    grouped: bool | None = None,
    lora: ExpertAdapters | None = None,
    biases: ExpertBiases | None = None,
) -> torch.Tensor:
    """x [tokens, dim] through the experts its router chose: `experts` [tokens, k] indices,
    `weights` [tokens, k] -> [tokens, dim]. `grouped` None: grouped on CUDA, the loop elsewhere.
    `lora`: per-expert low-rank updates added to both projections; `biases`: the projections'
    biases and the experts' activation (gpt-oss)."""
    if grouped is None:
        grouped = x.device.type == "cuda"
    if grouped:
        return experts_grouped(x, w13, w2, weights, experts, lora, biases)
    return experts_loop(x, w13, w2, weights, experts, lora, biases)


class Experts(nn.Module):
    """E SwiGLU experts as two stacked weights: w13 [E, 2·ffn_dim, dim], w2 [E, dim, ffn_dim]."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.grouped: bool | None = None  # `expert_outputs`'s choice; None: by device

    def forward(self, x, weights, experts) -> torch.Tensor:
        return expert_outputs(x, self.w13, self.w2, weights, experts, grouped=self.grouped)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w13, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.w2, std=out_std, a=-3 * out_std, b=3 * out_std)


class BiasedExperts(nn.Module):
    """`Experts` with a bias on each projection and their own activation (gpt-oss): w13 [E,
    2·ffn_dim, dim] (gate rows then up rows), b13 [E, 2·ffn_dim], w2 [E, dim, ffn_dim], b2 [E,
    dim]. A class of its own, not an `Experts`: expert parallelism and the engine's plain fused
    kernels take SwiGLU experts only (LoRA's adapters take both: `is_experts`)."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, activation: Callable) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        self.activation = activation
        self.grouped: bool | None = None  # `expert_outputs`'s choice; None: by device

    def biases(self) -> ExpertBiases:
        return ExpertBiases(self.b13, self.b2, self.activation)

    def forward(self, x, weights, experts) -> torch.Tensor:
        return expert_outputs(
            x, self.w13, self.w2, weights, experts, grouped=self.grouped, biases=self.biases()
        )

    def init_weights(self, std: float, out_std: float) -> None:
        Experts.init_weights(self, std, out_std)
        nn.init.zeros_(self.b13)
        nn.init.zeros_(self.b2)


def is_experts(module: nn.Module) -> bool:
    """Whether `module` is a MoE's trainable stacked experts (plain or biased)."""
    return isinstance(module, (Experts, BiasedExperts))


# e2m1 (MXFP4's elements): the 16 values of a 4-bit float (sign, two exponent bits, one
# mantissa bit), by their bits
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize(
    values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Quantized stacked weights -> [E, rows, cols] in `dtype` (None: the scale's): values [E,
    rows, cols] int8 or float8 e4m3, or 4-bit two a byte ([E, rows, cols / 2] uint8, the low
    nibble the even column), times scale [E, rows, groups] repeated over each group of columns
    (computed in fp32, rounded once). 4-bit values are signed integers, or, where the scales
    are uint8, MXFP4 (OCP microscaling): e2m1 values and a power-of-two scale a group (the
    byte a biased exponent, 127 = 1)."""
    mxfp4 = scale.dtype == torch.uint8
    if values.dtype == torch.uint8:
        nibbles = torch.stack((values & 0xF, values >> 4), dim=-1).flatten(-2)
        if mxfp4:
            table = torch.tensor(FP4_VALUES, device=values.device)
            values = table[nibbles.long()]
        else:
            values = (nibbles.to(torch.int8) ^ 8) - 8  # sign-extended
    if mxfp4:
        scale = torch.ldexp(torch.ones_like(scale, dtype=torch.float32), scale.int() - 127)
    group = values.shape[-1] // scale.shape[-1]
    weight = values.float() * scale.float().repeat_interleave(group, dim=-1)
    return weight.to(dtype or scale.dtype)


QUANTIZED_EXPERTS = ("w13", "w13_scale", "w2", "w2_scale")  # a `QuantizedExperts`' tensors


class QuantizedExperts(nn.Module):
    """`Experts` over weights kept quantized: w13 [E, 2·ffn_dim, dim] and w2 [E, dim, ffn_dim] in
    int8 or float8 e4m3, or 4-bit two a byte (uint8, last dimension halved), with scales
    w13_scale [E, 2·ffn_dim, groups] and w2_scale [E, dim, groups] (a row's groups of columns;
    one group: a scale a row) in the dtype that computes, as a compressed-tensors artifact
    stores them (`lmforge quantize --format compressed-tensors`, llm-compressor); or MXFP4, as
    gpt-oss's hub files (e2m1 two a byte, uint8 scales: a power of two a group of 32, see
    `dequantize`), computing in the input's dtype. `biases` (gpt-oss): each projection's bias
    and the experts' activation, as `BiasedExperts` holds them. The forward dequantizes both
    stacks and runs `expert_outputs`: the memory a model holds is the quantized one; the
    engine's subclass reads the quantized weights directly at decode
    (lmforge/generate/kernels/moe.py)."""

    def __init__(self, w13, w13_scale, w2, w2_scale, biases: ExpertBiases | None = None) -> None:
        super().__init__()
        for name, tensor in zip(QUANTIZED_EXPERTS, (w13, w13_scale, w2, w2_scale), strict=True):
            self.register_buffer(name, tensor)
        self.biased = biases is not None
        if biases is not None:
            self.b13 = nn.Parameter(biases.b13, requires_grad=False)
            self.b2 = nn.Parameter(biases.b2, requires_grad=False)
            self.activation = biases.activation
        self.grouped: bool | None = None  # `expert_outputs`'s choice; None: by device

    def biases(self) -> ExpertBiases | None:
        return BiasedExperts.biases(self) if self.biased else None

    def forward(self, x, weights, experts) -> torch.Tensor:
        w13 = dequantize(self.w13, self.w13_scale, x.dtype)
        w2 = dequantize(self.w2, self.w2_scale, x.dtype)
        return expert_outputs(
            x, w13, w2, weights, experts, grouped=self.grouped, biases=self.biases()
        )


def use_quantized_experts(model: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Make the experts of each sparse MLP whose weights `state` (our names) holds quantized (a
    `w13_scale` beside them) a `QuantizedExperts` of those tensors' shapes and dtypes (with the
    biases of biased experts), on the meta device, for `load_state_dict(assign=True)` to
    fill; returns how many."""
    swapped = 0
    for name, module in model.named_modules():
        prefix = f"{name}.experts."
        if isinstance(module, MoEFeedForward) and f"{prefix}w13_scale" in state:
            meta = [state[prefix + key].to("meta") for key in QUANTIZED_EXPERTS]
            biases = module.experts.biases() if isinstance(module.experts, BiasedExperts) else None
            module.experts = QuantizedExperts(*meta, biases=biases)
            swapped += 1
    return swapped


class MoEFeedForward(nn.Module):
    """A block's sparse MLP: x [b, s, dim] -> [b, s, dim], each token through its top-k experts.

    In training mode, under autograd, the router's logits of the last forward stay in
    `router_logits` [b·s, E] for the load-balancing loss (`load_balancing_loss`) and the experts'
    load (`expert_counts`); in eval mode or under no_grad (a frozen reference, a rollout, DPO's
    reference pass through the policy with its adapters off) nothing is kept, so the logits of
    the forward being trained are not replaced.
    """

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool,
        expert_bias: bool = False,
        router_bias: bool = False,
        experts: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Linear(dim, num_experts, bias=router_bias)
        self.experts = experts if experts is not None else Experts(dim, ffn_dim, num_experts)
        self.router_logits: torch.Tensor | None = None
        # DeepSeek-V3's selection bias [E], fp32 whatever the weights' dtype (steps of ~1e-3
        # would vanish in bf16), saved with the weights; moved by `update_expert_bias`
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts, dtype=torch.float32) if expert_bias else None
        )

    def _apply(self, fn, recurse=True):
        # `.to(bf16)` and the like cast buffers too: the bias stays fp32 (a device move applies)
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [b * s, dim]
        logits = self.router(tokens)  # [b * s, E]
        if self.training and torch.is_grad_enabled():
            self.router_logits = logits
        weights, experts = self.route(logits)
        return self.experts(tokens, weights, experts).view_as(x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` with this block's k, normalization and bias (the engine's subclass: one
        kernel)."""
        return route(
            logits, self.top_k, norm_topk_prob=self.norm_topk_prob, expert_bias=self.expert_bias
        )

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.router.weight, std=std, a=-3 * std, b=3 * std)
        if self.router.bias is not None:
            nn.init.zeros_(self.router.bias)
        self.experts.init_weights(std, out_std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free step (Wang et al., 2024): each expert's bias down
        by `rate` if it got more than the mean of the step's top-k choices `counts` [E], up by
        `rate` if fewer; an expert at the mean keeps its bias."""
        counts = counts.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(rate * torch.sign(counts.mean() - counts))


def _chosen(logits: torch.Tensor, top_k: int, expert_bias: torch.Tensor | None) -> torch.Tensor:
    """The experts `route` chooses from router logits [tokens, E] -> [tokens, k] (without a
    bias the top-k of the logits are those of the softmax)."""
    if expert_bias is None:
        return torch.topk(logits, top_k, dim=-1).indices
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.topk(probs + expert_bias.to(probs.device), top_k, dim=-1).indices


@torch.no_grad()
def expert_counts(
    logits: torch.Tensor, top_k: int, expert_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Router logits [tokens, E] -> [E] fp32: how many of the tokens' top-k choices (`route`'s,
    with `expert_bias` when given) went to each expert. Fixed shapes: no host sync."""
    chosen = _chosen(logits, top_k, expert_bias).reshape(-1)  # [tokens * k]
    counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
    return counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))


def load_balancing_loss(
    router_logits_per_layer: list[torch.Tensor] | tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    expert_biases: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al., 2022, eqs. 4-6), pooled over layers:
    E · Σ_e f_e · P_e, f_e the fraction of top-k assignments that went to expert e and P_e its
    mean router probability, both over every layer's tokens (rows where `attention_mask`
    [b, s] is 0 left out). Each layer's logits are [b·s, E]. Like transformers'
    `load_balancing_loss_func`, f sums the k choices, so a uniform router scores k.
    `expert_biases`: each layer's selection bias (None: none), so f counts `route`'s choices."""
    if expert_biases is None:
        expert_biases = [None] * len(router_logits_per_layer)
    device = router_logits_per_layer[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1, 1).to(device=device, dtype=torch.float32)  # [b*s, 1]
    rows = 0.0
    for logits, bias in zip(router_logits_per_layer, expert_biases, strict=True):
        probs = F.softmax(logits.to(device), dim=-1, dtype=torch.float32)  # [b*s, E]
        chosen = _chosen(logits.to(device), top_k, bias)  # [b*s, k]
        weight = (
            torch.ones_like(chosen, dtype=torch.float32) if mask is None else mask.expand_as(chosen)
        )
        assigned = assigned.scatter_add(0, chosen.reshape(-1), weight.reshape(-1))
        if mask is None:
            prob_sum = prob_sum + probs.sum(dim=0)
            rows = rows + probs.shape[0]
        else:
            prob_sum = prob_sum + (probs * mask).sum(dim=0)
            rows = rows + mask.sum()
    return num_experts * torch.sum((assigned / rows) * (prob_sum / rows))


class SparseModel:
    """What a Mixture-of-Experts family's Transformer adds (a mixin before the dense base): in
    training mode each sparse MLP keeps its last router logits, from which `aux_loss` makes the
    load-balancing loss that the training loop adds to every method's loss, and
    `expert_counts` the experts' load it logs; `update_expert_bias` moves DeepSeek-V3's
    selection bias (train/loop.py asks any model for these by name). The args carry
    num_experts, num_experts_per_tok and router_aux_loss_coef."""

    def _moe_blocks(self) -> dict[int, MoEFeedForward]:
        # (a block may be wrapped for activation checkpointing: modules() sees through it)
        found = {}
        for index, block in self.layers.items():
            for module in block.modules():
                if isinstance(module, MoEFeedForward):
                    found[int(index)] = module
        return found

    def router_logits(self) -> tuple[torch.Tensor, ...]:
        """The last training-mode forward's router logits, one [b·s, E] a sparse layer."""
        return tuple(mlp.router_logits for mlp in self._moe_blocks().values())

    def expert_counts(self) -> dict[int, torch.Tensor]:
        """Sparse layer index -> [E] fp32: the top-k choices each expert got in the last
        training-mode forward (all zeros before one)."""
        a = self.args
        counts = {}
        for layer, mlp in self._moe_blocks().items():
            if mlp.router_logits is None:
                counts[layer] = torch.zeros(a.num_experts, device=mlp.router.weight.device)
            else:
                counts[layer] = expert_counts(
                    mlp.router_logits, a.num_experts_per_tok, mlp.expert_bias
                )
        return counts

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        """DeepSeek-V3's bias step on every sparse layer from the step's top-k counts (sparse
        layer index -> [E], every micro-batch and rank summed; `expert_counts`' keys); nothing
        when `router_bias_update` is 0. The training loop calls it once a step, after the
        update, with the same all-reduced counts on every rank."""
        rate = getattr(self.args, "router_bias_update", 0.0)
        if rate > 0:
            for layer, mlp in self._moe_blocks().items():
                mlp.update_expert_bias(counts[layer], rate)

    def aux_loss(self, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """router_aux_loss_coef × the load-balancing loss of the last training-mode forward
        (`attention_mask` [b, s]: 0 for padding rows)."""
        a = self.args
        logits = self.router_logits()
        if not logits:  # every layer dense (mlp_only_layers): nothing to balance
            return torch.zeros((), device=self.tok_embeddings.weight.device)
        if any(layer is None for layer in logits):
            raise RuntimeError("aux_loss needs a forward in training mode first")
        biases = [mlp.expert_bias for mlp in self._moe_blocks().values()]
        loss = load_balancing_loss(
            logits, a.num_experts, a.num_experts_per_tok, attention_mask, biases
        )
        return a.router_aux_loss_coef * loss
