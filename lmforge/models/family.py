"""What a model family gives the rest of lmforge: the `Family` record each family's package
exports as `FAMILY`, and `ParamShape`, one parameter of a block as the memory planner sees it.

The registry (lmforge/models/__init__.py) lists the families; code outside models/ asks it for
the family of a config.json, a preset name or a `ModelArgs`, never imports a family by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from lmforge.errors import ModelFormatError


@dataclass(frozen=True)
class ParamShape:
    """One parameter of a transformer block, named as in the model (`attention.wq.weight`).

    kind: "linear" (a matmul weight LoRA may adapt), "norm" (an RMSNorm over the residual
    stream), "head_norm" (an RMSNorm over each head of the projection `reads`) or "experts"
    (a MoE's stacked expert weights [E, out, in]: matmul weights LoRA does not adapt).
    tp_dim: the dimension tensor parallelism splits; None: replicated over the tp axis.
    """

    name: str
    shape: tuple[int, ...]
    kind: Literal["linear", "norm", "head_norm", "experts"]
    tp_dim: int | None = None
    reads: str | None = None  # head_norm: the linear whose output it normalizes ("wq", "wk")

    @property
    def attribute(self) -> str:
        """The module's own name: 'wq' for 'attention.wq.weight'."""
        return self.name.removesuffix(".weight").rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Family:
    """One model family: its shapes, model, Hugging Face format and parallel/planner facts.

    args_class: the frozen dataclass of the family's hyperparameters (a `ModelArgs` subclass).
    model_class: builds the model from an `args_class` instance.
    model_type / architecture: what config.json calls the family.
    presets: named shapes (preset names are unique across families).
    args_from_hf_config(cfg, path) / args_to_hf_config(args, dtype): config.json translation.
    hf_to_ours(name) -> our name or None / ours_to_hf(name): the weight key map.
    block_params(args, layer=None): the parameters of block `layer` (the planner's shapes;
        None: a typical block).
    tp_plan(sequence_parallel=...): one block's tensor-parallel plan, module name -> torch
        ParallelStyle (sequence parallel in training, replicated norms in inference).
    hf_merge(hf_state, path, keep_quantized) / hf_split(hf_state): for formats that store one
        of our tensors as several (a MoE's per-expert weights): many HF tensors made one before
        the key map, and one split back after it on save; `keep_quantized`: experts quantized
        in the hub's files (gpt-oss's MXFP4) stay so for `moe.QuantizedExperts`, else are
        dequantized. None (dense families): names map one to one.
    hf_output_rows(name, rows, inverse=False): the rows of our weight `name`'s outputs (dim 0)
        in the order transformers keeps them (gpt-oss interleaves its experts' gate and up),
        for a LoRA factor B saved in PEFT's layout; `inverse`: back. None: the same order.
    """

    name: str
    title: str  # in messages: "Llama", "Qwen3"
    model_type: str
    architecture: str
    args_class: type
    model_class: type[torch.nn.Module]
    presets: dict
    args_from_hf_config: Callable[[dict, Path], object]
    args_to_hf_config: Callable[[object, torch.dtype], dict]
    hf_to_ours: Callable[[str], str | None]
    ours_to_hf: Callable[[str], str]
    block_params: Callable[[object], list[ParamShape]]
    tp_plan: Callable[..., dict]
    hf_merge: Callable[[dict, Path, bool], dict] | None = None
    hf_split: Callable[[dict], dict] | None = None
    hf_output_rows: Callable[..., torch.Tensor] | None = None

    def hf_state_dict_to_ours(
        self, hf_state: dict[str, torch.Tensor], path: Path, keep_quantized: bool = False
    ) -> dict[str, torch.Tensor]:
        """Our names for a HF state dict; a tensor the family does not have is an error."""
        if self.hf_merge is not None:
            hf_state = self.hf_merge(hf_state, path, keep_quantized)
        ours = {}
        for name, tensor in hf_state.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer some old exports carry; we recompute it
            our_name = self.hf_to_ours(name)
            if our_name is None:
                raise ModelFormatError(
                    f"{path}: unexpected tensor {name!r} for a {self.title} model"
                )
            # contiguous: set_model_state_dict's broadcast from rank 0 sends a view's storage
            # in storage order (a transposed layout arrived scrambled on the other ranks)
            ours[our_name] = tensor.contiguous()
        return ours

    def ours_state_dict_to_hf(
        self, state: dict[str, torch.Tensor], args
    ) -> dict[str, torch.Tensor]:
        """HF names for our state dict; a tied output projection is left out (HF ties it)."""
        hf_state = {
            self.ours_to_hf(name): tensor
            for name, tensor in state.items()
            if not (args.tie_embeddings and name == "output.weight")
        }
        return self.hf_split(hf_state) if self.hf_split is not None else hf_state
