"""Rewrite the README's generated blocks (and docs/planning.md's) from what the code prints, so
their numbers stay true.

A generated block lies between two lines `<!-- begin NAME ... -->` and `<!-- end NAME -->`;
everything between them is replaced. The blocks:

  demo-heldout      how many people, questions and answer pairs the demo holds out (from the
                    world settings of examples/tiny/pipeline.toml; no run needed)
  demo-results      the score table, the quantized copies and the timings of a finished demo
                    run (`make demo`, i.e. runs/tiny; give another with --run)
  memory-plan       `lmforge run examples/llama3_70b/pipeline.toml --dry-run --launcher slurm` on
                    80 GB GPUs with continued pretraining's CPU offload (PLAN_OVERRIDES)
  memory-plan-80gb  the same without the offload: the warning and suggestions
  qlora-plan        `lmforge plan` of QLoRA and LoRA for 70B on two 80 GB GPUs
  inference-plan    `lmforge plan --task generate` of 70B on two H100s (INFERENCE_PLAN)

Usage, from the repository root:
  python scripts/update_readme.py                 # every block; demo-results from runs/tiny
  python scripts/update_readme.py --run DIR       # demo-results from another run directory
  python scripts/update_readme.py --no-run        # only the blocks that need no run
  python scripts/update_readme.py --check         # exit 1, naming the blocks, if any differ

memory-plan-80gb and inference-plan live in docs/planning.md (`BLOCK_FILES`), the rest in
README.md. tests/test_readme.py checks the blocks that need no run against the code on every CI
run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# Blocks that live outside the README, by the file that holds them.
BLOCK_FILES = {
    "memory-plan-80gb": REPO / "docs" / "planning.md",
    "inference-plan": REPO / "docs" / "planning.md",
}


def block_file(name: str) -> Path:
    """The file that holds block `name`."""
    return BLOCK_FILES.get(name, README)


TINY = Path("examples/tiny/pipeline.toml")
EXAMPLE_70B = Path("examples/llama3_70b/pipeline.toml")
QLORA_PLAN = "--model llama3.1-70b --gpus 2 --gpu-memory 80GB --ac full"
# demo-results: the rows of the score table, with what each metric measures.
DEMO_ROWS = (
    ("answers/exact_match", "model writes the answer"),
    ("preference/accuracy", "true answer more likely than a false one"),
    ("demo_mc_chat/acc", "4-way, chat format"),
)


# ----------------------------------------------------------------------------- blocks


def _markers(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(^<!-- begin {re.escape(name)}\b[^\n]*-->\n)(.*?)(^<!-- end {re.escape(name)} -->$)",
        re.M | re.S,
    )


def read_block(text: str, name: str) -> str:
    """The text between block `name`'s markers."""
    match = _markers(name).search(text)
    if match is None:
        raise SystemExit(f"no block {name!r} (<!-- begin {name} --> ... end)")
    return match.group(2)


def replace_block(text: str, name: str, body: str) -> str:
    read_block(text, name)  # names a missing block
    body = body if body.endswith("\n") else body + "\n"
    return _markers(name).sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


# ----------------------------------------------------------------------------- no run needed


@contextlib.contextmanager
def _in_repo() -> Iterator[None]:
    """Run from the repository root, so paths print as the README shows them."""
    before = Path.cwd()
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(before)


def demo_heldout() -> str:
    """The sentence before the score table: what the demo world holds out."""
    from lmforge.data.demo import make_facts, split_people, write_demo_data

    demo = tomllib.loads((REPO / TINY).read_text())["stages"]["world"]["demo"]
    seed, num_people = demo.get("seed", 0), demo["num_people"]
    _, heldout_people = split_people(make_facts(seed, num_people))
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_demo_data(Path(tmp), **demo)
        questions = _count_lines(paths["sft_heldout"])
        pairs = _count_lines(paths["dpo_heldout"])
    return (
        f"Held-out evaluation on {len(heldout_people)} of the {num_people} people, never trained "
        f"on ({questions} questions; {pairs} true/false answer pairs):"
    )


