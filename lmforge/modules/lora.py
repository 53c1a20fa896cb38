"""LoRA as a module swap, PEFT-compatible adapter files, merging, and QLoRA's NF4 base.

LoRA (Hu et al., 2021, https://arxiv.org/abs/2106.09685) freezes a linear layer's weight W and
learns a low-rank update: y = x Wᵀ + (alpha / rank) · B(A(dropout(x))), A [rank, in] and
B [out, rank], with B = 0 at the start so the model is unchanged until it trains.
`apply_lora` swaps the targeted `nn.Linear`s of a model for `LoRALinear`s in place (on the meta
device too, before `parallelize()`); the frozen weight keeps its name `weight`, so base
checkpoints load into the swapped model unchanged. `disable_adapters` switches every adapter
off: DPO's reference model for free. `merge_lora` folds the updates into plain linears again.

QLoRA (Dettmers et al., 2023, https://arxiv.org/abs/2305.14314) stores the frozen weights as
4-bit NormalFloat with double-quantized scales (torchao's `NF4Tensor`; `quantize_base_nf4`)
while the adapters train in bf16/fp32.

Mixture-of-Experts models: target "experts" swaps each stacked `Experts` (models/moe.py; gpt-oss's
`BiasedExperts` with their frozen biases) for a `LoRAExperts`, with per-expert adapters of both projections, A [E, rank, in] and B [E, out, rank],
run inside the expert computation (models/moe.py's `ExpertAdapters`: per expert in the loop path,
as extra grouped products in the grouped one); target "router" makes the router a `LoRALinear`
(frozen by default, like every base weight).

Adapters are saved and loaded in the layout of Hugging Face PEFT (`adapter_config.json` +
`adapter_model.safetensors`, keys like
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so `peft.PeftModel` loads
ours onto transformers' model and ours loads PEFT's LoRA adapters for Llama. Experts and routers
are not `nn.Linear`s in transformers: PEFT adapts them through `target_parameters`
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, `mlp.gate.weight`; its `ParamWrapper`):
lora_A [rank·E, in] expert-major rows, lora_B [out, rank·E] rank-major columns, and two wrapped
parameters of one module nested (the first one, gate_up_proj, under `base_layer.`); lora_B's
rows follow transformers' output order (gpt-oss's gate and up alternate: the family's
`hf_output_rows`), and PEFT reads gpt-oss's transposed stacks by their `is_transposed`. PEFT allows
no dropout there, so neither does lmforge on those targets. What PEFT cannot load is refused when
the adapters are applied: gate / up / down on the dense MLP layers of a MoE model (PEFT on
transformers 5 rewrites those target_modules into the experts' parameters), and one expert
projection without the other.

Everything here is plain module structure (no custom autograd besides torchao's NF4 linear), so
FSDP2's `fully_shard` wraps blocks that contain `LoRALinear`s like any others.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveFloat, PositiveInt, field_validator
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from lmforge import models
from lmforge.config import Section
from lmforge.errors import ConfigError, ModelFormatError
from lmforge.models import moe

# Target name -> our module attribute (Meta names) and the Hugging Face module name.
TARGET_MODULES = {
    "q": "wq",
    "k": "wk",
    "v": "wv",
    "o": "wo",
    "gate": "w1",
    "up": "w3",
    "down": "w2",
    "output": "output",
    "experts": "experts",  # a MoE's stacked experts (both projections): `LoRAExperts`
    "router": "router",  # a MoE's router linear
}
HF_TARGET_NAMES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
    "output": "lm_head",
}
# Targets transformers holds as parameters, not nn.Linears: PEFT's `target_parameters`.
HF_TARGET_PARAMETERS = {
    "experts": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    "router": ("mlp.gate.weight",),
}
HF_PARAMETER_ALIASES = {"mlp.router.weight": "mlp.gate.weight"}  # gpt-oss's router
PARAMETER_TARGETS = tuple(HF_TARGET_PARAMETERS)
DEFAULT_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's module name
NF4_BLOCK_SIZE = 64  # weights per 4-bit block (one scale each), as in the QLoRA paper
NF4_SCALER_BLOCK_SIZE = 256  # scales per double-quantization block


class LoRASection(Section):
    """LoRA / QLoRA adapters on the model's linear layers (Hu et al., 2021; Dettmers et al.,
    2023)."""

    enabled: bool = False
    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    """The update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    targets: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Which linears get adapters: q, k, v, o (attention), gate, up, down (MLP), output,
    experts (a MoE's stacked experts, both projections), router (a MoE's router)."""
    quantize_base: Literal["none", "nf4"] = "none"
    """nf4: store the frozen base weights of the adapted linears (and adapted experts) in 4-bit
    NormalFloat (QLoRA)."""
    base_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the frozen linear weights (embeddings, norms and adapters stay float32): auto
    is bfloat16 when training in bf16 mixed precision (the matmuls read bf16 weights anyway:
    half the memory, the same forward), else float32."""

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str]) -> list[str]:
        problem = _targets_problem(targets)
        if problem:
            raise ValueError(problem)  # load_config names the key and where it was set
        return targets


def _targets_problem(targets) -> str | None:
    bad = [t for t in targets if t not in TARGET_MODULES]
    if bad or not targets:
        what = f"unknown LoRA target(s) {', '.join(map(repr, bad))}" if bad else "no LoRA targets"
        return f"{what}; allowed: {', '.join(TARGET_MODULES)}"
    return None


