"""Many LoRA adapters over one base model, mixed in one batch (`Engine(max_adapters=N)`,
`lmforge serve --lora NAME=PATH`).

Each adaptable linear of the base (attention's q, k, v, o and a dense MLP's gate, up, down) is
wrapped once in a `MultiLoRALinear` holding every adapter's matrices stacked in slots: A [slots,
rank, in], B [slots, out, rank] and a scale a slot, slot 0 all zeros (no adapter), an adapter's
rank zero-padded up to the engine's `max_adapter_rank`. A forward's row i uses the slot in
`AdapterSlots.batch[i]`: x A_sᵀ B_sᵀ · scale_s for each row's own slot s, two batched products
over the rows' gathered matrices (Punica's "batched gather matrix-vector" in plain torch), so one
batch mixes the base model and any adapters, and the base product runs once for all rows.

`AdapterSlots.rows[r]` is the slot of the sequence in cache row r, set when it is admitted;
`batch` equals `rows` between forwards (a decode step runs cache rows 0..b-1), and a prefill
over cache rows `rows` sets `batch[:n] = rows[rows]` for its forward and puts it back after,
both inside the forward's CUDA graph where it has one. Loading an adapter copies its matrices
into a free slot (buffers the compiled steps and graphs already read: nothing recompiles).
Adapters are PEFT directories (lmforge's LoRA outputs and PEFT's) of those targets; a MoE's
experts or router and the output head take none here (merge those).

Under tensor parallelism (`lmforge launch --nproc N serve|generate`, the layers on their local
shards: lmforge.generate.parallel) each process holds its share of every adapter: a
column-parallel linear (q, k, v, gate, up: its output rows split) its rows of B, a row-parallel
one (o, down: its input split, its outputs summed) its columns of A, and there the rank-r
products x_local A_localᵀ are summed over the processes (r numbers a token) before B.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from lmforge import models
from lmforge.errors import ConfigError, ModelFormatError
from lmforge.modules.lora import ADAPTER_WEIGHTS_NAME, TARGET_MODULES, read_peft_config

ADAPTABLE = ("q", "k", "v", "o", "gate", "up", "down")
_PEFT_PREFIX = "base_model.model."


class AdapterSlots:
    """Which adapter each cache row and each row of the running forward uses (see the module
    docstring): `capacity` adapters in slots 1..capacity, slot 0 none."""

    def __init__(self, *, capacity: int, max_batch: int, rank: int, device) -> None:
        self.capacity, self.rank = capacity, rank
        self.rows = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.batch = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.names: dict[str, int] = {}  # adapter name -> slot
        self.paths: dict[str, str] = {}
        # slot -> a number no other load had: the prefix cache's chains of that adapter start
        # at minus it (a slot's next adapter computes other keys and values)
        self.loads: dict[int, int] = {}
        self._loaded = 0
        self.layers: dict[str, MultiLoRALinear] = {}  # our module name -> its wrapper

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (None: the base model)."""
        if name is None:
            return 0
        if name not in self.names:
            known = ", ".join(sorted(self.names)) or "none loaded"
            raise ConfigError(f"unknown adapter {name!r}; loaded: {known}")
        return self.names[name]

    def cache_root(self, slot: int) -> int:
        """The prefix cache's root for sequences of adapter slot `slot` (0: the base)."""
        return -self.loads[slot] if slot else 0

    def admit(self, row: int, slot: int) -> None:
        """Cache row `row` now holds a sequence of adapter slot `slot`."""
        self.rows[row] = slot
        self.batch[row] = slot

    def for_rows(self, rows: torch.Tensor) -> None:
        """A forward over cache rows `rows` [n] (a prefill): its rows' slots."""
        self.batch[: rows.shape[0]] = self.rows[rows]

    def restore(self) -> None:
        """After such a forward: decode steps run cache rows 0..b-1."""
        self.batch.copy_(self.rows)


