"""The inference engine: the one place in lmforge that runs prefill and decode.

`Engine` holds a model and one static KV cache of `max_batch` rows by `max_seq_len` slots
(lmforge/modules/kv_cache.py; slot = position). Sequences are added at any time (`add`) and
advanced by `step()`, which returns the tokens it produced. `lmforge generate` (`Generator`), the
server (lmforge/serve/engine.py) and lm-eval's `generate_until` all drive it. Each step:

1. admit: waiting sequences take free cache rows, the lowest first, so that running rows stay
   packed at the top of the cache.
2. decode: one token for every running sequence whose prompt is in the cache, in one forward
   over cache rows 0..B-1, B the smallest bucket (1, 2, 4, ..., max_batch) that holds them,
   attending to cache slots 0..L-1 only, L the smallest KV bucket (256, 512, ...,
   max_seq_len - 1; `kv_buckets`) above every decoding row's position: a step reads the K/V
   its sequences have filled rather than the whole cache (64 rows of 4096 slots of Llama 3.2
   1B hold 8.6 GB, 3.5x its weights). The host knows each sequence's position
   (`Sequence.decode_position`), so choosing L needs nothing from the device. A row in the
   bucket that is not decoding (free, still prefilling, or finished but not yet collected)
   feeds a dummy token at the last slot, which no sequence reads, or at its own later slots,
   which its next sequence writes before it reads them; beyond slot L-1 such a row writes
   into the whole buffer and sees none of its keys, harmless as its output is ignored. On
   CUDA the step is compiled with the batch size (but for batch 1) and L as dynamic
   dimensions: one compile, and one CUDA graph recorded by the engine per (B, L) pair it
   meets (`StepGraphs`; `warmup` records the common ones).
3. prefill: up to `prefill_chunk` prompt tokens of admitted sequences in one right-padded
   forward: several short prompts together, a long one over several steps (chunked prefill),
   so that running sequences keep decoding meanwhile. A chunk writes its rows' slots
   start..end-1 and attends to slots 0..end-1; a sequence whose prompt is complete samples its
   first token from the logits at its last prompt position. On CUDA, pieces that all start
   their prompts are padded to a batch bucket and a width bucket (`prefill_width`) and run as
   that shape's CUDA graph, recorded from the eager forward: a short prompt's first token in
   3 ms instead of 16 (1B, H200), most of which was the host launching 600 kernels.
4. collect: the step's tokens are copied to the host and pushed to their sequences (stop
   tokens, stop strings, length, text).

On CUDA, a product of one row of activations (the batch-1 decode step) runs as lmforge's Triton
GEMV (lmforge/generate/kernels/) for plain, int8 and int4 weight-only weights (int4 in packed
fp16 arithmetic; tinygemm's layout converted at load), each block as four GEMVs
around attention with its norms, SiLU·up and residual adds inside them; such a quantized weight
meets 2-128 rows in `quantized_gemm` (dequantized tile by tile into tensor-core products), more
expanded to bf16, then cuBLAS. On Hopper and later those kernels launch while
the kernel before them finishes (lmforge/generate/early_launch.py). A Mixture-of-Experts
block's experts meet a few tokens in two Triton kernels that read only the chosen experts'
weights (lmforge/generate/kernels/moe.py), more in the grouped path.

The last token and position of every row live on the device, so a decode step needs nothing
from the host. On CUDA the engine collects step t's tokens only after it launched step t+1, so
the device never waits for Python; a sequence that stopped at step t costs one wasted row in
step t+1 (a length limit costs nothing: the engine counts the tokens it launched).

Sampling: greedy sequences take one argmax over the batch; sampled ones each draw with their own
`torch.Generator`, so a seeded sequence draws the same tokens whatever runs beside it. Orca (Yu
et al., OSDI 2022) calls this iteration-level scheduling; Sarathi (Agrawal et al., 2023) the
chunked prefill.

Prefix caching (`prefix_cache_tokens`): at admission a sequence copies the cached blocks of its
prompt's longest cached prefix into its row and prefills from there; once its prompt is in the
cache, its whole blocks are kept (lmforge/generate/prefix_cache.py).

Structured output: a sequence whose params carry a `json_format` holds a grammar matcher
(lmforge/generate/grammar.py). Its row's logits get the grammar's mask (-inf where a token is not
allowed) after the forward, before the argmax or the sampler (`_grammar_masks`); the forward and
its CUDA graphs are the same for every row, and a batch without such a row skips the mask. Its
tokens reach its matcher before they are pushed, and before the next mask is made: the one
point where the host waits for the step before (see `_grammar_masks`).
"""

from __future__ import annotations

import logging
import time
import types
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.errors import ConfigError
from lmforge.generate.adapters import AdapterSlots, load_adapter, unload_adapter, use_adapters
from lmforge.generate.attention import shape_free_attention
from lmforge.generate.grammar import Grammars
from lmforge.generate.prefix_cache import PrefixCache
from lmforge.generate.sampling import Sampler, SamplingParams, mask_disallowed, to_device
from lmforge.generate.sequence import (
    IncrementalText,
    Prompt,
    Sequence,
    TokenEvent,
    encode_prompt,
)
from lmforge.modules.kv_cache import KVCaches, attention_mask

log = logging.getLogger(__name__)

# A step where every row of its bucket decodes greedily takes its argmax, writes it as the
# rows' next input and advances their positions inside its CUDA graph (`decode_rows(greedy=
# True)`). False: on the host's stream after the graph, as sampled steps do (benchmarks/
# decode.py, variant lmforge-host-argmax).
GREEDY_IN_GRAPH = True

# Decode batch sizes with a CUDA graph of their own.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The fewest cache slots a decode step attends to; the KV buckets double from here up to
# max_seq_len (read when an engine is built: tests lower it to cross buckets cheaply).
MIN_KV_BUCKET = 256


# New prompts joining running sequences are prefilled together (see `Engine._prefill_due`).
PREFILL_BATCH = 4
PREFILL_WAIT_STEPS = 4
# Tokens a padded fresh prefill may hold whatever its real ones: below this a forward's time is
# its weights' reads and kernel launches, not its tokens (see `Engine._padded_prefill_shape`).
PREFILL_FREE_TOKENS = 1024


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    return (*(b for b in BUCKETS if b < max_batch), max_batch)


def kv_buckets(max_seq_len: int, smallest: int | None = None) -> tuple[int, ...]:
    """Cache slots a decode step attends to: `smallest` (default `MIN_KV_BUCKET`) doubled
    while below max_seq_len - 1, then max_seq_len - 1, the most a step reads. The last slot is
    never read: no sequence decodes at it (its last token is not fed back), only rows that
    do not decode write there. Never reading it also keeps the slice of the cache a step
    reads from ever being the whole buffer, which torch.compile would otherwise guard on
    (slicing all slots keeps a tensor contiguous, slicing fewer does not), so one compiled
    step takes every kv_len."""
    most = max(max_seq_len - 1, 1)
    length, buckets = smallest or MIN_KV_BUCKET, []
    while length < most:
        buckets.append(length)
        length *= 2
    return (*buckets, most)