MLP_TARGETS = ("gate", "up", "down")


def targets_for(targets, *, moe_model: bool) -> list[str]:
    """The targets as applied to a model. On a Mixture-of-Experts model the MLP targets gate, up
    and down (the default's) mean its experts, as PEFT reads gate_proj / up_proj / down_proj of a
    MoE model (its dense MLP layers among sparse ones, if any, then take no adapter: PEFT could
    not load them); one or two of the three alone cannot be (an expert adapter covers both
    stacked projections)."""
    named = [t for t in MLP_TARGETS if t in targets]
    if not moe_model or not named:
        return list(targets)
    if len(named) < len(MLP_TARGETS):
        raise ConfigError(
            f"LoRA target(s) {', '.join(named)} without the other MLP projections on a "
            "Mixture-of-Experts model: its MLPs are experts, adapted together (gate, up and down "
            'as one target); use "experts", e.g. lora.targets = ["q", "k", "v", "o", "experts"]'
        )
    chosen = {t for t in targets if t not in MLP_TARGETS} | {"experts"}
    return sorted(chosen, key=list(TARGET_MODULES).index)


def _nf4_tensor_type():
    """torchao's NF4Tensor class, or None when torchao was never imported (then no tensor can
    be one)."""
    module = sys.modules.get(_NF4_MODULE)
    return module.NF4Tensor if module is not None else None


def is_nf4(tensor: torch.Tensor) -> bool:
    nf4_type = _nf4_tensor_type()
    return nf4_type is not None and isinstance(tensor, nf4_type)


def _import_nf4():
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        raise ConfigError(
            'lora.quantize_base = "nf4" needs torchao >= 0.18: pip install "lmforge[quant]"'
        ) from None
    return nf4_tensor


def _dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the base weight (dequantized when it is stored as NF4)."""
    return weight.get_original_weight() if is_nf4(weight) else weight.detach()


def _frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if is_nf4(weight):
        out = _import_nf4().linear_nf4(x, weight)  # dequantizes to x's dtype, no weight grad
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (Hu et al., 2021).

    Built from the `nn.Linear` it replaces, whose parameters it adopts under the same names
    (`weight`, `bias`), so state-dict keys are unchanged. Adds `lora_a` (in -> rank) and
    `lora_b` (rank -> out) as bias-free `nn.Linear`s of the base weight's dtype and device
    (meta included: call `reset_lora_parameters()` after `to_empty`).

        forward(x) = base(x) + (alpha / rank) · lora_b(lora_a(dropout(x)))   unless `disabled`
    """

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if rank <= 0:
            raise ConfigError(f"LoRA rank={rank} must be > 0")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.weight = base.weight  # the same Parameter: tied or loaded weights stay as they are
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        factory = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.lora_a = nn.Linear(self.in_features, rank, bias=False, **factory)  # A [rank, in]
        self.lora_b = nn.Linear(rank, self.out_features, bias=False, **factory)  # B [out, rank]
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False
        if not self.weight.is_meta:
            self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """A: Kaiming-uniform (PEFT's and nn.Linear's default), B: zeros (no change at start)."""
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _frozen_linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        update = self.lora_b(self.lora_a(self.dropout(x).to(self.lora_a.weight.dtype)))
        return out + self.scale * update.to(out.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / rank) · B A [out, in], computed in fp32, returned in the base dtype."""
        base = _dense_weight(self.weight)
        delta = self.lora_b.weight.float() @ self.lora_a.weight.float()  # [out, in]
        return (base.float() + self.scale * delta).to(base.dtype)

    def merged_module(self) -> nn.Linear:
        """A frozen `nn.Linear` holding `merged_weight()` (and the bias)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(self.merged_weight(), requires_grad=False)
        linear.bias = self.bias
        return linear

    def quantize_base(self, block_size: int, name: str) -> None:
        if not is_nf4(self.weight):
            nf4 = _to_nf4(self.weight, block_size, f"{name}.weight")
            self.weight = nn.Parameter(nf4, requires_grad=False)

    base_names = ("weight",)

    def extra_repr(self) -> str:
        quantized = ", nf4" if is_nf4(self.weight) else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}, alpha={self.alpha:g}{quantized}"
        )


