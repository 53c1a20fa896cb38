"""Calibrated int4 / int8: GPTQ (Frantar et al., 2022) through llm-compressor, the library made
for it, on the artifact as transformers loads it; `lmforge quantize --method gptq`.

Round-to-nearest sets each weight to its nearest grid point alone; GPTQ quantizes a layer's
columns in turn and moves the columns not yet quantized to cancel the error on the layer's
inputs, measured on calibration samples (the pipeline's own data: `lmforge prepare`'s token
shards, or JSONL text). The result is the same file format as `--format compressed-tensors`
(pack-quantized, symmetric ints), which vLLM serves with its int4/int8 kernels and lmforge
and transformers load.

llm-compressor pins its own transformers and compressed-tensors (not vLLM's, not lmforge's), so
it runs in an environment of its own (`make calibrate`: .venv-calibrate), through
`gptq_worker.py`, which imports nothing from lmforge. lmforge tokenizes the samples, hands the
worker a job file, and writes the artifact's own files (config, tokenizer, lineage) around the
weights the worker wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from lmforge import artifact
from lmforge.errors import ConfigError, UserError

WORKER = Path(__file__).with_name("gptq_worker.py")
PYTHON_ENV = "LMFORGE_CALIBRATE_PYTHON"
VENV = Path(__file__).resolve().parents[2] / ".venv-calibrate"  # `make calibrate`
DEFAULT_SAMPLES = 128
DEFAULT_SEQ_LEN = 512


def calibrate_python(given: str | None) -> str:
    """The Python that runs llm-compressor: --calibrate-python, $LMFORGE_CALIBRATE_PYTHON, or
    the checkout's .venv-calibrate."""
    python = given or os.environ.get(PYTHON_ENV) or str(VENV / "bin" / "python")
    if not Path(python).exists():
        raise UserError(
            f"GPTQ runs llm-compressor in an environment of its own, and {python} does not "
            f"exist: {ENABLE_HINT}"
        )
    return python


ENABLE_HINT = (
    "run `make calibrate` (or pip install llmcompressor into a virtual environment) and pass its "
    f"Python with --calibrate-python or ${PYTHON_ENV}"
)


def calibration_missing() -> str | None:
    """Why GPTQ cannot run here (its environment is not installed), or None."""
    try:
        calibrate_python(None)
    except UserError:
        return f"GPTQ needs llm-compressor's environment, not installed here: {ENABLE_HINT}"
    return None


def calibration_samples(data: Path, tokenizer, samples: int, seq_len: int) -> list[list[int]]:
    """Up to `samples` token sequences of at most `seq_len`: windows spread evenly over a
    `lmforge prepare` shards directory (checked against the artifact's tokenizer), or the
    rows of a JSONL file (`text`; `prompt` + `response`; or `messages` contents), tokenized."""
    data = Path(data)
    if (data / "index.json").exists():
        return _shard_windows(data, tokenizer, samples, seq_len)
    if data.is_file():
        return _jsonl_samples(data, tokenizer, samples, seq_len)
    raise ConfigError(
        f"calibration data {data}: neither a `lmforge prepare` directory (index.json) nor a "
        f"JSONL file"
    )


