"""Quantization through torchao: artifacts round-trip, really shrink, stay close to the original,
record their lineage, load in transformers with lmforge's greedy output, stream tensor by tensor
to the same artifact as the whole-model path, and refuse what has no kernel.

Measured on the tiny model below (dim 128, ffn 256, 2 layers, bf16, random init, seed 0; logits
max |x| ~ 0.98, std ~ 0.22, so top-1 among 256 nearly flat logits is a harsh test):
  int8-wo (per row):  max-abs 0.012, rel-L2 0.009, top-1 agreement 0.95
  int4-wo (g=32):     max-abs 0.14,  rel-L2 0.097, top-1 agreement 0.88
(bounds below: int8 0.03 / 0.03 / 0.9, int4 0.25 / 0.2 / 0.75).
Linear weights on disk vs bf16: int8 0.517; int4 g=32 0.547 in torchao's CPU layout (one value
per byte + 3 bytes of scale and zero point per 32 values), 0.297 packed two per byte.
"""

from __future__ import annotations

import copy
import json
import shutil
import typing

import pytest
import torch

import lmforge
from lmforge import artifact
from lmforge.api import LoadedModel, build_model
from lmforge.cli import main as cli_main
from lmforge.errors import ConfigError, ModelFormatError
from lmforge.models import get_preset

pytest.importorskip("torchao")

from lmforge.generate import Generator, SamplingParams
from lmforge.quantize import (
    QuantSpec,
    quantize_artifact,
    quantize_model,
    save_quantized,
    stored,
)
from lmforge.quantize import quantize as quantize_lib
from lmforge.sizes import module_bytes, tensor_bytes