class NF4Linear(nn.Module):
    """A frozen bias-free linear whose weight is stored as NF4 (QLoRA's other frozen layers)."""

    def __init__(self, base: nn.Linear, *, block_size: int = NF4_BLOCK_SIZE) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = nn.Parameter(_to_nf4(base.weight, block_size), requires_grad=False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _frozen_linear(x, self.weight, self.bias)


def _to_nf4(
    weight: torch.Tensor, block_size: int, name: str = "weight", *, meta_ok: bool = False
) -> torch.Tensor:
    if weight.is_meta and not meta_ok:
        raise ValueError(
            f"{name}: NF4 quantization needs real weights; quantize after loading them"
        )
    numel = weight.numel()
    if numel % block_size:
        raise ConfigError(
            f"cannot store {name} {tuple(weight.shape)} as NF4: its {numel} elements are not a "
            f"multiple of the block size {block_size}"
        )
    # Double quantization groups the per-block scales; real Llama shapes take the paper's 256,
    # small ones (tests, tiny models) the largest group that divides their number of blocks.
    scaler_block_size = math.gcd(NF4_SCALER_BLOCK_SIZE, numel // block_size)
    return _import_nf4().to_nf4(weight.detach().contiguous(), block_size, scaler_block_size)


class LoRAExperts(nn.Module):
    """A MoE's stacked experts (models/moe.py's `Experts`, or `BiasedExperts` with their biases
    and activation: gpt-oss), frozen, plus a trainable low-rank update per expert and projection
    (Hu et al., 2021):

        W13_e + (alpha / rank) · lora_b.w13[e] @ lora_a.w13[e]   lora_a.w13 [E, rank, dim],
                                                                 lora_b.w13 [E, 2·ffn_dim, rank]
        W2_e  + (alpha / rank) · lora_b.w2[e] @ lora_a.w2[e]     lora_a.w2 [E, rank, ffn_dim],
                                                                 lora_b.w2 [E, dim, rank]

    applied inside the expert computation (`moe.expert_outputs`'s `lora`), never by forming
    W + ΔW. Adopts `w13` and `w2` (and `b13`, `b2`) under their names, so base state dicts load
    unchanged.

    QLoRA (`quantize_base`): each stacked weight is stored as NF4 over its [E·out, in] rows
    (torchao's NF4Tensor holds at most 2-D; a 64-weight block never straddles two experts when
    out·in is a multiple of 64, as in every real shape). The forward dequantizes a layer's
    stack to its stored dtype, and, under autograd, runs the experts under activation
    checkpointing, so the dequantized copy is not kept for backward: the memory cost is one
    layer's experts in bf16 at a time, the speed cost a second dequantization and expert
    forward per layer in backward (`_grouped_mm` reads plain bf16, never NF4).
    """

    base_names = ("w13", "w2")

    def __init__(self, base: moe.Experts | moe.BiasedExperts, *, rank: int, alpha: float):
        super().__init__()
        if rank <= 0:
            raise ConfigError(f"LoRA rank={rank} must be > 0")
        num_experts, two_ffn, dim = base.w13.shape
        self.shapes = {"w13": tuple(base.w13.shape), "w2": tuple(base.w2.shape)}
        self.num_experts, self.dim, self.ffn_dim = num_experts, dim, two_ffn // 2
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.base_class = type(base)
        self.w13, self.w2 = base.w13, base.w2
        self.biased = isinstance(base, moe.BiasedExperts)
        if self.biased:
            self.b13, self.b2, self.activation = base.b13, base.b2, base.activation
        for param in self.parameters():
            param.requires_grad_(False)
        self.grouped = base.grouped
        factory = {"device": self.w13.device, "dtype": self.w13.dtype}

        def stack(*shape):
            return nn.Parameter(torch.empty(num_experts, *shape, **factory))

        self.lora_a = nn.ParameterDict({"w13": stack(rank, dim), "w2": stack(rank, self.ffn_dim)})
        self.lora_b = nn.ParameterDict({"w13": stack(two_ffn, rank), "w2": stack(dim, rank)})
        self.disabled = False
        if not self.w13.is_meta:
            self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """A: nn.Linear's (and PEFT's) Kaiming-uniform per expert, U(±1/√in); B: zeros."""
        for name, a in self.lora_a.items():
            bound = 1 / math.sqrt(a.shape[-1])
            nn.init.uniform_(a, -bound, bound)
            nn.init.zeros_(self.lora_b[name])

    def init_weights(self, std: float, out_std: float) -> None:
        """Fresh base experts (as `moe.Experts` draws them: LoRA on a model trained from
        scratch) and fresh adapters."""
        self.base_class.init_weights(self, std, out_std)
        self.reset_lora_parameters()

    def base_weight(self, name: str) -> torch.Tensor:
        """The stacked base weight `name` (w13 / w2) [E, out, in], dequantized if NF4."""
        weight = getattr(self, name)
        if is_nf4(weight):
            return weight.get_original_weight().view(self.shapes[name])
        return weight

    def adapters(self) -> moe.ExpertAdapters | None:
        if self.disabled:
            return None
        a, b = self.lora_a, self.lora_b
        return moe.ExpertAdapters(a["w13"], b["w13"], a["w2"], b["w2"], self.scale)

    def _experts(self, x, weights, experts) -> torch.Tensor:
        w13, w2 = self.base_weight("w13"), self.base_weight("w2")
        biases = moe.BiasedExperts.biases(self) if self.biased else None
        return moe.expert_outputs(
            x, w13, w2, weights, experts, grouped=self.grouped, lora=self.adapters(), biases=biases
        )

    def forward(self, x, weights, experts) -> torch.Tensor:
        if torch.is_grad_enabled() and is_nf4(self.w13):  # see the class docstring
            return torch.utils.checkpoint.checkpoint(
                self._experts, x, weights, experts, use_reentrant=False
            )
        return self._experts(x, weights, experts)

    @torch.no_grad()
    def merged_weight(self, name: str) -> torch.Tensor:
        """W_e + (alpha / rank) · B_e A_e for every expert [E, out, in], computed in fp32,
        returned in the base dtype."""
        base = self.base_weight(name).detach()
        delta = torch.bmm(self.lora_b[name].float(), self.lora_a[name].float())  # [E, out, in]
        return (base.float() + self.scale * delta).to(base.dtype)

    def merged_module(self) -> moe.Experts | moe.BiasedExperts:
        """A frozen `Experts` (or `BiasedExperts`) holding the merged stacks."""
        with torch.device("meta"):
            if self.biased:
                merged = moe.BiasedExperts(
                    self.dim, self.ffn_dim, self.num_experts, self.activation
                )
                merged.b13, merged.b2 = self.b13, self.b2
            else:
                merged = moe.Experts(self.dim, self.ffn_dim, self.num_experts)
        for name in self.base_names:
            setattr(merged, name, nn.Parameter(self.merged_weight(name), requires_grad=False))
        merged.grouped = self.grouped
        return merged

    def quantize_base(self, block_size: int, name: str) -> None:
        for param_name in self.base_names:
            weight = getattr(self, param_name)
            if not is_nf4(weight):
                rows = weight.reshape(-1, weight.shape[-1])  # [E·out, in]: NF4 holds 2-D
                nf4 = _to_nf4(rows, block_size, f"{name}.{param_name}")
                setattr(self, param_name, nn.Parameter(nf4, requires_grad=False))

    def extra_repr(self) -> str:
        quantized = ", nf4" if is_nf4(self.w13) else ""
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, ffn_dim={self.ffn_dim}, "
            f"rank={self.rank}, alpha={self.alpha:g}{quantized}"
        )


def _stacked_to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our A [E, r, in], B [E, out, r] -> PEFT's ParamWrapper lora_A [E·r, in] (expert-major
    rows) and lora_B [out, r·E] (column j·E + e is B_e's column j), for an [E, out, in] weight
    (transformers' non-transposed layout, swapped in/out in PEFT's terms)."""
    num_experts, rank, _ = a.shape
    peft_a = a.reshape(num_experts * rank, a.shape[-1])
    peft_b = b.permute(1, 2, 0).reshape(b.shape[1], rank * num_experts)
    return peft_a.contiguous(), peft_b.contiguous()


def _stacked_from_peft(
    peft_a: torch.Tensor, peft_b: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `_stacked_to_peft`."""
    a = peft_a.reshape(num_experts, -1, peft_a.shape[-1])  # [E, r, in]
    b = peft_b.reshape(peft_b.shape[0], -1, num_experts).permute(2, 0, 1)  # [E, out, r]
    return a, b


# ---- applying, inspecting, merging -------------------------------------------------------

AdapterModule = LoRALinear | LoRAExperts


def lora_modules(model: nn.Module) -> dict[str, AdapterModule]:
    """Every adapted module of `model` (`LoRALinear`, `LoRAExperts`) by module name (e.g.
    'layers.0.attention.wq', 'layers.1.feed_forward.experts')."""
    return {
        name: m for name, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))
    }


