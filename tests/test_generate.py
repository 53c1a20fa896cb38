"""Generation: parity with transformers' greedy `generate`, the static cache against full
forwards, sampling, stops, streaming, chat prompts and the `lmforge generate` command."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch

import lmforge
from lmforge.api import build_model
from lmforge.cli import main as cli_main
from lmforge.errors import ConfigError
from lmforge.generate import Engine, Generator, Sampler, SamplingParams
from lmforge.generate import engine as engine_module
from lmforge.generate.generate import weight_bytes
from lmforge.generate.sampling import CDF_BLOCK, inverse_cdf
from tests.conftest import make_hf_llama, make_hf_qwen3
from tests.train_utils import demo_world, small_args

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=())


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Decode is many tiny matmuls: with 2 threads on 2 busy cores each waits for the other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_prompts(lengths, vocab_size=256, seed=0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "llama"
    hf_model = make_hf_llama(directory)
    hf_model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return hf_model, lmforge.load(directory)


@pytest.fixture(scope="module")
def hf_qwen3_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "qwen3"
    hf_model = make_hf_qwen3(directory, vocab_size=256)
    hf_model.generation_config.eos_token_id = None
    return hf_model, lmforge.load(directory)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A random tiny model with a BPE tokenizer trained on the demo corpus, and its artifact."""
    root = tmp_path_factory.mktemp("tiny")
    _, tokenizer, args = demo_world(root, vocab_size=384)
    loaded = lmforge.api.LoadedModel(
        model=build_model(args, seed=3).eval(), tokenizer=tokenizer, config=args, source="tiny"
    )
    artifact = lmforge.save(loaded, root / "artifact")
    return loaded, artifact


@pytest.mark.parametrize("pair", ["hf_pair", "hf_qwen3_pair"], ids=["llama", "qwen3"])
def test_greedy_matches_transformers_generate(request, pair):
    hf_model, loaded = request.getfixturevalue(pair)
    prompts = _random_prompts([5, 11, 8, 1])
    generator = Generator(loaded.model, max_batch=3, max_seq_len=64)  # 4 prompts: 2 batches
    results = generator.generate(prompts, GREEDY).results
    assert [r.index for r in results] == [0, 1, 2, 3]
    for prompt, result in zip(prompts, results):
        expected = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert result.token_ids == expected
        assert result.prompt_ids == prompt and result.finish_reason == "length"
    # transformers' own batch (left-padded, attention mask) agrees too.
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    batched = hf_model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=24,
        do_sample=False,
        pad_token_id=0,
    )[:, width:]
    assert batched.tolist() == [r.token_ids for r in results]


@pytest.mark.parametrize(
    "pair, overlap",
    [("hf_pair", False), ("hf_pair", True), ("hf_qwen3_pair", False)],
    ids=["llama", "llama-overlap", "qwen3"],
)
def test_engine_logprobs_equal_full_forward(request, pair, overlap, monkeypatch):
    """Chunked prefill (4 tokens a step), prompts joining a running batch in freed rows over
    stale slots, buckets of 1..4 rows, decode steps attending to 8, 16, 32 or 39 slots: every
    token's log-probabilities equal a plain forward's over the whole sequence."""
    _, loaded = request.getfixturevalue(pair)
    model = loaded.model
    monkeypatch.setattr(engine_module, "MIN_KV_BUCKET", 8)
    engine = Engine(model, max_batch=4, max_seq_len=40, prefill_chunk=4)
    kv_lens = check_kv_lens(engine)
    engine.overlap = overlap  # the CUDA schedule (collect a step after the next launch)
    prompts = _random_prompts([3, 9, 6, 13, 2, 7], seed=1)
    check_logprobs_against_full_forward(engine, prompts, [5, 12, 3, 8, 12, 6])
    assert set(kv_lens) == {8, 16, 32}


def check_logprobs_against_full_forward(engine: Engine, prompts, lengths, k: int = 3) -> None:
    """Run greedy `prompts` for `lengths` new tokens each with their `k` best log-probabilities
    through `engine`; every token's must equal a plain forward's over the whole sequence."""
    sequences = [
        engine.sequence(
            prompt, SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=()),
            index=i, num_logprobs=k,
        )
        for i, (prompt, n) in enumerate(zip(prompts, lengths))
    ]  # fmt: skip
    engine.add(sequences)
    events = {i: [] for i in range(len(prompts))}
    while engine.has_work:
        for sequence, event in engine.step():
            events[sequence.index].append(event)
    with torch.no_grad():
        for sequence in sequences:
            assert len(sequence.token_ids) == lengths[sequence.index]
            tokens = sequence.prompt_ids + sequence.token_ids
            logprobs = engine.model(torch.tensor([tokens]))[0].float().log_softmax(-1)
            for step, event in enumerate(events[sequence.index]):
                expected = logprobs[len(sequence.prompt_ids) - 1 + step]
                assert abs(event.logprob - expected[event.token_id].item()) <= 1e-5
                assert event.token_id == expected.argmax().item()
                best = expected.topk(k)
                assert [i for i, _ in event.top_logprobs] == best.indices.tolist()
                values = torch.tensor([v for _, v in event.top_logprobs])
                torch.testing.assert_close(values, best.values, rtol=0, atol=1e-5)


def check_kv_lens(engine: Engine) -> list[int]:
    """Check each decode step of `engine`: the positions the host computes are the device's,
    and all are below the KV length the step attends to; returns those lengths as they come."""
    kv_lens = []
    decode_rows = engine.decode_rows

    def checked(bucket, kv_len=None, **options):
        decoding = [s for s in engine._rows if s is not None and s.slot < bucket and s.prefilled]
        decoding = [s for s in decoding if s.num_scheduled < s.max_new_tokens]
        positions = [s.decode_position for s in decoding]
        assert engine._positions[[s.slot for s in decoding]].tolist() == positions
        assert kv_len == engine.kv_bucket(max(positions) + 1) and kv_len > max(positions)
        kv_lens.append(kv_len)
        return decode_rows(bucket, kv_len, **options)

    engine.decode_rows = checked
    return kv_lens


def test_kv_buckets():
    assert engine_module.kv_buckets(4096) == (256, 512, 1024, 2048, 4095)
    assert engine_module.kv_buckets(1000) == (256, 512, 999)
    assert engine_module.kv_buckets(257) == (256,)  # the last slot is never read
    assert engine_module.kv_buckets(100) == (99,)
    assert engine_module.kv_buckets(40, smallest=8) == (8, 16, 32, 39)
    model = build_model(small_args(max_seq_len=2048), seed=0).eval()
    engine = Engine(model, max_batch=2, max_seq_len=1024)
    assert engine.kv_buckets == (256, 512, 1023)
    lengths = [1, 256, 257, 512, 513, 1023, 1024]
    assert [engine.kv_bucket(n) for n in lengths] == [256, 256, 512, 512, 1023, 1023, 1023]


