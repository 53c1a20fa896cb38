"""A static key/value cache for decoding: one preallocated buffer pair per layer.

Each layer's `StaticKVCache` holds k and v of shape [max_batch, kv_heads, max_seq_len, head_dim],
allocated once, so the decode step has static shapes and addresses (what torch.compile's CUDA
graphs need, as in gpt-fast). A cache slot is a sequence position: row r's token at position p
lives in slot p. `KVCaches` groups the layers and is what the model's `kv_caches` argument takes.

Protocol (see `Attention.forward` in lmforge/models/llama/model.py): before a forward, the caller
sets the positions being written, and the slots attention reads, with
`KVCaches.set_positions(positions [b, s], slots [kv_len])`; each layer's attention then calls
`update(k, v)` with k/v [b, kv_heads, s, head_dim] (after RoPE, before the GQA repeat), which
writes them into slots `positions` of rows 0..b-1 and returns slots 0..kv_len-1 of those rows,
[b, kv_heads, kv_len, head_dim] (`slots` is `arange(kv_len)`; without it, all max_seq_len
slots). The attention mask covers the same slots: `attention_mask(positions, slots)` lets the
query at position p see slots <= p. A position >= kv_len is still written (into the whole
buffer: every position is < max_seq_len) but its query sees none of its own keys; the engine
puts only rows whose output it ignores there. Slots beyond a row's position may hold stale
values from an earlier, longer sequence or from padding; the mask hides them until they are
overwritten. Reading kv_len slots rather than max_seq_len keeps a decode step's reads in
proportion to its sequences' lengths, not to the cache's (the engine picks kv_len from a few
buckets: `lmforge.generate.engine.kv_buckets`); `slots` is a tensor, not an int, so that a
compiled step takes its size as a dynamic dimension.

A prefill writes chosen rows instead (the engine's sequences join a running batch in any free
row, a long prompt in chunks): `KVCaches.rows(rows, positions, kv_len)` is the view it passes as
`kv_caches`; each layer then writes rows `rows` [b] at `positions` [b, s] and returns their first
`kv_len` slots.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """One layer's keys and values, [max_batch, kv_heads, max_seq_len, head_dim] each."""

    def __init__(
        self,
        *,
        max_batch: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (max_batch, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions: torch.Tensor | None = None  # [b, s] slots the next update writes
        self.slots: torch.Tensor | None = None  # [kv_len] slots it returns (None: all)

    @property
    def kv_len(self) -> int:
        """The slots the next forward reads: `slots`' size, or all max_seq_len."""
        return self.k.shape[2] if self.slots is None else self.slots.shape[0]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [b, kv_heads, s, head_dim] at `positions`; return rows 0..b-1 of the cache
        at slots 0..kv_len-1, [b, kv_heads, kv_len, head_dim] each."""
        batch, kv_len = k.shape[0], self.kv_len
        rows = torch.arange(batch, device=k.device)[:, None]  # [b, 1], broadcast over s
        # Indexing rows [b, 1] and slots [b, s] around the head slice puts the indexed dims first:
        # the target is [b, s, kv_heads, head_dim], hence the transposed values.
        self.k[rows, :, self.positions] = k.transpose(1, 2).to(self.k.dtype)
        self.v[rows, :, self.positions] = v.transpose(1, 2).to(self.v.dtype)
        return self.k[:batch, :, :kv_len], self.v[:batch, :, :kv_len]

    def update_rows(
        self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int, k, v
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `update`, into cache rows `rows` [b] at slots `positions` [b, s]; returns those
        rows' slots 0..kv_len-1, [b, kv_heads, kv_len, head_dim] each."""
        index = rows[:, None]  # [b, 1], broadcast over the slots
        self.k[index, :, positions] = k.transpose(1, 2).to(self.k.dtype)
        self.v[index, :, positions] = v.transpose(1, 2).to(self.v.dtype)
        return self.k[rows, :, :kv_len], self.v[rows, :, :kv_len]


class _RowsView:
    """The caches as a prefill of some rows sees them (see the module docstring)."""

    def __init__(self, caches: KVCaches, rows, positions, kv_len: int) -> None:
        self.caches, self.rows, self.positions, self.kv_len = caches, rows, positions, kv_len

    def __getitem__(self, layer: int) -> _RowsLayer:
        return _RowsLayer(self, self.caches[layer])


class _RowsLayer:
    def __init__(self, view: _RowsView, cache: StaticKVCache) -> None:
        self.view, self.cache = view, cache

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        view = self.view
        return self.cache.update_rows(view.rows, view.positions, view.kv_len, k, v)


class KVCaches:
    """The static caches of all layers; pass as the model's `kv_caches` (indexed by layer)."""

    def __init__(
        self,
        *,
        num_layers: int,
        max_batch: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.layers = [
            StaticKVCache(
                max_batch=max_batch,
                num_kv_heads=num_kv_heads,
                max_seq_len=max_seq_len,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
            )
            for _ in range(num_layers)
        ]

    @classmethod
    def for_model(
        cls,
        args,
        *,
        max_batch: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_kv_heads: int | None = None,
    ) -> KVCaches:
        """Caches shaped for a model's `ModelArgs` (num_layers, num_kv_heads, head_dim), with
        `num_kv_heads` this process's share under tensor parallelism."""
        return cls(
            num_layers=args.num_layers,
            max_batch=max_batch,
            num_kv_heads=num_kv_heads or args.num_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=args.head_dim,
            dtype=dtype,
            device=device,
        )

    def __getitem__(self, layer: int) -> StaticKVCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def set_positions(self, positions: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Slots [b, s] that the next forward writes (its tokens' positions), and the slots
        [kv_len] (`arange(kv_len)`) its attention reads: None for all max_seq_len."""
        for layer in self.layers:
            layer.positions, layer.slots = positions, slots

    def rows(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int) -> _RowsView:
        """The view a prefill of cache rows `rows` [b] at `positions` [b, s] passes as the
        model's `kv_caches`; attention then sees slots 0..kv_len-1 of those rows."""
        return _RowsView(self, rows, positions, kv_len)

    def copy_slots(self, source_rows: torch.Tensor, target_rows: torch.Tensor, length: int) -> None:
        """Copy slots 0..length-1 of cache rows `source_rows` [n] into `target_rows` [n] (on
        the cache's device), in every layer, two indexed copies a layer whatever n (a prompt
        cached once, shared by several sequences: a row a copy was 2 launches a layer, 14,336
        for 448 sequences of a 16-layer model)."""
        for layer in self.layers:
            layer.k[target_rows, :, :length] = layer.k[source_rows, :, :length]
            layer.v[target_rows, :, :length] = layer.v[source_rows, :, :length]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer (for marking static addresses before compiling)."""
        return [t for layer in self.layers for t in (layer.k, layer.v)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def attention_mask(positions: torch.Tensor, slots: int | torch.Tensor) -> torch.Tensor:
    """Bool mask [b, 1, s, kv_len] for queries at `positions` [b, s] against cache slots
    0..kv_len-1 (`slots`: kv_len, or `arange(kv_len)` on the device): True where slot <= the
    query's position (causal, and blind to stale slots beyond)."""
    if isinstance(slots, int):
        slots = torch.arange(slots, device=positions.device)
    return (slots[None, None, :] <= positions[:, :, None])[:, None]
