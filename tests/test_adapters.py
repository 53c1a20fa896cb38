"""Many LoRA adapters over one base model in one batch (lmforge/generate/adapters.py): each
sequence decodes the greedy tokens of its adapter merged into the model, whatever runs beside
it (the base, other adapters), with the prefix cache keeping each adapter's prompts apart; an
adapter loads into a free slot and unloads when no sequence uses it; bad adapters are clear
errors that change nothing."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lmforge.api import build_model
from lmforge.errors import ConfigError, ModelFormatError
from lmforge.generate import Generator, SamplingParams
from lmforge.modules.lora import LoRASection, apply_lora, merge_lora, save_peft_adapter
from tests.train_utils import small_args

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=())


def _base():
    model = build_model(small_args(), seed=3).eval()
    with torch.no_grad():  # greedy choices far from ties
        for param in model.parameters():
            param.mul_(3.0)
    return model


def make_adapter(base, directory, *, targets, rank, seed, std=0.3):
    """A PEFT adapter of random (nonzero) matrices on `targets`, and `base` with it merged
    (a copy)."""
    model = copy.deepcopy(base)
    apply_lora(model, targets=targets, rank=rank, alpha=2.0 * rank)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    config = LoRASection(enabled=True, rank=rank, alpha=2.0 * rank, targets=targets)
    save_peft_adapter(model, model.args, directory, base_model="base", lora_cfg=config)
    return merge_lora(model).eval()


def _greedy(model, prompts, **options) -> list[list[int]]:
    """(On a copy: an engine fuses its model's projections.)"""
    model = copy.deepcopy(model)
    results = Generator(model, max_batch=4, max_seq_len=64, **options).generate(prompts, GREEDY)
    return [r.token_ids for r in results.results]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = _base()
    merged = {
        "attn": make_adapter(base, root / "attn", targets=["q", "k", "v", "o"], rank=4, seed=1),
        "all": make_adapter(
            base, root / "all", targets=["q", "v", "gate", "up", "down"], rank=8, seed=2
        ),
    }
    return root, base, merged


def test_a_batch_mixes_the_base_and_adapters_each_as_merged(world):
    root, base, merged = world
    prompts = [[5, 17, 33, 2, 9], [7, 8, 9], list(range(3, 30)), [11, 4]]
    names = [None, "attn", "all", "attn"]
    expected = []
    for prompt, name in zip(prompts, names, strict=True):
        model = base if name is None else merged[name]
        expected += _greedy(model, [prompt])
    generator = Generator(copy.deepcopy(base), max_batch=4, max_seq_len=64, max_adapters=2,
                          max_adapter_rank=8, prefix_cache_tokens=64,
                          prefix_block_tokens=8)  # fmt: skip
    engine = generator.engine
    for name in ("attn", "all"):
        engine.load_adapter(name, root / name)
    for _ in range(2):  # the second round: prompts in the prefix cache, each adapter's own
        sequences = [
            engine.sequence(p, GREEDY, index=i, adapter=n)
            for i, (p, n) in enumerate(zip(prompts, names, strict=True))
        ]
        engine.add(sequences)
        while engine.has_work:
            engine.step()
        assert [s.token_ids for s in sequences] == expected
    assert sequences[2].cached_tokens == 24  # its own prompt's blocks, from the first round


def test_loading_and_unloading_and_what_is_refused(world, tmp_path):
    root, base, _ = world
    generator = Generator(copy.deepcopy(base), max_batch=2, max_seq_len=64, max_adapters=1,
                          max_adapter_rank=4)  # fmt: skip
    engine = generator.engine
    with pytest.raises(ConfigError, match="rank 8 is above the engine's max_adapter_rank 4"):
        engine.load_adapter("all", root / "all")
    engine.load_adapter("attn", root / "attn")
    with pytest.raises(ConfigError, match="1 adapters are loaded, the most"):
        engine.load_adapter("again", root / "attn")
    with pytest.raises(ConfigError, match="unknown adapter 'nope'; loaded: attn"):
        engine.sequence([1, 2], GREEDY, adapter="nope")
    waiting = engine.sequence([1, 2, 3], GREEDY, adapter="attn")
    engine.add([waiting])
    with pytest.raises(ConfigError, match="in use"):
        engine.unload_adapter("attn")
    while engine.has_work:
        engine.step()
    engine.unload_adapter("attn")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["lm_head"]}
    ))  # fmt: skip
    with pytest.raises(ModelFormatError, match="adapts output, which served adapters do not"):
        engine.load_adapter("head", bad)
    with pytest.raises(ModelFormatError, match=r"adapter_config\.json: file not found"):
        engine.load_adapter("none", tmp_path)
    assert engine.adapters.names == {}
    fused = Generator(copy.deepcopy(base), max_batch=1, max_seq_len=32)
    with pytest.raises(ConfigError, match="takes no adapters"):
        fused.engine.load_adapter("x", root / "attn")
    with pytest.raises(ConfigError, match="already fused"):
        Generator(fused.engine.model, max_batch=1, max_seq_len=32, max_adapters=1)


def test_generate_runs_an_adapter_unmerged_as_merged(tmp_path, capsys):
    """`lmforge generate ART --lora DIR` (a pipeline's generate stage: lora = ...) prints
    what the adapter merged into the artifact prints."""
    import lmforge
    from lmforge import cli
    from lmforge.api import LoadedModel
    from tests.test_serve import make_artifact

    (tmp_path / "model").mkdir()
    artifact = make_artifact(tmp_path / "model")
    loaded = lmforge.load(artifact)
    merged = make_adapter(loaded.model, tmp_path / "adapter", targets=["q", "v", "up"], rank=4,
                          seed=3, std=0.5)  # fmt: skip
    merged_dir = lmforge.save(
        LoadedModel(model=merged, tokenizer=loaded.tokenizer, config=loaded.config, source="m"),
        tmp_path / "merged",
    )
    argv = ["--prompt", "The cat sat", "--temperature", "0", "--max-new-tokens", "8"]
    outputs = []
    for command in (["generate", str(merged_dir)], ["generate", str(artifact), "--lora",
                                                     str(tmp_path / "adapter")]):  # fmt: skip
        assert cli.main([*command, *argv]) == 0
        outputs.append(capsys.readouterr().out.split("\n[1]")[0])
    assert outputs[0] == outputs[1] and "=== The cat sat" in outputs[0]
    assert cli.main(["generate", str(artifact), *argv]) == 0
    assert capsys.readouterr().out.split("\n[1]")[0] != outputs[0]  # the adapter mattered
