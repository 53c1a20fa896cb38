"""Pretraining data: `TokenShards` checks and `PackedLoader` order, rank slices, exact resume
and per-document masks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.prepare import PrepareSection, prepare
from lmforge.data.pretrain import PackedLoader, TokenShards, build_block_causal_mask
from lmforge.data.tokenizer import load_tokenizer, train_bpe
from lmforge.errors import DataError, UserError

WORDS = [
    "packed",
    "windows",
    "cross",
    "document",
    "borders",
    "and",
    "every",
    "rank",
    "reads",
    "its",
    "own",
    "slice",
]
SEQ_LEN = 16


def random_docs(num_docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(num_docs)]


def train_tokenizer(root: Path, seed: int, vocab_size: int) -> Path:
    (root / f"corpus{seed}.txt").write_text("\n".join(random_docs(200, seed)), encoding="utf-8")
    train_bpe([root / f"corpus{seed}.txt"], vocab_size=vocab_size, out_dir=root / f"tok{seed}")
    return root / f"tok{seed}"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    """(shards directory, tokenizer directory): ~80 documents in shards of 300 tokens."""
    root = tmp_path_factory.mktemp("pretrain_data")
    tokenizer_dir = train_tokenizer(root, seed=0, vocab_size=400)
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in random_docs(80, seed=3)))
    cfg = PrepareSection(
        input=[str(jsonl)],
        tokenizer=str(tokenizer_dir),
        out=str(root / "shards"),
        workers=1,
        shard_tokens=300,
    )
    prepare(cfg, progress=False)
    return root / "shards", tokenizer_dir


@pytest.fixture
def shards(prepared) -> TokenShards:
    return TokenShards(prepared[0])


def take(loader: PackedLoader, num_batches: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(num_batches)]


def window_start(stream: np.ndarray, inputs: torch.Tensor) -> int:
    """The stream offset of the window whose first SEQ_LEN tokens are `inputs` [SEQ_LEN]."""
    return next(
        start
        for start in range(0, stream.size - SEQ_LEN, SEQ_LEN)
        if np.array_equal(stream[start : start + SEQ_LEN], inputs.numpy())
    )


def assert_batches_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys(), step
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)


def test_token_shards_and_tokenizer_refusal(prepared, shards, tmp_path):
    shards_dir, tokenizer_dir = prepared
    assert shards.num_tokens > 10 * SEQ_LEN and len(shards._tokens) > 3
    tokenizer = load_tokenizer(tokenizer_dir)
    shards.check_tokenizer(tokenizer.fingerprint())
    other = load_tokenizer(train_tokenizer(tmp_path, seed=9, vocab_size=300))
    assert other.fingerprint() != tokenizer.fingerprint()
    with pytest.raises(UserError) as info:
        shards.check_tokenizer(other.fingerprint())
    message = str(info.value)
    assert str(shards_dir) in message
    assert tokenizer.fingerprint() in message and other.fingerprint() in message
    # Every document in the stream is BOS ... EOS.
    stream = shards.read(0, shards.num_tokens)
    assert (stream[shards.doc_starts] == tokenizer.bos_id).all()
    assert (stream[shards.doc_starts[1:] - 1] == tokenizer.eos_id).all()


def test_damaged_or_missing_shards(prepared, tmp_path):
    with pytest.raises(DataError, match=r"no meta\.json"):
        TokenShards(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in prepared[0].iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    (copy / "tokens-00001.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=r"tokens-00001.bin: holds 10 bytes"):
        TokenShards(copy)
    with pytest.raises(DataError, match="too few for one sample"):
        PackedLoader(TokenShards(prepared[0]), seq_len=10**6, micro_batch_size=1)


def test_one_epoch_visits_every_window_once(shards):
    stream = shards.read(0, shards.num_tokens)
    loader = PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=1, seed=3)
    starts = []
    for batch in take(loader, loader.num_windows):
        inputs, labels = batch["inputs"][0].numpy(), batch["labels"][0].numpy()
        assert batch["inputs"].dtype == batch["labels"].dtype == torch.int64
        assert batch["inputs"].shape == (1, SEQ_LEN)
        assert np.array_equal(inputs[1:], labels[:-1])
        start = window_start(stream, batch["inputs"][0])
        assert np.array_equal(labels, stream[start + 1 : start + SEQ_LEN + 1])
        starts.append(start)
    assert sorted(starts) == list(range(0, loader.num_windows * SEQ_LEN, SEQ_LEN))
    assert starts != sorted(starts)  # shuffled
    assert loader.epoch == 1


def test_order_is_deterministic_per_seed_and_epoch(shards):
    def inputs(seed, num_batches):
        loader = PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=4, seed=seed)
        return torch.cat([b["inputs"] for b in take(loader, num_batches)])

    num_windows = (shards.num_tokens - 1) // SEQ_LEN
    two_epochs = (2 * num_windows) // 4
    a, b, c = inputs(7, two_epochs), inputs(7, two_epochs), inputs(8, two_epochs)
    assert torch.equal(a, b) and not torch.equal(a, c)
    k = num_windows // 2
    assert not torch.equal(a[:k], a[num_windows : num_windows + k])  # a permutation per epoch


@pytest.mark.parametrize("dp_size", [2, 3])
def test_ranks_are_disjoint_and_together_the_global_order(shards, dp_size):
    micro = 2
    num_steps = (shards.num_tokens // SEQ_LEN) // (micro * dp_size) + 3  # past an epoch end
    single = PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=micro * dp_size, seed=1)
    ranks = [
        PackedLoader(
            shards, seq_len=SEQ_LEN, micro_batch_size=micro, dp_rank=r, dp_size=dp_size, seed=1
        )
        for r in range(dp_size)
    ]
    seen_in_epoch0: list[tuple] = []
    for _ in range(num_steps):
        want = next(single)["inputs"]  # [micro * dp_size, s]
        got = [next(loader)["inputs"] for loader in ranks]
        for r in range(dp_size):
            # Rank r holds global samples r, r + dp_size, ...
            assert torch.equal(got[r], want[r::dp_size])
            if ranks[r].epoch == 0:
                seen_in_epoch0.extend(tuple(row.tolist()) for row in got[r])
    assert len(seen_in_epoch0) == len(set(seen_in_epoch0))


def test_resume_reproduces_the_next_batches_on_every_rank(shards):
    dp_size, micro = 2, 3
    settings = dict(seq_len=SEQ_LEN, micro_batch_size=micro, dp_size=dp_size, seed=5)
    settings["document_masking"] = True
    steps_per_epoch = PackedLoader(shards, **settings).num_windows / (micro * dp_size)
    num_steps = int(2.5 * steps_per_epoch)  # crosses two epoch boundaries
    for rank in range(dp_size):
        reference = take(PackedLoader(shards, dp_rank=rank, **settings), num_steps)
        rng = random.Random(rank)
        # Several successive resumes, one right at the end of an epoch's steps.
        cuts = sorted({*rng.sample(range(1, num_steps), 4), int(steps_per_epoch)})
        got: list[dict] = []
        loader = PackedLoader(shards, dp_rank=rank, **settings)
        for end in [*cuts, num_steps]:
            got.extend(take(loader, end - len(got)))
            state = loader.state_dict()
            assert json.loads(json.dumps(state)) == state  # plain ints
            loader = PackedLoader(shards, dp_rank=rank, **settings)  # a fresh process
            loader.load_state_dict(state)
        assert_batches_equal(got, reference)


def test_resume_with_another_dp_size_continues_the_global_order(shards):
    single = PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=1, seed=2)
    global_order = torch.cat([b["inputs"] for b in take(single, 60)])
    old = [
        PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=2, dp_rank=r, dp_size=2, seed=2)
        for r in range(2)
    ]
    for loader in old:
        take(loader, 5)  # 5 steps x 2 ranks x 2 samples = 20 global samples
    state = old[0].state_dict()
    assert state == old[1].state_dict() and state["samples_consumed"] == 20
    new = [
        PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=1, dp_rank=r, dp_size=4, seed=2)
        for r in range(4)
    ]
    for loader in new:
        loader.load_state_dict(state)
    for step in range(3):
        for r, loader in enumerate(new):
            assert torch.equal(next(loader)["inputs"][0], global_order[20 + 4 * step + r])


def test_resume_refuses_a_changed_order(shards):
    state = PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=1, seed=0).state_dict()
    with pytest.raises(UserError, match="seed=0, this run has seed=1"):
        PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=1, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="seq_len=16, this run has seq_len=8"):
        PackedLoader(shards, seq_len=8, micro_batch_size=1, seed=0).load_state_dict(state)


def test_document_ids_and_positions(shards):
    loader = PackedLoader(shards, seq_len=SEQ_LEN, micro_batch_size=8, document_masking=True)
    doc_start_set = set(shards.doc_starts.tolist())
    stream = shards.read(0, shards.num_tokens)
    num_boundaries = 0
    for batch in take(loader, 6):
        assert batch["document_ids"].dtype == torch.int32
        assert batch["positions"].dtype == torch.int64
        for inputs, ids, positions in zip(
            batch["inputs"], batch["document_ids"], batch["positions"]
        ):
            window = window_start(stream, inputs)
            want_id, want_pos = 0, 0
            for i in range(SEQ_LEN):
                if i > 0 and window + i in doc_start_set:
                    want_id, want_pos = want_id + 1, 0
                    num_boundaries += 1
                    assert inputs[i] == shards.bos_id and inputs[i - 1] == shards.eos_id
                assert (ids[i], positions[i]) == (want_id, want_pos), i
                want_pos += 1
    assert num_boundaries > 10


def test_block_causal_mask():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    mask = build_block_causal_mask(ids)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    for b in range(2):
        for q in range(6):
            for k in range(6):
                assert mask[b, 0, q, k] == (k <= q and ids[b, q] == ids[b, k])
    assert torch.equal(mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