def _count_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def dry_run_lines(*overrides: str) -> list[str]:
    """What `lmforge run examples/llama3_70b/pipeline.toml --dry-run --launcher slurm` prints,
    in a scratch working directory (nothing is written to the repository)."""
    from lmforge.pipeline import load_pipeline, run_pipeline

    lines: list[str] = []
    with _in_repo(), tempfile.TemporaryDirectory() as workdir:
        pipeline = load_pipeline(EXAMPLE_70B, workdir=workdir, overrides=overrides)
        run_pipeline(pipeline, launcher="slurm", dry_run=True, echo=lines.append)
    return "\n".join(lines).splitlines()


def _plan_section(lines: Sequence[str]) -> list[str]:
    """The memory-plan header and its lines (to the first blank line)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("memory plan"))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return list(lines[start:end])


# The README's dry run: 80 GB GPUs, continued pretraining with its optimizer state on the CPU.
PLAN_OVERRIDES = ("plan.gpu_memory=80GB", "stages.cpt.parallel.cpu_offload=true")


def memory_plan(*overrides: str) -> str:
    overrides = overrides or PLAN_OVERRIDES
    lines = dry_run_lines(*overrides)
    command = f"$ lmforge run {EXAMPLE_70B} --dry-run --launcher slurm"
    if overrides:
        command += " \\\n    " + " ".join(overrides)
    header = lines[:3]  # the pipeline line and the first two stages
    return "\n".join(["```text", command, *header, "  ...", *_plan_section(lines), "```"])


def memory_plan_80gb() -> str:
    return memory_plan("plan.gpu_memory=80GB")


def qlora_plan() -> str:
    """QLoRA against LoRA for 70B on two 80 GB GPUs, as `lmforge plan` totals them."""
    totals = {
        method: _plan_total(f"{QLORA_PLAN} --method {method}") for method in ("qlora", "lora")
    }
    return (
        f"`lmforge plan {QLORA_PLAN} --method qlora` fits at {totals['qlora']} per GPU "
        f"where LoRA needs {totals['lora']}."
    )


# An inference stage too large for its GPUs: the table, the verdict and the suggestions.
INFERENCE_PLAN = (
    "--model llama3.1-70b --task generate --tp 2 --batch 16 --seq-len 8192 --gpu-memory h100"
)


def inference_plan() -> str:
    command = f"$ lmforge plan {INFERENCE_PLAN}"
    return "\n".join(["```text", command, _plan_output(INFERENCE_PLAN).rstrip(), "```"])


def _plan_output(argv: str) -> str:
    from lmforge.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *argv.split()])
    return out.getvalue()


def _plan_total(argv: str) -> str:
    output = _plan_output(argv)
    match = re.search(r"^ *total +([0-9.]+ GiB)", output, re.M)
    if match is None:
        raise SystemExit(f"lmforge plan {argv}: no total line in\n{output}")
    return match.group(1)


# ----------------------------------------------------------------------------- from a run


def demo_results(run_dir: Path) -> str:
    """The score table of the demo's eval stage, the quantized copies and the timings."""
    from lmforge.report import collect_run
    from lmforge.report.html import format_bytes

    summary = collect_run(run_dir)
    stages = {stage.name: stage for stage in summary.stages}
    scores = _eval_models(run_dir, "eval")
    columns = [_column(label, model, stages) for label, model in scores.items()]
    lines = ["| | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for metric, meaning in DEMO_ROWS:
        cells = [_score(model["metrics"], metric) for model in scores.values()]
        lines.append(f"| {metric} ({meaning}) | " + " | ".join(cells) + " |")
    quantized = _eval_models(run_dir, "eval_quantized")
    weights = {a.stage: a.weight_bytes for a in summary.artifacts}
    sources = [Path(str(m.get("source", ""))).parent.name for m in quantized.values()]
    costs = ["| | " + " | ".join(quantized) + " |", "|---|" + "---|" * len(quantized)]
    perplexity = sorted({k for m in quantized.values() for k in m["metrics"] if "perplexity/" in k})
    for metric in [*(metric for metric, _ in DEMO_ROWS), *perplexity]:
        cells = [_score(m["metrics"], metric, stderr=False) for m in quantized.values()]
        costs.append(f"| {metric} | " + " | ".join(cells) + " |")
    costs.append(
        "| weights on disk | " + " | ".join(format_bytes(weights.get(s)) for s in sources) + " |"
    )
    took = sum(s.duration_s or 0.0 for s in summary.stages)
    pretrain = stages["pretrain"]
    loss = pretrain.metrics
    day = (summary.stages[0].started_at or "")[:10]
    return "\n".join(
        [
            *lines,
            "",
            "What quantizing the dpo model costs (int4: round-to-nearest, and calibrated by GPTQ "
            "on the pretraining shards; fp8: float8 weights and activations; perplexity on "
            "held-out biographies):",
            "",
            *costs,
            "",
            f"That run ({run_dir.name}, {day}): the {len(summary.stages)} stages took "
            f"{_minutes(took)} (pretraining {pretrain.duration_s:.0f} s, loss "
            f"{loss['first_loss']:.2f} → {loss['loss']:.2f}).",
        ]
    )


def _eval_models(run_dir: Path, stage: str) -> dict[str, dict]:
    path = run_dir / stage / "out" / "results.json"
    if not path.is_file():
        raise SystemExit(f"{path}: not found; finish the demo run first (make demo)")
    return json.loads(path.read_text())["models"]


def _column(label: str, model: dict, stages: dict) -> str:
    """A model's column title: its label and how its stage trained it (LoRA, the DPO loss)."""
    stage = stages.get(Path(str(model.get("source", ""))).parent.name)
    if stage is None or stage.kind not in ("sft", "dpo", "grpo"):
        return label
    config = stage.config
    notes = []
    lora = config.get("lora") or {}
    if lora.get("enabled"):
        notes.append("LoRA" if lora.get("quantize_base") in (None, "none") else "QLoRA")
    loss_type = (config.get("dpo") or {}).get("loss_type")
    if stage.kind == "dpo" and loss_type and loss_type != "sigmoid":
        notes.append(f"{loss_type.upper()} loss")
    if stage.kind == "grpo" and not lora.get("enabled"):
        notes.append("full")
    return f"{label} ({', '.join(notes)})" if notes else label


def _score(metrics: dict, metric: str, *, stderr: bool = True) -> str:
    value = metrics.get(metric)
    if value is None:
        return "-"
    text = f"{value:.2f}"
    error = metrics.get(f"{metric}_stderr")
    if stderr and isinstance(error, int | float):
        text += f" ± {error:.2f}".replace(" 0.", " .")
    return text


def _minutes(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


# ----------------------------------------------------------------------------- main

BLOCKS_WITHOUT_RUN: dict[str, Callable[[], str]] = {
    "demo-heldout": demo_heldout,
    "memory-plan": memory_plan,
    "memory-plan-80gb": memory_plan_80gb,
    "qlora-plan": qlora_plan,
    "inference-plan": inference_plan,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=REPO / "runs" / "tiny", metavar="DIR")
    parser.add_argument("--no-run", action="store_true", help="skip demo-results")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    blocks = {name: make() for name, make in BLOCKS_WITHOUT_RUN.items()}
    if not args.no_run:
        blocks["demo-results"] = demo_results(args.run)
    stale = []
    for path in sorted({block_file(name) for name in blocks}):
        text = path.read_text()
        updated = text
        names = [name for name in blocks if block_file(name) == path]
        for name in names:
            updated = replace_block(updated, name, blocks[name])
        stale += [name for name in names if read_block(text, name) != read_block(updated, name)]
        if not args.check:
            path.write_text(updated)
    if args.check:
        if stale:
            print(f"stale blocks: {', '.join(stale)} (run scripts/update_readme.py)")
        return 1 if stale else 0
    print(f"{len(blocks)} blocks, {len(stale)} changed{': ' if stale else ''}{', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