def test_long_and_short_caches_give_the_same_tokens(monkeypatch):
    """A cache of 2048 slots and one of 48 (and one read whole at every step) decode the same
    greedy tokens: rows of different lengths in one batch, their steps crossing KV buckets."""
    model = build_model(small_args(max_seq_len=2048), seed=2).eval()
    prompts = _random_prompts([3, 17, 9, 30, 5], seed=6)
    params = SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=())
    whole = Generator(model, max_batch=4, max_seq_len=48).generate(prompts, params).results
    monkeypatch.setattr(engine_module, "MIN_KV_BUCKET", 8)
    for max_seq_len in (48, 2048):
        generator = Generator(model, max_batch=4, max_seq_len=max_seq_len, prefill_chunk=16)
        kv_lens = check_kv_lens(generator.engine)
        results = generator.generate(prompts, params).results
        assert [r.token_ids for r in results] == [r.token_ids for r in whole], max_seq_len
        assert set(kv_lens) == {8, 16, 32, 47 if max_seq_len == 48 else 64}


def test_sequence_alone_equals_it_in_a_batch_of_32(hf_pair, monkeypatch):
    """Greedy tokens of each sequence are the same alone (bucket 1) and among 31 others of
    other lengths (buckets up to 32, rows joining and leaving, decode steps attending to as
    many slots as the longest row needs)."""
    _, loaded = hf_pair
    monkeypatch.setattr(engine_module, "MIN_KV_BUCKET", 16)
    generator = Generator(loaded.model, max_batch=32, max_seq_len=64, prefill_chunk=64)
    lengths = [1 + (7 * i) % 23 for i in range(40)]
    prompts = _random_prompts(lengths, seed=4)
    params = [
        SamplingParams(max_new_tokens=4 + (5 * i) % 17, temperature=0, stop_token_ids=())
        for i in range(40)
    ]
    together = generator.generate(prompts, params).results
    for i in (0, 5, 17, 31, 39):
        alone = generator.generate([prompts[i]], params[i]).results[0]
        assert alone.token_ids == together[i].token_ids, i


def test_sampling_is_reproducible_and_top_k_1_is_greedy(hf_pair):
    _, loaded = hf_pair
    generator = Generator(loaded.model, max_batch=2, max_seq_len=48)
    prompts = _random_prompts([4, 7], seed=3)
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, stop_token_ids=())
    first = [r.token_ids for r in generator.generate(prompts, sampled, seed=1).results]
    again = [r.token_ids for r in generator.generate(prompts, sampled, seed=1).results]
    other = [r.token_ids for r in generator.generate(prompts, sampled, seed=2).results]
    assert first == again
    assert first != other
    greedy = [r.token_ids for r in generator.generate(prompts, GREEDY).results]
    top1 = SamplingParams(max_new_tokens=24, temperature=1.5, top_k=1, stop_token_ids=())
    assert [r.token_ids for r in generator.generate(prompts, top1, seed=5).results] == greedy
    tiny_p = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=1e-6, stop_token_ids=())
    assert [r.token_ids for r in generator.generate(prompts, tiny_p, seed=5).results] == greedy
    # The CUDA loop (next step started before this one's tokens are read) gives the same.
    generator.engine.overlap = True
    assert [r.token_ids for r in generator.generate(prompts, sampled, seed=1).results] == first
    stop_id = greedy[0][3]
    stopped = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=(stop_id,))
    cut = greedy[0].index(stop_id) + 1
    assert generator.generate(prompts, stopped).results[0].token_ids == greedy[0][:cut]
    generator.engine.overlap = False
    # Per-row settings: a greedy row beside a sampled one stays greedy.
    mixed = generator.generate(prompts, [GREEDY, sampled], seed=7).results
    assert mixed[0].token_ids == greedy[0]


def test_unseeded_rows_draw_together_and_a_seeded_row_keeps_its_own_draws(hf_pair, monkeypatch):
    """Every row samples in one sampler call a step (a call per row was ~10 kernel launches
    a row, every step): rows without a seed with the engine's generator's uniforms, a seeded
    row with its own, so it draws what it draws alone; greedy and top-k 1 rows stay greedy."""
    _, loaded = hf_pair
    generator = Generator(loaded.model, max_batch=4, max_seq_len=48)
    prompts = _random_prompts([4, 7, 5, 6], seed=12)
    sampled = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=())
    top1 = SamplingParams(max_new_tokens=24, temperature=1.5, top_k=1, stop_token_ids=())
    greedy = [r.token_ids for r in generator.generate(prompts[:3], GREEDY).results]
    seeded_alone = generator.generate([prompts[3]], sampled, seed=3).results[0].token_ids
    engine = generator.engine
    rows = [
        engine.sequence(prompts[0], GREEDY),
        engine.sequence(prompts[1], top1),
        engine.sequence(prompts[2], sampled),
        engine.sequence(prompts[3], sampled, seed=3),
    ]
    calls, real_call = [], Sampler.__call__

    def counted(sampler, logits, draws=None, **uniforms):
        calls.append(logits.shape[0])
        return real_call(sampler, logits, draws, **uniforms)

    monkeypatch.setattr(Sampler, "__call__", counted)
    engine.add(rows)
    while engine.has_work:
        engine.step()
    assert [rows[0].token_ids, rows[1].token_ids] == greedy[:2]
    assert rows[3].token_ids == seeded_alone
    assert len(rows[2].token_ids) == 24 and rows[2].token_ids != greedy[2]
    assert calls == [4] * 24  # prefill + 23 steps


