"""Shared fixtures: tiny random Hugging Face Llama and Qwen3 models written to temporary
directories."""

from __future__ import annotations

import os

# Triton kernels (lmforge/generate/kernels/) run on the CPU through Triton's interpreter. It
# must be on before anything imports triton (torchao does), or kernels half-interpret.
os.environ.setdefault("TRITON_INTERPRET", "1")
# MKL (torch's CPU BLAS) may round a product differently by the memory alignment of its operands
# unless its conditional numerical reproducibility is on, which it reads before its first call:
# two runs of one training in this process once logged losses one ulp apart (CI, 2026-12-02).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

# Tiny HF LlamaConfig variants covering what the importer must handle.
HF_VARIANTS = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa_rope_scaling": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        rope_theta=500000.0,
    ),
    "odd_vocab_tied_scaling": dict(
        vocab_size=301,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


def make_hf_llama(directory, *, seed: int = 0, dtype=torch.float32, **overrides):
    """Save a random transformers LlamaForCausalLM to `directory`; returns the HF model."""
    transformers = pytest.importorskip("transformers")
    settings = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    settings.update(overrides)
    config = transformers.LlamaConfig(**settings)
    return _save_random(transformers.LlamaForCausalLM, config, directory, seed=seed, dtype=dtype)


def _save_random(model_class, config, directory, *, seed: int, dtype):
    """A random `model_class(config)` with its norms (q/k head norms too) away from one, saved
    to `directory`."""
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model = model.to(dtype).eval()
    model.save_pretrained(directory)
    return model


# Qwen3's odd test shape: head_dim 40 is neither hidden_size / heads (32) nor a power of two.
QWEN3_SHAPE = dict(
    vocab_size=301,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=40,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
)


def make_hf_qwen3(directory, *, seed: int = 0, dtype=torch.float32, **overrides):
    """Save a random transformers Qwen3ForCausalLM to `directory`; returns the HF model."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(**(QWEN3_SHAPE | overrides))
    return _save_random(transformers.Qwen3ForCausalLM, config, directory, seed=seed, dtype=dtype)


@pytest.fixture(params=sorted(HF_VARIANTS))
def hf_variant(request, tmp_path):
    directory = tmp_path / request.param
    model = make_hf_llama(directory, **HF_VARIANTS[request.param])
    return directory, model


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(tokenizer_dir, shards_dir) of a small generated corpus."""
    from tests.train_utils import make_shards

    return make_shards(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data):
    """A pretraining run directory with checkpoints at steps 2 and 4."""
    from tests.train_utils import pretrain_args, run_inprocess

    tokenizer, shards = data
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    extra = ["train.steps=4", "checkpoint.every=2"]
    assert run_inprocess("pretrain", pretrain_args(run_dir, tokenizer, shards, *extra)) == 0
    return run_dir
