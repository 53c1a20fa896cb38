"""Hugging Face and Meta interop: logits parity with transformers, exact round trips, sharding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import lmforge
from lmforge import artifact
from lmforge.errors import ModelFormatError
from tests.conftest import make_hf_llama


def _random_tokens(vocab_size: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (3, 37), generator=generator)


def test_logits_match_transformers(hf_variant):
    directory, hf_model = hf_variant
    loaded = lmforge.load(directory)
    tokens = _random_tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        ours = loaded.model(tokens)
        theirs = hf_model(tokens).logits
    assert ours.shape == theirs.shape == (3, 37, hf_model.config.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_import_export_is_bitwise_and_loads_in_transformers(hf_variant, tmp_path):
    transformers = pytest.importorskip("transformers")
    directory, hf_model = hf_variant
    out = tmp_path / "exported"
    lmforge.save(lmforge.load(directory), out)
    original = artifact.read_safetensors(directory)
    exported = artifact.read_safetensors(out)
    if hf_model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype
        assert torch.equal(exported[name], tensor), name
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = _random_tokens(hf_model.config.vocab_size, seed=2)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)
    lineage = json.loads((out / "lmforge.json").read_text())
    assert lineage["stage"] == "convert"
    assert lineage["hash"] == artifact.directory_hash(out)


def test_bfloat16_round_trip_keeps_dtype(tmp_path):
    make_hf_llama(tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = lmforge.load(tmp_path / "bf16")
    assert loaded.model.tok_embeddings.weight.dtype == torch.bfloat16
    lmforge.save(loaded, tmp_path / "out")
    a, b = (
        load_file(tmp_path / "bf16" / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) and b[k].dtype == torch.bfloat16 for k in a)


def test_sharded_export_has_a_correct_index(tmp_path):
    transformers = pytest.importorskip("transformers")
    make_hf_llama(tmp_path / "src")
    loaded = lmforge.load(tmp_path / "src")
    out = tmp_path / "sharded"
    lmforge.save(loaded, out, max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    total = 0
    for shard in shards:
        tensors = load_file(shard)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        assert all(index["weight_map"][name] == shard.name for name in tensors)
    assert index["metadata"]["total_size"] == total
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = _random_tokens(256)
    with torch.no_grad():
        assert (hf(tokens).logits - loaded.model(tokens)).abs().max() <= 1e-5
    reloaded = lmforge.load(out)
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(reloaded.model.state_dict()[name], tensor)


def _half_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of the importer's permutation: our RoPE layout back to Meta's."""
    out_dim, dim = weight.shape
    head_dim = out_dim // num_heads
    return weight.view(num_heads, 2, head_dim // 2, dim).transpose(1, 2).reshape(out_dim, dim)


def _write_meta_checkpoint(loaded, directory, num_shards: int) -> None:
    """Split our weights the way Meta's model-parallel checkpoints are split."""
    args = loaded.config
    state = {n: t.clone() for n, t in loaded.model.state_dict().items()}
    for name in list(state):
        if name.endswith("attention.wq.weight"):
            state[name] = _half_to_interleaved(state[name], args.num_heads)
        elif name.endswith("attention.wk.weight"):
            state[name] = _half_to_interleaved(state[name], args.num_kv_heads)
    split = {
        "tok_embeddings.weight": 1,
        "output.weight": 0,
        "wq.weight": 0,
        "wk.weight": 0,
        "wv.weight": 0,
        "w1.weight": 0,
        "w3.weight": 0,
        "wo.weight": 1,
        "w2.weight": 1,
    }
    shards = [{} for _ in range(num_shards)]
    for name, tensor in state.items():
        dim = next((d for suffix, d in split.items() if name.endswith(suffix)), None)
        for rank in range(num_shards):
            shards[rank][name] = (
                tensor.chunk(num_shards, dim=dim)[rank].clone() if dim is not None else tensor
            )
    directory.mkdir(parents=True)
    for rank, shard in enumerate(shards):
        torch.save(shard, directory / f"consolidated.{rank:02d}.pth")
    params = {
        "dim": args.dim,
        "n_layers": args.num_layers,
        "n_heads": args.num_heads,
        "n_kv_heads": args.num_kv_heads,
        "vocab_size": args.vocab_size,
        "multiple_of": 32,
        "ffn_dim_multiplier": 1.25,
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "use_scaled_rope": False,
    }
    (directory / "params.json").write_text(json.dumps(params))


@pytest.mark.parametrize("num_shards", [1, 2])
def test_meta_original_import_matches(tmp_path, num_shards):
    make_hf_llama(tmp_path / "hf", hidden_size=64, intermediate_size=224, num_key_value_heads=2)
    # ffn: int(2*4*64/3)=170, *1.25=212, rounded up to a multiple of 32 = 224
    reference = lmforge.load(tmp_path / "hf")
    _write_meta_checkpoint(reference, tmp_path / "meta" / "original", num_shards)
    loaded = lmforge.load(tmp_path / "meta")
    assert loaded.config.ffn_dim == 224
    tokens = _random_tokens(256)
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens), reference.model(tokens))


def test_meta_checkpoint_refuses_pickled_code(tmp_path):
    directory = tmp_path / "evil"
    directory.mkdir()
    (directory / "params.json").write_text(
        json.dumps({"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 256})
    )

    class Payload:
        def __reduce__(self):
            return (print, ("owned",))

    torch.save({"x": Payload()}, directory / "consolidated.00.pth")
    with pytest.raises(ModelFormatError, match="weights-only"):
        lmforge.load(directory)


def test_bad_sources_name_the_path(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file"):
        lmforge.load(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="not a model directory"):
        lmforge.load(tmp_path / "empty")
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelFormatError, match="model type 'gpt2' is not supported; lmforge reads"):
        lmforge.load(other)


def test_missing_shard_is_named(tmp_path):
    make_hf_llama(tmp_path / "src")
    lmforge.save(lmforge.load(tmp_path / "src"), tmp_path / "sharded", max_shard_size="40KB")
    victim = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelFormatError, match=victim.name):
        lmforge.load(tmp_path / "sharded")


def test_shape_mismatch_is_named(tmp_path):
    make_hf_llama(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"feed_forward\.w\d\.weight has shape"):
        lmforge.load(tmp_path / "src")


def test_preset_loads_with_random_weights():
    loaded = lmforge.load("tiny")
    assert loaded.config.num_params() == sum(p.numel() for p in loaded.model.parameters())
    logits = loaded.model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, loaded.config.vocab_size)
