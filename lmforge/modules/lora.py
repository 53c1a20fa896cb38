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

Adapters are saved and loaded in the layout of Hugging Face PEFT (`adapter_config.json` +
`adapter_model.safetensors`, keys like
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so `peft.PeftModel` loads
ours onto transformers' model and ours loads PEFT's LoRA adapters for Llama.

Everything here is plain module structure (no custom autograd besides torchao's NF4 linear), so
FSDP2's `fully_shard` wraps blocks that contain `LoRALinear`s like any others.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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
    """Which linears get adapters: q, k, v, o (attention), gate, up, down (MLP), output."""
    quantize_base: Literal["none", "nf4"] = "none"
    """nf4: store the frozen base weights of the adapted linears in 4-bit NormalFloat (QLoRA)."""
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


# ---- applying, inspecting, merging -------------------------------------------------------


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRALinear of `model` by module name (e.g. 'layers.0.attention.wq')."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


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
    """Swap the targeted linears of a `Transformer` (any family) for `LoRALinear`s, in place, and
    freeze every other parameter; with `base_dtype`, store the frozen linear weights in it
    (`frozen_linears`; the adapters keep the model's dtype). Works on a meta-device model
    (adapters are then initialized by `reset_lora_parameters(model)` after `to_empty`).
    Returns `model`.

    targets: names from q, k, v, o, gate, up, down, output (Meta's wq wk wv wo w1 w3 w2 output).
    """
    problem = _targets_problem(targets)
    if problem:
        raise ConfigError(problem)
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
        if not isinstance(module, nn.Linear) or attribute not in attributes:
            continue
        if attribute == "output" and name != "output":
            continue  # only the model's output head, no nested module of that name
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        swaps.append((parent, attribute))
    if not swaps:
        raise ConfigError(f"no linear layer of the model matches the LoRA targets {list(targets)}")
    for parent, attribute in swaps:
        base = getattr(parent, attribute)
        setattr(parent, attribute, LoRALinear(base, rank=rank, alpha=alpha, dropout=dropout))
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
    """The LoRALinears' bases and every other frozen linear layer whose weight is not shared
    with another module (a tied output projection is the embedding table)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    adapters = {id(sub) for m in lora_modules(model).values() for sub in (m.lora_a, m.lora_b)}
    return [
        m
        for m in model.modules()
        if isinstance(m, (nn.Linear, LoRALinear))
        and id(m) not in adapters
        and not m.weight.requires_grad
        and owners[id(m.weight)] == 1
    ]


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
        state[f"{name}.lora_a.weight"] = module.lora_a.weight.detach()
        state[f"{name}.lora_b.weight"] = module.lora_b.weight.detach()
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
    `nn.Linear` (frozen, like the rest of a LoRA model), in place. NF4 bases are dequantized.
    Returns `model`."""
    for name, module in lora_modules(model).items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        merged = module.merged_weight()
        linear = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(merged, requires_grad=False)
        linear.bias = module.bias
        setattr(parent, attribute, linear)
    return model


# ---- QLoRA ----------------------------------------------------------------------------------


@torch.no_grad()
def quantize_base_nf4(
    model: nn.Module, *, include_frozen_linears: bool = False, block_size: int = NF4_BLOCK_SIZE
) -> nn.Module:
    """Store the frozen base weight of every `LoRALinear` as NF4 (QLoRA), in place; with
    `include_frozen_linears`, also swap every other frozen `nn.Linear` (not sharing its weight
    with an embedding) for an `NF4Linear`. Call after the base weights are loaded. The adapters
    keep their dtype. Returns `model`."""
    for name, module in lora_modules(model).items():
        if not is_nf4(module.weight):
            nf4 = _to_nf4(module.weight, block_size, f"{name}.weight")
            module.weight = nn.Parameter(nf4, requires_grad=False)
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
    `load_nf4_shard` after `to_empty`."""
    for name, module in lora_modules(model).items():
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


def _peft_module_name(our_module: str, args) -> str:
    """'layers.0.attention.wq' -> 'base_model.model.model.layers.0.self_attn.q_proj' (by the
    key map of the family of `args`)."""
    hf_name = models.ours_to_hf(f"{our_module}.weight", args)
    return _PEFT_PREFIX + hf_name.removesuffix(".weight")


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
    attribute_to_target = {attr: target for target, attr in TARGET_MODULES.items()}
    hf_targets = sorted(
        {HF_TARGET_NAMES[attribute_to_target[name.rsplit(".", 1)[-1]]] for name in modules}
    )
    tensors = {}
    for name, module in modules.items():
        prefix = _peft_module_name(name, args)
        tensors[f"{prefix}.lora_A.weight"] = module.lora_a.weight.detach().cpu().contiguous()
        tensors[f"{prefix}.lora_B.weight"] = module.lora_b.weight.detach().cpu().contiguous()
    alpha = lora_cfg.alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": lora_cfg.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": lora_cfg.dropout,
        "target_modules": hf_targets,
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
        "target_parameters": bool,
        "trainable_token_indices": bool,
        "layer_replication": bool,
    }
    for key, is_unsupported in unsupported.items():
        if key in config and is_unsupported(config[key]):
            raise ModelFormatError(
                f"{path}: {key} = {json.dumps(config[key])} is not supported by lmforge's LoRA"
            )
    hf_to_target = {hf: target for target, hf in HF_TARGET_NAMES.items()}
    names = config.get("target_modules")
    if names == "all-linear":  # PEFT's shorthand: every linear except the output head
        names = [HF_TARGET_NAMES[t] for t in DEFAULT_TARGETS]
    if not isinstance(names, list) or not names or any(n not in hf_to_target for n in names):
        raise ModelFormatError(
            f"{path}: target_modules = {json.dumps(names)} is not supported; allowed: a list of "
            f"{', '.join(HF_TARGET_NAMES.values())} (or 'all-linear')"
        )
    try:
        return LoRASection(
            enabled=True,
            rank=config["r"],
            alpha=config["lora_alpha"],
            dropout=config.get("lora_dropout", 0.0),
            targets=sorted({hf_to_target[n] for n in names}, key=list(TARGET_MODULES).index),
        )
    except KeyError as err:
        raise ModelFormatError(f"{path}: lacks the key {err.args[0]!r}") from None
    except ValueError as err:  # pydantic: r or lora_alpha out of range
        raise ModelFormatError(f"{path}: invalid LoRA settings ({err})") from None


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
    for name, module in lora_modules(model).items():
        prefix = _peft_module_name(name, model.args)
        expected[f"{prefix}.lora_A.weight"] = module.lora_a.weight
        expected[f"{prefix}.lora_B.weight"] = module.lora_b.weight
    # PEFT also saves the full base weight of an adapted lm_head ("...lm_head.base_layer.weight")
    # when it suspects tied embeddings; it is the base model's own weight, which we already have.
    found = {k for k in tensors if not k.endswith(".base_layer.weight")}
    missing, unexpected = sorted(set(expected) - found), sorted(found - set(expected))
    if missing or unexpected:
        raise ModelFormatError(
            f"{weights_path}: tensors do not match {ADAPTER_CONFIG_NAME}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for key, param in expected.items():
            tensor = tensors[key]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelFormatError(
                    f"{weights_path}: tensor {key} has shape {tuple(tensor.shape)}, the model "
                    f"needs {tuple(param.shape)} (an adapter for another model?)"
                )
            param.copy_(tensor)
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
    "LoRALinear",
    "LoRASection",
    "NF4Linear",
    "adapter_hash",
    "apply_lora",
    "disable_adapters",
    "is_nf4",
    "load_peft_adapter",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "quantize_base_nf4",
    "read_peft_config",
    "reset_lora_parameters",
    "save_peft_adapter",
    "trainable_parameters",
]
