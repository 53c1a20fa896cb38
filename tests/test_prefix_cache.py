"""Automatic prefix caching in the engine (lmforge/generate/prefix_cache.py): a prompt that
starts with an earlier prompt's whole blocks copies their keys and values instead of
prefilling them, and decodes the tokens (and log-probabilities) an engine without the cache
gives; the pool keeps the most recently used blocks under pressure; chunked prefill, a
Qwen3-MoE and a gpt-oss model (its sliding window) alike."""

from __future__ import annotations

import pytest
import torch

from lmforge.api import build_model
from lmforge.generate import Engine, Generator, SamplingParams
from lmforge.generate.prefix_cache import PrefixCache
from lmforge.modules.kv_cache import KVCaches
from tests.train_utils import small_args, small_qwen3_moe_args

BLOCK = 8
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())


def _peaky(args):
    model = build_model(args, seed=3).eval()
    with torch.no_grad():  # greedy choices far from ties
        for param in model.parameters():
            param.mul_(3.0)
    return model


def _prompts(prefix_len: int, tails, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 250, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(1, 250, (n,), generator=g).tolist() for n in tails]


def _run(model, prompts, **options):
    """Each prompt alone, in order (so later ones can find earlier ones' blocks): tokens,
    cached prompt tokens each, and the engine."""
    generator = Generator(model, max_batch=2, max_seq_len=96, **options)
    outputs, cached = [], []
    for prompt in prompts:
        engine = generator.engine
        sequence = engine.sequence(prompt, GREEDY)
        engine.add([sequence])
        while engine.has_work:
            engine.step()
        outputs.append(sequence.token_ids)
        cached.append(sequence.cached_tokens)
    return outputs, cached, generator.engine


@pytest.mark.parametrize(
    "args",
    [small_args(), small_qwen3_moe_args()],
    ids=["llama", "qwen3_moe"],
)
def test_a_shared_prefix_is_copied_and_decodes_the_same_tokens(args):
    model = _peaky(args)
    prompts = [*_prompts(29, [5, 3, 11]), _prompts(29, [4])[0][:16]]  # 16 tokens: 8 cached
    plain, none, _ = _run(model, prompts)
    cached_run, cached, engine = _run(
        model, prompts, prefix_cache_tokens=64, prefix_block_tokens=BLOCK
    )
    assert cached_run == plain and none == [0, 0, 0, 0]
    # the first prompt finds nothing; the others its 3 whole blocks of the 29-token prefix
    # (the 16-token one: its first block, as its last token is always prefilled)
    assert cached == [0, 24, 24, 8]
    cache = engine.prefix_cache
    assert cache.hits == 56 and cache.queries == sum(len(p) for p in prompts)


def test_chunked_prefill_continues_after_the_copied_blocks():
    model = _peaky(small_args())
    prompts = _prompts(40, [30, 33], seed=1)
    plain, _, _ = _run(model, prompts, prefill_chunk=16)
    tokens, cached, _ = _run(
        model, prompts, prefill_chunk=16, prefix_cache_tokens=96, prefix_block_tokens=BLOCK
    )
    assert tokens == plain and cached == [0, 40]


def test_gpt_oss_windowed_layers_take_cached_blocks():
    from lmforge.models import get_preset

    args = get_preset("gpt-oss-20b").replace(
        dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=32,
        num_experts=4, num_experts_per_tok=2, vocab_size=256, sliding_window=6, bos_id=None,
        eos_id=None, max_seq_len=256,
    )  # fmt: skip
    model = _peaky(args)
    prompts = _prompts(21, [4, 7], seed=2)
    plain, _, _ = _run(model, prompts)
    tokens, cached, _ = _run(model, prompts, prefix_cache_tokens=64, prefix_block_tokens=BLOCK)
    assert tokens == plain and cached == [0, 16]


def test_the_pool_keeps_the_most_recent_blocks():
    """Two blocks of pool: a chain of two fills it; a new prompt's block evicts the least
    recently used; a prompt matching an evicted block finds only what is left before it."""
    caches = KVCaches(num_layers=1, max_batch=1, num_kv_heads=1, max_seq_len=32, head_dim=2,
                      dtype=torch.float32, device="cpu")  # fmt: skip
    caches[0].k[0] = torch.arange(64.0).view(1, 32, 2)
    cache = PrefixCache(caches, num_blocks=2, block_tokens=4)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    cache.store(0, a + b + [0])
    assert len(cache.match(a + b + [0])) == 2
    cache.store(0, [*c, 0])  # evicts a's block (least recently used: matched before b's)
    assert cache.match(a + b + [0]) == [] and len(cache.match([*c, 0])) == 1
    caches[0].k.zero_()
    assert cache.load(0, cache.match([*c, 0])) == 4
    torch.testing.assert_close(caches[0].k[0, 0, :4], torch.arange(8.0).view(4, 2))
    assert Engine(build_model(small_args()), prefix_cache_tokens=4).prefix_cache is None