class MultiLoRALinear(nn.Module):
    """A linear layer plus each row's own adapter's low-rank update (module docstring):
    `base` the linear as it was (a quantized or GEMV layer as well), `lora_a` [slots, rank, in],
    `lora_b` [slots, out, rank], `scale` [slots]."""

    def __init__(self, base: nn.Module, adapters: AdapterSlots) -> None:
        super().__init__()
        self.base = base
        self.adapters = adapters
        weight = base.weight
        slots, rank = adapters.capacity + 1, adapters.rank
        dtype = weight.dtype if weight.is_floating_point() else torch.bfloat16
        factory = {"device": weight.device, "dtype": dtype}
        rows, cols = _local_shape(base)
        # a tensor-parallel shard (module docstring): "out" its rows, "in" its columns
        self.split = (
            "in" if cols < base.in_features else "out" if rows < base.out_features else None
        )
        self.register_buffer("lora_a", torch.zeros(slots, rank, cols, **factory))
        self.register_buffer("lora_b", torch.zeros(slots, rows, rank, **factory))
        self.register_buffer("scale", torch.zeros(slots, **factory))

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = x.shape[0]
        slots = self.adapters.batch[:rows]  # [b]
        flat = x.reshape(rows, -1, x.shape[-1]).to(self.lora_a.dtype)  # [b, s, in]
        low = torch.bmm(flat, self.lora_a[slots].transpose(1, 2))  # [b, s, rank]
        if self.split == "in":  # this process's columns' share: summed over the processes
            low = funcol.all_reduce(low, "sum", dist.group.WORLD)
        update = torch.bmm(low, self.lora_b[slots].transpose(1, 2))  # [b, s, out]
        update = update * self.scale[slots].view(rows, 1, 1)
        return out + update.view(out.shape).to(out.dtype)


def _local_shape(base: nn.Module) -> tuple[int, int]:
    """(output rows, input columns) this process computes: a plain linear's local weight's
    (tensor-parallel shards keep the whole layer's in_features / out_features), else the
    layer's own sizes."""
    if type(base) is nn.Linear:
        return tuple(base.weight.shape)
    return base.out_features, base.in_features


def _local_matrices(layer: MultiLoRALinear, a: torch.Tensor, b: torch.Tensor):
    """An adapter's A [rank, in] and B [out, rank] for `layer`: this process's share of them
    under tensor parallelism (its rows of B, or its columns of A), else as they are."""
    if layer.split is None:
        return a, b
    rank = dist.get_rank()
    if layer.split == "out":
        rows = layer.lora_b.shape[1]
        return a, b[rank * rows : (rank + 1) * rows]
    cols = layer.lora_a.shape[2]
    return a[:, rank * cols : (rank + 1) * cols], b


def use_adapters(model: nn.Module, adapters: AdapterSlots) -> int:
    """Wrap every adaptable linear of `model`'s blocks in a `MultiLoRALinear` over
    `adapters`; returns how many."""
    attributes = {TARGET_MODULES[t] for t in ADAPTABLE}
    if any(getattr(block.attention, "wqkv", None) is not None for block in model.layers.values()):
        raise ConfigError(
            "the model's projections are already fused (an engine without adapters ran on it): "
            "load it again for an engine with adapters"
        )
    for name, module in list(model.named_modules()):
        parent_name, _, attribute = name.rpartition(".")
        if attribute not in attributes or not name.startswith("layers."):
            continue
        if isinstance(module, MultiLoRALinear) or not hasattr(module, "in_features"):
            continue
        parent = model.get_submodule(parent_name)
        wrapped = MultiLoRALinear(module, adapters)
        setattr(parent, attribute, wrapped)
        adapters.layers[name] = wrapped
    return len(adapters.layers)


