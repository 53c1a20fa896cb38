"""`lmforge quantize --method gptq`: llm-compressor's GPTQ in its own environment (`make
calibrate`), calibrated on the pipeline's data; skipped where that environment is missing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import lmforge
from lmforge.api import LoadedModel, build_model
from lmforge.cli import main
from lmforge.data.pretrain import TokenShards
from lmforge.data.tokenizer import load_tokenizer
from lmforge.models import get_preset
from lmforge.quantize import calibrated

needs_calibrate = pytest.mark.skipif(
    not Path(os.environ.get(calibrated.PYTHON_ENV) or calibrated.VENV / "bin" / "python").exists(),
    reason="no llm-compressor environment (make calibrate)",
)
TINY = get_preset("tiny").replace(num_layers=2, vocab_size=300, dim=256, ffn_dim=512)


@pytest.fixture(scope="module")
def source(tmp_path_factory, data):
    """A random tiny model with the corpus's tokenizer (that `data`'s shards were made with)."""
    tokenizer_dir, _ = data
    model = build_model(TINY, dtype=torch.float32, seed=5)
    tokenizer = load_tokenizer(tokenizer_dir)
    out = tmp_path_factory.mktemp("gptq") / "model"
    return lmforge.save(LoadedModel(model, tokenizer, TINY, "test"), out, stage="test")


def _logit_error(artifact: Path, reference, ids: torch.Tensor) -> float:
    with torch.no_grad():
        got = lmforge.load(artifact, dtype="float32").model(ids).float()
    return (got - reference).pow(2).mean().item()


@needs_calibrate
def test_gptq_loses_less_than_round_to_nearest(source, data, tmp_path, capsys):
    """GPTQ on windows of the pipeline's shards: the artifact is compressed-tensors (what vLLM
    serves), lmforge loads it, its lineage names the method and the data, and its logits on
    held-out tokens are closer to the original's than round-to-nearest's at the same int4
    group size (9x closer when written, 2026-12-04)."""
    _, shards = data
    gptq, rtn = tmp_path / "gptq", tmp_path / "rtn"
    assert main(["quantize", str(source), str(gptq), "--scheme", "int4-wo", "--method", "gptq",
                 "--calibration", str(shards), "--calibration-samples", "32",
                 "--calibration-seq-len", "64", "--group-size", "32"]) == 0  # fmt: skip
    assert "with GPTQ (llm-compressor, 32 samples" in capsys.readouterr().out
    assert main(["quantize", str(source), str(rtn), "--scheme", "int4-wo", "--format",
                 "compressed-tensors", "--group-size", "32"]) == 0  # fmt: skip
    config = json.loads((gptq / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    lineage = json.loads((gptq / "lmforge.json").read_text())
    assert '"method": "gptq"' in json.dumps(lineage) and str(shards) in json.dumps(lineage)
    # held-out text: the corpus between the calibration windows (32 of 64 tokens, evenly spread)
    corpus = TokenShards(shards)
    stride = len(corpus) // 32
    windows = [corpus.read(i * stride + 64, i * stride + 64 + 48) for i in range(0, 32, 4)]
    ids = torch.tensor(np.stack(windows).astype(np.int64))
    with torch.no_grad():
        reference = lmforge.load(source, dtype="float32").model(ids).float()
    assert _logit_error(gptq, reference, ids) < 0.5 * _logit_error(rtn, reference, ids)


@needs_calibrate
def test_gptq_on_jsonl_text_and_its_errors(source, tmp_path, capsys):
    """JSONL calibration rows (text, prompt + response, messages); a row that is not JSON names
    its file and line; gptq without data or with torchao options is refused, exit 2."""
    rows = tmp_path / "calib.jsonl"
    rows.write_text(
        json.dumps({"text": "the cat sat on the mat"}) + "\n"
        + json.dumps({"prompt": "who sat? ", "response": "the cat"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hello there"}]}) + "\n"
    )  # fmt: skip
    out = tmp_path / "q"
    assert main(["quantize", str(source), str(out), "--scheme", "int8-wo", "--method", "gptq",
                 "--calibration", str(rows)]) == 0  # fmt: skip
    assert "3 samples" in capsys.readouterr().out
    assert lmforge.load(out).model is not None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    base = ["quantize", str(source), str(tmp_path / "x"), "--scheme", "int4-wo"]
    assert main([*base, "--method", "gptq", "--calibration", str(bad)]) == 2
    assert f"{bad}:2: not JSON" in capsys.readouterr().err
    assert main([*base, "--method", "gptq"]) == 2
    assert "--method gptq needs --calibration" in capsys.readouterr().err
    assert main([*base, "--method", "gptq", "--calibration", str(rows), "--format", "torchao"]) == 2
    assert not (tmp_path / "x").exists()


def test_gptq_without_its_environment_says_how_to_make_it(source, data, tmp_path, capsys):
    _, shards = data
    missing = tmp_path / "no-venv" / "bin" / "python"
    code = main(["quantize", str(source), str(tmp_path / "q"), "--scheme", "int4-wo",
                 "--method", "gptq", "--calibration", str(shards),
                 "--calibrate-python", str(missing)])  # fmt: skip
    assert code == 2
    assert "make calibrate" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