def prefill_width(length: int, most: int) -> int:
    """The width a compiled engine pads a fresh prefill of `length` tokens to, so that one
    recorded graph serves every length up to it: powers of two from 16 to 256, then multiples
    of 256 (at most 25% padding from 1,024 tokens on, where a prefill's compute starts to
    count), never more than `most` (the cache's slots)."""
    width = 16
    while width < min(length, 256):
        width *= 2
    if width < length:
        width = -(-length // 256) * 256
    return min(width, most)


def own_code(fn: Callable) -> Callable:
    """`fn` over a copy of its code object. Dynamo keeps what it compiled on the code object,
    and an engine's steps skip the guards on their model's modules, so without a copy an
    engine over another model (quantized linears for plain ones, say) would run the first
    engine's compiled step: it failed reading a `weight` that the new linears do not have."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


def warm_prefill_shapes(buckets: Iterable[int], most: int) -> list[tuple[int, int]]:
    """The fresh-prefill shapes `Engine.warmup` records: every batch bucket at the narrowest
    width, and each wider width a prefill of that bucket pads to for free (rows x width <=
    PREFILL_FREE_TOKENS), so that a server's first prompts of each length do not stall every
    running stream while their graph records (three forwards and a capture)."""
    shapes = []
    for bucket in buckets:
        width = prefill_width(1, most)
        while True:
            shapes.append((bucket, width))
            wider = prefill_width(width + 1, most)
            if wider == width or bucket * wider > PREFILL_FREE_TOKENS:
                break
            width = wider
    return shapes


def decode_step(
    model: nn.Module,
    caches: KVCaches,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token for cache rows 0..b-1: tokens and positions [b, 1], attending to cache slots
    `slots` (`arange(kv_len)`; every decoding position < kv_len) -> float32 logits [b, vocab].
    Compiled on CUDA (CUDA graphs) with kv_len, the size of `slots`, a dynamic dimension."""
    caches.set_positions(positions, slots)
    mask = attention_mask(positions, slots)  # [b, 1, 1, kv_len]
    logits = model(tokens, positions=positions, attn_mask=mask, kv_caches=caches)
    return logits[:, -1].float()


def batched_decode_step(model, caches, tokens, positions, slots) -> torch.Tensor:
    """`decode_step` under another name: compiled once for every batch size > 1 (a dynamic
    batch dimension), apart from the batch-1 step and its specialized kernels."""
    return decode_step(model, caches, tokens, positions, slots)


def local_kv_heads(model: nn.Module) -> int:
    """Key/value heads this process holds: all, or its share under tensor parallelism (the
    rows of its `wk` shard, or of the key part of a fused `wqkv`; the blocks of a
    tensor-parallel model run on local shards, lmforge.generate.parallel)."""
    attention = next(iter(model.layers.values())).attention
    kv_dim = (
        attention.fused_sizes[1] if attention.wqkv is not None else attention.wk.weight.shape[0]
    )
    return kv_dim // model.args.head_dim


def use_quantized_kernels(model: nn.Module, device: torch.device) -> int:
    """On a CUDA GPU, swap the model's torchao weight-only linears (tinygemm's int4 included)
    for lmforge's kernels (lmforge/generate/kernels/); returns how many were swapped."""
    if all(type(p.data) is torch.Tensor or isinstance(p, DTensor) for p in model.parameters()):
        return 0  # nothing quantized
    kernels = _kernels(device)
    return kernels.use_quantized_kernels(model, tinygemm=True) if kernels else 0


def _kernels(device: torch.device):
    """lmforge's Triton kernels where they run: CUDA, compute capability 8.0 or later."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return None
    try:
        from lmforge.generate import kernels
    except ImportError as error:  # a CUDA build of torch comes with Triton; in case not
        log.warning("lmforge's decode kernels are off: %s", error)
        return None
    return kernels


def plain_quantized_weights(model: nn.Module) -> None:
    """Quantized (torchao) weights as plain tensors to the compiled graph: each weight becomes a
    parametrization over its inner tensors, rebuilt inside the graph. A tensor-subclass input is
    otherwise taken apart in Python on every call (int8 weight-only 1B on an H200: a 3.9 ms
    decode step, 1.6 ms with plain inputs). The model is inference-only afterwards."""
    if all(type(p.data) is torch.Tensor or isinstance(p, DTensor) for p in model.parameters()):
        return
    from torchao.utils import unwrap_tensor_subclass

    unwrap_tensor_subclass(model)


def warm_up(step: Callable[[], torch.Tensor], state: tuple[torch.Tensor, ...] = ()) -> None:
    """Run `step` twice before its CUDA graph records it (compiling, tuning), the tensors of
    `state` it changes put back after each run, as if it had not run."""
    saved = [tensor.clone() for tensor in state]
    for _ in range(2):
        try:
            step()
        finally:
            for tensor, before in zip(state, saved):
                tensor.copy_(before)


class StepGraphs:
    """CUDA graphs of the engine's steps, recorded by the engine, all in one memory pool: the
    compiled decode steps, one per (batch bucket, KV bucket), and the eager prefill forwards of
    fresh prompts, one per (batch bucket, width bucket). A replay is one call, where
    torch.compile's "reduce-overhead" mode goes through dynamo's guards and its CUDA graph
    trees' bookkeeping on every call (measured on an H200, 1B: batch-1 decode 826 -> 910
    tokens/s, the server at 64 streams 21.1k -> 25.3k tokens/s), and an eager prefill spends
    ~16 ms of host time launching 600 kernels for ~3.4 ms of device work (1B, 16 tokens).
    A step reads its inputs from buffers that never move (weights, cache, the decode row and
    slot views, the prefill input buffers), so nothing is copied in at replay; its output is
    the graph's own buffer, overwritten by the next replay of that graph (the engine consumes
    it first). A new key runs twice uncaptured (compiling, tuning) before it is recorded: a step
    is idempotent (it writes K/V at its positions and advances nothing) or names the `state`
    it changes, which is put back after each of those runs; a key recorded before `clear` (its
    step compiled and tuned) records again at once."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.warmed: set[tuple] = set()  # keys whose steps ran (compiled, tuned) in this process
        # Every step warms up and records on this one stream. cuBLAS keeps a workspace (32 MiB
        # on Hopper) for each stream it has run on, for the life of the process: a stream a
        # recording, as torch.cuda.graph takes by default, left 0.1 GB of workspaces behind
        # a 1B engine's warm-up (benchmarks/engine_release.py on an H200) and up to 1 GiB
        # (32 pooled streams) behind a server's recordings.
        self.stream = torch.cuda.Stream()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed = False  # a recording failed: steps run as they are from then on

    def clear(self) -> None:
        """Forget every graph (their buffers moved); their memory pool goes back with them.
        The stream stays (and its cuBLAS workspace with it)."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def run(
        self, key: tuple, step: Callable[[], torch.Tensor], state: tuple[torch.Tensor, ...] = ()
    ) -> torch.Tensor:
        """Replay `key`'s graph, recording it from `step` (which changes the tensors `state`)
        first if it is new; where CUDA cannot capture a step (this one or an earlier one), run
        it as it is, with a warning."""
        if self.failed:
            return step()
        if key not in self.graphs:
            try:
                self.graphs[key] = self._record(step, state, warm=key not in self.warmed)
                self.warmed.add(key)
            except RuntimeError as error:
                log.warning("running without CUDA graphs: recording %s failed (%s)", key, error)
                self.failed = True
                return step()
        graph, output = self.graphs[key]
        graph.replay()
        return output

    def _record(
        self, step: Callable[[], torch.Tensor], state: tuple[torch.Tensor, ...] = (), *, warm: bool
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.stream.wait_stream(torch.cuda.current_stream())
        if warm:
            with torch.cuda.stream(self.stream):  # off the default stream, as capture wants
                warm_up(step, state)
            torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's event loop thread may touch CUDA meanwhile.
        with torch.cuda.graph(
            graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
        ):
            output = step()
        return graph, output


class ShapeForwards:
    """Forwards of a few padded shapes (fresh prefills, scoring batches): each shape's inputs
    are copied into buffers of its own, where its CUDA graph (`graphs`) reads them; without
    graphs (the CPU) the same buffers feed the forward eagerly."""

    def __init__(self, device: torch.device, graphs: StepGraphs | None) -> None:
        self.device, self.graphs = device, graphs
        self.buffers: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}  # by inputs[0]'s shape

    def run(self, name: str, forward: Callable[..., torch.Tensor], *inputs: torch.Tensor):
        """`forward(*inputs)` with `inputs` (host tensors) in this shape's buffers."""
        shape = tuple(inputs[0].shape)
        if shape not in self.buffers:
            self.buffers[shape] = tuple(torch.empty_like(t, device=self.device) for t in inputs)
        on_cuda = self.device.type == "cuda"
        for buffer, values in zip(self.buffers[shape], inputs):
            buffer.copy_(values.pin_memory() if on_cuda else values, non_blocking=on_cuda)
        step = partial(forward, *self.buffers[shape])
        return step() if self.graphs is None else self.graphs.run((name, *shape), step)