def load_adapter(model: nn.Module, adapters: AdapterSlots, name: str, path: str | Path) -> int:
    """Read the PEFT adapter at `path` into a free slot under `name`; returns the slot. Bad
    files are a ModelFormatError naming them, a full table or a rank above the engine's a
    ConfigError; nothing changes then."""
    path = Path(path)
    if name in adapters.names:
        raise ConfigError(f"an adapter named {name!r} is already loaded")
    free = sorted(set(range(1, adapters.capacity + 1)) - set(adapters.names.values()))
    if not free:
        raise ConfigError(
            f"{adapters.capacity} adapters are loaded, the most this engine holds; unload one"
        )
    config = read_peft_config(path)
    unsupported = sorted(set(config.targets) - set(ADAPTABLE))
    if unsupported:
        raise ModelFormatError(
            f"{path}: adapts {', '.join(unsupported)}, which served adapters do not (only "
            f"{', '.join(ADAPTABLE)}); merge it into the model instead (`lmforge merge`)"
        )
    if config.rank > adapters.rank:
        raise ConfigError(
            f"{path}: rank {config.rank} is above the engine's max_adapter_rank "
            f"{adapters.rank} (serve: --max-lora-rank)"
        )
    tensors = _read_tensors(path / ADAPTER_WEIGHTS_NAME)
    targeted = {TARGET_MODULES[t] for t in config.targets}
    chosen = {n: layer for n, layer in adapters.layers.items() if n.rsplit(".", 1)[1] in targeted}
    absent = sorted(targeted - {n.rsplit(".", 1)[1] for n in chosen})
    if absent:  # (a MoE's MLPs are experts: their adapters are for merging)
        names = [t for t in config.targets if TARGET_MODULES[t] in absent]
        raise ModelFormatError(
            f"{path}: adapts {', '.join(names)}, which this model has no plain linear for"
        )
    matrices = {}
    for layer_name, layer in chosen.items():
        hf_module = models.ours_to_hf(f"{layer_name}.weight", model.args).rpartition(".")[0]
        keys = [f"{_PEFT_PREFIX}{hf_module}.lora_{ab}.weight" for ab in ("A", "B")]
        missing = [key for key in keys if key not in tensors]
        if missing:
            raise ModelFormatError(f"{path / ADAPTER_WEIGHTS_NAME}: {missing[0]} is missing")
        a, b = (tensors[key] for key in keys)
        want = ((config.rank, layer.base.in_features), (layer.base.out_features, config.rank))
        if (tuple(a.shape), tuple(b.shape)) != want:
            raise ModelFormatError(
                f"{path / ADAPTER_WEIGHTS_NAME}: {keys[0]} and its B have shapes "
                f"{tuple(a.shape)}, {tuple(b.shape)}; the model needs {want[0]}, {want[1]} "
                "(an adapter for another model?)"
            )
        matrices[layer_name] = _local_matrices(layer, a, b)
    slot = free[0]
    with torch.no_grad():
        for layer_name, layer in adapters.layers.items():
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
            layer.scale[slot] = 0.0
            if layer_name in matrices:
                a, b = matrices[layer_name]
                layer.lora_a[slot, : config.rank] = a
                layer.lora_b[slot, :, : config.rank] = b
                layer.scale[slot] = config.alpha / config.rank
    adapters.names[name] = slot
    adapters.paths[name] = str(path)
    adapters._loaded += 1
    adapters.loads[slot] = adapters._loaded
    return slot


def _read_tensors(weights: Path) -> dict[str, torch.Tensor]:
    if not weights.exists():
        raise ModelFormatError(f"{weights}: file not found")
    try:
        return load_file(weights)
    except (SafetensorError, OSError) as err:
        raise ModelFormatError(f"{weights}: cannot read safetensors ({err})") from None


def unload_adapter(adapters: AdapterSlots, name: str) -> None:
    """Free adapter `name`'s slot (its matrices stay until a load overwrites them: no row uses
    the slot any more)."""
    adapters.slot(name)  # an unknown name is a ConfigError
    del adapters.names[name], adapters.paths[name]
