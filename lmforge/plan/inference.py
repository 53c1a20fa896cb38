"""Memory arithmetic of inference, per GPU, as lmforge's engine and scorer run it.

Three kinds of work, each a `task` of `InferenceSetup`:

- "generate" (`lmforge generate`, the server, lm-eval's generation): the `Engine`
  (lmforge/generate/engine.py) holds the weights and one static KV cache of `batch` rows ×
  `seq_len` slots per layer, k and v [rows, kv_heads / tp, slots, head_dim] in the model's dtype;
  a step prefills up to `prefill_chunk` prompt tokens (right-padded rows; each layer reads its
  rows' first kv_len slots as a copy, and SDPA with a mask may take the math kernel, which holds
  the attention scores) or decodes one token per row, then float32 logits [rows, vocab].
- "score" (lm-eval's log-likelihoods, `lmforge.generate.logprobs`): one forward of `batch`
  right-padded rows of `seq_len` tokens without a cache (causal SDPA: flash), then the logits
  of the scored positions only, in the model's dtype, float32, and their log-softmax.
- "quantize" (`lmforge quantize` streaming from safetensors): one tensor on the device at a
  time (as stored, cast, an fp32 working copy in torchao, the quantized result); the host holds
  about two shards. With `calibrated` (`--method gptq`, llm-compressor in a process of its own,
  on the CPU): nothing on the GPU; the host holds the whole model as stored, one block's GPTQ
  Hessians (fp32 [K, K] a linear) and the calibration samples' activations between blocks.

Weights under tensor parallelism (`lmforge launch --nproc N`, lmforge/generate/parallel.py:
the trainer's TP plan without sequence parallelism) are split N ways where the plan splits
them (attention heads, MLP columns, the embedding and output by vocabulary); the norms are
whole on every GPU. Quantized artifacts load on one GPU only (the TP loader refuses them).
Overhead is the training planner's: the CUDA context, NCCL's buffers with more than one
process, and a few percent of the peak for the caching allocator.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from lmforge.errors import ConfigError
from lmforge.models import ModelArgs
from lmforge.plan.memory import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    DTYPE_BYTES,
    NCCL_BYTES,
    GiB,
    PhasedMemory,
    Setup,
    param_specs,
    parse_memory,
    tp_local_numel,
)
from lmforge.quantize.schemes import INT4_GROUP_SIZES, default_int4_group_size
from lmforge.quantize.schemes import SCHEMES as QUANT_SCHEMES

TASKS = ("generate", "score", "eval", "quantize")  # eval: lm-eval, scoring and generating
# Bytes of torchao's weight tensors (measured on their flattened parts, tests/test_plan_inference):
# (bytes per value, bytes per scale group). int8-wo: int8 values, an fp32 scale and an int8
# zero point per row or group. int4-wo made on the CPU (IntxUnpackedToInt8Tensor): one value per
# int8 byte, a bf16 scale and an int8 zero point per group. int4-wo made on CUDA
# (Int4TilePackedTo4dTensor, tinygemm): two values per byte, a bf16 scale and zero per group.
# fp8 (Float8Tensor): float8 values and an fp32 scale per row.
QUANT_LAYOUT = {
    ("int8-wo", False): (1.0, 5),
    ("int4-wo", False): (1.0, 3),
    ("int4-wo", True): (0.5, 4),
    ("fp8", False): (1.0, 4),
}
DEFAULT_PREFILL_CHUNK = 2048  # the engine's on CUDA
MXFP4_GROUP = 32  # values a power-of-two scale byte covers in MXFP4
# Scored positions a row of lm-eval's log-likelihood requests is planned with: its continuations
# are short (a choice, an answer); perplexity scores every position.
EVAL_SCORED_TOKENS = 256


@dataclass(frozen=True, kw_only=True)
class InferenceSetup:
    """Everything the memory of an inference stage depends on (see the module docstring)."""

    args: ModelArgs
    task: str = "generate"
    tp: int = 1
    dtype: str = "bf16"  # the weights' and activations' dtype (fp32 / bf16 / fp16)
    quantization: str | None = None  # int8-wo | int4-wo: a quantized artifact
    group_size: int | None = None  # None: per row (int8-wo); int4-wo: as `lmforge quantize`
    int4_packed: bool = True  # int4-wo made on CUDA (tinygemm's layout); False: made on the CPU
    quantize_output: bool = False  # the output projection quantized too
    mxfp4_experts: bool = False  # the hub's MXFP4 experts kept (gpt-oss; one process)
    batch: int = 1  # KV-cache rows (generate) or rows of one forward (score)
    seq_len: int = 4096  # KV-cache slots per row (generate) or tokens per row (score)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    scored_tokens: int | None = None  # score: positions per row through the output (None: all)
    max_shard_bytes: int = 5 * 10**9  # quantize: the writer's shard size (host memory)
    calibrated: bool = False  # quantize: GPTQ on `batch` samples of `seq_len` tokens (the host)

    def replace(self, **changes) -> InferenceSetup:
        return dataclasses.replace(self, **changes)

    @property
    def value_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def scored_per_row(self) -> int:
        """Positions a scoring row takes through the output (at most the row's length)."""
        return min(self.scored_tokens or self.seq_len, self.seq_len)


def check_inference_setup(setup: InferenceSetup) -> None:
    """Refuse what the engine or the TP loader refuses (ConfigError, one line)."""
    if setup.task not in TASKS:
        raise ConfigError(f"task {setup.task!r}; allowed: {', '.join(TASKS)}")
    if setup.dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {setup.dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    if setup.quantization is not None and setup.quantization not in QUANT_SCHEMES:
        raise ConfigError(
            f"quantization {setup.quantization!r}; allowed: {', '.join(QUANT_SCHEMES)}"
        )
    if setup.tp < 1 or setup.batch < 1 or setup.seq_len < 1 or setup.prefill_chunk < 1:
        raise ConfigError("tp, batch, seq_len and prefill_chunk must be >= 1")
    if setup.scored_tokens is not None and setup.scored_tokens < 1:
        raise ConfigError(f"scored_tokens {setup.scored_tokens} must be >= 1")
    if setup.args.num_kv_heads % setup.tp:
        raise ConfigError(
            f"{setup.tp} processes must divide the model's num_kv_heads "
            f"({setup.args.num_kv_heads}): the KV cache is split by kv heads"
        )
    if setup.tp > 1 and setup.quantization is not None and setup.task != "quantize":
        raise ConfigError(
            "tensor-parallel inference takes a bf16/fp32 model, not a quantized artifact; run "
            "a quantized model on one GPU"
        )


# ----------------------------------------------------------------------------- components


def _training_view(setup: InferenceSetup) -> Setup:
    """The training planner's Setup with the same model and TP degree (for its parameter
    shapes and TP splits; no FSDP)."""
    return Setup(args=setup.args, gpus=setup.tp, tp=setup.tp, dp_shard=1)


def quantized_bytes(numel: int, rows: int, setup: InferenceSetup) -> int:
    """Bytes of one linear weight of `numel` values in `rows` output rows under the scheme."""
    packed = setup.quantization == "int4-wo" and setup.int4_packed
    per_value, per_group = QUANT_LAYOUT[(setup.quantization, packed)]
    group = setup.group_size
    if group is None and setup.quantization == "int4-wo":
        # What `lmforge quantize` picks: 256, or the largest size dividing every input size.
        a = setup.args
        sizes = (a.dim, a.num_heads * a.head_dim, a.ffn_dim)
        group = default_int4_group_size(sizes) or INT4_GROUP_SIZES[-1]
    groups = rows if group is None else math.ceil(numel / group)
    return int(numel * per_value) + groups * per_group


def weight_bytes(setup: InferenceSetup) -> int:
    """The model's weights on one GPU (rank 0's TP shard): linears of the blocks quantized when
    the artifact is (the output projection when `quantize_output`), the rest in the dtype; a
    tied output projection is the embedding (counted once)."""
    view = _training_view(setup)
    total = 0
    for spec in param_specs(view, num_layers=1):
        numel = tp_local_numel(spec, view)
        count = setup.args.num_layers if spec.group != "root" else 1
        is_output = spec.name == "output.weight"
        quantized = setup.quantization is not None and (
            (spec.group != "root" and spec.matmul) or (is_output and setup.quantize_output)
        )
        if setup.mxfp4_experts and spec.expert and setup.tp == 1:
            total += count * (numel // 2 + numel // MXFP4_GROUP)  # e2m1 two a byte, a scale
        elif quantized:
            rows = numel // spec.shape[1]  # the shard's output rows
            total += count * quantized_bytes(numel, rows, setup)
        else:
            total += count * numel * cache_dtype_bytes(setup)
    if setup.quantization is not None and setup.quantize_output and setup.args.tie_embeddings:
        # quantizing the output of a tied model gives it its own (quantized) copy
        a = setup.args
        rows = math.ceil(a.vocab_size / setup.tp)
        total += quantized_bytes(rows * a.dim, rows, setup)
    return total


def cache_dtype_bytes(setup: InferenceSetup) -> int:
    """Bytes of the unquantized weights, and so of the KV cache (the embedding's dtype): int4
    made on CUDA casts the whole model to bf16 first (tinygemm computes in bf16)."""
    packed_int4 = setup.quantization == "int4-wo" and setup.int4_packed
    return 2 if packed_int4 else setup.value_bytes


def kv_cache_bytes(setup: InferenceSetup) -> int:
    """k and v of every layer: [batch, kv_heads / tp, seq_len, head_dim] each, as
    `lmforge.modules.kv_cache.KVCaches.num_bytes` counts them on one process."""
    a = setup.args
    local_heads = a.num_kv_heads // setup.tp
    per_layer = 2 * setup.batch * local_heads * setup.seq_len * a.head_dim
    return a.num_layers * per_layer * cache_dtype_bytes(setup)


def forward_bytes_per_token(setup: InferenceSetup) -> int:
    """What one token holds at the peak of a block's forward without autograd: the residual
    stream, the normed input, RMSNorm's fp32 copy, and the larger of the attention's
    projections (q, k, v, RoPE'd q and k, output) and the MLP's (the fused gate/up output,
    silu(gate) and the product), the latter split by TP."""
    a = setup.args
    c = cache_dtype_bytes(setup)
    local = max(4 * a.ffn_dim, 3 * a.q_dim + 3 * a.kv_dim) / setup.tp
    return int(c * (2 * a.dim + local) + 4 * a.dim)


def _logits_bytes(setup: InferenceSetup, positions: int) -> int:
    """Logits of `positions` rows: the output's dtype (each rank's vocabulary share, then
    all-gathered whole) and float32."""
    v = setup.args.vocab_size
    c = cache_dtype_bytes(setup)
    return positions * (c * v + c * math.ceil(v / setup.tp) + 4 * v)


def prefill_bytes(setup: InferenceSetup) -> int:
    """One prefill step of `prefill_chunk` tokens attending to `seq_len` slots (the worst
    step: a chunk at the end of a full row): the block's activations, each layer's copy of its
    rows' keys and values, the bool mask and (the math kernel) the scores and their softmax."""
    a = setup.args
    tokens = min(setup.prefill_chunk, setup.batch * setup.seq_len)
    rows = max(1, min(setup.batch, math.ceil(tokens / setup.seq_len)))
    kv_len = setup.seq_len
    c = cache_dtype_bytes(setup)
    kv_copy = 2 * rows * (a.num_kv_heads // setup.tp) * kv_len * a.head_dim * c
    mask = tokens * kv_len
    scores = 2 * tokens * (a.num_heads // setup.tp) * kv_len * c
    return tokens * forward_bytes_per_token(setup) + kv_copy + mask + scores


def decode_bytes(setup: InferenceSetup) -> int:
    """One decode step over every row: a token per row through a block, its mask over the
    slots, and the float32 logits [batch, vocab] the sampler reads."""
    rows = setup.batch
    mask = rows * setup.seq_len
    scores = (
        2 * rows * (setup.args.num_heads // setup.tp) * setup.seq_len * cache_dtype_bytes(setup)
    )
    return rows * forward_bytes_per_token(setup) + mask + scores + _logits_bytes(setup, rows)


def score_bytes(setup: InferenceSetup) -> dict[str, int]:
    """One scoring forward: activations of batch × seq_len tokens plus the hidden states it
    returns, then the scored positions' logits and log-softmax (float32)."""
    a = setup.args
    tokens = setup.batch * setup.seq_len
    scored = setup.batch * setup.scored_per_row
    c = cache_dtype_bytes(setup)
    hidden = tokens * a.dim * c
    return {
        "activations": tokens * forward_bytes_per_token(setup) + hidden,
        "logits": _logits_bytes(setup, scored) + 4 * scored * a.vocab_size,
    }


# Rows up to which a quantized product runs without expanding its weight (the GEMV at one row,
# `quantized_gemm` up to this many) = lmforge.generate.kernels.quantized_gemm.MAX_ROWS.
QUANTIZED_GEMM_ROWS = 128


def expanded_weight_bytes(setup: InferenceSetup, rows: int) -> int:
    """A quantized artifact multiplies more than QUANTIZED_GEMM_ROWS rows of activations (a
    prefill chunk, a scoring batch) by its weights expanded to bf16 one linear at a time
    (lmforge/generate/kernels/): the largest, the fused gate/up projection or a quantized
    output projection. Decoding up to that many sequences needs none, and fp8 none at all (its
    products read the float8 weights as they are)."""
    if setup.quantization in (None, "fp8") or rows <= QUANTIZED_GEMM_ROWS:
        return 0
    a = setup.args
    largest = max(2 * a.ffn_dim * a.dim, a.vocab_size * a.dim if setup.quantize_output else 0)
    return 2 * largest


def gptq_host_bytes(setup: InferenceSetup) -> int:
    """GPTQ's host memory (llm-compressor, one block at a time): the model as stored, the
    block's Hessians (fp32 [K, K] for each of its seven linears' inputs), and the samples'
    hidden states [batch, seq_len, dim] in fp32 entering and leaving the block."""
    a = setup.args
    model = a.num_params() * setup.value_bytes
    heads = a.num_heads * a.head_dim
    hessians = 4 * (5 * a.dim**2 + heads**2 + a.ffn_dim**2)
    activations = 2 * 4 * setup.batch * setup.seq_len * a.dim
    return model + hessians + activations


def quantize_device_bytes(setup: InferenceSetup) -> int:
    """Streaming quantization holds one tensor on the device: the largest (the embedding or a
    projection) as read, cast to bf16, torchao's fp32 working copy, and the result."""
    a = setup.args
    largest = max(a.vocab_size * a.dim, a.ffn_dim * a.dim)
    return largest * (setup.value_bytes + 2 + 4 + 1)


# ----------------------------------------------------------------------------- the plan


@dataclass(kw_only=True)
class InferencePlan(PhasedMemory):
    """Per-GPU memory of an inference stage: its phases' components, the peak, the verdict."""

    setup: InferenceSetup
    host_bytes: int = 0  # host memory the stage needs besides the process itself
    notes: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.setup.tp

    @property
    def fits(self) -> bool | None:
        return self.gpu_fits


def plan_inference(setup: InferenceSetup, gpu_memory: int | str | None = None) -> InferencePlan:
    """Per-GPU memory of `setup` (see the module docstring); gpu_memory as `plan_memory`'s."""
    check_inference_setup(setup)
    gpu_memory = parse_memory(gpu_memory) if gpu_memory is not None else None
    notes: list[str] = []
    host = 0
    if setup.task == "quantize" and setup.calibrated:
        phases = {"GPTQ on the host": {"(no GPU memory)": 0}}
        host = gptq_host_bytes(setup)
        notes.append(f"host: about {host / GiB:.1f} GiB (the model, one block's Hessians)")
    elif setup.task == "quantize":
        phases = {"one tensor": {"tensor and its quantized copy": quantize_device_bytes(setup)}}
        host = 2 * setup.max_shard_bytes
        notes.append(f"host: about {host / GiB:.0f} GiB (one shard being written, one tensor)")
    else:
        weights = weight_bytes(setup)
        phases = {}
        if setup.task in ("score", "eval"):
            phases["scoring forward"] = {"weights": weights, **score_bytes(setup)}
        if setup.task in ("generate", "eval"):
            cache = kv_cache_bytes(setup)
            phases["prefill"] = {
                "weights": weights,
                "KV cache": cache,
                "prefill": prefill_bytes(setup),
            }
            phases["decode"] = {
                "weights": weights,
                "KV cache": cache,
                "decode step": decode_bytes(setup),
            }
        rows = {
            "scoring forward": setup.batch * setup.seq_len,
            "prefill": min(setup.prefill_chunk, setup.batch * setup.seq_len),
            "decode": setup.batch,
        }
        for name, phase in phases.items():
            if expanded := expanded_weight_bytes(setup, rows[name]):
                phase["expanded weight"] = expanded
    peak_phase = max(phases, key=lambda k: sum(phases[k].values()))
    peak = sum(phases[peak_phase].values())
    overhead = CUDA_CONTEXT_BYTES + (NCCL_BYTES if setup.tp > 1 else 0)
    overhead += int(ALLOCATOR_SLACK * peak)
    if setup.calibrated:
        overhead = 0  # (its worker runs on the CPU)
    return InferencePlan(
        setup=setup,
        phases=phases,
        peak_phase=peak_phase,
        overhead=overhead,
        gpu_memory=gpu_memory,
        host_bytes=host,
        notes=notes,
    )


def describe_inference(setup: InferenceSetup) -> str:
    """One line: what was planned."""
    a = setup.args
    count = a.num_params()
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    weights = setup.quantization or setup.dtype
    if setup.mxfp4_experts and setup.tp == 1:
        weights += ", the experts MXFP4"
    if setup.task == "quantize" and setup.calibrated:
        return (
            f"GPTQ of a {size} model on the host (llm-compressor), {setup.batch} samples × "
            f"{setup.seq_len} tokens"
        )
    if setup.task == "quantize":
        return f"streaming quantization of a {size} model, one tensor at a time"
    where = f"{setup.tp} GPUs (tensor parallel)" if setup.tp > 1 else "one GPU"
    scoring = f"scoring {setup.batch} × {setup.seq_len} tokens"
    if setup.scored_tokens is not None:
        scoring += f" ({setup.scored_per_row} through the output a row)"
    if setup.task == "score":
        work = scoring
    elif setup.task == "eval":
        work = f"{scoring} or generating with a KV cache as large"
    else:
        work = (
            f"KV cache {setup.batch} × {setup.seq_len} tokens, prefill chunk {setup.prefill_chunk}"
        )
    return f"{size} in {weights} on {where}; {work}"


def format_inference_plan(plan: InferencePlan) -> str:
    """The per-GPU table of an inference plan, as `lmforge plan` prints a training one."""
    lines = [describe_inference(plan.setup), ""]
    names = list(plan.phases)
    components = list(dict.fromkeys(c for phase in plan.phases.values() for c in phase))
    width = max(36, *(len(c) + 2 for c in components))
    lines.append(f"{'GiB per GPU':<{width}}" + "".join(f"{n:>16}" for n in names))
    for component in components:
        values = "".join(f"{plan.phases[n].get(component, 0) / GiB:>16.2f}" for n in names)
        lines.append(f"{component:<{width}}{values}")
    lines.append(f"{'overhead (context, NCCL, slack)':<{width}}{plan.overhead / GiB:>16.2f}")
    lines.append(
        f"{'total at the peak (' + plan.peak_phase + ')':<{width}}{plan.total / GiB:>16.2f}"
    )
    if plan.gpu_memory is not None:
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(
            f"{verdict}: {plan.total / GiB:.1f} of {plan.gpu_memory / GiB:.1f} GiB per GPU "
            f"({plan.total / plan.gpu_memory:.0%})"
        )
    lines += [f"note: {note}" for note in plan.notes]
    lines += [f"suggestion: {s}" for s in plan.suggestions]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- suggestions


def suggest_inference(
    setup: InferenceSetup,
    gpu_memory: int | str,
    *,
    max_gpus: int = 8,
    command: str = "generate",
    batch_name: str = "batch",
) -> list[str]:
    """Single changes that make `setup` fit `gpu_memory`, as text, most useful first: tensor
    parallelism over more GPUs of the node, int4 weights on one GPU, a smaller batch, a
    shorter context."""
    if setup.task == "quantize":
        return ['quantize on the CPU (device = "cpu"): streaming needs one tensor of memory']
    out = []

    def fits(candidate: InferenceSetup) -> InferencePlan | None:
        plan = plan_inference(candidate, gpu_memory)
        return plan if plan.fits else None

    if setup.quantization is None:
        for tp in (2, 4, 8, 16):
            if setup.tp < tp <= max_gpus and setup.args.num_kv_heads % tp == 0:
                plan = fits(setup.replace(tp=tp))
                if plan is not None:
                    out.append(
                        f"tensor parallelism over {tp} GPUs (launcher.nproc_per_node = {tp}; by "
                        f"hand: lmforge launch --nproc {tp} {command} ...): "
                        f"{plan.total / GiB:.1f} GiB per GPU"
                    )
                    break
        plan = fits(setup.replace(quantization="int4-wo", group_size=None, tp=1))
        if plan is not None:
            out.append(
                'int4 weights on one GPU (a quantize stage with scheme = "int4-wo" first): '
                f"{plan.total / GiB:.1f} GiB"
            )
    for name, key in ((batch_name, "batch"), ("a context of", "seq_len")):
        value = getattr(setup, key)
        while value > 1:
            value //= 2
            plan = fits(setup.replace(**{key: value}))
            if plan is not None:
                what = f"{name} = {value}" if key == "batch" else f"{name} {value} tokens"
                out.append(f"{what}: {plan.total / GiB:.1f} GiB per GPU")
                break
    return out