def test_sampler_keeps_to_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    generator = torch.Generator().manual_seed(0)
    top_k = Sampler([SamplingParams(temperature=1.0, top_k=2)] * 2, device=torch.device("cpu"))
    top_p = Sampler([SamplingParams(temperature=1.0, top_p=0.9)] * 2, device=torch.device("cpu"))
    k_draws = torch.cat([top_k(logits, generator) for _ in range(300)])
    p_draws = torch.cat([top_p(logits, generator) for _ in range(300)])
    assert set(k_draws.tolist()) == {0, 1}
    assert set(p_draws.tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.9 <= 0.95
    assert 0.5 < (k_draws == 0).float().mean() < 0.75  # 0.5 / 0.8 = 0.625


def test_top_k_rows_draw_from_the_largest_k_as_from_the_whole_sorted_vocabulary():
    """When every sampled row has a top-k, the sampler takes the largest k logits instead of
    sorting the vocabulary: both ways draw from the exact top-k / top-p distribution (20,000
    draws each, total variation distance within sampling error), and greedy rows beside them
    keep their argmax."""
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1)) * 2
    draws = 20_000
    for k, p in ((3, 1.0), (40, 0.9), (17, 0.5)):
        best, ids = (logits / 0.9).topk(k)
        probs = best.softmax(-1)
        kept = probs.cumsum(-1) - probs < p  # the first token always stays
        exact = torch.zeros(500)
        exact[ids[kept]] = probs[kept] / probs[kept].sum()
        params = [SamplingParams(temperature=0.9, top_k=k, top_p=p)] * (draws - 1)
        params.append(SamplingParams(temperature=0))  # greedy, beside them
        narrow = Sampler(params, device=torch.device("cpu"))
        whole = Sampler(params, device=torch.device("cpu"))
        whole.widest_top_k = None  # the whole-vocabulary sort
        assert narrow.widest_top_k == k
        for sampler in (narrow, whole):
            tokens = sampler(logits.expand(draws, -1), torch.Generator().manual_seed(k))
            assert tokens[-1] == logits.argmax()
            frequencies = torch.bincount(tokens[:-1], minlength=500) / (draws - 1)
            assert 0.5 * (frequencies - exact).abs().sum() < 0.04, (k, p)


def test_min_p_keeps_the_tokens_near_the_best_after_temperature_and_before_top_p():
    """min_p keeps the tokens at least min_p times as likely as the best one (after
    temperature), then top-p cuts what it kept (vLLM's order; Hugging Face's top-p first would
    keep token 1 in the last row); min_p 1 is greedy. Drawn with given uniforms: exact."""
    cpu = torch.device("cpu")
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 5))
    params = [
        SamplingParams(temperature=1.0),  # plain: cdf 0.5, 0.8, 0.95, 1
        SamplingParams(temperature=1.0, min_p=0.5),  # keeps 0, 1: 0.625, 0.375
        SamplingParams(temperature=2.0, min_p=0.5),  # p^(1/2) / max: 1, .77, .55, .32
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=1.0, min_p=0.5, top_p=0.6),  # 0.625 >= 0.6: token 0 only
    ]
    sampler = Sampler(params, device=cpu)
    assert sampler.uses_min_p and not Sampler(params[:1], device=cpu).uses_min_p
    for uniform, expected in (
        (0.99, [3, 1, 2, 0, 0]),
        (0.6, [1, 0, 1, 0, 0]),
        (0.7, [1, 1, 1, 0, 0]),
    ):
        uniforms = torch.full((5,), uniform)
        assert sampler(logits, uniforms=uniforms).tolist() == expected, uniform
    # the same through the sort (a row with top-p beside them) and through top-k
    with_top_k = [SamplingParams(temperature=1.0, min_p=0.5, top_k=3)] * 5
    assert (
        Sampler(with_top_k, device=cpu)(logits, uniforms=torch.full((5,), 0.99)).tolist() == [1] * 5
    )
    with pytest.raises(ConfigError, match="min_p"):
        SamplingParams(min_p=1.5)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_rows_without_min_p_or_min_tokens_draw_what_they_draw_alone(top_p):
    """Rows with min_p or min_tokens beside plain rows: the plain rows' tokens are those they
    draw alone with the same uniforms (over 3000 columns: the two-level search), and a min_p
    1 row at temperature 1 takes the argmax."""
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 3000, generator=g) * 3
    uniforms = torch.rand(6, generator=g)
    plain = SamplingParams(temperature=0.8, top_p=top_p)
    params = [
        plain,
        SamplingParams(temperature=1.0, min_p=1.0, top_p=top_p),
        SamplingParams(temperature=1.0, top_p=top_p),
        SamplingParams(temperature=0.7, min_p=0.05, top_p=top_p, min_tokens=2),
        plain,
        SamplingParams(temperature=0, min_tokens=5),
    ]
    stop_ids = [(), (), (), (7, 11), (), [int(logits[5].argmax())]]
    sampler = Sampler(params, device=cpu, stop_ids=stop_ids)
    before = logits.clone()
    tokens = sampler(logits, uniforms=uniforms, num_generated=torch.tensor([0, 0, 0, 1, 0, 4]))
    assert torch.equal(logits, before)  # masks go to a copy (log-probabilities read these)
    for row in (0, 2, 4):
        alone = Sampler([params[row]], device=cpu)(
            logits[row : row + 1], uniforms=uniforms[row : row + 1]
        )
        assert tokens[row] == alone[0], row
    assert tokens[1] == logits[1].argmax()
    assert tokens[5] == logits[5].topk(2).indices[1]  # its argmax is its stop id, masked
    assert tokens[3] not in (7, 11)


def test_min_tokens_masks_each_rows_stop_ids_until_it_has_enough():
    """A row below its min_tokens cannot choose its stop ids (greedy rows too); one past it,
    or with no stop ids, chooses as without; a row without min_tokens is untouched."""
    cpu = torch.device("cpu")
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [0.0, 1.0, 5.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    params = [
        SamplingParams(temperature=0, max_new_tokens=8, min_tokens=3),
        SamplingParams(temperature=0, max_new_tokens=8, min_tokens=2),
        SamplingParams(temperature=0),
    ]
    sampler = Sampler(params, device=cpu, stop_ids=[{2, 3}, {2}, {0}])
    assert sampler.all_greedy
    assert sampler(logits, num_generated=torch.tensor([0, 1, 0])).tolist() == [1, 3, 0]
    assert sampler(logits, num_generated=torch.tensor([2, 2, 0])).tolist() == [1, 2, 0]
    assert sampler(logits, num_generated=torch.tensor([3, 2, 0])).tolist() == [2, 2, 0]
    assert sampler(logits).tolist() == [2, 2, 0]  # no row under its min_tokens
    # no stop ids: nothing to mask (not token 0)
    bare = Sampler(params[:1], device=cpu, stop_ids=[()])
    assert bare(logits[:1], num_generated=torch.tensor([0])).tolist() == [2]
    assert Sampler(params[2:], device=cpu).min_tokens is None  # nothing built without it
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
    with pytest.raises(ConfigError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-1,))