def lora_base_names(model: nn.Module) -> list[str]:
    """State-dict names of the adapted (frozen) base weights, without activation
    checkpointing's prefix: 'layers.0.attention.wq.weight', 'layers.1.feed_forward.experts.w13'."""
    return [
        f"{name.replace(WRAPPER_PREFIX, '')}.{base}"
        for name, module in lora_modules(model).items()
        for base in module.base_names
    ]


def nf4_summary(model: nn.Module) -> str:
    """Which frozen weights are NF4 (layer indices folded into '*'), and the stacked experts
    left unquantized because they carry no adapters: what QLoRA's log line says."""

    def fold(names):
        return sorted({re.sub(r"layers\.\d+\.", "layers.*.", n) for n in names})

    quantized = [
        name.replace(WRAPPER_PREFIX, "")
        for name, param in model.named_parameters()
        if is_nf4(param)
    ]
    plain_experts = [
        f"{name.replace(WRAPPER_PREFIX, '')}.{p}"
        for name, m in model.named_modules()
        if moe.is_experts(m)
        for p in ("w13", "w2")
    ]
    text = f"NF4: {', '.join(fold(quantized)) or 'nothing'}"
    if plain_experts:
        dtype = str(model.get_submodule(plain_experts[0].rsplit(".", 1)[0]).w13.dtype)
        text += (
            f"; stacked experts without adapters stay in {dtype.removeprefix('torch.')} "
            f"({', '.join(fold(plain_experts))}; add 'experts' to lora.targets to store them "
            "in NF4)"
        )
    return text


def _is_lora_parameter(name: str) -> bool:
    return ".lora_a." in f".{name}" or ".lora_b." in f".{name}"


