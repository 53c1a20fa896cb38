"""`lmforge serve --lora NAME=PATH`: requests name an adapter as their "model" and get the
tokens of that adapter merged into the model, the base model's beside them; adapters load and
unload at run time (vLLM's routes), a broken one is a 400 and serving goes on; /v1/models lists
them. Through the real openai client and HTTP."""

from __future__ import annotations

import copy

import pytest
import torch

openai = pytest.importorskip("openai")

import lmforge  # noqa: E402
from lmforge.generate import Generator, SamplingParams  # noqa: E402
from tests.test_adapters import make_adapter  # noqa: E402
from tests.test_serve import Server, make_artifact, request  # noqa: E402

GREEDY = dict(max_tokens=8, temperature=0)


def _texts(model, tokenizer, prompt: str) -> str:
    generator = Generator(copy.deepcopy(model), tokenizer, max_batch=1, max_seq_len=96)
    ids = generator.encode_prompt(prompt)
    params = SamplingParams(max_new_tokens=GREEDY["max_tokens"], temperature=0)
    return generator.generate([ids], params).results[0].text


def test_adapters_by_model_name_loaded_and_unloaded_at_run_time(tmp_path):
    (tmp_path / "model").mkdir()
    artifact = make_artifact(tmp_path / "model")
    torch.set_num_threads(1)
    loaded = lmforge.load(artifact)
    merged = {
        "tone": make_adapter(
            loaded.model, tmp_path / "tone", targets=["q", "v", "o"], rank=4, seed=1, std=0.5
        ),
        "style": make_adapter(
            loaded.model,
            tmp_path / "style",
            targets=["k", "gate", "up", "down"],
            rank=8,
            seed=2,
            std=0.5,
        ),
    }
    prompt = "The cat sat"
    expected = {name: _texts(m, loaded.tokenizer, prompt) for name, m in merged.items()}
    expected["base"] = _texts(loaded.model, loaded.tokenizer, prompt)
    assert len(set(expected.values())) == 3  # the adapters change the answer
    server = Server(
        artifact, tmp_path / "server.log", "--served-model-name", "base", "--lora",
        f"tone={tmp_path / 'tone'}", "--max-loras", "2", "--max-lora-rank", "8",
        "--max-seq-len", "96",
    ).wait_ready()  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["base", "tone"]

        def answer(model: str) -> str:
            return client.completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text

        assert answer("tone") == expected["tone"] and answer("base") == expected["base"]
        status, _, body = request(
            server, "POST", "/v1/load_lora_adapter",
            {"lora_name": "broken", "lora_path": str(tmp_path / "nowhere")},
        )  # fmt: skip
        assert status == 400 and b"lora_path" in body and b"not found" in body
        status, _, _ = request(
            server, "POST", "/v1/load_lora_adapter",
            {"lora_name": "style", "lora_path": str(tmp_path / "style")},
        )  # fmt: skip
        assert status == 200
        assert answer("style") == expected["style"] and answer("tone") == expected["tone"]
        status, _, _ = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "tone"})
        assert status == 200
        with pytest.raises(openai.NotFoundError):
            answer("tone")
        status, _, body = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "tone"})
        assert status == 404 and b"lora_name" in body
        assert answer("base") == expected["base"]
    finally:
        server.stop()
