"""An eval stage: several models scored side by side on the same tasks, written as one
results.json with a printable table (`lmforge eval --config stage.toml`, what a pipeline's eval
stage runs; the settings are `lmforge.pipeline.kinds.EvalStageSection`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmforge.pipeline.kinds import EvalStageSection


def run_eval_stage(cfg: EvalStageSection) -> dict:
    """Score every model of an eval stage side by side; writes `<cfg.out>/results.json`.

    Metrics per model: `TASK/METRIC` (and `TASK/METRIC_stderr`) for lm-eval tasks, plain
    (`tasks`) and with the chat template (`chat_tasks`); `preference/accuracy` and
    `preference/margin`; `perplexity/FILE`. Returns the results with a printable `table`.
    """
    from lmforge.eval import perplexity, preference_accuracy, run_eval
    from lmforge.eval.harness import metric_rows, model_record, write_results
    from lmforge.eval.tasks import write_demo_task
    from lmforge.generate import parallel

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    include = [*cfg.include_path]
    if cfg.demo_data:
        include.append(str(write_demo_task(cfg.demo_data, out / "tasks")))
    limit = None if cfg.limit is None else (int(cfg.limit) if cfg.limit >= 1 else cfg.limit)
    metrics: dict[str, dict[str, float]] = {label: {} for label in cfg.labels}
    samples: dict[str, list] = {}
    for tasks, chat in ((cfg.tasks, False), (cfg.chat_tasks, True)):
        if not tasks:
            continue
        evaluated = run_eval(
            cfg.models,
            tasks,
            include_path=include or None,
            limit=limit,
            batch_size=cfg.batch_size,
            device=cfg.device,
            dtype=cfg.dtype,
            num_fewshot=cfg.num_fewshot,
            apply_chat_template=chat,
            write=False,
        )
        for label, result in zip(cfg.labels, evaluated):
            for (task, metric), (value, stderr) in metric_rows(result.results).items():
                metrics[label][f"{task}/{metric}"] = value
                if stderr is not None:
                    metrics[label][f"{task}/{metric}_stderr"] = stderr
    for label, source in zip(cfg.labels, cfg.models):
        if cfg.answer_data:
            from lmforge.eval.answers import answer_accuracy

            found = answer_accuracy(source, cfg.answer_data, device=cfg.device, dtype=cfg.dtype)
            metrics[label]["answers/exact_match"] = found["exact_match"]
            samples[label] = found["examples"]
        if cfg.preference_data:
            found = preference_accuracy(
                source,
                cfg.preference_data,
                device=cfg.device,
                dtype=cfg.dtype,
                batch_size=cfg.batch_size,
            )
            metrics[label]["preference/accuracy"] = found["accuracy"]
            metrics[label]["preference/margin"] = found["mean_margin"]
        for file in cfg.perplexity:
            found = perplexity(
                source, [file], seq_len=cfg.perplexity_seq_len, batch_size=cfg.batch_size,
                device=cfg.device, dtype=cfg.dtype,
            )  # fmt: skip
            metrics[label][f"perplexity/{Path(file).name}"] = found["perplexity"]
    models = {
        label: {
            "source": source,
            "hash": model_record(source).get("hash"),
            "metrics": metrics[label],
            "answers": samples.get(label, []),
        }
        for label, source in zip(cfg.labels, cfg.models)
    }
    results = {
        "models": models,
        "settings": cfg.model_dump(mode="json"),
        "table": format_eval_table(models),
    }
    if parallel.is_main():  # tensor parallel: the others hold no lm-eval results
        write_results(out / "results.json", results)
    return results


def format_eval_table(models: Mapping[str, Mapping]) -> str:
    """Models as rows, metrics as columns (value ± stderr where known)."""
    names: list[str] = []
    for entry in models.values():
        for key in entry["metrics"]:
            if not key.endswith("_stderr") and key not in names:
                names.append(key)
    header = ["model", *names]
    rows = []
    for label, entry in models.items():
        row = [label]
        for key in names:
            value = entry["metrics"].get(key)
            stderr = entry["metrics"].get(f"{key}_stderr")
            cell = "-" if value is None else f"{value:.3f}"
            if value is not None and stderr is not None:
                cell += f" ± {stderr:.3f}"
            row.append(cell)
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
