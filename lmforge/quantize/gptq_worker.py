"""GPTQ through llm-compressor, run by `lmforge quantize --method gptq` with the Python of an
environment that has llm-compressor (`make calibrate` builds one: llm-compressor pins its own
transformers and compressed-tensors). It imports nothing from lmforge.

    python gptq_worker.py JOB.json

JOB: {"source": HF model directory, "out": directory to write, "samples": JSONL of
{"input_ids": [...]} rows (tokenized by lmforge), "bits": 4 or 8, "group_size": int or null,
"max_seq_len": int}. Writes the model compressed (compressed-tensors, pack-quantized) as
llm-compressor saves it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def scheme(bits: int, group_size: int | None) -> dict:
    """Weight-only, symmetric ints: in groups of `group_size` columns, or one scale a row."""
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "channel"}
    if group_size:
        weights |= {"strategy": "group", "group_size": group_size}
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def main(job_path: str) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = json.loads(Path(job_path).read_text())
    with open(job["samples"]) as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    rows = [
        {"input_ids": r["input_ids"], "attention_mask": [1] * len(r["input_ids"])} for r in rows
    ]
    model = AutoModelForCausalLM.from_pretrained(job["source"], dtype="auto")
    processor = AutoTokenizer.from_pretrained(job["source"])
    recipe = GPTQModifier(config_groups=scheme(job["bits"], job["group_size"]), ignore=["lm_head"])
    torch.manual_seed(0)
    oneshot(
        model=model,
        dataset=Dataset.from_list(rows),
        recipe=recipe,
        processor=processor,
        max_seq_length=job["max_seq_len"],
        num_calibration_samples=len(rows),
    )
    model.save_pretrained(job["out"], save_compressed=True)


if __name__ == "__main__":
    main(sys.argv[1])