def test_min_tokens_holds_off_stop_tokens_and_strings_in_the_engine(tiny_with_tokenizer):
    """Greedy with its own first token as a stop id ends at once; with min_tokens 3 it runs
    on, and every token is the greedy one of the masked logits: it ends at its first stop id
    after the third token. A stop string found in the first min_tokens tokens does not end it;
    a row beside it without min_tokens generates what it does alone."""
    loaded, _ = tiny_with_tokenizer
    tokenizer = loaded.tokenizer
    generator = Generator(loaded.model, tokenizer, max_batch=2, max_seq_len=64)
    prompts = ["Kelmora is a town", "The baker"]
    free = generator.generate(
        prompts, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
    ).results
    first = free[0].token_ids[0]
    stop_at_first = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(first,))
    assert generator.generate(prompts[:1], stop_at_first).results[0].token_ids == [first]
    held = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(first,), min_tokens=3)
    alone = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
    results = generator.generate(prompts, [held, alone]).results
    ids = results[0].token_ids
    assert len(ids) >= 3 and first not in ids[:3]
    assert results[0].finish_reason == "length" or (ids[-1] == first and first not in ids[3:-1])
    assert results[1].token_ids == free[1].token_ids
    # each token is the argmax of a plain forward's logits, the stop id masked for 3 tokens
    tokens = results[0].prompt_ids + ids
    with torch.no_grad():
        logits = generator.engine.model(torch.tensor([tokens]))[0].float()
    for step, token in enumerate(ids):
        expected = logits[len(results[0].prompt_ids) - 1 + step]
        if step < 3:
            expected[first] = float("-inf")
        assert token == expected.argmax().item(), step
    # a stop string inside the first tokens' text waits for min_tokens
    text = free[0].text
    stop = text[:2] if text[:2].strip() else text.strip()[:2]
    early = SamplingParams(max_new_tokens=12, temperature=0, stop=(stop,), stop_token_ids=())
    assert len(generator.generate(prompts[:1], early).results[0].token_ids) < 12
    late = SamplingParams(
        max_new_tokens=12, temperature=0, stop=(stop,), stop_token_ids=(), min_tokens=12
    )
    result = generator.generate(prompts[:1], late).results[0]
    assert result.token_ids == free[0].token_ids and result.finish_reason == "length"


@pytest.mark.parametrize("columns", [4 * CDF_BLOCK + 1, 8 * CDF_BLOCK, 8 * CDF_BLOCK + 37])
def test_two_level_inverse_cdf_draws_what_one_scan_draws(columns):
    """Wide rows are searched block by block (`inverse_cdf`): on probabilities whose sums are
    exact in fp32 (multiples of 2^-10, most of them 0, a last block partly past the end), each
    row draws the first index whose running sum exceeds its uniform times the row's total, as a
    scan of the whole row finds it, never an index of probability 0, at uniforms from 0 to
    just under 1."""
    g = torch.Generator().manual_seed(columns)
    counts = torch.randint(0, 4, (200, columns), generator=g)
    counts *= torch.rand(200, columns, generator=g) < 0.05
    counts[:, 0] += 1  # at least one token a row
    probs = counts.float() / 1024
    uniforms = torch.rand(200, generator=g)
    uniforms[:2] = torch.tensor([0.0, 1 - 2**-24])
    cdf = probs.double().cumsum(-1)
    want = (cdf > uniforms.double()[:, None] * cdf[:, -1:]).int().argmax(-1)
    got = inverse_cdf(probs, uniforms, None)
    assert torch.equal(got, want)
    assert (probs.gather(-1, got[:, None]) > 0).all()


def test_stop_tokens_and_strings_end_each_row_on_its_own(tiny_with_tokenizer):
    loaded, _ = tiny_with_tokenizer
    tokenizer = loaded.tokenizer
    generator = Generator(loaded.model, tokenizer, max_batch=2, max_seq_len=64)
    prompts = ["Kelmora is a town", "The baker"]
    base = SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=())
    free = generator.generate(prompts, base).results
    for result in free:
        assert result.text == tokenizer.decode(result.token_ids)
        assert result.finish_reason == "length" and len(result.token_ids) == 30

    # A stop token: each row ends at its own first occurrence of it (if any).
    stop_id = free[0].token_ids[6]
    stopped = generator.generate(
        prompts, SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=(stop_id,))
    ).results
    for before, after in zip(free, stopped):
        if stop_id in before.token_ids:
            cut = before.token_ids.index(stop_id) + 1
            assert after.token_ids == before.token_ids[:cut]
            assert (after.finish_reason, after.stop) == ("stop", stop_id)
            assert after.text == tokenizer.decode(before.token_ids[: cut - 1])
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"

    # A stop string: the text is cut before it; the other row runs on.
    text = free[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    assert stop.strip()
    stopped = generator.generate(
        prompts, SamplingParams(max_new_tokens=30, temperature=0, stop=(stop,), stop_token_ids=())
    ).results
    for before, after in zip(free, stopped):
        if stop in before.text:
            assert after.text == before.text[: before.text.index(stop)]
            assert (after.finish_reason, after.stop) == ("stop", stop)
            assert after.token_ids == before.token_ids[: len(after.token_ids)]
            assert len(after.token_ids) < 30
        else:
            assert after.text == before.text and after.finish_reason == "length"

    # Default stop ids are the tokenizer's (EOS, end of turn).
    assert generator.engine.sequence("x", SamplingParams()).stop_ids == frozenset(
        tokenizer.stop_ids
    )


def test_stream_yields_text_per_step_and_holds_back_stop_prefixes(tiny_with_tokenizer):
    loaded, _ = tiny_with_tokenizer
    generator = Generator(loaded.model, loaded.tokenizer, max_batch=2, max_seq_len=64)
    prompts = ["Dunvale", "A goat"]
    free = generator.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0)).results
    stop = free[1].text[5:9]
    params = SamplingParams(max_new_tokens=20, temperature=0, stop=(stop,))
    stream = generator.stream(prompts, params)
    pieces: dict[int, list[str]] = {0: [], 1: []}
    num_steps = 0
    for events in stream:
        num_steps += 1
        assert torch.is_grad_enabled()  # the engine's no_grad does not leak into the caller
        assert len({e.index for e in events}) == len(events)  # at most one token per row
        for event in events:
            pieces[event.index].append(event.text)
            assert stop not in "".join(pieces[event.index])
    results = stream.results
    for index, result in enumerate(results):
        assert "".join(pieces[index]) == result.text
        assert len(pieces[index]) == len(result.token_ids)
    assert results[1].finish_reason == "stop"
    assert results[1].text == free[1].text[: free[1].text.index(stop)]
    assert num_steps == max(len(r.token_ids) for r in results)
    assert stream.stats.num_new_tokens == sum(len(r.token_ids) for r in results)


def test_chat_prompts_use_the_template(tiny_with_tokenizer):
    loaded, _ = tiny_with_tokenizer
    tokenizer = loaded.tokenizer
    generator = Generator(loaded.model, tokenizer, max_batch=1, max_seq_len=64)
    messages = [{"role": "user", "content": "Where does Kalo live?"}]
    result = generator.generate([messages], SamplingParams(max_new_tokens=5), seed=0).results[0]
    assert result.prompt_ids == tokenizer.encode_chat(messages, add_generation_prompt=True)
    assert generator.encode_prompt("hi") == tokenizer.encode("hi", bos=True)