class HostValues:
    """Values on their way from the device to the host, copied without a sync: read them
    only after the step that queued the copy is collected (its `ready` event)."""

    def __init__(self, values: torch.Tensor, *, pinned: bool) -> None:
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=pinned)
        self.host.copy_(values, non_blocking=pinned)
        self._list: list | None = None

    def __getitem__(self, index: int):
        if self._list is None:
            self._list = self.host.tolist()
        return self._list[index]


@dataclass
class _Launch:
    """One step's tokens, on their way to the host."""

    sequences: list[Sequence]
    tokens: torch.Tensor  # [n] on the host (pinned on CUDA), filled when `ready` fires
    ready: torch.cuda.Event | None
    # it holds tokens of constrained sequences that their grammars have not taken yet
    unfed: bool = False


class Engine:
    """Continuous batching over one model and one KV cache (see the module docstring).

    Args:
        model: a model of one of lmforge.models' families (any dtype; quantized weights work).
        tokenizer: a `lmforge.data.tokenizer.Tokenizer`, or None for token-id prompts only.
        max_batch: sequences that run at once (cache rows); more wait for a free row.
        max_seq_len: cache length: prompt plus new tokens of a sequence must fit (default: the
            model's, at most 4096).
        device: where to run (default: where the model is); the model is moved there.
        compile: torch.compile the decode step (default: on CUDA only, with CUDA graphs).
        prefill_chunk: prompt tokens prefilled per step at most (default 2048 on CUDA, 512
            elsewhere).
        fuse: join each block's q/k/v and gate/up projections into one matmul each (plain
            weights only; the state dict keeps Meta's names).
        tune_decode: on CUDA, compile the batch-1 step with coordinate descent tuning (see
            `_compile_decode`).
        quantized_kernels: on CUDA, run torchao weight-only int8 linears (and int4 made on
            the CPU, and tinygemm's int4, made on CUDA, converted once here) through lmforge's
            Triton kernels instead of torchao's: one row in the GEMV, 2-128 rows in
            `quantized_gemm` (dequantized tile by tile; int4 at 2-64 rows in the CUDA kernel
            `kernels.int4_mma` where nvcc builds it), more expanded to bf16 for cuBLAS.
            Off (with fuse, gemv, fuse_blocks and fused_experts off too), the model's modules
            and weights stay as they are: an engine over weights being trained (GRPO's
            rollouts).
        gemv: on CUDA, multiply plain floating-point weights by one row of activations (the
            batch-1 decode step) with lmforge's Triton GEMV instead of inductor's reductions.
        fuse_blocks: on CUDA, where a block's projections are fused and in lmforge's kernels,
            its batch-1 forward is four GEMV launches, the norms, SiLU·up and residual adds
            inside them, around one attention kernel that also applies RoPE and writes the
            cache (`FusedDecodeBlock`, lmforge/generate/decode_attention.py).
        fused_experts: on CUDA, a Mixture-of-Experts block's experts (plain weights, no LoRA)
            run a few tokens (at most `kernels.moe.FUSED_PAIRS` token-expert pairs) in two
            Triton kernels that read only the chosen experts' weights (`FusedExperts`); more
            take the grouped path.
        cache_dtype: the KV cache's (default: the embedding table's). GRPO's rollouts over fp32
            weights under bf16 autocast keep bf16 keys and values, as they are computed.
        prefix_cache_tokens: prompt tokens kept after their sequences ran, in blocks of
            `prefix_block_tokens`, for later prompts that start with them
            (lmforge/generate/prefix_cache.py); 0: none.
        max_adapters: LoRA adapters that can be loaded at once (`load_adapter`), each
            sequence running with its own or none, mixed in a batch
            (lmforge/generate/adapters.py); 0: none (the linears stay as they are).
        max_adapter_rank: the largest rank such an adapter may have.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        *,
        max_batch: int = 1,
        max_seq_len: int | None = None,
        device: str | torch.device | None = None,
        compile: bool | None = None,
        prefill_chunk: int | None = None,
        fuse: bool = True,
        tune_decode: bool = True,
        quantized_kernels: bool = True,
        gemv: bool = True,
        fuse_blocks: bool = True,
        fused_experts: bool = True,
        cache_dtype: torch.dtype | None = None,
        prefix_cache_tokens: int = 0,
        prefix_block_tokens: int = 64,
        max_adapters: int = 0,
        max_adapter_rank: int = 16,
    ) -> None:
        args = model.args
        if max_batch < 1:
            raise ConfigError(f"max_batch={max_batch} must be >= 1")
        max_seq_len = max_seq_len or min(args.max_seq_len, 4096)
        if not 2 <= max_seq_len <= args.max_seq_len:
            raise ConfigError(
                f"max_seq_len={max_seq_len} must be in 2..{args.max_seq_len} (the model's "
                "max_seq_len)"
            )
        device = torch.device(device) if device is not None else model.tok_embeddings.weight.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.model = model.to(device).eval()
        if quantized_kernels:  # whatever the layout: see the docs
            start = time.perf_counter()
            if use_quantized_kernels(model, device):
                log.info(
                    "quantized weights in the kernels' layout: %.1f s", time.perf_counter() - start
                )
        self.adapters = None
        if max_adapters > 0:  # before fusing: wrapped linears do not fuse
            self.adapters = AdapterSlots(
                capacity=max_adapters, max_batch=max_batch, rank=max_adapter_rank, device=device
            )
            use_adapters(model, self.adapters)
        self.fused = fuse and model.fuse_projections()
        kernels = _kernels(device)
        if kernels and quantized_kernels and (packed := kernels.use_int4_mma(model)):
            log.info("%d int4 linears in the CUDA product's layout for 2-64 rows", packed)
        if kernels and gemv:
            kernels.use_gemv(model)
        if kernels and fuse_blocks:
            kernels.use_fused_blocks(model)
        if kernels and fused_experts:
            kernels.use_fused_experts(model)
        self.tokenizer = tokenizer
        self.args = args
        self.device = device
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.on_cuda = device.type == "cuda"
        self.prefill_chunk = prefill_chunk or (2048 if self.on_cuda else 512)
        self.buckets = decode_buckets(max_batch)
        self.kv_buckets = kv_buckets(max_seq_len)
        self.dtype = cache_dtype or model.tok_embeddings.weight.dtype
        self.caches = KVCaches.for_model(
            args,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            dtype=self.dtype,
            device=device,
            num_kv_heads=local_kv_heads(model),
        )
        self.prefix_cache = None
        if prefix_cache_tokens >= prefix_block_tokens > 0:
            self.prefix_cache = PrefixCache(
                self.caches,
                num_blocks=prefix_cache_tokens // prefix_block_tokens,
                block_tokens=prefix_block_tokens,
            )
        self.compiled = self.on_cuda if compile is None else compile
        self.tune_decode = tune_decode
        self.graphs = StepGraphs() if self.compiled and self.on_cuda else None
        self._prefills = ShapeForwards(device, self.graphs)  # fresh prefills, padded
        # Collect step t after launching step t+1 (pointless where nothing is asynchronous).
        self.overlap = self.on_cuda
        self._decode_one, self._decode_many = decode_step, batched_decode_step
        # The `slots` a decode step over each KV bucket's length takes: views of one arange.
        every_slot = torch.arange(max_seq_len, device=device)
        self._kv_slots = {length: every_slot[:length] for length in self.kv_buckets}
        self._last_slot = max_seq_len - 1
        # Each row's next input token and its position; rows not decoding sit at the last slot.
        self._tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._draws = torch.Generator(device=device)  # unseeded sampled rows, all at once
        self._draws.seed()
        self._last_sampler: tuple[list[SamplingParams], Sampler | None] = ([], None)
        # Seeded sequences' uniforms [max_batch, max_seq_len], by cache row and token (made
        # when the first one is admitted; `_draw_ahead`).
        self._uniforms: torch.Tensor | None = None
        self._positions = torch.full((max_batch,), self._last_slot, device=device)
        # A decode step's inputs over rows 0..b-1, per bucket: views [b, 1] made once, so that
        # a CUDA graph reads them where they are instead of copying them in at every replay.
        self._row_inputs = {
            b: (self._tokens[:b, None], self._positions[:b, None]) for b in self.buckets
        }
        if self.compiled:
            if quantized_kernels:  # (it changes the model's modules too)
                plain_quantized_weights(self.model)
            self._compile_decode()
        self._rows: list[Sequence | None] = [None] * max_batch
        self._waiting: deque[Sequence] = deque()
        self._prefilling: deque[Sequence] = deque()  # admitted, prompt not all in the cache
        self._pending: deque[_Launch] = deque()
        self.num_decode_steps = 0
        self.num_shared_prompt_tokens = 0  # prompt tokens copied in the cache, not prefilled
        self._grammars: Grammars | None = None  # made for the first JSON format (`grammars`)

    def _compile_decode(self) -> None:
        """Two compiled steps: batch 1, and any other bucket (one dynamic-batch compile), both
        with a dynamic KV length (on CUDA a graph is still recorded per batch and KV bucket
        pair). The KV length's range starts at the smallest bucket, so dynamo never sees it as
        0 or 1, which it specializes on. On CUDA, the batch-1 step's matrix-vector products
        are lmforge's Triton GEMV (`use_gemv`, `use_quantized_kernels`: opaque ops to
        inductor); its other reductions (the norms) compile with inductor's coordinate descent
        tuning, as do its products when the GEMV is off (`gemv=False`)."""
        # The engine's model is fixed from here on: the steps skip the guards on its modules
        # (checked on every call otherwise: 0.7 ms of a 1.7 ms int4 1B step on an H200); an
        # engine over another model still gets graphs of its own (tests/test_generate.py).
        one = many = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if len(self.kv_buckets) > 1:  # one compile for every KV length
            for slots in self._kv_slots.values():
                torch._dynamo.mark_dynamic(
                    slots, 0, min=self.kv_buckets[0], max=self.kv_buckets[-1]
                )
        row_inputs = [t for b, views in self._row_inputs.items() if b > 1 for t in views]
        for tensor in row_inputs:  # one compile for every bucket > 1
            torch._dynamo.mark_dynamic(tensor, 0, min=2, max=self.max_batch)
        if self.on_cuda:  # the CPU: otherwise inductor's defaults
            # The CUDA graphs (StepGraphs) read and write these where they are: buffers
            # that never move (the caches; views of the slots, tokens and positions).
            static = [*self.caches.tensors(), *self._kv_slots.values()]
            for tensor in static + [t for views in self._row_inputs.values() for t in views]:
                torch._dynamo.mark_static_address(tensor)
            one = {**many, "coordinate_descent_tuning": self.tune_decode}
        # dict(...): torch.compile pops guard_filter_fn from the options it is given.
        self._decode_one = torch.compile(
            own_code(decode_step), fullgraph=True, dynamic=False, options=dict(one)
        )
        self._decode_many = torch.compile(
            own_code(batched_decode_step), fullgraph=True, options=dict(many)
        )

    # ---- sequences ------------------------------------------------------------------------

    def seed_draws(self, seed: int) -> None:
        """Seed the generator that sampled sequences without a seed of their own draw from
        (tensor parallelism: every process seeds it alike, so all draw the same tokens)."""
        self._draws.manual_seed(seed % 2**64)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (see `lmforge.generate.sequence.encode_prompt`)."""
        return encode_prompt(prompt, self.tokenizer, vocab_size=self.args.vocab_size)

    def grammars(self) -> Grammars:
        """The compiler of JSON formats over this engine's vocabulary, made on first use (a
        server makes it at start: importing xgrammar takes ~1 s)."""
        if self.tokenizer is None:
            raise ConfigError("a json_format needs a tokenizer; this model has none")
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.args.vocab_size)
        return self._grammars

    def default_stop_ids(self) -> frozenset[int]:
        if self.tokenizer is not None:
            return frozenset(self.tokenizer.stop_ids)
        eos = self.args.eos_id
        return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)

    def sequence(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        index: int = 0,
        seed: int | None = None,
        num_logprobs: int | None = None,
        shares_prompt_with: Sequence | None = None,
        adapter: str | None = None,
    ) -> Sequence:
        """A checked, not yet added sequence (a ConfigError names what is wrong).

        adapter: a loaded LoRA adapter's name (`load_adapter`) to run with; None: the base.

        shares_prompt_with: a sequence with the same prompt, added before this one: once its
        prompt is in the cache, this sequence's row gets a copy of all but the prompt's last
        token, whose forward alone it runs (G completions of one prompt prefill it once)."""
        ids = self.encode_prompt(prompt)
        if not ids:
            raise ConfigError(f"prompt {index} is empty")
        if len(ids) >= self.max_seq_len:
            raise ConfigError(
                f"prompt {index} has {len(ids)} tokens; max_seq_len={self.max_seq_len} leaves no "
                "room for new tokens (raise max_seq_len or shorten the prompt)"
            )
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer; this model has none")
        generator = None
        if not params.greedy and seed is not None:  # unseeded: the engine's draws
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed % 2**64)
        stop_ids = params.stop_token_ids
        vocab_size = self.args.vocab_size
        if stop_ids is not None and any(i >= vocab_size for i in stop_ids):
            bad = next(i for i in stop_ids if i >= vocab_size)
            raise ConfigError(
                f"stop token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
            )
        if shares_prompt_with is not None and shares_prompt_with.prompt_ids != ids:
            raise ConfigError(
                f"prompt {index} shares the prompt of prompt {shares_prompt_with.index}, "
                "but their tokens differ"
            )
        stop_ids = self.default_stop_ids() if stop_ids is None else frozenset(stop_ids)
        adapter_slot = 0
        if adapter is not None:
            if self.adapters is None:
                raise ConfigError(f"adapter {adapter!r}: this engine takes no adapters")
            adapter_slot = self.adapters.slot(adapter)
        grammar = None
        if params.json_format is not None:
            grammar = self.grammars().matcher(params.json_format, stop_ids)
        return Sequence(
            index=index,
            prompt_ids=ids,
            params=params,
            max_new_tokens=min(params.max_new_tokens, self.max_seq_len - len(ids)),
            stop_ids=stop_ids,
            text_decoder=IncrementalText(self.tokenizer) if self.tokenizer else None,
            num_logprobs=num_logprobs,
            prompt_source=shares_prompt_with,
            generator=generator,
            grammar=grammar,
            adapter_slot=adapter_slot,
        )

    def load_adapter(self, name: str, path) -> None:
        """Load the PEFT LoRA adapter at `path` as `name` (sequences then ask for it by name:
        `sequence(adapter=)`); a ConfigError or ModelFormatError says what is wrong, and
        nothing changes."""
        if self.adapters is None:
            raise ConfigError("this engine takes no adapters (max_adapters=0)")
        load_adapter(self.model, self.adapters, name, path)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`; refused while a sequence waiting or running uses it."""
        if self.adapters is None:
            raise ConfigError("this engine takes no adapters (max_adapters=0)")
        slot = self.adapters.slot(name)
        held = [*self._waiting, *(s for s in self._rows if s is not None)]
        if any(s.adapter_slot == slot for s in held):
            raise ConfigError(f"adapter {name!r} is in use by a running or waiting sequence")
        unload_adapter(self.adapters, name)

    def add(self, sequences: Iterable[Sequence]) -> None:
        """Queue sequences; they start as cache rows free up."""
        self._waiting.extend(sequences)

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence now: it produces nothing more and its row is free for the next step."""
        if sequence.done:
            return
        sequence.cancelled = True
        if sequence in self._waiting:
            self._waiting.remove(sequence)
        self._release(sequence)

    def clear(self) -> None:
        """Cancel everything (a caller that stopped iterating); the engine is then idle."""
        for sequence in [*self._waiting, *(s for s in self._rows if s is not None)]:
            self.cancel(sequence)
        self._pending.clear()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._rows)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._pending or self.num_running)

    # ---- one step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[tuple[Sequence, TokenEvent]]:
        """Admit, decode, prefill, and return the tokens that reached the host: (sequence,
        event) pairs, in no particular order across sequences."""
        launch = self._launch()
        if launch is not None:
            self._pending.append(launch)
        keep = 1 if self.overlap and launch is not None else 0
        events = []
        while len(self._pending) > keep:
            events += self._collect(self._pending.popleft())
        return events

    def release_cache(self) -> None:
        """Give the KV cache's memory back while the engine is idle, with the CUDA graphs
        recorded over it; `reserve_cache` takes it again. The compiled steps stay: GRPO's
        rollout engine compiles once a run and holds its cache only while it samples."""
        if self.has_work:
            raise RuntimeError("release_cache: the engine still has sequences")
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        for tensor in self._cache_tensors():
            tensor.untyped_storage().resize_(0)
        if self.graphs is not None:  # they read and write the old buffers
            self.graphs.clear()
            self._prefills = ShapeForwards(self.device, self.graphs)

    def reserve_cache(self) -> None:
        """Take the KV cache's memory again after `release_cache` (zeroed, as when made; the
        same tensors, so the compiled steps keep them; the graphs record anew)."""
        for tensor in self._cache_tensors():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(tensor.numel() * tensor.element_size())
                tensor.zero_()

    def _cache_tensors(self) -> list[torch.Tensor]:
        pool = self.prefix_cache.tensors() if self.prefix_cache is not None else []
        return [*self.caches.tensors(), *pool]

    def warmup(self) -> None:
        """Compile the decode steps now, and record the CUDA graphs (plain and `greedy`) of
        every batch bucket at the smallest KV bucket (what short sequences use) and of batch 1
        at every KV bucket (a single stream, as `lmforge generate` runs, never pauses to
        record one), and those of fresh prefills (`warm_prefill_shapes`: short prompts; no
        sequence is in the cache yet, so any rows will do). Other shapes record on first use,
        once per process; compiling is not repeated."""
        pairs = [(bucket, self.kv_buckets[0]) for bucket in self.buckets]
        pairs += [(1, kv_len) for kv_len in self.kv_buckets[1:]]
        if not self.compiled:
            pairs = pairs[:1]
        prefills = warm_prefill_shapes(self.buckets, self.max_seq_len) if self.compiled else []
        with torch.no_grad():
            for bucket, kv_len in pairs:  # the first call compiles (and records its graph)
                self.decode_rows(bucket, kv_len).argmax(-1)
                greedy = GREEDY_IN_GRAPH and self.graphs is not None
                if greedy and not self.num_running:  # (it rewrites the rows' inputs)
                    self.decode_rows(bucket, kv_len, greedy=True)
            for bucket, width in prefills:
                tokens = torch.zeros(bucket, width, dtype=torch.long)
                positions = torch.arange(width).clamp(max=self._last_slot).repeat(bucket, 1)
                rows = torch.arange(bucket)
                self._prefills.run("prefill", self._run_prefill, tokens, positions, rows)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def _launch(self) -> _Launch | None:
        self._admit()
        self._copy_shared_prompts()
        sequences, tokens = [], []
        decoding = [
            s
            for s in self._rows
            if s is not None and s.prefilled and s.num_scheduled < s.max_new_tokens
        ]
        if decoding:
            tokens.append(self._decode_running(decoding))
            sequences += decoding
        chunks = self._prefill_chunks() if self._prefill_due(decoding) else []
        if chunks:
            completed, first_tokens = self._prefill(chunks)
            if completed:
                sequences += completed
                tokens.append(first_tokens)
        if not sequences:
            return None
        for sequence in sequences:
            sequence.num_scheduled += 1
        return self._to_host(sequences, torch.cat(tokens) if len(tokens) > 1 else tokens[0])

    def _admit(self) -> None:
        for slot, held in enumerate(self._rows):
            if not self._waiting:
                return
            if held is None:
                sequence = self._waiting.popleft()
                sequence.slot = slot
                if sequence.generator is not None:
                    self._draw_ahead(sequence)
                sequence.admitted_at = self.num_decode_steps
                self._rows[slot] = sequence
                self._prefilling.append(sequence)
                if self.adapters is not None:
                    self.adapters.admit(slot, sequence.adapter_slot)
                if self.prefix_cache is not None and sequence.prompt_source is None:
                    root = self._cache_root(sequence)
                    blocks = self.prefix_cache.match(sequence.prompt_ids, root)
                    sequence.num_cached = self.prefix_cache.load(slot, blocks)
                    sequence.cached_tokens = sequence.num_cached

    def _cache_root(self, sequence: Sequence) -> int:
        """Its prompt's chain root in the prefix cache: its adapter's (keys differ)."""
        return 0 if self.adapters is None else self.adapters.cache_root(sequence.adapter_slot)

    def _draw_ahead(self, sequence: Sequence) -> None:
        """A seeded sampled sequence's uniforms for all its tokens, from its own generator,
        into its cache row's row of `_uniforms` (read one a token by `_sample`)."""
        if self._uniforms is None:
            self._uniforms = torch.zeros(self.max_batch, self.max_seq_len, device=self.device)
        n = sequence.max_new_tokens
        draws = torch.rand(n, generator=sequence.generator, device=self.device)
        self._uniforms[sequence.slot, :n] = draws

    def _release(self, sequence: Sequence) -> None:
        if sequence in self._prefilling:
            self._prefilling.remove(sequence)
        if sequence.slot is not None:
            self._rows[sequence.slot] = None
            # A fill launch: `tensor[i] = int` waits for the GPU's queued work (21.5 ms
            # behind a matmul on an H200; 11% of the server's engine process at 64 streams).
            self._positions[sequence.slot : sequence.slot + 1].fill_(self._last_slot)
            sequence.slot = None

    # ---- decode ---------------------------------------------------------------------------

    def kv_bucket(self, length: int) -> int:
        """The KV bucket of a decode step that must see `length` slots (at most the largest)."""
        return next((b for b in self.kv_buckets if b >= length), self.kv_buckets[-1])

    @torch.no_grad()
    def decode_rows(
        self, bucket: int, kv_len: int | None = None, *, greedy: bool = False
    ) -> torch.Tensor:
        """One compiled decode step over cache rows 0..bucket-1 (a bucket size) with the tokens
        and positions they hold, attending to cache slots 0..kv_len-1 (kv_len rounded up to a
        KV bucket; default: the largest, max_seq_len - 1) -> float32 logits [bucket, vocab];
        changes no state but the caches' slots at those positions (warm-up, benchmarks: a
        sequence decoding at position p attends to `kv_bucket(p + 1)` slots). `greedy`: each
        row's argmax becomes its next input token and its position advances, in the same CUDA
        graph -> those tokens [bucket] (on the device)."""
        kv_len = self.kv_bucket(kv_len or self.max_seq_len)
        slots = self._kv_slots[kv_len]  # [kv_len]
        tokens, positions = self._row_inputs[bucket]  # [bucket, 1] each
        decode = self._decode_one if bucket == 1 else self._decode_many
        step = partial(decode, self.model, self.caches, tokens, positions, slots)
        state = ()
        if greedy:
            step, state = partial(self._greedy_step, step, tokens, positions), (tokens, positions)
        if self.graphs is None:
            return step()
        return self.graphs.run(("greedy" if greedy else "decode", bucket, kv_len), step, state)

    def _greedy_step(self, decode: Callable, tokens: torch.Tensor, positions: torch.Tensor):
        """decode() -> logits [b, vocab]; their argmax [b] becomes `tokens` [b, 1], and
        `positions` [b, 1] advance (`_advance`)."""
        chosen = decode().argmax(dim=-1)
        tokens.copy_(chosen[:, None])
        self._advance(positions)
        return chosen

    def _decode_running(self, decoding: list[Sequence]) -> torch.Tensor:
        """One token for each decoding sequence -> their tokens [n] (on the device)."""
        slots = [s.slot for s in decoding]
        bucket = next(b for b in self.buckets if b > max(slots))
        # Host state only (the same on every process under tensor parallelism, like `bucket`).
        kv_len = self.kv_bucket(max(s.decode_position for s in decoding) + 1)
        self.num_decode_steps += 1
        leading = slots == list(range(len(slots)))  # rows 0..n-1: plain slices
        whole = leading and len(slots) == bucket
        if GREEDY_IN_GRAPH and whole and all(s.plain_greedy for s in decoding):
            # every row of the bucket takes its argmax: chosen inside the step's CUDA graph
            # (on an H200 the argmax, the copy and the position update outside it were ~4
            # launches, 17-27 µs a token of a 0.6-0.8 ms 1B step)
            return self.decode_rows(bucket, kv_len, greedy=True)
        logits = self.decode_rows(bucket, kv_len)
        if leading:
            tokens = self._sample(decoding, logits[: len(slots)])
            self._tokens[: len(slots)] = tokens
        else:
            index = self._to_device(slots)
            tokens = self._sample(decoding, logits[index])
            self._tokens[index] = tokens
        self._advance(self._positions[:bucket])
        return tokens

    def _advance(self, positions: torch.Tensor) -> None:
        """A step's rows' positions one on (rows not decoding stay at the last slot)."""
        positions.add_(1).clamp_(max=self._last_slot)

    # ---- prefill --------------------------------------------------------------------------

    def _prefill_due(self, decoding: list[Sequence]) -> bool:
        """Whether this step prefills. A prefill is an eager forward: its host time (~2.5 ms
        for a 1B model) barely depends on how many prompts it takes, and while sequences
        decode it delays their step. So new prompts wait until PREFILL_BATCH of them are
        admitted or the oldest has waited PREFILL_WAIT_STEPS decode steps; with nothing
        decoding, or a prompt already half in the cache, they go at once."""
        if not decoding or not self._prefilling:
            return True
        oldest = self._prefilling[0]
        return (
            len(self._prefilling) >= PREFILL_BATCH
            or oldest.num_cached > 0
            or self.num_decode_steps - oldest.admitted_at >= PREFILL_WAIT_STEPS
        )

    def _waits_for_prompt_source(self, sequence: Sequence) -> bool:
        """Whether `sequence` waits for its prompt source to cache the prompt it will copy:
        only while that source holds a row and has not cached it yet (a source that finished,
        or runs behind it, leaves it to prefill its own prompt)."""
        source = sequence.prompt_source
        if source is None or sequence.num_cached > 0 or len(sequence.prompt_ids) < 2:
            return False
        return source.slot is not None and source.num_cached < len(sequence.prompt_ids) - 1

    def _copy_shared_prompts(self) -> None:
        """Sequences whose prompt source has cached their prompt take a copy of all its slots
        but the last (whose forward gives their own first token) and prefill only that one;
        the copies of one prompt length go together."""
        by_length: dict[int, list[tuple[int, int]]] = {}  # shared length -> (source, target)
        for sequence in self._prefilling:
            source, shared = sequence.prompt_source, len(sequence.prompt_ids) - 1
            if source is None or sequence.num_cached > 0 or shared < 1 or source.slot is None:
                continue
            if source.num_cached >= shared:
                by_length.setdefault(shared, []).append((source.slot, sequence.slot))
                sequence.num_cached = shared
                self.num_shared_prompt_tokens += shared
        for shared, pairs in by_length.items():
            sources, targets = zip(*pairs)
            self.caches.copy_slots(self._to_device(sources), self._to_device(targets), shared)

    def _prefill_chunks(self) -> list[tuple[Sequence, int, int]]:
        """(sequence, start, length) of the prompt pieces this step prefills, oldest first."""
        budget, chunks = self.prefill_chunk, []
        for sequence in self._prefilling:
            if budget <= 0:
                break
            if self._waits_for_prompt_source(sequence):
                continue
            start = sequence.num_cached
            length = min(len(sequence.prompt_ids) - start, budget)
            chunks.append((sequence, start, length))
            budget -= length
        return chunks

    def _prefill(
        self, chunks: list[tuple[Sequence, int, int]]
    ) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run prompt pieces into their rows; returns the sequences whose prompt is now
        complete and their first tokens [n] (on the device)."""
        completed, last_hidden = [], []
        for group, padded in self._prefill_groups(chunks):
            hidden = self._prefill_forward(group, padded)  # [>= n, >= width, dim]
            last = []
            for row, (sequence, start, length) in enumerate(group):
                sequence.num_cached = start + length
                if sequence.prefilled:
                    self._prefilling.remove(sequence)
                    completed.append(sequence)
                    last.append((row, length - 1))
                    if self.prefix_cache is not None:
                        root = self._cache_root(sequence)
                        self.prefix_cache.store(sequence.slot, sequence.prompt_ids, root)
            if last:  # read now: the next replay of this shape's graph overwrites `hidden`
                index = self._to_device(last)  # [n, 2]: (row, last position)
                last_hidden.append(hidden[index[:, 0], index[:, 1]])
        if not completed:
            return [], None
        logits = self.model.output(torch.cat(last_hidden)).float()  # [n, vocab]
        first = self._sample(completed, logits)
        slots = self._to_device([s.slot for s in completed])
        self._tokens[slots] = first
        self._positions[slots] = self._to_device([len(s.prompt_ids) for s in completed])
        return completed, first

    def _prefill_groups(
        self, chunks: list[tuple[Sequence, int, int]]
    ) -> list[tuple[list[tuple[Sequence, int, int]], tuple[int, int] | None]]:
        """The forwards a step's prompt pieces run in, each with the (rows, width) it pads to
        (None: eager, as it is): one, unless a compiled engine cannot pad them all into one
        graphed shape (a long prompt among short ones, a piece continuing a prompt); then
        fresh pieces of each width bucket that pads well go as a graphed shape of their own (a
        graphed prefill took 0.8 ms of host for the 1B on an H200, an eager one 16), and the
        rest together, eagerly."""
        if not self.compiled:
            return [(chunks, None)]
        padded = self._padded_prefill_shape(chunks)
        if padded is not None:
            return [(chunks, padded)]
        by_width: dict[int, list[tuple[Sequence, int, int]]] = {}
        for chunk in chunks:
            width = prefill_width(chunk[2], self.max_seq_len) if chunk[1] == 0 else 0
            by_width.setdefault(width, []).append(chunk)
        groups, rest = [], []
        for width, group in by_width.items():
            padded = self._padded_prefill_shape(group) if width else None
            if padded is None:
                rest += group
            else:
                groups.append((group, padded))
        return groups + ([(rest, None)] if rest else [])

    def _prefill_forward(
        self, chunks: list[tuple[Sequence, int, int]], padded: tuple[int, int] | None
    ) -> torch.Tensor:
        """The model over the pieces, right-padded into one batch, writing their K/V -> hidden
        states [b, width, dim], row i for piece i. Pieces that all start a prompt attend
        causally (a padded row's real queries see only its real keys): no mask, so
        FlashAttention takes them. `padded`: the (batch bucket, width bucket) fresh pieces
        pad to, whose CUDA graph replays the forward (the eager forward's host time is most of
        a short prompt's: ~16 ms of host for ~3.4 ms of device work, 1B, 16 tokens); None:
        eager, as they are."""
        fresh = all(start == 0 for _, start, _ in chunks)
        batch, width = padded or (len(chunks), max(length for _, _, length in chunks))
        tokens = torch.zeros(batch, width, dtype=torch.long)  # right-padded with id 0
        positions = torch.arange(width).repeat(batch, 1)  # [b, width]
        rows = [sequence.slot for sequence, _, _ in chunks]
        for row, (sequence, start, length) in enumerate(chunks):
            tokens[row, :length] = torch.tensor(sequence.prompt_ids[start : start + length])
            positions[row] += start
        # Padding writes slots past a row's piece (its own future slots, rewritten before they
        # are read) or, clamped, the last slot, which no sequence reads: all that padding rows
        # (in row 0: any row will do) write.
        positions[len(chunks) :] = self._last_slot
        rows += [0] * (batch - len(chunks))
        positions.clamp_(max=self._last_slot)
        if padded is not None:
            return self._prefills.run(
                "prefill", self._run_prefill, tokens, positions, torch.tensor(rows)
            )
        kv_len = max(start + length for _, start, length in chunks)
        tokens, positions, rows = (self._to_device(t) for t in (tokens, positions, rows))
        mask = None if fresh else attention_mask(positions, kv_len)
        return self._run_prefill(tokens, positions, rows, mask)

    def _padded_prefill_shape(self, chunks: list[tuple[Sequence, int, int]]) -> tuple | None:
        """(rows, width) a fresh prefill of `chunks` pads to, or None where padding would cost
        more than the graph saves: past PREFILL_FREE_TOKENS, the padded shape may hold at most
        twice the real tokens, and never more than a chunk (as much as an eager forward runs;
        one long prompt among short ones would otherwise pad every row to its width)."""
        if any(start for _, start, _ in chunks):
            return None  # a piece continuing its prompt attends with a mask, unpadded
        real = sum(length for _, _, length in chunks)
        width = prefill_width(max(length for _, _, length in chunks), self.max_seq_len)
        batch = next(b for b in self.buckets if b >= len(chunks))
        limit = min(
            max(2 * real, PREFILL_FREE_TOKENS), max(self.prefill_chunk, PREFILL_FREE_TOKENS)
        )
        return (batch, width) if batch * width <= limit else None

    def _run_prefill(self, tokens, positions, rows, mask=None) -> torch.Tensor:
        """The prefill forward itself: tokens and positions [b, width], cache rows [b]."""
        kv_len = tokens.shape[1] if mask is None else mask.shape[-1]
        if self.adapters is not None:
            self.adapters.for_rows(rows)
        with shape_free_attention(self.device):
            hidden = self.model(
                tokens,
                positions=positions,
                attn_mask=mask,
                kv_caches=self.caches.rows(rows, positions, kv_len),
                return_hidden=True,
            )
        if self.adapters is not None:
            self.adapters.restore()
        return hidden

    def _to_device(self, values) -> torch.Tensor:
        return to_device(values, self.device)

    # ---- sampling and collecting ----------------------------------------------------------

    def _batch_sampler(self, sequences: list[Sequence]) -> Sampler:
        """The sampler of these rows' settings: the last step's while the rows are the same (a
        new one copies five settings tensors to the device, seven with min_tokens)."""
        params = [s.params for s in sequences]
        last_params, sampler = self._last_sampler
        if len(params) != len(last_params) or any(
            a is not b for a, b in zip(params, last_params, strict=True)
        ):
            # (a row's stop ids follow from its params: the same params, the same ids)
            vocab_size = self.args.vocab_size
            stop_ids = [[i for i in s.stop_ids if i < vocab_size] for s in sequences]
            sampler = Sampler(params, device=self.device, stop_ids=stop_ids)
            self._last_sampler = (params, sampler)
        return sampler

    def _sample(self, sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab] -> each sequence's next token [n] (on the device), every row in
        one sampler call (a call per row launched ~20 kernels a row, every step); queues the
        log-probabilities of the sequences that ask for them (of the logits as they are, before
        min_tokens' masks, as vLLM's)."""
        # rows whose stop ids min_tokens masks this step: the count goes to the device, where
        # the sampler compares it with its tensor of min_tokens (a row past it adds 0s)
        under = any(s.under_min_tokens for s in sequences)
        masks = self._grammar_masks(sequences)
        scores = logits if masks is None else mask_disallowed(logits, *masks)
        if all(s.params.greedy for s in sequences) and not under:
            chosen = scores.argmax(dim=-1)
        else:
            num_generated = None
            if under:
                num_generated = self._to_device([s.num_scheduled for s in sequences])
            sampler = self._batch_sampler(sequences)
            uniforms = None if sampler.all_greedy else self._uniforms_of(sequences)
            chosen = sampler(scores, uniforms=uniforms, num_generated=num_generated)
        wanted = [i for i, s in enumerate(sequences) if s.num_logprobs is not None]
        if wanted:
            self._queue_logprobs([sequences[i] for i in wanted], logits, chosen, wanted)
        return chosen

    def _grammar_masks(self, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The constrained rows among `sequences` [k] and the tokens each may take next
        (`Grammars.masks`: [k, ceil(vocab / 32)] int32), on the device; None where no row is
        constrained, so that unconstrained batches pay nothing.

        A row's mask must follow from all its earlier tokens, but the engine launches step
        t+1 before step t's tokens reach the host (the overlap of the module docstring). So
        here, after this step's forward is launched and before its sampling, the host waits
        for the tokens launched before (`_feed_grammars`: the event recorded after step t's
        copy, not this step's forward, which runs on meanwhile) and feeds them to their
        matchers: a constrained row is never sampled ahead of its grammar, and the other rows
        and the forwards keep their overlap. A matcher that took its stop token (a row
        launched once more before its end reached the host) asks nothing: that token is
        dropped at collection."""
        if not any(s.grammar is not None for s in sequences):
            return None
        for launch in self._pending:
            self._feed_grammars(launch)
        rows = [
            i
            for i, s in enumerate(sequences)
            if s.grammar is not None and not s.done and not s.grammar.is_terminated()
        ]
        if not rows:
            return None
        bitmask = self._grammars.masks([sequences[i].grammar for i in rows])
        return self._to_device(rows), self._to_device(bitmask)

    def _feed_grammars(self, launch: _Launch) -> None:
        """The tokens of `launch`'s constrained sequences to their matchers, once (waiting for
        the tokens to reach the host)."""
        if not launch.unfed:
            return
        launch.unfed = False
        if launch.ready is not None:
            launch.ready.synchronize()
        for sequence, token in zip(launch.sequences, launch.tokens.tolist()):
            grammar = sequence.grammar
            if grammar is None or sequence.done or grammar.is_terminated():
                continue
            if not grammar.accept_token(token):  # its mask allowed it: never happens
                raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    def _uniforms_of(self, sequences: list[Sequence]) -> torch.Tensor:
        """The uniform each row draws its token with [n]: a seeded sequence's own (drawn
        ahead, by its cache row and its count of tokens), the others' from the engine's
        generator, all at once."""
        seeded = [s.generator is not None for s in sequences]
        if not any(seeded):
            return torch.rand(len(sequences), generator=self._draws, device=self.device)
        rows = self._to_device([s.slot for s in sequences])
        tokens = self._to_device([s.num_scheduled if s.generator else 0 for s in sequences])
        own = self._uniforms[rows, tokens]
        if all(seeded):
            return own
        batch = torch.rand(len(sequences), generator=self._draws, device=self.device)
        return torch.where(self._to_device(seeded), own, batch)

    def _queue_logprobs(self, wanted: list[Sequence], logits, chosen, rows: list[int]) -> None:
        """Queue the chosen tokens' log-probabilities of `wanted` (logits' `rows`), copied to
        the host with the step's tokens (no sync), and, where asked for, the best k (a sync:
        an API option)."""
        if len(rows) < logits.shape[0]:
            index = self._to_device(rows)
            logits, chosen = logits[index], chosen[index]
        picked = logits.gather(-1, chosen[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)
        values = HostValues(picked.float(), pinned=self.on_cuda)
        k = max(s.num_logprobs for s in wanted)
        tops = [None] * len(wanted)
        if k:
            top_values, top_ids = logits.log_softmax(dim=-1).topk(min(k, logits.shape[-1]))
            tops = [list(zip(i.tolist(), v.tolist())) for i, v in zip(top_ids, top_values)]
        for row, sequence in enumerate(wanted):
            n = sequence.num_logprobs
            sequence.logprobs.append((values, row, tops[row][:n] if n else None))

    def _to_host(self, sequences: list[Sequence], tokens: torch.Tensor) -> _Launch:
        host = torch.empty(len(sequences), dtype=torch.long, pin_memory=self.on_cuda)
        host.copy_(tokens, non_blocking=self.on_cuda)
        ready = None
        if self.on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        unfed = any(s.grammar is not None for s in sequences)
        return _Launch(sequences, host, ready, unfed)

    def _collect(self, launch: _Launch) -> list[tuple[Sequence, TokenEvent]]:
        if launch.ready is not None:
            launch.ready.synchronize()
        self._feed_grammars(launch)
        events = []
        for sequence, token in zip(launch.sequences, launch.tokens.tolist()):
            if sequence.done:  # stopped in an earlier step, or cancelled
                continue
            event = sequence.push(token)
            if sequence.num_logprobs is not None:
                values, row, event.top_logprobs = sequence.logprobs.popleft()
                event.logprob = values[row]
            events.append((sequence, event))
            if sequence.finished:
                self._release(sequence)
        return events
