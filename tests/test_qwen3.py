"""The Qwen3 dense family: preset parameter counts against transformers, logits parity with
`Qwen3ForCausalLM` on an odd shape (head_dim neither dim / heads nor a power of two), the
Hugging Face round trip, and what its config.json may not ask for.

Shared stages (training, LoRA/PEFT, generation, quantization, planning) are tested on both
families by the parametrized tests next to the Llama ones.
"""

from __future__ import annotations

import json

import pytest
import torch

import lmforge
from lmforge import artifact, models
from lmforge.errors import ModelFormatError
from tests.conftest import make_hf_qwen3

transformers = pytest.importorskip("transformers")

# The published config.json values (Qwen/Qwen3-*): hidden, layers, heads, kv heads,
# intermediate, tied embeddings; all have head_dim 128, vocab 151936.
PUBLISHED = {
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144, True),
    "qwen3-4b": (2560, 36, 32, 8, 9728, True),
    "qwen3-8b": (4096, 36, 32, 8, 12288, False),
    "qwen3-14b": (5120, 40, 40, 8, 17408, False),
    "qwen3-32b": (5120, 64, 64, 8, 25600, False),
}
# Parameter counts as Qwen's model cards round them (billions).
CARD_SIZES = {
    "qwen3-0.6b": 0.6,
    "qwen3-1.7b": 1.7,
    "qwen3-4b": 4.0,
    "qwen3-8b": 8.2,
    "qwen3-14b": 14.8,
    "qwen3-32b": 32.8,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_equal_transformers(name):
    hidden, layers, heads, kv_heads, ffn, tied = PUBLISHED[name]
    config = transformers.Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        intermediate_size=ffn,
        vocab_size=151936,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        theirs = transformers.Qwen3ForCausalLM(config)
        ours = models.new_model(models.get_preset(name))
    expected = sum(p.numel() for p in theirs.parameters())  # a tied table counts once
    args = models.get_preset(name)
    assert args.num_params() == expected == sum(p.numel() for p in ours.parameters())
    assert round(expected / 1e9, 1) == CARD_SIZES[name]
    assert (args.head_dim, args.tie_embeddings, args.max_seq_len) == (128, tied, 40960)


def _tokens(vocab_size: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (3, 29), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["untied", "tied"])
def hf_qwen3(request, tmp_path):
    directory = tmp_path / request.param
    return directory, make_hf_qwen3(directory, tie_word_embeddings=request.param == "tied")


def test_logits_match_transformers_on_an_odd_shape(hf_qwen3):
    directory, hf_model = hf_qwen3
    loaded = lmforge.load(directory)
    assert loaded.config.family == "qwen3" and loaded.config.head_dim == 40
    tokens = _tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        ours = loaded.model(tokens)
        theirs = hf_model(tokens).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_export_is_bitwise_and_loads_as_qwen3(hf_qwen3, tmp_path):
    directory, hf_model = hf_qwen3
    out = lmforge.save(lmforge.load(directory), tmp_path / "exported")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    original = artifact.read_safetensors(directory)
    exported = artifact.read_safetensors(out)
    if hf_model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "Qwen3ForCausalLM"
    tokens = _tokens(hf_model.config.vocab_size, seed=2)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_type 'yarn' is not supported for Qwen3",
        ),
        ({"head_dim": "wide"}, "config.json has a value of the wrong type"),
    ],
)
def test_config_json_refusals_name_the_key(tmp_path, change, message):
    args = models.get_preset("qwen3-0.6b")
    config = models.args_to_hf_config(args, torch.bfloat16) | change
    path = tmp_path / "config.json"
    with pytest.raises(ModelFormatError, match=message):
        models.args_from_hf_config(config, path)


def test_config_json_round_trip_and_dispatch(tmp_path):
    for name in PUBLISHED:
        args = models.get_preset(name)
        config = models.args_to_hf_config(args, torch.bfloat16)
        assert models.args_from_hf_config(config, tmp_path) == args
    unknown = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    with pytest.raises(ModelFormatError, match=r"'llama' \(LlamaForCausalLM\), 'qwen3'"):
        models.args_from_hf_config(unknown, tmp_path / "config.json")
