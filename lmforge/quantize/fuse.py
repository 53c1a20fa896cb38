"""Fused q/k/v and gate/up projections over quantized weights (the engine's `fuse`).

int8 weight-only weights (torchao's `Int8Tensor`, per row or per group of columns) keep one
scale (and zero point) per output row or row group, so the weights of several linears stack
into one by stacking each of their inner tensors along the rows: exactly the weights they were,
and one quantized matrix-vector product instead of three (q/k/v) or two (gate/up) per block.
"""

from __future__ import annotations

import torch

from lmforge.models import RowStack


def _int8_tensor_type() -> type | None:
    try:
        from torchao.quantization import Int8Tensor
    except ImportError:
        return None
    return Int8Tensor


class QuantizedRowStack(RowStack):
    """`RowStack` that also joins int8 weight-only weights of one layout."""

    def accepts(self, weights: list[torch.Tensor]) -> bool:
        return super().accepts(weights) or self._int8_rows(weights)

    def __call__(self, weights: list[torch.Tensor]) -> torch.Tensor:
        if super().accepts(weights):
            return super().__call__(weights)
        first = weights[0]
        names, attributes = first.__tensor_flatten__()
        inner = {name: torch.cat([getattr(w, name) for w in weights]) for name in names}
        rows = inner["qdata"].shape[0]
        size = (rows, *first.shape[1:])
        stride = torch.empty(size, device="meta").stride()
        return type(first).__tensor_unflatten__(inner, attributes, size, stride)

    @staticmethod
    def _int8_rows(weights: list[torch.Tensor]) -> bool:
        """Int8Tensor weight-only weights, 2-D, one block size, every inner tensor with a row
        per output row (dynamic activation quantization carries more state: not these)."""
        int8 = _int8_tensor_type()
        if int8 is None or not all(type(w) is int8 for w in weights):
            return False
        first = weights[0]
        same = all(
            w.block_size == first.block_size and w.dtype == first.dtype and w.ndim == 2
            for w in weights
        )
        if not same or any(w.act_quant_kwargs is not None for w in weights):
            return False
        for w in weights:
            names, _ = w.__tensor_flatten__()
            if any(getattr(w, name).shape[0] != w.shape[0] for name in names):
                return False
        return True