def apply_lora(
    model: nn.Module,
    *,
    targets: list[str] | tuple[str, ...],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    base_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Swap the targeted linears of a `Transformer` (any family) for `LoRALinear`s (a MoE's
    stacked experts for `LoRAExperts`), in place, and freeze every other parameter; with
    `base_dtype`, store the frozen linear weights in it (`frozen_linears`; the adapters keep the
    model's dtype). Works on a meta-device model (adapters are then initialized by
    `reset_lora_parameters(model)` after `to_empty`). Returns `model`.

    targets: names from q, k, v, o, gate, up, down, output, experts, router (Meta's wq wk wv wo
    w1 w3 w2 output, a MoE's experts and router).
    """
    problem = _targets_problem(targets)
    if problem:
        raise ConfigError(problem)
    targets = targets_for(targets, moe_model=any(moe.is_experts(m) for m in model.modules()))
    on_parameters = [t for t in targets if t in PARAMETER_TARGETS]
    if dropout > 0 and on_parameters:
        raise ConfigError(
            f"lora.dropout = {dropout} with LoRA target(s) {', '.join(on_parameters)}: adapters "
            "on experts and routers take no dropout (PEFT's target_parameters cannot represent "
            "it); set lora.dropout = 0 or drop those targets"
        )
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters; merge or rebuild it first")
    args = getattr(model, "args", None)
    if "output" in targets and getattr(args, "tie_embeddings", False):
        raise ConfigError(
            "LoRA target 'output' is not supported with tied embeddings (the output projection "
            "is the input embedding table); drop 'output' from the targets"
        )
    attributes = {TARGET_MODULES[t] for t in targets}
    swaps = []
    for name, module in model.named_modules():
        attribute = name.rsplit(".", 1)[-1]
        is_experts = moe.is_experts(module)
        if not (isinstance(module, nn.Linear) or is_experts) or attribute not in attributes:
            continue
        if is_experts != (attribute == TARGET_MODULES["experts"]):
            continue
        if attribute == "output" and name != "output":
            continue  # only the model's output head, no nested module of that name
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        swaps.append((parent, attribute))
    if not swaps:
        raise ConfigError(f"no linear layer of the model matches the LoRA targets {list(targets)}")
    matched = {attribute for _, attribute in swaps}
    unmatched = [t for t in targets if TARGET_MODULES[t] not in matched]
    if unmatched:  # rather than adapt the others and leave these unsaid
        found = ", ".join(t for t in targets if t not in unmatched)
        raise ConfigError(
            f"LoRA target(s) {', '.join(unmatched)} name no module of this model (of the "
            f"targets, it has {found}); drop them from lora.targets"
        )
    for parent, attribute in swaps:
        base = getattr(parent, attribute)
        if moe.is_experts(base):
            adapted = LoRAExperts(base, rank=rank, alpha=alpha)
        else:
            adapted = LoRALinear(base, rank=rank, alpha=alpha, dropout=dropout)
        setattr(parent, attribute, adapted)
    for name, param in model.named_parameters():
        param.requires_grad_(_is_lora_parameter(name))
    if base_dtype is not None:
        for module in frozen_linears(model):
            for name, param in module.named_parameters(recurse=False):
                setattr(module, name, nn.Parameter(param.to(base_dtype), requires_grad=False))
    return model


def frozen_dtype(lora: LoRASection, bf16_training: bool) -> torch.dtype | None:
    """What `lora.base_dtype` asks for when training is (or is not) in bf16 mixed precision;
    None: leave the model's dtype."""
    if lora.base_dtype == "bfloat16" or (lora.base_dtype == "auto" and bf16_training):
        return torch.bfloat16
    return None


def frozen_linears(model: nn.Module) -> list[nn.Module]:
    """The LoRALinears' and LoRAExperts' bases, the experts LoRA does not adapt and every other
    frozen linear layer whose weight is not shared with another module (a tied output projection
    is the embedding table)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    adapters = {id(sub) for m in lora_modules(model).values() for sub in (m.lora_a, m.lora_b)}
    found = []
    for m in model.modules():
        if (
            isinstance(m, LoRAExperts)
            or (moe.is_experts(m) and not m.w13.requires_grad)
            or (
                isinstance(m, (nn.Linear, LoRALinear))
                and id(m) not in adapters
                and not m.weight.requires_grad
                and owners[id(m.weight)] == 1
            )
        ):
            found.append(m)
    return found


def reset_lora_parameters(model: nn.Module) -> None:
    """Initialize every adapter of `model` (after a meta-device model was materialized)."""
    for module in lora_modules(model).values():
        module.reset_lora_parameters()


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require grad (after `apply_lora`: the adapters only)."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only, by our names ('layers.0.attention.wq.lora_a.weight')."""
    state = {}
    for name, module in lora_modules(model).items():
        for param_name, param in module.named_parameters():
            if _is_lora_parameter(param_name):
                state[f"{name}.{param_name}"] = param.detach()
    return state


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` as its frozen base inside the block (e.g. DPO's reference model)."""
    modules = list(lora_modules(model).values())
    previous = [m.disabled for m in modules]
    for module in modules:
        module.disabled = True
    try:
        yield model
    finally:
        for module, was_disabled in zip(modules, previous):
            module.disabled = was_disabled


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base weight and swap the `LoRALinear` back for an
    `nn.Linear` (a `LoRAExperts` for an `Experts`: W_e += scale · B_e A_e), frozen like the rest
    of a LoRA model, in place. NF4 bases are dequantized. Returns `model`."""
    for name, module in lora_modules(model).items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, module.merged_module())
    return model


# ---- QLoRA ----------------------------------------------------------------------------------


@torch.no_grad()
def quantize_base_nf4(
    model: nn.Module, *, include_frozen_linears: bool = False, block_size: int = NF4_BLOCK_SIZE
) -> nn.Module:
    """Store the frozen base weight of every `LoRALinear` (and the stacked weights of every
    `LoRAExperts`) as NF4 (QLoRA), in place; with `include_frozen_linears`, also swap every
    other frozen `nn.Linear` (not sharing its weight with an embedding) for an `NF4Linear`.
    Call after the base weights are loaded. The adapters keep their dtype. `nf4_summary` says
    what was quantized. Returns `model`."""
    for name, module in lora_modules(model).items():
        module.quantize_base(block_size, name)
    if include_frozen_linears:
        plain = {id(m) for m in frozen_linears(model) if type(m) is nn.Linear}
        for name in [name for name, m in model.named_modules() if id(m) in plain]:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attribute, NF4Linear(getattr(parent, attribute), block_size=block_size))
    return model


def nf4_placeholders(model: nn.Module, *, num_shards: int, block_size: int = NF4_BLOCK_SIZE):
    """QLoRA under FSDP2: before `fully_shard`, turn each adapted base weight (on the meta
    device) into an NF4 tensor, so that FSDP2 shards and all-gathers its packed form (torchao's
    NF4 all-gather extension: 0.5 bytes a weight on the wire and in memory). Each weight must
    split into `num_shards` row blocks that hold whole NF4 and scale blocks. Fill the shards with
    `load_nf4_shard` after `to_empty`. Stacked experts (`LoRAExperts`) are refused here: QLoRA
    on experts runs in one process."""
    for name, module in lora_modules(model).items():
        if isinstance(module, LoRAExperts):
            raise ConfigError(
                f'lora.quantize_base = "nf4" over {num_shards} FSDP shards with LoRA target '
                f"'experts' ({name.replace(WRAPPER_PREFIX, '')}) is not supported yet; use QLoRA "
                "in one process or drop 'experts' from lora.targets"
            )
        name = f"{name.replace(WRAPPER_PREFIX, '')}.weight"
        weight = module.weight
        nf4 = _to_nf4(weight, block_size, name, meta_ok=True)
        groups = nf4.n_blocks // nf4.scaler_block_size  # double-quantization groups
        if weight.shape[0] % num_shards or groups % num_shards:
            raise ConfigError(
                f'lora.quantize_base = "nf4" over {num_shards} FSDP shards: {name} '
                f"{tuple(weight.shape)} does not split into {num_shards} row blocks of whole "
                f"NF4 scale groups ({groups} groups of {nf4.scaler_block_size * block_size} "
                "weights); use fewer processes or QLoRA in one process"
            )
        module.weight = nn.Parameter(nf4, requires_grad=False)


def load_nf4_shard(local: torch.Tensor, full: torch.Tensor, *, index: int, num_shards: int):
    """Fill a rank's NF4 shard (made by `nf4_placeholders`, then `to_empty`) with its rows of
    `full`, the whole weight quantized once, as in one process."""
    chunk = torch.chunk(full, num_shards, dim=0)[index]
    nf4_to_empty(local)
    local.copy_(chunk)


def nf4_to_empty(weight: torch.Tensor) -> None:
    """Finish `to_empty` on an NF4 placeholder: it materializes only the inner tensors that
    FSDP shards, not the scale mean and the 16-value code book (one each a weight)."""
    weight.scaler_mean = torch.empty_like(weight.scaler_mean, device=weight.device)
    weight.nf4 = torch.empty_like(weight.nf4, device=weight.device)


def quantize_like(weight: torch.Tensor, block_size: int = NF4_BLOCK_SIZE) -> torch.Tensor:
    """`weight` as NF4 with the block sizes `quantize_base_nf4` uses."""
    return _to_nf4(weight, block_size)


# ---- PEFT-compatible adapter files ------------------------------------------------------------


@dataclass(frozen=True)
class _PeftTensors:
    """Where one adapted weight's adapter lives in a PEFT file."""

    prefix: str  # '<prefix>.lora_A.weight' / '<prefix>.lora_B.weight'
    module: AdapterModule
    base: str  # the adapted weight's attribute: 'weight', 'w13', 'w2'
    target_module: str | None  # its adapter_config.json target_modules entry, or
    target_parameter: str | None  # its target_parameters entry
    output_rows: Callable[..., torch.Tensor] | None  # `Family.hf_output_rows` for this weight

    def ours_as_peft(self) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.module
        if isinstance(m, LoRAExperts):
            a, b = _stacked_to_peft(m.lora_a[self.base].detach(), m.lora_b[self.base].detach())
        else:
            a, b = m.lora_a.weight.detach(), m.lora_b.weight.detach()
        return a, b if self.output_rows is None else self.output_rows(b)

    def peft_as_ours(self, peft_a, peft_b) -> tuple[torch.Tensor, torch.Tensor]:
        """`ours_as_peft`'s inverse: a PEFT file's lora_A and lora_B in our layout."""
        if self.output_rows is not None:
            peft_b = self.output_rows(peft_b, inverse=True)
        if isinstance(self.module, LoRAExperts):
            return _stacked_from_peft(peft_a, peft_b, self.module.num_experts)
        return peft_a, peft_b

    def ours(self) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.module
        if isinstance(m, LoRAExperts):
            return m.lora_a[self.base], m.lora_b[self.base]
        return m.lora_a.weight, m.lora_b.weight


def _peft_tensors(model: nn.Module, args) -> list[_PeftTensors]:
    """PEFT's names for every adapter of `model`, by the key map of the family of `args`:
    'layers.0.attention.wq' -> 'base_model.model.model.layers.0.self_attn.q_proj' (target_modules
    q_proj); 'layers.1.feed_forward.experts' w13 / w2 -> '...layers.1.mlp.experts.base_layer' /
    '...layers.1.mlp.experts' (target_parameters mlp.experts.gate_up_proj / down_proj: PEFT
    nests the wrappers of one module's parameters in their order of registration, which is
    ours); the router -> '...mlp.gate' (target_parameters mlp.gate.weight)."""
    attribute_to_target = {attr: target for target, attr in TARGET_MODULES.items()}
    reorder = models.family_of(args).hf_output_rows
    found = []
    for name, module in lora_modules(model).items():
        target = attribute_to_target[name.rsplit(".", 1)[-1]]
        for index, base in enumerate(module.base_names):
            hf_name = models.ours_to_hf(f"{name}.{base}", args)
            hf_module = hf_name.rpartition(".")[0]
            nesting = ".base_layer" * (len(module.base_names) - 1 - index)
            in_layer = re.sub(r"^model\.layers\.\d+\.", "", hf_name)
            on_parameter = target in PARAMETER_TARGETS
            found.append(
                _PeftTensors(
                    prefix=_PEFT_PREFIX + hf_module + nesting,
                    module=module,
                    base=base,
                    target_module=None if on_parameter else HF_TARGET_NAMES[target],
                    target_parameter=in_layer if on_parameter else None,
                    output_rows=reorder and partial(reorder, f"{name}.{base}"),
                )
            )
    return found


def _write_atomically(path: Path, write) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def save_peft_adapter(
    model: nn.Module, args, out_dir: str | Path, *, base_model: str, lora_cfg: LoRASection
) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT's LoRA layout and key
    names) for a full, unsharded model's adapters into `out_dir` (created if needed; other
    files there are left alone). `base_model` goes into `base_model_name_or_path`. Returns
    `out_dir`."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to save")
    for name, module in modules.items():
        if module.rank != lora_cfg.rank or not math.isclose(
            module.scale, lora_cfg.alpha / lora_cfg.rank
        ):
            raise ValueError(
                f"{name}: rank {module.rank} / alpha {module.alpha} differ from the LoRA config "
                f"(rank {lora_cfg.rank}, alpha {lora_cfg.alpha})"
            )
    if getattr(args, "tie_embeddings", False) and "output" in modules:
        raise ConfigError("LoRA on the output projection of a tied-embedding model")
    entries = _peft_tensors(model, args)
    tensors = {}
    for entry in entries:
        peft_a, peft_b = entry.ours_as_peft()
        tensors[f"{entry.prefix}.lora_A.weight"] = peft_a.cpu().contiguous()
        tensors[f"{entry.prefix}.lora_B.weight"] = peft_b.cpu().contiguous()
    hf_targets = sorted({e.target_module for e in entries if e.target_module})
    hf_parameters = sorted({e.target_parameter for e in entries if e.target_parameter})
    alpha = lora_cfg.alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": lora_cfg.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": lora_cfg.dropout,
        "target_modules": hf_targets,
        "target_parameters": hf_parameters or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomically(
        out_dir / ADAPTER_WEIGHTS_NAME,
        lambda p: save_file(tensors, p, metadata={"format": "pt"}),
    )
    _write_atomically(
        out_dir / ADAPTER_CONFIG_NAME,
        lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
    )
    return out_dir


def read_peft_config(adapter_dir: str | Path) -> LoRASection:
    """The LoRA settings of a PEFT adapter directory, refusing what LoRALinear cannot
    represent (DoRA, rsLoRA, biases, per-layer ranks, ...); errors name the file."""
    path = Path(adapter_dir) / ADAPTER_CONFIG_NAME
    if not path.exists():
        raise ModelFormatError(f"{path}: file not found (not a PEFT adapter directory)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFormatError(f"{path}: not valid JSON ({err})") from None
    if config.get("peft_type") != "LORA":
        raise ModelFormatError(
            f"{path}: peft_type {config.get('peft_type')!r} is not supported; allowed: 'LORA'"
        )
    unsupported = {
        "bias": lambda v: v not in (None, "none"),
        "fan_in_fan_out": bool,
        "use_dora": bool,
        "use_rslora": bool,
        "lora_bias": bool,
        "modules_to_save": bool,
        "layers_to_transform": lambda v: v is not None,
        "rank_pattern": bool,
        "alpha_pattern": bool,
        "trainable_token_indices": bool,
        "layer_replication": bool,
    }
    for key, is_unsupported in unsupported.items():
        if key in config and is_unsupported(config[key]):
            raise ModelFormatError(
                f"{path}: {key} = {json.dumps(config[key])} is not supported by lmforge's LoRA"
            )
    hf_to_target = {hf: target for target, hf in HF_TARGET_NAMES.items()}
    parameter_targets = _parameter_targets(config.get("target_parameters"), path)
    names = config.get("target_modules")
    if names == "all-linear":  # PEFT's shorthand: every linear except the output head
        names = [HF_TARGET_NAMES[t] for t in DEFAULT_TARGETS if t in HF_TARGET_NAMES]
    if parameter_targets and names is None:
        names = []
    if (
        not isinstance(names, list)
        or not (names or parameter_targets)
        or any(n not in hf_to_target for n in names)
    ):
        raise ModelFormatError(
            f"{path}: target_modules = {json.dumps(names)} is not supported; allowed: a list of "
            f"{', '.join(HF_TARGET_NAMES.values())} (or 'all-linear')"
        )
    targets = {hf_to_target[n] for n in names} | parameter_targets
    try:
        return LoRASection(
            enabled=True,
            rank=config["r"],
            alpha=config["lora_alpha"],
            dropout=config.get("lora_dropout", 0.0),
            targets=sorted(targets, key=list(TARGET_MODULES).index),
        )
    except KeyError as err:
        raise ModelFormatError(f"{path}: lacks the key {err.args[0]!r}") from None
    except ValueError as err:  # pydantic: r or lora_alpha out of range
        raise ModelFormatError(f"{path}: invalid LoRA settings ({err})") from None


def _parameter_targets(entries, path: Path) -> set[str]:
    """PEFT's target_parameters -> our targets (experts, router). PEFT matches an entry as a
    suffix of '<module>.<parameter>', so 'experts.gate_up_proj' and the full
    'mlp.experts.gate_up_proj' both name the experts' first stack; both stacks are needed."""
    if not entries:
        return set()
    known = {hf: target for target, names in HF_TARGET_PARAMETERS.items() for hf in names}
    known |= {alias: known[name] for alias, name in HF_PARAMETER_ALIASES.items()}
    allowed = ", ".join(known)
    if not isinstance(entries, list):
        raise ModelFormatError(f"{path}: target_parameters = {json.dumps(entries)}: not a list")
    matched: dict[str, str] = {}
    for entry in entries:
        hits = [hf for hf in known if hf == entry or hf.endswith(f".{entry}")]
        if len(hits) != 1:
            raise ModelFormatError(
                f"{path}: target_parameters entry {entry!r} is not supported by lmforge's LoRA; "
                f"allowed: {allowed}"
            )
        matched[HF_PARAMETER_ALIASES.get(hits[0], hits[0])] = known[hits[0]]
    targets = set(matched.values())
    for target in targets:
        missing = [hf for hf in HF_TARGET_PARAMETERS[target] if hf not in matched]
        if missing:
            raise ModelFormatError(
                f"{path}: target_parameters adapts only part of the {target} ({missing[0]} is "
                f"missing); lmforge adapts {' and '.join(HF_TARGET_PARAMETERS[target])} together"
            )
    return targets


def load_peft_adapter(model: nn.Module, adapter_dir: str | Path) -> LoRASection:
    """Apply a PEFT LoRA adapter directory to a (materialized) `Transformer`, in place:
    `apply_lora` with its config, then its tensors. Returns the adapter's settings."""
    adapter_dir = Path(adapter_dir)
    cfg = read_peft_config(adapter_dir)
    config_path = adapter_dir / ADAPTER_CONFIG_NAME
    try:
        apply_lora(model, targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout)
    except ConfigError as err:
        raise ModelFormatError(f"{config_path}: {err}") from None
    weights_path = adapter_dir / ADAPTER_WEIGHTS_NAME
    if not weights_path.exists():
        extra = (
            " (adapter_model.bin is not read: pickle)"
            if (adapter_dir / "adapter_model.bin").exists()
            else ""
        )
        raise ModelFormatError(f"{weights_path}: file not found{extra}")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as err:
        raise ModelFormatError(f"{weights_path}: cannot read safetensors ({err})") from None
    expected = {}
    for entry in _peft_tensors(model, model.args):
        peft_a, peft_b = entry.ours_as_peft()
        expected[f"{entry.prefix}.lora_A.weight"] = (entry, 0, peft_a.shape)
        expected[f"{entry.prefix}.lora_B.weight"] = (entry, 1, peft_b.shape)
    # PEFT also saves the full base weight of an adapted lm_head ("...lm_head.base_layer.weight")
    # when it suspects tied embeddings; it is the base model's own weight, which we already have.
    found = {k for k in tensors if not k.endswith(".base_layer.weight")}
    missing, unexpected = sorted(set(expected) - found), sorted(found - set(expected))
    if missing or unexpected:
        raise ModelFormatError(
            f"{weights_path}: tensors do not match {ADAPTER_CONFIG_NAME}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    for key, (_, _, shape) in expected.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise ModelFormatError(
                f"{weights_path}: tensor {key} has shape {tuple(tensors[key].shape)}, the model "
                f"needs {tuple(shape)} (an adapter for another model?)"
            )
    with torch.no_grad():
        for entry in {id(e): e for e, _, _ in expected.values()}.values():
            peft_a, peft_b = entry.peft_as_ours(
                tensors[f"{entry.prefix}.lora_A.weight"], tensors[f"{entry.prefix}.lora_B.weight"]
            )
            param_a, param_b = entry.ours()
            param_a.copy_(peft_a)
            param_b.copy_(peft_b)
    return cfg


def adapter_hash(adapter_dir: str | Path) -> str:
    """sha256 over the adapter's config and weights files (for lineage records)."""
    digest = hashlib.sha256()
    for name in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME):
        digest.update(name.encode())
        digest.update((Path(adapter_dir) / name).read_bytes())
    return digest.hexdigest()


__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "HF_TARGET_NAMES",
    "TARGET_MODULES",
    "LoRAExperts",
    "LoRALinear",
    "LoRASection",
    "NF4Linear",
    "adapter_hash",
    "apply_lora",
    "disable_adapters",
    "is_nf4",
    "load_peft_adapter",
    "lora_base_names",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "nf4_summary",
    "quantize_base_nf4",
    "read_peft_config",
    "reset_lora_parameters",
    "save_peft_adapter",
    "targets_for",
    "trainable_parameters",
]
