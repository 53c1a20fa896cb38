"""Reading quantized artifacts: whether a directory holds torchao weights, and its state dict
with torchao tensor subclasses (unpacking lmforge's two-int4-per-byte storage). Written by
`lmforge.quantize.quantize`; read by `lmforge.load`, which is why nothing here imports above
`lmforge.artifact` and the model family's key map.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from pathlib import Path

import torch

from lmforge import artifact, models
from lmforge.errors import ModelFormatError, UserError

log = logging.getLogger(__name__)

PACKED_SUFFIX = "_int4x2"  # `<module>._weight_qdata_int4x2`: two int4 values per byte
# config.json of a packed artifact: quant_method "torchao" with this config type, which torchao
# does not have, so transformers and vLLM refuse it (older artifacts: the method below, which
# transformers skipped with a warning and then loaded random weights).
PACKED_CONFIG_TYPE = "LmforgePackedInt4_LoadWithLmforgeOnly"
LEGACY_PACKED_QUANT_METHOD = "lmforge-int4x2"
PACKED_METADATA_KEY = "lmforge_int4x2"  # safetensors metadata: JSON list of packed keys


def require_torchao() -> None:
    """Import torchao (quietly), or a UserError naming the install command when it is missing."""
    if "torchao.prototype.safetensors.safetensors_support" in sys.modules:
        return
    # Its import warns about optional CUDA extensions (mxfp8, cutlass) and a pytree
    # registration, none of which weight-only quantization uses: keep them off the console.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.prototype.safetensors.safetensors_support
        import torchao.quantization  # noqa: F401
    except ImportError:
        raise UserError(
            "torchao is not installed; quantized models need it: pip install 'lmforge[quant]'"
        ) from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def quiet_torchao() -> None:
    """Import torchao quietly where it is installed (for packages that import it themselves,
    such as compressed-tensors); nothing where it is not."""
    with contextlib.suppress(UserError):
        require_torchao()


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], last dim even -> uint8 with two values per byte (element 2j in
    the low nibble, 2j+1 in the high one)."""
    assert values.dtype == torch.int8 and values.shape[-1] % 2 == 0, (values.dtype, values.shape)
    nibbles = (values.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [..., n] -> int8 [..., 2n] in [-8, 7]."""
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    both = torch.stack((low, high), dim=-1).flatten(-2)
    return (both ^ 8) - 8  # sign-extend the 4-bit two's complement


def is_quantized(directory: Path) -> bool:
    """Whether a model directory holds torchao-quantized weights: our lineage says so, or its
    config.json has a torchao (or our packed) `quantization_config`."""
    directory = Path(directory)
    lineage_path = directory / artifact.LINEAGE_NAME
    if lineage_path.exists():
        quantization = artifact.read_json(lineage_path).get("quantization") or {}
        if quantization and quantization.get("format") != "compressed-tensors":  # is_compressed
            return True
    config_path = directory / artifact.CONFIG_NAME
    if not config_path.exists():
        return False
    method = (artifact.read_json(config_path).get("quantization_config") or {}).get("quant_method")
    return method in ("torchao", LEGACY_PACKED_QUANT_METHOD)


def _read_flat(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    tensors, metadata = {}, {}
    for file in artifact.weight_files(directory):
        try:
            with safe_open(file, framework="pt") as handle:
                metadata.update(handle.metadata() or {})
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[key] = handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise ModelFormatError(f"{file}: cannot read safetensors ({err})") from None
    return tensors, metadata


def read_quantized_state(directory: Path, args) -> dict[str, torch.Tensor]:
    """Our-named state dict of a quantized artifact, torchao subclasses for quantized weights
    (on the CPU)."""
    require_torchao()
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict
    from torchao.prototype.safetensors.safetensors_utils import is_metadata_torchao

    directory = Path(directory)
    tensors, metadata = _read_flat(directory)
    for key in json.loads(metadata.get(PACKED_METADATA_KEY, "[]")):
        if key not in tensors:
            raise ModelFormatError(f"{directory}: packed tensor {key} is listed but absent")
        tensors[key.removesuffix(PACKED_SUFFIX)] = unpack_int4(tensors.pop(key))
    if not is_metadata_torchao(metadata):
        raise ModelFormatError(
            f"{directory}: the safetensors metadata does not describe torchao tensors; a "
            "quantized artifact is written by `lmforge quantize` or transformers' TorchAoConfig"
        )
    try:
        state, leftover = unflatten_tensor_state_dict(tensors, metadata)
    except ValueError as err:
        raise ModelFormatError(f"{directory}: cannot rebuild the torchao tensors ({err})") from None
    if leftover:
        raise ModelFormatError(
            f"{directory}: tensors not described by the metadata: {sorted(leftover)[:4]}"
        )
    return models.hf_state_dict_to_ours(state, args, directory)


def has_mxfp4_experts(directory: Path) -> bool:
    """Whether a model directory's config.json says MXFP4 (gpt-oss's hub files: experts as
    e2m1 blocks and power-of-two scales, which the inference commands keep so)."""
    config_path = Path(directory) / artifact.CONFIG_NAME
    if not Path(directory).is_dir() or not config_path.exists():
        return False
    config = artifact.read_json(config_path).get("quantization_config") or {}
    return config.get("quant_method") == "mxfp4"


def is_compressed(directory: Path) -> bool:
    """Whether a model directory's config.json says compressed-tensors (`lmforge quantize
    --format compressed-tensors`, llm-compressor)."""
    config_path = Path(directory) / artifact.CONFIG_NAME
    if not config_path.exists():
        return False
    config = artifact.read_json(config_path).get("quantization_config") or {}
    return config.get("quant_method") == "compressed-tensors"


def read_compressed_state(directory: Path, args, dtype=None) -> dict[str, torch.Tensor]:
    """Our-named state dict of a compressed-tensors artifact, each packed linear as the torchao
    tensor lmforge's own quantizer makes (`compressed_as_torchao`), computing in `dtype` (its
    scales and the other weights cast; None: as stored): what `lmforge.load` builds a
    quantized model from, so that generate, eval and serve run it as they run lmforge's
    int8 / int4 (the engine converting it once at load into its kernels' layout)."""
    state = artifact.read_safetensors(Path(directory))
    if dtype is not None:
        state = {n: t.to(dtype) if _high_precision(t) else t for n, t in state.items()}
    return models.hf_state_dict_to_ours(compressed_as_torchao(state), args, directory)


def _high_precision(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.element_size() > 1  # not float8 values


def compressed_as_torchao(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A compressed-tensors HF state dict with each linear's weight as torchao's: int4
    (`IntxUnpackedToInt8Tensor`, groups) or int8 (`Int8Tensor`) weight-only, zero points 0, in
    its scale's dtype (the same values w = q * scale); float8 (FP8-dynamic) as `Float8Tensor`
    with a scale a row and its activations quantized a row at run time. A Mixture-of-Experts'
    experts are stacked a layer at a time and stay quantized (`_experts_stacked`)."""
    require_torchao()
    from torchao.quantization import Int8Tensor, IntxUnpackedToInt8Tensor

    out, rest = {}, {}
    state = _experts_stacked(state, out)
    for prefix, values, scale in _float8_linears(state, rest):
        out[f"{prefix}.weight"] = _float8_tensor(values, scale)
    for prefix, q, scale, bits in _packed_linears(rest, out):
        block = [1, q.shape[1] // scale.shape[1]]
        zero = torch.zeros(scale.shape, dtype=torch.int8)
        if bits == 4:
            out[f"{prefix}.weight"] = IntxUnpackedToInt8Tensor(
                q, scale, zero, torch.int4, block, scale.dtype, None
            )
        else:
            out[f"{prefix}.weight"] = Int8Tensor(q, scale, block, scale.dtype, zero_point=zero)
    return out


def _experts_stacked(
    state: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A Mixture-of-Experts' per-expert quantized linears stacked a layer at a time into `out`,
    in transformers 5's stacked names (`mlp.experts.gate_up_proj`: each expert's gate rows then
    its up rows; `mlp.experts.down_proj`) with their scales beside them (`..._scale`, [E, rows,
    groups]), the values kept quantized (int8, float8, int4 packed two a byte: the layout of
    `lmforge.models.moe.QuantizedExperts`); returns the other tensors."""
    experts = {n: t for n, t in state.items() if _EXPERT.search(n)}
    if not experts:
        return state
    linears = {}  # (block prefix, expert, projection) -> (values [rows, cols], scale, bits)
    leftover: dict[str, torch.Tensor] = {}
    found = [(p, v, scale, 8) for p, v, scale in _float8_linears(experts, leftover)]
    found += list(_packed_linears(leftover, {}))
    for prefix, values, scale, bits in found:
        block, expert, projection = _EXPERT_LINEAR.match(prefix).groups()
        linears[block, int(expert), projection] = values, scale.reshape(len(values), -1), bits
    for block in sorted({block for block, _, _ in linears}):
        count = 1 + max(e for b, e, _ in linears if b == block)
        for name, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            per_expert = [[linears[block, e, part] for part in parts] for e in range(count)]
            values = torch.stack([torch.cat([v for v, _, _ in e]) for e in per_expert])
            if per_expert[0][0][2] == 4:
                values = pack_int4(values)  # [E, rows, cols / 2]
            out[f"{block}.experts.{name}"] = values
            out[f"{block}.experts.{name}_scale"] = torch.stack(
                [torch.cat([s for _, s, _ in e]) for e in per_expert]
            )  # [E, rows, groups]
    return {n: t for n, t in state.items() if n not in experts}


_EXPERT_LINEAR = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj$")
_EXPERT = re.compile(r"\.experts\.\d+\.")


def dequantized_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A compressed-tensors pack-quantized HF state dict with each linear's weight unpacked and
    dequantized (w = q * scale) in its scale's dtype: plain weights, for whatever reads an
    artifact's state dict to change it (`lmforge.api.read_state_dict`: training, merging)."""
    out, rest = {}, {}
    for prefix, values, scale in _float8_linears(state, rest):
        out[f"{prefix}.weight"] = (values.float() * scale.float()).to(scale.dtype)
    for prefix, q, scale, _ in _packed_linears(rest, out):
        group = q.shape[1] // scale.shape[1]
        weight = q.float() * scale.float().repeat_interleave(group, dim=1)
        out[f"{prefix}.weight"] = weight.to(scale.dtype)
    return out


FLOAT8_MAX = 448.0  # e4m3's largest finite value


def float8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (float8 e4m3 values [rows, K], fp32 scales [rows, 1]): one scale a row,
    amax / 448. fp8's weights (`--scheme fp8`) and its activations at run time are both so."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FLOAT8_MAX
    values = (x.float() / scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def float8_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight [N, K] as `--scheme fp8` stores it, as the torchao tensor
    `lmforge.load` makes of it."""
    values, scale = float8_rows(weight)
    return _float8_tensor(values, scale.to(weight.dtype))


def _float8_tensor(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torchao's float8 weight (values [N, K] e4m3, scale [N, 1]) computing in the scale's
    dtype: each product quantizes its input a row at a time and runs `torch._scaled_mm`."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8Tensor, PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import (
        QuantizeTensorToFloat8Kwargs,
    )

    return Float8Tensor(
        values, scale.float().reshape(-1, 1), [1, values.shape[1]],
        mm_config=Float8MMConfig(use_fast_accum=True),
        act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=PerRow()),
        dtype=scale.dtype,
    )  # fmt: skip


def _float8_linears(state: dict[str, torch.Tensor], others: dict[str, torch.Tensor]):
    """(prefix, values float8 [N, K], scale [N, 1]) of each float-quantized linear of a
    compressed-tensors state dict (FP8-dynamic), in turn; every other tensor goes into
    `others`."""
    float8 = {n.removesuffix(".weight") for n, t in state.items()
              if n.endswith(".weight") and t.dtype == torch.float8_e4m3fn}  # fmt: skip
    for name, tensor in state.items():
        prefix = name.rsplit(".", 1)[0]
        if prefix not in float8:
            others[name] = tensor
        elif name.endswith(".weight"):
            yield prefix, tensor, state[f"{prefix}.weight_scale"]


def _packed_linears(state: dict[str, torch.Tensor], others: dict[str, torch.Tensor]):
    """(prefix, q int8 [N, K], scale [N, groups], bits) of each pack-quantized linear of a
    compressed-tensors state dict, in turn; every other tensor goes into `others`."""
    quiet_torchao()
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError:
        raise UserError(
            "a compressed-tensors artifact needs the compressed-tensors package: pip install "
            "'lmforge[quant]'"
        ) from None
    for name, tensor in state.items():
        if not name.endswith(".weight_packed"):
            if not name.endswith((".weight_scale", ".weight_shape")):
                others[name] = tensor
            continue
        prefix = name.removesuffix(".weight_packed")
        scale, shape = state[f"{prefix}.weight_scale"], state[f"{prefix}.weight_shape"]
        n, k = (int(v) for v in shape)
        bits = 32 * tensor.shape[1] // k  # K/8 int32 columns: 4 bits; K/4: 8
        q = unpack_from_int32(tensor, bits, torch.Size([n, k])).to(torch.int8)
        yield prefix, q, scale, bits