def test_report_and_errors(hf_pair):
    _, loaded = hf_pair
    generator = Generator(loaded.model, max_batch=2, max_seq_len=16)
    output = generator.generate(_random_prompts([3, 5]), GREEDY)
    # 16 slots: the 5-token prompt gets 11 new tokens, the 3-token one 13.
    assert [len(r.token_ids) for r in output.results] == [13, 11]
    stats = output.stats
    assert stats.num_new_tokens == 24 and stats.num_decode_tokens == 22
    assert stats.num_decode_steps == 12 and stats.decode_s > 0 and stats.peak_memory_bytes > 0
    assert stats.weight_bytes == weight_bytes(loaded.model)
    report = stats.format()
    for word in ("tokens/s", "GB/s", "peak memory", "prefill"):
        assert word in report
    # Untied: the input table is only looked up, the output table is read whole; tied: once.
    model = loaded.model
    table = model.tok_embeddings.weight.numel() * 4
    assert weight_bytes(model) == sum(p.numel() * 4 for p in model.parameters()) - table
    args = model.args.replace(tie_embeddings=True)
    tied = build_model(args)
    assert weight_bytes(tied) == sum(p.numel() * 4 for p in tied.parameters())
    assert weight_bytes(tied.to(torch.bfloat16)) == args.num_params() * 2
    # a tensor-parallel process's vocabulary rows are an embedding too (only looked up)
    from lmforge.generate.parallel import VocabularyShard

    untied = build_model(model.args)
    untied_bytes = weight_bytes(untied)
    untied.tok_embeddings = VocabularyShard(untied.tok_embeddings.weight.detach(), 0, None)
    assert weight_bytes(untied) == untied_bytes
    with pytest.raises(ConfigError, match="max_seq_len"):
        generator.generate([list(range(16))], GREEDY)
    with pytest.raises(ConfigError, match="tokenizer"):
        generator.generate(["text"], GREEDY)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)


def test_decode_step_compiles_without_graph_breaks(hf_pair, monkeypatch):
    _, loaded = hf_pair
    compile_calls = []
    real_compile = torch.compile

    def eager_compile(fn, **kwargs):
        # Trace with dynamo and AOT autograd but generate no code: fast, still refuses graph
        # breaks and specializing a dynamic size (AOT's functionalized graph can guard on
        # shapes that dynamo's alone does not).
        compile_calls.append(kwargs)
        options = {"guard_filter_fn": kwargs["options"]["guard_filter_fn"]}
        kwargs = {**kwargs, "backend": "aot_eager", "options": options}
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", eager_compile)
    monkeypatch.setattr(engine_module, "MIN_KV_BUCKET", 8)  # KV buckets 8, 16, 32, 39
    torch._dynamo.reset()
    prompts = _random_prompts([4, 9], seed=4)
    eager = Generator(loaded.model, max_batch=2, max_seq_len=40).generate(prompts, GREEDY)
    compiled_generator = Generator(loaded.model, max_batch=2, max_seq_len=40, compile=True)
    compiled_generator.warmup()  # batch 1, and batch 2 (dynamic: 2..max_batch), KV length 8
    kv_lens = check_kv_lens(compiled_generator.engine)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = compiled_generator.generate(prompts, GREEDY)
        again = compiled_generator.generate(prompts[:1], GREEDY)  # bucket 1: compiled already
    assert set(kv_lens) == {8, 16, 32}  # one compile for every KV length (dynamic)
    no_module_guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    assert compile_calls == [
        {"fullgraph": True, "dynamic": False, "options": no_module_guards},  # batch 1
        {"fullgraph": True, "options": no_module_guards},  # other buckets, one dynamic compile
    ]
    assert [r.token_ids for r in compiled.results] == [r.token_ids for r in eager.results]
    assert again.results[0].token_ids == eager.results[0].token_ids
    # Without module guards, a second engine over another model (one layer fewer, untied) must
    # still get graphs of its own. (This one reads all 39 slots at every step: one KV bucket,
    # a static size.)
    monkeypatch.setattr(engine_module, "MIN_KV_BUCKET", 256)
    args = loaded.model.args.replace(num_layers=1, tie_embeddings=False)
    other = build_model(args, seed=5).eval()
    expected = Generator(other, max_batch=2, max_seq_len=40).generate(prompts, GREEDY)
    second = Generator(other, max_batch=2, max_seq_len=40, compile=True).generate(prompts, GREEDY)
    assert [r.token_ids for r in second.results] == [r.token_ids for r in expected.results]
    # ... and over a model of other modules: linears whose weight has another name (as
    # lmforge's quantized linears have no `weight`), where the first engine's compiled step
    # failed looking for `weight`.
    for block in other.layers.values():
        block.attention.wo = _RenamedLinear(block.attention.wo.weight)
    expected = Generator(other, max_batch=2, max_seq_len=40).generate(prompts, GREEDY)
    third = Generator(other, max_batch=2, max_seq_len=40, compile=True).generate(prompts, GREEDY)
    assert [r.token_ids for r in third.results] == [r.token_ids for r in expected.results]
    assert compiled_generator.generate(prompts, GREEDY).results == compiled.results
    torch._dynamo.reset()


class _RenamedLinear(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.renamed = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.renamed)