def _shard_windows(data: Path, tokenizer, samples: int, seq_len: int) -> list[list[int]]:
    from lmforge.data.pretrain import TokenShards

    shards = TokenShards(data)
    if tokenizer is not None:
        shards.check_tokenizer(tokenizer.fingerprint())
    windows = max(1, min(samples, len(shards) // seq_len))
    stride = len(shards) // windows
    starts = np.arange(windows) * stride
    return [shards.read(int(s), int(s) + min(seq_len, len(shards))).tolist() for s in starts]


def _jsonl_samples(data: Path, tokenizer, samples: int, seq_len: int) -> list[list[int]]:
    if tokenizer is None:
        raise ConfigError(f"calibration data {data}: text needs the artifact's tokenizer")
    rows = []
    with open(data, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{data}:{number}: not JSON ({error.msg})") from None
            ids = tokenizer.encode(_row_text(row, data, number), bos=True)[:seq_len]
            if len(ids) > 1:
                rows.append(ids)
            if len(rows) == samples:
                break
    if not rows:
        raise ConfigError(f"calibration data {data}: no rows with text")
    return rows


def _row_text(row, data: Path, number: int) -> str:
    if isinstance(row, dict):
        if isinstance(row.get("text"), str):
            return row["text"]
        if isinstance(row.get("prompt"), str):
            return row["prompt"] + str(row.get("response") or row.get("completion") or "")
        if isinstance(row.get("messages"), list):
            return "\n".join(
                str(m.get("content") or "") for m in row["messages"] if isinstance(m, dict)
            )
    raise ConfigError(
        f"{data}:{number}: a calibration row needs `text`, `prompt` (+ `response`) or `messages`"
    )


def write_calibrated(
    source: str | Path,
    out: str | Path,
    *,
    scheme: str,
    group_size: int | None,
    data: Path,
    samples: int = DEFAULT_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
    python: str | None = None,
    overwrite: bool = False,
) -> tuple[Path, int]:
    """GPTQ-quantize `source`'s block linears on samples of `data`; returns the artifact's path
    and how many samples calibrated it."""
    from lmforge.api import detect_format, write_model_files
    from lmforge.quantize.compressed import _streamed
    from lmforge.quantize.stored import is_compressed, is_quantized

    artifact.check_output(out, inputs=[source, data], overwrite=overwrite)
    source = Path(source)
    if detect_format(source) != "hf":
        raise ConfigError(f"{source}: GPTQ reads a model directory (lmforge convert makes one)")
    if is_quantized(source) or is_compressed(source):
        raise ConfigError(f"{source}: is already quantized; quantize the original")
    python = calibrate_python(python)
    shapes, _, model_args, tokenizer = _streamed(source, None)
    rows = calibration_samples(data, tokenizer, samples, seq_len)
    bits = {"int4-wo": 4, "int8-wo": 8}[scheme]
    with tempfile.TemporaryDirectory(prefix="lmforge-gptq-") as work:
        work = Path(work)
        _run_worker(python, work, source, rows, bits, group_size, seq_len)
        written = artifact.read_json(work / "out" / artifact.CONFIG_NAME)
        stored_dtype = next(t.dtype for t in shapes.values() if t.is_floating_point())
        config = _hf_config(model_args, stored_dtype, written["quantization_config"])
        lineage = {"scheme": scheme, "group_size": group_size, "format": "compressed-tensors",
                   "method": "gptq", "calibration": str(data), "samples": len(rows)}  # fmt: skip
        with artifact.atomic_directory(Path(out), overwrite=overwrite) as staging:
            for weights in (work / "out").glob("model*.safetensors*"):
                shutil.move(weights, staging / weights.name)
            record = artifact.lineage_record(
                stage="quantize", parent=source, config={"quantization": lineage}
            )
            record["quantization"] = lineage  # where the report and the planner read it
            write_model_files(staging, model_args, config, tokenizer, record)
    return Path(out), len(rows)


def _hf_config(model_args, dtype, quantization_config: dict) -> dict:
    from lmforge import models

    config = models.args_to_hf_config(model_args, dtype)
    config["quantization_config"] = quantization_config
    return config


def _run_worker(python, work: Path, source: Path, rows, bits, group_size, seq_len) -> None:
    with open(work / "samples.jsonl", "w") as out:
        for ids in rows:
            out.write(json.dumps({"input_ids": ids}) + "\n")
    job = {"source": str(source.resolve()), "out": str(work / "out"), "bits": bits,
           "samples": str(work / "samples.jsonl"), "group_size": group_size,
           "max_seq_len": seq_len}  # fmt: skip
    (work / "job.json").write_text(json.dumps(job))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the worker's environment's own packages, not lmforge's
    done = subprocess.run(
        [python, str(WORKER), str(work / "job.json")], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise UserError(f"llm-compressor's GPTQ failed ({python}):\n{tail}")
