"""How many bytes tensors and models hold, as stored: tensor subclasses (torchao's quantized and
NF4 weights) count their inner tensors, a DTensor its local shard."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`: a DTensor's local shard; a subclass's inner tensors (qdata, scales)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(tensor, DTensor):
        return tensor_bytes(tensor.to_local())
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in inner_names]
        return sum(tensor_bytes(t) for t in inner if isinstance(t, torch.Tensor))
    return tensor.numel() * tensor.element_size()


def module_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each (also a shared one) counted once."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(tensor_bytes(t) for t in tensors.values())