def test_cli_prints_text_and_report(tiny_with_tokenizer, tmp_path, capsys):
    _, artifact = tiny_with_tokenizer
    code = cli_main(
        [
            "generate",
            str(artifact),
            "--prompt",
            "Kelmora is",
            "--max-new-tokens",
            "6",
            "--seed",
            "0",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "=== Kelmora is" in out and "6 new, finish: length" in out
    for word in ("tokens/s", "GB/s", "peak memory"):
        assert word in out

    prompts_file = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "The baker"}, {"messages": [{"role": "user", "content": "Hello"}]}]
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = cli_main(
        [
            "generate",
            str(artifact),
            "--prompts-file",
            str(prompts_file),
            "--temperature",
            "0",
            "--max-new-tokens",
            "4",
            "--stop",
            "zzz",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "=== The baker" in out and "=== Hello" in out and "[2]" in out

    code = cli_main(
        [
            "generate",
            str(artifact),
            "--chat",
            "Hi",
            "--max-new-tokens",
            "3",
            "--top-k",
            "5",
            "--top-p",
            "0.9",
            "--min-p",
            "0.05",
            "--min-tokens",
            "3",
            "--no-compile",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "=== Hi" in out and "3 new, finish: length" in out
    code = cli_main(
        ["generate", str(artifact), "--prompt", "x", "--max-new-tokens", "2", "--min-tokens", "3"]
    )
    assert code == 2 and "min_tokens=3" in capsys.readouterr().err

    prompts_file.write_text('{"text": 1}\n')
    assert cli_main(["generate", str(artifact), "--prompts-file", str(prompts_file)]) == 2
    assert f"{prompts_file}:1" in capsys.readouterr().err
    code = cli_main(["generate", str(artifact), "--prompt", "x", "--max-seq-len", "1"])
    assert code == 2 and "max-seq-len" in capsys.readouterr().err


def test_text_prompts_of_a_chat_tuned_artifact_go_through_its_chat_template(
    tiny_with_tokenizer, tmp_path, monkeypatch, capsys
):
    """Issue 58: `lmforge generate SFT_ARTIFACT --prompt TEXT` answers TEXT as a user message,
    as `--chat TEXT` does; a base model continues it; `--raw` continues it anyway."""
    from lmforge.artifact import chat_tuned
    from lmforge.data.tokenizer import LLAMA3_CHAT_TEMPLATE

    loaded, converted = tiny_with_tokenizer  # lineage: converted from the preset, no training
    tokenizer = loaded.tokenizer
    assert tokenizer.chat_template == LLAMA3_CHAT_TEMPLATE  # lmforge's, for a Llama 3 vocabulary
    runs = tmp_path / "work" / "runs" / "demo"  # as a pipeline lays them out, paths relative
    pretrained = lmforge.save(loaded, runs / "pretrain" / "artifact", stage="pretrain")
    tuned = lmforge.save(loaded, runs / "sft" / "artifact", stage="sft", parent=pretrained)
    quantized = lmforge.save(
        loaded, runs / "quantize" / "out", stage="quantize", parent="runs/demo/sft/artifact"
    )
    own = tmp_path / "hf"  # a Hugging Face model (no lineage) that ships its own template
    own.mkdir()
    for file in converted.iterdir():
        if file.name != "lmforge.json":
            (own / file.name).write_bytes(file.read_bytes())
    (own / "chat_template.jinja").write_text(LLAMA3_CHAT_TEMPLATE + "{#- its own -#}")
    monkeypatch.chdir(tmp_path)  # not the pipeline's workdir: parents are found from the artifact
    lineage = [chat_tuned(path) for path in (converted, pretrained, tuned, quantized, own)]
    assert lineage == [None, False, True, True, None]

    question = "Where does Kalo live?"
    messages = [{"role": "user", "content": question}]
    chat_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    text_ids = tokenizer.encode(question, bos=True)
    applied = "applying the artifact's chat template (--raw for plain text)\n"
    continued = "continuing the text as it is: the artifact was not tuned to chat"

    def generate(artifact, *options) -> tuple[list[int], str]:
        command = ["generate", str(artifact), *options, "--max-new-tokens", "2"]
        code = cli_main([*command, "--temperature", "0", "--device", "cpu", "--no-compile"])
        out, err = capsys.readouterr()
        assert code == 0, err
        return [int(n) for n in re.findall(r"^\[\d+\] (\d+) prompt tokens", out, re.M)], err

    counts, err = generate(tuned, "--prompt", question)
    assert counts == [len(chat_ids)] and applied in err
    counts, err = generate(tuned, "--chat", question)
    assert counts == [len(chat_ids)] and "template" not in err
    counts, err = generate(tuned, "--raw", "--prompt", question)
    assert counts == [len(text_ids)] and "template" not in err and continued not in err
    for chat_model in (quantized, own):  # the SFT parent's say; the model's own template
        counts, err = generate(chat_model, "--prompt", question)
        assert counts == [len(chat_ids)] and applied in err, chat_model
    counts, err = generate(pretrained, "--prompt", question)
    assert counts == [len(text_ids)] and continued in err
    counts, err = generate(converted, "--prompt", question)
    assert counts == [len(text_ids)] and continued in err

    # a prompts file: its text rows become user messages too, its chats stay as they are
    rows = [{"prompt": question}, {"messages": messages}]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    counts, err = generate(tuned, "--prompts-file", str(prompts_file))
    assert counts == [len(chat_ids)] * 2 and applied in err
    counts, err = generate(tuned, "--prompts-file", str(prompts_file), "--raw")
    assert counts == [len(text_ids), len(chat_ids)]

    assert cli_main(["generate", str(tuned), "--raw", "--chat", question]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --raw and --chat: give one") and len(err.splitlines()) == 1


@pytest.mark.parametrize("num_kv_heads", [2, 4])
def test_fused_projections_keep_logits_and_state_dict(num_kv_heads, tmp_path):
    args = small_args(num_kv_heads=num_kv_heads)
    model = build_model(args, seed=0).eval()
    tokens = torch.tensor(_random_prompts([12, 12]))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        reference = model(tokens)
        assert model.fuse_projections()
        assert {"wqkv.weight", "wo.weight"} == {
            name for name, _ in model.layers["0"].attention.named_parameters()
        }
        torch.testing.assert_close(model(tokens), reference, rtol=0, atol=1e-5)
        fused_state = model.state_dict()  # Meta's names, split back
        assert sorted(fused_state) == sorted(state)
        assert all(torch.equal(fused_state[name], state[name]) for name in state)
        other = build_model(args, seed=1).eval()
        assert other.fuse_projections()
        other.load_state_dict(state)  # joined on load
        torch.testing.assert_close(other(tokens), reference, rtol=0, atol=1e-5)
        saved = lmforge.save(
            lmforge.api.LoadedModel(model=model, tokenizer=None, config=args, source="t"),
            tmp_path / "artifact",
        )
        torch.testing.assert_close(lmforge.load(saved).model(tokens), reference, rtol=0, atol=1e-5)


def test_only_plain_weights_fuse(hf_pair):
    from lmforge.modules.lora import apply_lora

    lora = apply_lora(build_model(small_args(), seed=0), targets=["q"], rank=2, alpha=4)
    names = [name for name, _ in lora.named_parameters()]
    assert not lora.fuse_projections()
    assert [name for name, _ in lora.named_parameters()] == names
    _, loaded = hf_pair
    prompts = _random_prompts([7, 3])
    unfused = build_model(loaded.config, seed=0)
    unfused.load_state_dict(loaded.model.state_dict())
    plain = Generator(unfused, max_batch=2, max_seq_len=64, fuse=False)
    assert not plain.fused and "wq" in dict(unfused.layers["0"].attention.named_children())
    fused = Generator(loaded.model, max_batch=2, max_seq_len=64)
    assert fused.fused
    assert [r.token_ids for r in fused.generate(prompts, GREEDY).results] == [
        r.token_ids for r in plain.generate(prompts, GREEDY).results
    ]


def test_inference_forwards_use_attention_without_per_shape_setup():
    """Prefill and scoring run eagerly with new shapes nearly every batch: on a GPU they leave
    out cuDNN's attention (an execution plan built per shape); elsewhere nothing changes."""
    from lmforge.generate.attention import shape_free_attention

    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    with shape_free_attention("cuda"):  # only flags: no GPU needed
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before
    with shape_free_attention("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before


def test_incremental_text_with_the_tokenizers_stream_equals_window_decoding(tmp_path):
    """Streamed text (tokenizers' DecodeStream where the backend has it) comes out piece for
    piece as the decode-a-window rule gives it, multi-byte characters split across ids
    included, and `flush` turns an incomplete character into U+FFFD either way."""
    from lmforge.data.tokenizer import train_bpe
    from lmforge.generate.sequence import IncrementalText

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n" * 20 + "héllo wörld\n")
    tokenizer = train_bpe([corpus], vocab_size=300, out_dir=tmp_path / "tok")
    assert tokenizer.text_stream() is not None
    text = "the cat: héllo 🙂 日本語 wörld"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 2  # rare characters are split into byte ids

    def pieces(decoder: IncrementalText, ids: list[int]) -> list[str]:
        return [decoder.push(i) for i in ids] + [decoder.flush()]

    def window() -> IncrementalText:
        decoder = IncrementalText(tokenizer)
        decoder._stream = None  # the decode-a-window rule
        return decoder

    assert pieces(IncrementalText(tokenizer), ids) == pieces(window(), ids)
    assert "".join(pieces(IncrementalText(tokenizer), ids)) == text
    cut = ids[: len(tokenizer.encode("the cat: héllo ")) + 1]  # ends inside the emoji's bytes
    assert pieces(IncrementalText(tokenizer), cut) == pieces(window(), cut)
    assert "".join(pieces(IncrementalText(tokenizer), cut)).endswith("\ufffd")


def test_prompts_joining_running_sequences_are_prefilled_together(hf_pair):
    """While sequences decode, a new prompt waits up to PREFILL_WAIT_STEPS steps for others
    (one eager prefill for several); PREFILL_BATCH of them, or nothing decoding, go at once.
    The tokens are those of the prompt generated alone."""
    _, loaded = hf_pair
    engine = Engine(loaded.model, max_batch=8, max_seq_len=64)
    params = SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=())
    prompts = _random_prompts([5, 7, 3, 4, 6, 8], seed=9)

    def steps_until_prefilled(sequences) -> int:
        engine.add(sequences)
        steps = 0
        while not all(s.prefilled for s in sequences):
            engine.step()
            steps += 1
        return steps

    first = engine.sequence(prompts[0], params, index=0)
    assert steps_until_prefilled([first]) == 1  # nothing decodes yet
    late = engine.sequence(prompts[1], params, index=1)
    assert steps_until_prefilled([late]) == engine_module.PREFILL_WAIT_STEPS
    group = [engine.sequence(p, params, index=i) for i, p in enumerate(prompts[2:])]
    assert len(group) == engine_module.PREFILL_BATCH
    assert steps_until_prefilled(group) == 1
    while engine.has_work:
        engine.step()
    alone = Generator(loaded.model, max_batch=1, max_seq_len=64).generate([prompts[1]], params)
    assert late.token_ids == alone.results[0].token_ids


def test_prefill_widths():
    widths = [engine_module.prefill_width(n, 4096) for n in (1, 16, 17, 200, 256, 257, 1025)]
    assert widths == [16, 16, 32, 256, 256, 512, 1280]
    assert engine_module.prefill_width(100, 40) == 40  # never past the cache
    model = build_model(small_args(max_seq_len=4096), seed=0).eval()
    engine = Engine(model, max_batch=64, max_seq_len=4096, prefill_chunk=2048)

    def shape(*lengths):
        return engine._padded_prefill_shape([(None, 0, n) for n in lengths])

    assert shape(16) == (1, 16)
    assert shape(*[100] * 5) == (8, 128)  # 1,024 tokens: padding is free up to there
    assert shape(2000) == (1, 2048)
    assert shape(2000, *[1] * 40) is None  # 64 rows of 2,048: run as it is
    assert shape(700, 700, 700) is None  # 4 rows of 768 > one chunk of 2,048
    assert shape(300, 300, 300, 300) == (4, 512)  # at most twice the 1,200 real tokens
    # Warm-up records every shape that short prompts pad to for free, and nothing wider.
    warm = engine_module.warm_prefill_shapes(engine.buckets, 4096)
    for count in (1, 3, 4, 9, 33, 64):
        for length in (1, 16, 17, 100, 257, 600, 1024):
            padded = shape(*[length] * count)
            free = padded is not None and padded[0] * padded[1] <= 1024
            assert (padded in warm) == free or padded[1] == 16, (count, length, padded)
    assert warm[:8] == [(1, w) for w in (16, 32, 64, 128, 256, 512, 768, 1024)]
    assert (64, 16) in warm and (64, 32) not in warm


def test_padded_prefills_keep_every_rows_log_probabilities(hf_pair, monkeypatch):
    """A compiled engine pads fresh prefills to a (batch bucket, width bucket) shape (on CUDA
    each shape's forward is a CUDA graph): padding rows write only the last slot of row 0 and
    padded positions a row's own later slots, so every token's log-probabilities still equal
    a plain forward's over the whole sequence, with rows decoding while others are prefilled
    into freed rows and a prompt longer than the chunk (its later piece attends with a mask,
    unpadded). The decode steps run eagerly here: the test is about the prefills."""
    _, loaded = hf_pair
    model = loaded.model
    monkeypatch.setattr(Engine, "_compile_decode", lambda engine: None)
    engine = Engine(model, max_batch=4, max_seq_len=64, prefill_chunk=48, compile=True)
    prompts = _random_prompts([5, 17, 40, 3, 29, 50], seed=11)
    check_logprobs_against_full_forward(engine, prompts, [12, 9, 6, 12, 4, 10])
    # The first step: pieces of 5, 17 and 26 tokens (48 in all), padded to 4 rows of 32.
    assert (4, 32) in engine._prefills.buffers


def test_a_long_prompt_among_short_ones_prefills_in_graphed_groups(monkeypatch):
    """Where one padded shape would cost too much (a 600-token prompt would pad three short
    ones to 768 each), a compiled engine runs each width bucket's fresh prompts as a padded
    shape of its own; every token's log-probabilities still equal a plain forward's."""
    model = build_model(small_args(max_seq_len=1024), seed=0).eval()
    monkeypatch.setattr(Engine, "_compile_decode", lambda engine: None)
    engine = Engine(model, max_batch=4, max_seq_len=1024, prefill_chunk=1024, compile=True)
    prompts = _random_prompts([600, 20, 30, 9], seed=13)
    check_logprobs_against_full_forward(engine, prompts, [3, 4, 2, 3])
    assert sorted(engine._prefills.buffers) == [(1, 16), (1, 768), (2, 32)]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
        ),
    ],
)
def test_an_engine_gives_its_cache_back_and_takes_it_again(device):
    """`release_cache` frees the KV cache (and, on a GPU, the CUDA graphs over it) of an idle
    engine and `reserve_cache` takes it again: the next sequences (sampled with seeds,
    log-probabilities read) come out as from an engine that never gave it back, and the
    compiled steps are not compiled again (GRPO's rollout engine, once a run)."""
    model = build_model(small_args(), seed=0).to(device).eval()
    prompts = _random_prompts([7, 12, 3, 9], seed=2)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, stop_token_ids=())

    def run(engine):
        sequences = [
            engine.sequence(p, params, index=i, seed=10 + i, num_logprobs=0)
            for i, p in enumerate(prompts)
        ]
        logprobs = [[] for _ in sequences]
        engine.add(sequences)
        while engine.has_work:
            for sequence, event in engine.step():
                logprobs[sequence.index].append(event.logprob)
        assert all(len(lp) == 20 and max(lp) <= 0 for lp in logprobs)
        return [s.token_ids for s in sequences], logprobs

    engine = Engine(model, max_batch=4, max_seq_len=64)
    first = run(engine)
    torch._dynamo.utils.counters.clear()
    for _ in range(2):
        engine.release_cache()
        assert all(t.untyped_storage().nbytes() == 0 for t in engine.caches.tensors())
        assert engine.graphs is None or not engine.graphs.graphs
        engine.reserve_cache()
        tokens, logprobs = run(engine)
        assert tokens == first[0]
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(first[1]))
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]  # nothing compiled again
    with pytest.raises(RuntimeError, match="still has sequences"):
        engine.add([engine.sequence(prompts[0], params)])
        engine.release_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_greedy_tokens_chosen_inside_the_graph_equal_the_hosts():
    """On a GPU, a step where every row of its bucket decodes greedily takes its argmax inside
    the step's CUDA graph (`decode_rows(greedy=True)`), recorded mid-stream (its warm-up runs
    put the rows' inputs back): the tokens equal those chosen from the logits outside it (the
    path a sequence asking for log-probabilities takes), one sequence and four at a time."""
    model = build_model(small_args(), seed=0).cuda().eval()
    engine = Engine(model, max_batch=4, max_seq_len=64)
    params = SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=())
    for prompts in (_random_prompts([7], seed=1), _random_prompts([7, 12, 3, 9], seed=2)):
        runs = []
        for num_logprobs in (None, 0):  # inside the graph, then outside it
            sequences = [
                engine.sequence(p, params, index=i, num_logprobs=num_logprobs)
                for i, p in enumerate(prompts)
            ]
            engine.add(sequences)
            while engine.has_work:
                engine.step()
            runs.append([s.token_ids for s in sequences])
        assert runs[0] == runs[1] and all(len(ids) == 24 for ids in runs[0])
    recorded = {key[:2] for key in engine.graphs.graphs}
    assert ("greedy", 1) in recorded and ("greedy", 4) in recorded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_dropped_engine_leaves_at_most_its_streams_cublas_workspace():
    """cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it has run on, until the
    process ends: the engine warms up and records all its graphs on one stream of its own, so
    a dropped engine leaves that one behind (with a new stream a recording, ~10 of them)."""
    torch._C._cuda_clearCublasWorkspaces()  # the baseline (no graph alive uses them)
    gc.collect()
    before = torch.cuda.memory_allocated()
    model = build_model(small_args(), seed=0).cuda().eval()
    engine = Engine(model, max_batch=4, max_seq_len=64)
    engine.warmup()
    recorded = len(engine.graphs.graphs)
    del engine, model
    gc.collect()
    left = torch.cuda.memory_allocated() - before
    assert recorded >= 6 and left <= 2 * 32 * 2**20 + 4 * 2**20, (recorded, left)


