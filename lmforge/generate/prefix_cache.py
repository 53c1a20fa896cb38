"""Automatic prefix caching: prompts' keys and values kept in fixed blocks after their
sequence ran, so that a later prompt starting with the same tokens copies them into its cache
row instead of prefilling them (a shared system prompt, a multi-turn chat, lm-eval's
multiple-choice contexts).

The engine's cache is one row of `max_seq_len` slots a sequence (slot = position), so cached
blocks live in a pool of their own, `num_blocks` blocks of `block_tokens` slots in every layer
(per process under tensor parallelism: its own heads). A block is named by its tokens and the
block before it (`(parent id, tokens)`, a chain from the prompt's start): a block's keys and
values depend on every token before it, and on nothing after. Finding a prompt's blocks is a
walk down that chain; the entries found move to the end of an LRU order, and a new block takes
a free one or the least recently used (copies, never shared: a block evicted while a row holds
its copy changes nothing in the row).

Both directions are one indexed copy a layer (`load`: blocks -> the row's first slots;
`store`: the row's full prompt blocks -> the pool, once its prompt is in the cache), queued on
the device like the forwards around them, so CUDA graphs and chunked prefill are unaffected:
a sequence that found n blocks starts its prefill at slot n · block_tokens, as a chunk
continuing its prompt does. At least the prompt's last token is always prefilled: its logits
give the first new token. Every process of a tensor-parallel engine sees the same prompts in
the same order, so each makes the same choices for its own heads.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from lmforge.modules.kv_cache import KVCaches


class PrefixCache:
    """A pool of cached prompt blocks over `caches`' layers (see the module docstring)."""

    def __init__(self, caches: KVCaches, *, num_blocks: int, block_tokens: int) -> None:
        first = caches[0].k  # [rows, kv_heads, slots, head_dim]
        _, heads, _, head_dim = first.shape
        self.caches = caches
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks

        def pool() -> torch.Tensor:  # [blocks, kv_heads, block_tokens, head_dim]
            shape = (num_blocks, heads, block_tokens, head_dim)
            return torch.zeros(shape, dtype=first.dtype, device=first.device)

        self.k = [pool() for _ in range(len(caches))]
        self.v = [pool() for _ in range(len(caches))]
        # (parent entry id or a chain's root, the block's tokens) -> (entry id, pool block),
        # least recent first; entry ids count up from 1, roots are 0 or negative
        self.entries: OrderedDict[tuple[int, tuple[int, ...]], tuple[int, int]] = OrderedDict()
        self.free = list(range(num_blocks))
        self.next_id = 1  # 0: the chain's root, before the first block
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, served from the pool

    def _blocks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        b = self.block_tokens
        return [tuple(tokens[i : i + b]) for i in range(0, len(tokens) - b + 1, b)]

    def match(self, prompt: list[int], root: int = 0) -> list[int]:
        """The pool blocks holding `prompt`'s longest cached prefix of whole blocks, all but
        its last token at most (counted in `queries` and `hits`). `root`: what else the keys
        and values depend on (a LoRA adapter's: chains of different roots never meet)."""
        self.queries += len(prompt)
        found, parent = [], root
        for block in self._blocks(prompt[:-1]):
            entry = self.entries.get((parent, block))
            if entry is None:
                break
            self.entries.move_to_end((parent, block))
            parent = entry[0]
            found.append(entry[1])
        self.hits += len(found) * self.block_tokens
        return found

    def load(self, row: int, blocks: list[int]) -> int:
        """Copy `blocks` into cache row `row`'s first slots; returns how many slots."""
        if not blocks:
            return 0
        length = len(blocks) * self.block_tokens
        index = torch.tensor(blocks, device=self.k[0].device)
        for layer, pool_k, pool_v in zip(self.caches.layers, self.k, self.v, strict=True):
            # [n, heads, b, hd] -> [heads, n · b, hd]
            layer.k[row, :, :length] = pool_k[index].transpose(0, 1).flatten(1, 2)
            layer.v[row, :, :length] = pool_v[index].transpose(0, 1).flatten(1, 2)
        return length

    def store(self, row: int, prompt: list[int], root: int = 0) -> None:
        """Keep the whole blocks of `prompt`, in cache row `row`, that the pool lacks (`root`
        as for `match`)."""
        parent, new = root, []  # new: (position of the block in the prompt, pool block)
        for position, block in enumerate(self._blocks(prompt)):
            key = (parent, block)
            entry = self.entries.get(key)
            if entry is None:
                pool_block = self._take_block()
                if pool_block is None:
                    break
                entry = (self.next_id, pool_block)
                self.next_id += 1
                self.entries[key] = entry
                new.append((position, pool_block))
            else:
                self.entries.move_to_end(key)
            parent = entry[0]
        if new:
            self._copy_in(row, new)

    def _take_block(self) -> int | None:
        """A free pool block, else the least recently used entry's (None: an empty pool)."""
        if self.free:
            return self.free.pop()
        if not self.entries:
            return None
        _, (_, block) = self.entries.popitem(last=False)
        return block

    def _copy_in(self, row: int, new: list[tuple[int, int]]) -> None:
        b = self.block_tokens
        slots = torch.tensor(
            [position * b + i for position, _ in new for i in range(b)], device=self.k[0].device
        )
        index = torch.tensor([block for _, block in new], device=self.k[0].device)
        for layer, pool_k, pool_v in zip(self.caches.layers, self.k, self.v, strict=True):
            heads, head_dim = pool_k.shape[1], pool_k.shape[3]
            # the row's slots [heads, n · b, hd] -> [n, heads, b, hd]
            for cache, pool in ((layer.k, pool_k), (layer.v, pool_v)):
                blocks = cache[row][:, slots].view(heads, len(new), b, head_dim)
                pool[index] = blocks.transpose(0, 1)

    def clear(self) -> None:
        """Forget every block (the pool's memory stays)."""
        self.entries.clear()
        self.free = list(range(self.num_blocks))

    def tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v]