ARGS = get_preset("tiny").replace(
    dim=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=256, vocab_size=256
)
TOKENS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).float()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A bf16 artifact of the tiny model (untied)."""
    model = build_model(ARGS, dtype=torch.bfloat16, seed=0)
    directory = tmp_path_factory.mktemp("quantize") / "source"
    return lmforge.save(LoadedModel(model, None, ARGS, "tiny"), directory, stage="test")


@pytest.fixture(scope="module")
def quantized(source):
    """scheme -> (artifact path, the in-memory quantized model it was written from)."""
    out = {}
    for name, spec in SPECS.items():
        loaded = lmforge.load(source)
        modules = quantize_model(loaded.model, spec)
        path = save_quantized(loaded, source.parent / name, spec=spec, modules=modules)
        out[name] = (path, loaded.model)
    return out


SPECS = {
    "int8-wo": QuantSpec("int8-wo"),
    "int4-wo": QuantSpec("int4-wo", group_size=32),
    "int4-packed": QuantSpec("int4-wo", group_size=32, pack_int4=True),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_round_trip_gives_the_in_memory_logits(quantized, name):
    path, in_memory = quantized[name]
    scheme = SPECS[name].scheme
    loaded = lmforge.load(path)
    weight = loaded.model.layers["1"].feed_forward.w2.weight
    expected_type = {"int8-wo": "Int8Tensor", "int4-wo": "IntxUnpackedToInt8Tensor"}[scheme]
    assert type(weight).__name__ == expected_type
    assert type(loaded.model.output.weight) is torch.nn.Parameter  # output stays bf16
    assert loaded.model.output.weight.dtype == torch.bfloat16
    assert loaded.config == ARGS
    assert not weight.requires_grad
    assert torch.equal(_logits(loaded.model), _logits(in_memory))


@pytest.mark.parametrize(
    ("scheme", "max_abs", "rel_l2", "top1"),
    [("int8-wo", 0.03, 0.03, 0.9), ("int4-wo", 0.25, 0.2, 0.75)],
)
def test_logits_stay_close_to_the_original(source, quantized, scheme, max_abs, rel_l2, top1):
    reference = _logits(lmforge.load(source).model)
    ours = _logits(lmforge.load(quantized[scheme][0]).model)
    diff = ours - reference
    assert diff.abs().max().item() <= max_abs
    assert (diff.norm() / reference.norm()).item() <= rel_l2
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agreement >= top1


@pytest.mark.parametrize(
    ("name", "bound"), [("int8-wo", 0.52), ("int4-wo", 0.55), ("int4-packed", 0.30)]
)
def test_linear_weights_shrink_on_disk_and_in_memory(source, quantized, name, bound):
    path, model = quantized[name]
    modules = quantize_lib.quantized_module_names(ARGS, quantize_output=False)
    report = quantize_lib.size_report(path, model, modules)
    assert report.linear_bf16_bytes == 2 * ARGS.num_layers * sum(
        model.get_submodule(f"layers.0.{name}").weight.numel()
        for name in quantize_lib.BLOCK_LINEARS
    )
    assert report.linear_bytes / report.linear_bf16_bytes <= bound
    assert report.disk_bytes < quantize_lib.weight_file_bytes(source)
    original_memory = module_bytes(lmforge.load(source).model)
    assert report.memory_bytes < original_memory
    # subclass weights count their inner tensors: qdata 1 byte per value (int4 held in int8)
    wq = model.layers["0"].attention.wq.weight
    assert tensor_bytes(wq) >= wq.numel()
    if name == "int4-packed":  # and the file holds two values per byte
        sizes = quantize_lib.stored_bytes(path)
        assert sizes["model.layers.0.self_attn.q_proj._weight_qdata_int4x2"] == wq.numel() // 2


def test_lineage_records_scheme_parent_and_hash(source, quantized):
    path, _ = quantized["int4-packed"]
    lineage = json.loads((path / "lmforge.json").read_text())
    assert lineage["stage"] == "quantize"
    assert lineage["parent"] == {"source": str(source), "hash": artifact.artifact_hash(source)}
    assert lineage["hash"] == artifact.directory_hash(path)
    record = lineage["quantization"]
    assert record["scheme"] == "int4-wo" and record["group_size"] == 32
    assert len(record["modules"]) == 7 * ARGS.num_layers
    assert "model.layers.1.mlp.down_proj" in record["modules"]
    assert record["not_quantized"] == ["model.embed_tokens", "lm_head"]
    assert record["hf_loadable"] is False and "vLLM" in record["note"]
    config = json.loads((path / "config.json").read_text())
    quant_type = config["quantization_config"]["quant_type"]["default"]["_type"]
    assert quant_type == stored.PACKED_CONFIG_TYPE
    loadable = json.loads((quantized["int4-wo"][0] / "lmforge.json").read_text())
    assert loadable["quantization"]["hf_loadable"] is True


@pytest.mark.parametrize("name", ["int8-wo", "int4-wo"])
def test_artifact_loads_in_transformers_and_generates_what_lmforge_generates(quantized, name):
    transformers = pytest.importorskip("transformers")
    path, model = quantized[name]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu").eval()
    expected_type = {"int8-wo": "Int8Tensor", "int4-wo": "IntxUnpackedToInt8Tensor"}[name]
    assert type(hf_model.model.layers[0].self_attn.q_proj.weight).__name__ == expected_type
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits.float()
    assert (theirs - _logits(model)).abs().max().item() <= 1e-5
    prompt = TOKENS[0, :6].tolist()
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=())
    ours = Generator(lmforge.load(path).model, max_seq_len=32).generate([prompt], greedy)
    hf_ids = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert ours.results[0].token_ids == hf_ids


@pytest.mark.parametrize("name", list(SPECS))
def test_quantization_config_is_what_transformers_and_vllm_rebuild(quantized, name):
    """Both rebuild config.json's `quant_type` with torchao's `config_from_dict` (vLLM's
    TorchAOConfig.from_config too; vLLM itself is not installed here): loadable artifacts give
    back the config they were made with, packed ones an error."""
    from torchao.core.config import config_from_dict, config_to_dict

    path, _ = quantized[name]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "torchao" and list(config["quant_type"]) == ["default"]
    spec = SPECS[name]
    if spec.pack_int4:
        with pytest.raises(ValueError, match=stored.PACKED_CONFIG_TYPE):
            config_from_dict(config["quant_type"]["default"])
        return
    rebuilt = config_from_dict(config["quant_type"]["default"])
    made_with = quantize_lib.torchao_config(spec.scheme, spec.group_size, "cpu")
    assert config_to_dict(rebuilt) == config_to_dict(made_with)


def test_packed_int4_is_refused_elsewhere_and_legacy_packed_still_loads(quantized, tmp_path):
    transformers = pytest.importorskip("transformers")
    path, model = quantized["int4-packed"]
    with pytest.raises(ValueError, match=stored.PACKED_CONFIG_TYPE):  # not random weights
        transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu")
    # an artifact written before this format: quant_method "lmforge-int4x2" in config.json
    legacy = tmp_path / "legacy"
    shutil.copytree(path, legacy)
    config = json.loads((legacy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "lmforge-int4x2", "scheme": "int4-wo"}
    (legacy / "config.json").write_text(json.dumps(config))
    assert torch.equal(_logits(lmforge.load(legacy).model), _logits(model))


def test_qwen3_int8_round_trips_and_loads_in_transformers(tmp_path):
    """Quantization reads the linears and HF names through the family: a Qwen3 (head norms,
    head_dim 48 != dim / heads) round-trips and transformers reads it as Qwen3 int8."""
    transformers = pytest.importorskip("transformers")
    args = get_preset("qwen3-0.6b").replace(
        dim=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=48, ffn_dim=256, vocab_size=256
    )
    model = build_model(args, dtype=torch.bfloat16, seed=0)
    source = lmforge.save(LoadedModel(model, None, args, "qwen3"), tmp_path / "src", stage="test")
    loaded = lmforge.load(source)
    spec = QuantSpec(scheme="int8-wo")
    path = save_quantized(
        loaded, tmp_path / "int8", spec=spec, modules=quantize_model(loaded.model, spec)
    )
    reloaded = lmforge.load(path)
    assert reloaded.config == args
    assert torch.equal(_logits(reloaded.model), _logits(loaded.model))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu").eval()
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    assert type(hf_model.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits.float()
    assert (theirs - _logits(loaded.model)).abs().max().item() <= 1e-5


def test_transformers_torchao_checkpoint_loads_in_lmforge(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup

    from tests.conftest import make_hf_llama

    make_hf_llama(tmp_path / "hf", hidden_size=128, intermediate_size=256, dtype=torch.bfloat16)
    config = transformers.TorchAoConfig(
        IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    )
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", quantization_config=config, device_map="cpu", dtype=torch.bfloat16
    ).eval()
    hf_model.save_pretrained(tmp_path / "hf-int4")
    loaded = lmforge.load(tmp_path / "hf-int4")  # no lmforge.json: config.json says torchao
    weight = loaded.model.layers["0"].feed_forward.w1.weight
    assert type(weight).__name__ == "IntxUnpackedToInt8Tensor"
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits.float()
    assert (theirs - _logits(loaded.model)).abs().max().item() <= 1e-5


def test_cli_quantizes_tied_output_and_prints_sizes(tmp_path, capsys):
    tied = ARGS.replace(tie_embeddings=True)
    source = lmforge.save(
        LoadedModel(build_model(tied, dtype=torch.bfloat16, seed=1), None, tied, "tiny"),
        tmp_path / "tied",
        stage="test",
    )
    out = tmp_path / "int4"
    argv = ["quantize", str(source), str(out), "--scheme", "int4-wo", "--group-size", "64"]
    assert cli_main([*argv, "--quantize-output", "--pack-int4", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "15 linears" in printed and "untied" in printed and "tensor by tensor" in printed
    assert "WARNING: int4 values packed two per byte" in captured.err
    assert "transformers and vLLM cannot load" in captured.err
    assert "on disk" in printed and "in memory" in printed and "x" in printed
    loaded = lmforge.load(out)
    assert not loaded.config.tie_embeddings
    assert type(loaded.model.output.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert type(loaded.model.tok_embeddings.weight) is torch.nn.Parameter
    reference = _logits(lmforge.load(source).model)
    assert (_logits(loaded.model) - reference).abs().max().item() <= 0.3
    lineage = json.loads((out / "lmforge.json").read_text())
    assert lineage["quantization"]["not_quantized"] == ["model.embed_tokens"]


def test_pack_unpack_int4_is_exact():
    values = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # every int4 value, both nibbles
    values = values[:, torch.randperm(values.shape[1], generator=torch.Generator().manual_seed(0))]
    packed = quantize_lib.pack_int4(values)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert torch.equal(quantize_lib.unpack_int4(packed), values)


def test_bad_group_size_names_it(source, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"group_size 48 does not divide the input size 128"):
        quantize_artifact(source, tmp_path / "bad", scheme="int4-wo", group_size=48)
    # 256 given explicitly is not replaced by a size that divides (only the default is chosen)
    with pytest.raises(ConfigError, match=r"group_size 256 .* attention.wq"):
        quantize_artifact(source, tmp_path / "bad", scheme="int4-wo", group_size=256)
    spec = QuantSpec(scheme="int4-wo", group_size=96)
    with pytest.raises(ConfigError, match=r"group_size 96"):
        quantize_lib.check_group_size(spec, ARGS, "cpu")
    argv = ["quantize", str(source), str(tmp_path / "bad"), "--scheme", "int4-wo"]
    assert cli_main([*argv, "--group-size", "48", "--device", "cpu"]) == 2
    assert "group_size 48" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_default_int4_group_is_the_largest_that_divides_and_says_so(source, tmp_path, capsys):
    # The demo's shape (dim 128, as ARGS): 256 does not divide it, so no --group-size gives 128.
    out = tmp_path / "int4"
    argv = ["quantize", str(source), str(out), "--scheme", "int4-wo", "--device", "cpu"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "with int4-wo (group size 128) on cpu" in printed[0]
    assert [line for line in printed if "group size 128:" in line] == [
        "note: int4 group size 128: the default 256 does not divide the input size 128 of "
        "attention.wq (dim), and 128 is the largest of 256, 128, 64, 32 that divides every "
        "quantized linear's (--group-size chooses another)"
    ]
    assert json.loads((out / "lmforge.json").read_text())["quantization"]["group_size"] == 128
    # The whole-model path chooses and says the same.
    whole = quantize_artifact(source, tmp_path / "whole", scheme="int4-wo", stream=False)
    assert whole.spec.group_size == 128 and whole.notes[0].startswith("int4 group size 128: ")
    # The tiny preset (dim 256, ffn 768) keeps 256 without a note; a shape no supported size
    # divides is refused; the planner counts the group quantize will choose.
    preset = get_preset("tiny")
    result = quantize_artifact("tiny", tmp_path / "preset", scheme="int4-wo")
    assert result.spec.group_size == 256 and not any("group size" in n for n in result.notes)
    odd = ARGS.replace(dim=80, num_heads=4, num_kv_heads=2, ffn_dim=160)
    with pytest.raises(ConfigError, match=r"no int4 group size of 256, 128, 64, 32 divides"):
        quantize_lib.check_group_size(QuantSpec("int4-wo"), odd, "cpu")
    from lmforge.plan.inference import InferenceSetup, weight_bytes

    for args, group in ((ARGS, 128), (preset, 256)):
        chosen = InferenceSetup(args=args, task="quantize", quantization="int4-wo")
        assert weight_bytes(chosen) == weight_bytes(chosen.replace(group_size=group))
        assert weight_bytes(chosen) != weight_bytes(chosen.replace(group_size=group // 2))


def test_schemes_without_a_kernel_are_refused_with_what_works(monkeypatch):
    with pytest.raises(ConfigError, match=r"'int2-wo' is unknown; allowed: int8-wo, int4-wo"):
        quantize_lib.check_scheme("int2-wo", "cpu")
    with pytest.raises(ConfigError, match=r"no kernel on mps; schemes that work there: none"):
        quantize_lib.check_scheme("int8-wo", "mps")
    monkeypatch.setattr(quantize_lib, "_cuda_capability", lambda device: (7, 5))
    with pytest.raises(
        ConfigError,
        match=r"'int4-wo' has no kernel on cuda \(compute capability 7.5; int4 needs 8.0\+\); "
        r"schemes that work there: int8-wo$",
    ):
        quantize_lib.check_scheme("int4-wo", "cuda")
    quantize_lib.check_scheme("int8-wo", "cuda")
    with pytest.raises(ConfigError, match=r"group_size 16 is not supported by the CUDA int4"):
        quantize_lib.check_group_size(QuantSpec("int4-wo", 16), ARGS, "cuda")


def test_load_refuses_another_dtype_and_requantizing(quantized, tmp_path):
    path, model = quantized["int4-wo"]
    with pytest.raises(ModelFormatError, match=r"computes in the dtype it was quantized in"):
        lmforge.load(path, dtype="float32")
    assert torch.equal(_logits(lmforge.load(path, dtype="bfloat16").model), _logits(model))
    with pytest.raises(ConfigError, match=r"already quantized \(int4-wo\)"):
        quantize_artifact(path, tmp_path / "again", scheme="int8-wo")


def test_quantize_model_leaves_the_original_module_types(source):
    model = lmforge.load(source).model
    before = copy.deepcopy(model)
    quantize_model(model, QuantSpec("int8-wo"))
    assert type(model.tok_embeddings.weight) is torch.nn.Parameter
    assert torch.equal(model.tok_embeddings.weight, before.tok_embeddings.weight)
    assert torch.equal(model.output.weight, before.output.weight)
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]


def _artifact_contents(directory) -> dict:
    """Each file's tensors (in order) and safetensors metadata, config.json and the index: the
    files themselves differ between runs (safetensors orders the metadata as a hash map)."""
    from safetensors import safe_open

    contents = {"config.json": json.loads((directory / "config.json").read_text())}
    if (directory / artifact.INDEX_NAME).exists():
        contents["index"] = json.loads((directory / artifact.INDEX_NAME).read_text())
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            tensors = [(key, handle.get_tensor(key)) for key in handle.keys()]  # noqa: SIM118
            contents[path.name] = (handle.metadata(), [key for key, _ in tensors])
        contents[path.name + ":tensors"] = tensors
    return contents


def _assert_same_contents(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        if name.endswith(":tensors"):
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(value, theirs[name])), name
        else:
            assert value == theirs[name], name


@pytest.mark.parametrize(
    ("name", "tied", "quantize_output", "dtype"),
    [
        ("int8-wo", False, False, None),
        ("int4-wo", True, True, None),
        ("int4-packed", False, True, None),
        ("int4-wo", False, False, "bfloat16"),  # a float32 source cast on the way
    ],
)
def test_streaming_writes_the_whole_model_paths_artifact(
    tmp_path, monkeypatch, name, tied, quantize_output, dtype
):
    args = ARGS.replace(tie_embeddings=tied)
    model = build_model(args, dtype=torch.float32 if dtype else torch.bfloat16, seed=2)
    source = lmforge.save(LoadedModel(model, None, args, "tiny"), tmp_path / "src", stage="test")
    spec = SPECS[name]
    options = dict(
        scheme=spec.scheme,
        group_size=spec.group_size,
        pack_int4=spec.pack_int4,
        quantize_output=quantize_output,
        dtype=dtype,
        max_shard_size=60_000,  # several shards, cut between a weight and its scales too
    )
    whole = quantize_artifact(source, tmp_path / "whole", stream=False, **options)
    monkeypatch.setattr(lmforge.api, "load", None)  # streaming never loads the whole model
    monkeypatch.setattr(artifact, "read_safetensors", None)
    streamed = quantize_artifact(source, tmp_path / "streamed", **options)
    assert streamed.streamed and not whole.streamed
    expected = _artifact_contents(whole.path)
    assert len([name for name in expected if name.endswith(":tensors")]) >= 3
    _assert_same_contents(_artifact_contents(streamed.path), expected)  # tensors bit for bit
    lineage = [json.loads((r.path / "lmforge.json").read_text()) for r in (whole, streamed)]
    assert lineage[0]["quantization"] == lineage[1]["quantization"]
    assert lineage[0]["config"] == lineage[1]["config"]
    assert (whole.original, whole.quantized, whole.notes) == (
        streamed.original,
        streamed.quantized,
        streamed.notes,
    )


def test_scheme_list_is_one():
    from lmforge.commands import quantize as quantize_command
    from lmforge.pipeline.kinds import QuantizeStageSection
    from lmforge.quantize.schemes import SCHEMES

    assert quantize_lib.SCHEMES is SCHEMES and quantize_command.SCHEMES is SCHEMES
    assert typing.get_args(QuantizeStageSection.model_fields["scheme"].annotation) == SCHEMES


def test_streaming_reads_a_transformers_directory(tmp_path):
    from tests.conftest import make_hf_llama

    source = tmp_path / "hf"  # float32, tied, written by transformers' save_pretrained
    make_hf_llama(source, hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    options = dict(scheme="int8-wo", quantize_output=True, dtype="bfloat16")
    whole = quantize_artifact(source, tmp_path / "whole", stream=False, **options)
    streamed = quantize_artifact(source, tmp_path / "streamed", **options)
    assert streamed.streamed and "untied" in " ".join(streamed.notes)
    _assert_same_contents(_artifact_contents(streamed.path), _artifact_contents(whole.path))


# ---- compressed-tensors (vLLM's fast int4 / int8 kernels) ------------------------------------


@pytest.mark.parametrize("scheme,group", [("int4-wo", 128), ("int8-wo", None)])
def test_compressed_tensors_artifact_loads_in_transformers_with_lmforge_logits(
    source, tmp_path, scheme, group, capsys
):
    """`--format compressed-tensors`: config.json's quantization_config is what
    compressed-tensors parses, the packed weights are its own (transformers runs them through
    it), and lmforge reads it back as the torchao int4 / int8 tensors its own quantizer makes
    (what the engine converts into its kernels' layout): equal logits; `read_state_dict` gives
    the same weights dequantized (for training or merging from it)."""
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    out = tmp_path / scheme
    assert cli_main(["quantize", str(source), str(out), "--scheme", scheme,
                     "--format", "compressed-tensors"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "compressed-tensors" in printed and f"lmforge serve {out} --engine vllm" in printed
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    weights = parsed.config_groups["group_0"].weights
    assert (weights.num_bits, weights.group_size, weights.symmetric) == (
        {"int4-wo": 4, "int8-wo": 8}[scheme],
        group,
        True,
    )
    assert parsed.format == "pack-quantized" and "lm_head" in parsed.ignore

    assert lmforge.load(out).model.layers["0"].attention.wq.weight.dtype == torch.bfloat16
    ours = lmforge.load(out, dtype="float32").model  # the same ints and scales, in fp32
    wq = ours.layers["0"].attention.wq.weight
    kind = {"int4-wo": "IntxUnpackedToInt8Tensor", "int8-wo": "Int8Tensor"}[scheme]
    assert type(wq.data).__name__ == kind and wq.dtype == torch.float32
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 9, 20, 33, 7, 2]])
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())
    # greedy decoding: transformers' tokens are lmforge's (the check that runs where vLLM's CPU
    # build has no int4 kernel: tests/test_vllm.py skips there)
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=())
    ours_tokens = Generator(ours, max_batch=1).generate([tokens[0].tolist()], params).results
    generation = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        theirs_tokens = theirs.generate(tokens, **generation)[0, tokens.shape[1] :]
    assert theirs_tokens.tolist() == list(ours_tokens[0].token_ids)
    # the weights are the round-to-nearest ones: near the originals, and read_state_dict's
    plain = lmforge.api.read_state_dict(out, ours.args)["layers.0.attention.wq.weight"]
    assert type(plain) is torch.Tensor and torch.equal(plain, wq.dequantize().to(plain.dtype))
    original = lmforge.load(source, dtype="float32").model
    wq = wq.dequantize()
    reference = original.layers["0"].attention.wq.weight
    step = reference.abs().amax() / (7.5 if scheme == "int4-wo" else 127.5)
    assert (wq - reference).abs().max() <= step * 0.51 + 1e-2 * step


def test_fp8_is_compressed_tensors_fp8_dynamic_that_transformers_loads(source, tmp_path, capsys):
    """`--scheme fp8` (W8A8): float8 e4m3 block linears with a scale a row, activations
    quantized a token at run time, written as compressed-tensors' FP8-dynamic. transformers
    (through compressed-tensors) dequantizes the same weights lmforge multiplies; lmforge's
    products quantize their inputs too (torchao's Float8Tensor, torch._scaled_mm), so its
    logits stay within that rounding of transformers' and of the bf16 original; the engine
    decodes it; read_state_dict gives the dequantized weights."""
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fp8"
    assert cli_main(["quantize", str(source), str(out), "--scheme", "fp8"]) == 0
    printed = capsys.readouterr().out
    assert "FP8-dynamic (W8A8)" in printed and "activations a token at run time" in printed
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    group = parsed.config_groups["group_0"]
    assert parsed.format == "float-quantized" and "lm_head" in parsed.ignore
    assert (group.weights.type, group.weights.num_bits, group.weights.strategy) == (
        "float", 8, "channel")  # fmt: skip
    assert (group.input_activations.strategy, group.input_activations.dynamic) == ("token", True)

    ours = lmforge.load(out).model
    wq = ours.layers["0"].attention.wq.weight
    assert type(wq.data).__name__ == "Float8Tensor" and wq.qdata.dtype == torch.float8_e4m3fn
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    their_wq = theirs.model.layers[0].self_attn.q_proj  # compressed-tensors' fp8 linear
    assert torch.equal(their_wq.weight.view(torch.uint8), wq.qdata.view(torch.uint8))
    torch.testing.assert_close(their_wq.weight_scale.float(), wq.scale, rtol=1e-2, atol=0)
    tokens = torch.tensor([[1, 5, 9, 20, 33, 7, 2]])
    original = lmforge.load(source).model
    with torch.no_grad():
        got, want, bf16 = ours(tokens).float(), theirs(tokens).logits.float(), original(tokens)
    assert _relative(got, want) < 0.1 and _relative(got, bf16.float()) < 0.15
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())
    [result] = Generator(ours, max_batch=1).generate([tokens[0].tolist()], params).results
    assert len(result.token_ids) == 6
    plain = lmforge.api.read_state_dict(out, ours.args)["layers.0.attention.wq.weight"]
    assert type(plain) is torch.Tensor and torch.equal(plain, wq.dequantize().to(plain.dtype))


def test_fp8_in_the_engines_layer_fused_as_bf16_projections_are(source, tmp_path):
    """On a GPU the engine swaps each float8 linear for its `Float8Linear` (the same float8
    values and scales, `torch._scaled_mm` on its input quantized a row at a time; one row the
    GEMV, weight-only, as the interpreter runs it here), which joins
    q/k/v and gate/up into one product each. A product equals its definition computed in
    float64 (within the float8 rounding of a few inputs); the logits stay within a few percent
    of torchao's own product's, whose activation scales round otherwise (here on the CPU,
    whose `_scaled_mm` computes the same)."""
    from lmforge.generate.kernels import Float8Linear, use_quantized_kernels

    out = tmp_path / "fp8"
    assert cli_main(["quantize", str(source), str(out), "--scheme", "fp8"]) == 0
    reference, model = lmforge.load(out).model, lmforge.load(out).model
    linear = reference.layers["0"].attention.wq
    x = torch.randn(7, linear.in_features, dtype=torch.bfloat16)
    scale = x.double().abs().amax(-1, keepdim=True) / 448  # the definition, in float64
    rows = (x.double() / scale).to(torch.float8_e4m3fn).double() * scale
    weight = linear.weight.qdata.double() * linear.weight.scale.double()
    assert _relative(Float8Linear.from_linear(linear)(x).double(), rows @ weight.t()) < 5e-3
    one = x[:1]  # one row: the float8 weights read in the GEMV, the input as it is
    got = Float8Linear.from_linear(linear)(one).double()
    assert _relative(got, one.double() @ weight.t()) < 2**-8  # (bf16's rounding of the output)
    assert use_quantized_kernels(model) == 7 * model.args.num_layers
    assert model.fuse_projections()
    attention, ffn = model.layers["0"].attention, model.layers["0"].feed_forward
    assert type(attention.wqkv) is Float8Linear and type(ffn.w13) is Float8Linear
    tokens = torch.tensor([[1, 5, 9, 20, 33, 7, 2]])
    with torch.no_grad():
        got, want = model(tokens).float(), reference(tokens).float()
    assert _relative(got, want) < 6e-2
    wq = reference.layers["0"].attention.wq.weight
    assert torch.equal(attention.wqkv.values[: wq.shape[0]].view(torch.uint8),
                       wq.qdata.view(torch.uint8))  # fmt: skip


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_one_line(source, tmp_path, monkeypatch):
    """An fp8 artifact loaded on a GPU older than compute capability 8.9 (an A100's 8.0 here,
    the capability faked: no GPU in the suite) stops at load with one line, before any kernel;
    on 8.9+ (and on the CPU) it loads."""
    out = tmp_path / "fp8"
    assert cli_main(["quantize", str(source), str(out), "--scheme", "fp8"]) == 0
    state = lmforge.load(out).model.state_dict()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"fp8 weights .* compute capability 8.9\+.* is 8.0"):
        lmforge.api._check_float8_device(out, state, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    lmforge.api._check_float8_device(out, state, torch.device("cuda"))
    plain = {"w": torch.zeros(2, 2)}  # nothing in float8: any GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    lmforge.api._check_float8_device(out, plain, torch.device("cuda"))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--group-size", "64"], "one scale an output row"),
        (["--format", "torchao"], "where --scheme fp8 is written"),
        (["--method", "gptq", "--calibration", "x"], "fp8 is round to nearest"),
    ],
)
def test_fp8_refuses_what_it_has_not(source, tmp_path, capsys, extra, message):
    out = tmp_path / "fp8"
    assert cli_main(["quantize", str(source), str(out), "--scheme", "fp8", *extra]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_compressed_tensors_refuses_torchao_options(source, tmp_path, capsys):
    out = tmp_path / "x"
    base = ["quantize", str(source), str(out), "--scheme", "int4-wo", "--format",
            "compressed-tensors"]  # fmt: skip
    assert cli_main([*base, "--pack-int4"]) == 2
    assert "--pack-int4 is a torchao option" in capsys.readouterr().err
    assert cli_main([*base, "--group-size", "48"]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert not out.exists()


def test_compressed_tensors_from_a_config_file(source, tmp_path):
    """What a pipeline's quantize stage runs: `lmforge quantize --config` with format."""
    out = tmp_path / "w4a16"
    config = tmp_path / "stage.toml"
    config.write_text(f'source = "{source}"\nout = "{out}"\nscheme = "int4-wo"\n'
                      'format = "compressed-tensors"\ngroup_size = 64\n')  # fmt: skip
    assert cli_main(["quantize", "--config", str(config)]) == 0
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization["config_groups"]["group_0"]["weights"]["group_size"] == 64


def test_compressed_tensors_streams_what_the_whole_model_gives_and_shards(source, tmp_path):
    """A safetensors source is compressed one tensor at a time: the same tensors, and sizes,
    as from the model loaded whole; small shards get an index that transformers and lmforge
    read."""
    from lmforge.quantize import compressed

    args = compressed.quantization_args("int4-wo", 64)
    streamed = compressed._compressed_tensors(*compressed._streamed(source, None)[:2], args)
    whole = compressed._compressed_tensors(*compressed._whole(source, None)[:2], args)
    assert streamed[0] == whole[0] and sorted(streamed[2]) == sorted(whole[2])
    for key, size in streamed[0].items():
        tensor = streamed[1](key)
        assert torch.equal(tensor, whole[1](key)), key
        assert tensor.numel() * tensor.element_size() == size, key
    one, many = tmp_path / "one", tmp_path / "many"
    for out, shard in ((one, "5GB"), (many, "100KB")):
        assert cli_main(["quantize", str(source), str(out), "--scheme", "int4-wo", "--format",
                         "compressed-tensors", "--group-size", "64", "--max-shard-size",
                         shard]) == 0  # fmt: skip
    assert (many / "model.safetensors.index.json").exists()
    assert len(list(many.glob("model-*.safetensors"))) > 1
    first, second = lmforge.load(one).model.state_dict(), lmforge.load(many).model.state_dict()

    def plain(t):
        return t if type(t) is torch.Tensor else t.dequantize()

    assert all(torch.equal(plain(first[name]), plain(second[name])) for name in first)


@pytest.mark.parametrize("scheme,group", [("int4-wo", 64), ("int8-wo", None)])
def test_compressed_tensors_reach_the_engines_kernels(source, tmp_path, scheme, group):
    """What the engine converts at load (`QuantizedLinear.from_linear`) takes a compressed
    artifact's weights as it takes lmforge's own: the same values in its int8 / int4 layout."""
    from lmforge.generate.kernels.layers import quantized_values

    out = tmp_path / scheme
    options = ["--group-size", str(group)] if group else []
    assert cli_main(["quantize", str(source), str(out), "--scheme", scheme, "--format",
                     "compressed-tensors", *options]) == 0  # fmt: skip
    weight = lmforge.load(out).model.layers["1"].feed_forward.w2.weight.data
    bits, q, scale, zero = quantized_values(weight)
    assert bits == {"int4-wo": 4, "int8-wo": 8}[scheme]
    columns = q.shape[1] // scale.shape[1]
    scales = scale.float().repeat_interleave(columns, dim=1)
    if bits == 8:
        values = q.float() * scales
    else:
        values = (q.float() - 8) * scales + zero.float().repeat_interleave(columns, dim=1)
    torch.testing.assert_close(values.to(weight.dtype), weight.dequantize(), rtol=0, atol=0)