def test_warm_up_puts_back_what_a_step_changes():
    """A step recorded as a CUDA graph runs twice before (`engine.warm_up`): the state it names
    comes back as it was after each run, also when a run fails, so that the recorded graph's
    one replay advances it once."""
    tokens, positions, runs = torch.tensor([[5]]), torch.tensor([[7]]), []

    def step():
        runs.append((tokens.item(), positions.item()))
        tokens.fill_(9)
        positions.add_(1)
        if len(runs) == 3:
            raise RuntimeError("capture failed")
        return tokens

    engine_module.warm_up(step, (tokens, positions))
    assert runs == [(5, 7), (5, 7)] and (tokens.item(), positions.item()) == (5, 7)
    with pytest.raises(RuntimeError):
        engine_module.warm_up(step, (tokens, positions))
    assert (tokens.item(), positions.item()) == (5, 7)
    engine_module.warm_up(lambda: positions.add_(1))  # no state named: idempotent steps only
    assert positions.item() == 9


def _graphs_recording_with(record, monkeypatch):
    """A `StepGraphs` without a GPU whose recordings are `record(step, state, *, warm)`'s."""
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    graphs = engine_module.StepGraphs()
    monkeypatch.setattr(graphs, "_record", record)
    return graphs


def test_a_step_cuda_cannot_capture_runs_as_it_is(monkeypatch, caplog):
    """Where recording a graph fails (a step that syncs with the host, say), the step's
    result still comes back, with a warning, and no later step tries to record again."""
    recorded = []

    def record(step, state=(), *, warm):
        recorded.append(step)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = _graphs_recording_with(record, monkeypatch)
    assert graphs.run(("prefill", 1, 16), lambda: torch.tensor([1.0])).tolist() == [1.0]
    assert graphs.run(("decode", 1, 256), lambda: torch.tensor([2.0])).tolist() == [2.0]
    assert len(recorded) == 1 and graphs.failed
    assert "running without CUDA graphs: recording ('prefill', 1, 16) failed" in caplog.text


def test_a_step_recorded_before_records_again_without_warm_up_runs(monkeypatch):
    """After `clear` (a KV cache given back and taken again: GRPO's rollouts), a key whose step
    ran before records again at once: its step compiled and tuned the first time."""
    warm_ups = []

    def record(step, state=(), *, warm):
        warm_ups.append(warm)
        graph = type("Graph", (), {"replay": lambda self: None})()
        return graph, step()

    graphs = _graphs_recording_with(record, monkeypatch)
    for key in (("decode", 8, 256), ("decode", 8, 256), ("prefill", 1, 16)):
        graphs.run(key, lambda: torch.tensor([1.0]))
    graphs.clear()
    for key in (("decode", 8, 256), ("decode", 16, 256)):
        graphs.run(key, lambda: torch.tensor([1.0]))
    assert warm_ups == [True, True, False, True]
