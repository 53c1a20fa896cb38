"""Rendering a `RunSummary`: matplotlib figures, one self-contained HTML page, markdown.

Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display)
and embedded in the page as `data:image/png;base64,...`, so report.html opens anywhere as one
file, without network access.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import html
import io
from pathlib import PurePath
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: lmforge.report imports this module to render
    from lmforge.report import RunSummary

ACCENT = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


@dataclasses.dataclass
class Figure:
    key: str
    title: str
    png: bytes
    caption: str = ""

    @property
    def data_uri(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


# ----------------------------------------------------------------------------- figures


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    figure = MplFigure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def make_figures(summary: RunSummary) -> list[Figure]:
    figures = []
    if summary.training:
        figures.append(_loss_figure(summary))
        figures.append(_throughput_figure(summary))
    for stage, models in summary.evals.items():
        figure = _eval_figure(stage, models)
        if figure is not None:
            figures.append(figure)
    if summary.artifacts:
        figures.append(_sizes_figure(summary))
    return figures


def _loss_figure(summary: RunSummary) -> Figure:
    stages = list(summary.training)
    figure = _new_figure(4.2 * len(stages), 3.2)
    axes = figure.subplots(1, len(stages), squeeze=False)[0]
    for ax, stage, color in zip(axes, stages, ACCENT):
        records = [r for r in summary.training[stage] if "loss" in r]
        ax.plot(
            [r["step"] for r in records],
            [r["loss"] for r in records],
            marker="o",
            markersize=3,
            color=color,
        )
        ax.set_title(f"{stage}: loss")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if (
            records
            and min(r["loss"] for r in records) > 0
            and max(r["loss"] for r in records) / min(r["loss"] for r in records) > 20
        ):
            ax.set_yscale("log")
    caption = "; ".join(
        f"{s}: {recs[0]['loss']:.3f} → {recs[-1]['loss']:.3f}"
        for s, recs in ((s, [r for r in summary.training[s] if "loss" in r]) for s in stages)
        if recs
    )
    return Figure("loss", "Training loss per stage", _png(figure), caption)


def _throughput_figure(summary: RunSummary) -> Figure:
    stages = list(summary.training)
    speeds, mfus = [], []
    for stage in stages:
        # The first logged window includes start-up; the mean of the rest is the steady state.
        records = summary.training[stage]
        steady = records[1:] or records
        tps = [r["tokens_per_s"] for r in steady if isinstance(r.get("tokens_per_s"), int | float)]
        mfu = [r["mfu"] for r in steady if isinstance(r.get("mfu"), int | float)]
        speeds.append(sum(tps) / len(tps) if tps else 0.0)
        mfus.append(100 * sum(mfu) / len(mfu) if mfu else 0.0)
    figure = _new_figure(8.4, 3.0)
    left, right = figure.subplots(1, 2)
    left.bar(stages, speeds, color=ACCENT[: len(stages)])
    left.set_title("throughput (tokens/s, mean)")
    left.grid(axis="y", alpha=0.3)
    right.bar(stages, mfus, color=ACCENT[: len(stages)])
    right.set_title("MFU (%)")
    right.grid(axis="y", alpha=0.3)
    for ax, values, fmt in ((left, speeds, "{:,.0f}"), (right, mfus, "{:.2f}")):
        for i, value in enumerate(values):
            ax.annotate(fmt.format(value), (i, value), ha="center", va="bottom", fontsize=8)
    caption = (
        "MFU is against metrics.peak_flops (default: one H200's bf16 peak), so on a CPU "
        "it is close to 0."
    )
    return Figure("throughput", "Throughput and MFU", _png(figure), caption)


def eval_bar_metrics(models: dict[str, dict]) -> list[str]:
    """Metrics shown as bars: fractions (accuracies, exact match), not stderrs, margins or
    perplexities."""
    names: list[str] = []
    for metrics in models.values():
        for key, value in metrics.items():
            if key.endswith("_stderr") or key in names or not isinstance(value, int | float):
                continue
            if 0.0 <= value <= 1.0 and any(w in key for w in ("acc", "exact_match")):
                names.append(key)
    return names


def _eval_figure(stage: str, models: dict[str, dict]) -> Figure | None:
    metrics = eval_bar_metrics(models)
    if not metrics:
        return None
    labels = list(models)
    figure = _new_figure(max(5.0, 1.3 * len(labels) * max(1, len(metrics)) ** 0.5 + 2), 3.8)
    ax = figure.subplots()
    width = 0.8 / len(metrics)
    for j, (metric, color) in enumerate(zip(metrics, ACCENT * 4)):
        values = [models[m].get(metric, 0.0) for m in labels]
        errors = [models[m].get(f"{metric}_stderr", 0.0) or 0.0 for m in labels]
        positions = [i - 0.4 + width * (j + 0.5) for i in range(len(labels))]
        ax.bar(positions, values, width=width, yerr=errors, capsize=2, label=metric, color=color)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{stage}: each model side by side")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(
        fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncols=min(4, len(metrics))
    )
    return Figure(
        f"eval_{stage}",
        f"Evaluation: {stage}",
        _png(figure),
        "error bars: standard error (lm-eval)",
    )


def _sizes_figure(summary: RunSummary) -> Figure:
    artifacts = summary.artifacts
    figure = _new_figure(7.0, 0.45 * len(artifacts) + 1.2)
    ax = figure.subplots()
    names = [a.stage + (f" ({a.scheme})" if a.scheme else "") for a in artifacts]
    sizes = [a.weight_bytes / 1e6 for a in artifacts]
    colors = [ACCENT[1] if a.scheme else ACCENT[0] for a in artifacts]
    ax.barh(names, sizes, color=colors)
    ax.invert_yaxis()
    for i, size in enumerate(sizes):
        ax.annotate(
            f"{size:.2f} MB",
            (size, i),
            va="center",
            fontsize=8,
            xytext=(3, 0),
            textcoords="offset points",
        )
    ax.set_xlabel("weights on disk (MB)")
    ax.set_xlim(0, max(sizes or [1]) * 1.2)
    ax.set_title("artifact sizes: original (blue) vs quantized (orange)")
    return Figure("sizes", "Artifact sizes", _png(figure))


# ----------------------------------------------------------------------------- tables


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _size(num_bytes: int | None) -> str:
    if not num_bytes:
        return "-"
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def stage_rows(summary: RunSummary) -> list[list[str]]:
    rows = []
    for s in summary.stages:
        took = f"{s.duration_s:.1f}s" if isinstance(s.duration_s, int | float) else "-"
        if s.status in ("succeeded", "skipped"):
            detail = _stage_detail(s)
        else:
            detail = s.reason
        status = "up to date" if s.status == "skipped" else s.status
        rows.append([s.name, s.kind, status, took, detail])
    return rows


def _stage_detail(s) -> str:
    m = s.metrics
    if s.kind in ("pretrain", "sft", "dpo") and "loss" in m:
        first = m.get("first_loss")
        text = (
            f"loss {first:.3f} → {m['loss']:.3f}"
            if isinstance(first, float)
            else f"loss {m['loss']:.3f}"
        )
        if isinstance(m.get("tokens_per_s"), int | float):
            text += f", {m['tokens_per_s']:,.0f} tokens/s"
        return text
    if s.kind == "eval":
        return f"{len(m)} model(s) evaluated"
    if s.kind in ("quantize", "export"):
        return _size(m.get("bytes")) + (f" ({m['scheme']})" if m.get("scheme") else "")
    if s.kind == "generate" and m.get("decode_tokens_per_s"):
        return f"{m['decode_tokens_per_s']:.1f} tokens/s decode"
    return ", ".join(f"{k} {_fmt(v)}" for k, v in m.items() if isinstance(v, int | float))


def eval_rows(models: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    names: list[str] = []
    for metrics in models.values():
        for key in metrics:
            if not key.endswith("_stderr") and key not in names:
                names.append(key)
    header = ["model", *names]
    rows = []
    for label, metrics in models.items():
        row = [label]
        for key in names:
            value = metrics.get(key)
            stderr = metrics.get(f"{key}_stderr")
            cell = "-" if value is None else f"{value:.3f}"
            if value is not None and isinstance(stderr, int | float):
                cell += f" ± {stderr:.3f}"
            row.append(cell)
        rows.append(row)
    return header, rows


def answer_rows(answers: dict[str, list[dict]]) -> tuple[list[str], list[list[str]]]:
    """Held-out questions with the reference and each model's greedy answer."""
    labels = list(answers)
    header = ["question", "true answer", *labels]
    rows = []
    for i, example in enumerate(answers[labels[0]]):
        row = [example["question"], example["reference"]]
        for label in labels:
            given = answers[label][i]["answer"] if i < len(answers[label]) else ""
            mark = "✓" if given.strip().casefold() == example["reference"].casefold() else "✗"
            row.append(f"{mark} {given}" if given else f"{mark} (nothing)")
        rows.append(row)
    return header, rows


def artifact_rows(summary: RunSummary) -> list[list[str]]:
    by_path = {PurePath(a.path).as_posix(): a.stage for a in summary.artifacts}
    rows = []
    for a in summary.artifacts:
        parent = a.parent or "-"
        parent_stage = by_path.get(PurePath(parent).as_posix()) if a.parent else None
        shown_parent = f"{parent_stage} ({parent})" if parent_stage else parent
        rows.append(
            [
                a.stage,
                a.path,
                _size(a.weight_bytes),
                a.scheme or "-",
                shown_parent,
                (a.parent_hash or "-")[:12],
                (a.hash or "-")[:12],
            ]
        )
    return rows


def lineage_chains(summary: RunSummary) -> list[list[str]]:
    """Chains from the origin (a preset or outside path) through each stage's artifact to each
    leaf artifact, following the parents recorded in lmforge.json."""
    by_path = {PurePath(a.path).as_posix(): a for a in summary.artifacts}

    def parent(artifact):
        return by_path.get(PurePath(artifact.parent).as_posix()) if artifact.parent else None

    has_children = {p.stage for a in summary.artifacts if (p := parent(a)) is not None}
    chains = []
    for leaf in summary.artifacts:
        if leaf.stage in has_children:
            continue
        chain, current = [leaf.stage], leaf
        while (up := parent(current)) is not None and up.stage not in chain:
            chain.append(up.stage)
            current = up
        if current.parent and parent(current) is None:
            chain.append(current.parent)
        chains.append(list(reversed(chain)))
    return chains


# ----------------------------------------------------------------------------- HTML

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1100px; color: #222; padding: 0 1em; }
h1 { border-bottom: 2px solid #4C72B0; padding-bottom: .2em; }
h2 { margin-top: 1.6em; color: #333; }
table { border-collapse: collapse; margin: .6em 0; font-size: 14px; display: block;
        overflow-x: auto; max-width: 100%; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f2f4f8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; border: 1px solid #e4e4e4; }
.status-succeeded, .status-skipped { color: #2e7d32; }
.status-failed, .status-cancelled { color: #c62828; font-weight: bold; }
.status-not_started, .status-pending, .status-running { color: #ef6c00; }
.chain { font-family: monospace; }
"""


def _table(header: list[str], rows: list[list[str]], status_col: int | None = None) -> str:
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ""
            if status_col is not None and i == status_col:
                cls = f' class="status-{html.escape(cell.replace(" ", "_"))}"'
            cells.append(f"<td{cls}>{html.escape(cell)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _figure_html(figure: Figure) -> str:
    caption = f"<figcaption>{html.escape(figure.caption)}</figcaption>" if figure.caption else ""
    return (
        f'<figure id="fig-{html.escape(figure.key)}"><img src="{figure.data_uri}" '
        f'alt="{html.escape(figure.title)}">{caption}</figure>'
    )


def render_html(summary: RunSummary, figures: list[Figure]) -> str:
    by_key = {f.key: f for f in figures}
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>lmforge report: {html.escape(summary.name)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>lmforge pipeline <code>{html.escape(summary.name)}</code></h1>",
        f"<p>Run directory <code>{html.escape(str(summary.run_dir))}</code>; report written "
        f"{now}.</p>",
        "<h2>Stages</h2>",
        _table(
            ["stage", "kind", "state", "took", "key metrics / reason"],
            stage_rows(summary),
            status_col=2,
        ),
    ]
    if summary.training:
        parts.append("<h2>Training</h2>")
        for key in ("loss", "throughput"):
            if key in by_key:
                parts.append(_figure_html(by_key[key]))
    if summary.evals:
        parts.append("<h2>Evaluation</h2>")
        for stage, models in summary.evals.items():
            parts.append(f"<h3>{html.escape(stage)}</h3>")
            header, rows = eval_rows(models)
            parts.append(_table(header, rows))
            sources = summary.eval_sources.get(stage, {})
            if sources:
                parts.append(
                    "<p>"
                    + ", ".join(
                        f"<b>{html.escape(k)}</b>: <code>{html.escape(str(v))}</code>"
                        for k, v in sources.items()
                    )
                    + "</p>"
                )
            if f"eval_{stage}" in by_key:
                parts.append(_figure_html(by_key[f"eval_{stage}"]))
            if stage in summary.eval_answers:
                header, rows = answer_rows(summary.eval_answers[stage])
                parts.append("<p>Greedy answers to the first held-out questions:</p>")
                parts.append(_table(header, rows))
    if summary.artifacts:
        parts.append("<h2>Artifacts</h2>")
        if "sizes" in by_key:
            parts.append(_figure_html(by_key["sizes"]))
        parts.append(
            _table(
                ["stage", "path", "weights", "quantization", "parent", "parent hash", "hash"],
                artifact_rows(summary),
            )
        )
        parts.append("<h2>Lineage</h2><ul>")
        for chain in lineage_chains(summary):
            parts.append(f'<li class="chain">{html.escape(" → ".join(chain))}</li>')
        parts.append("</ul>")
    if summary.sample:
        parts.append(f"<h2>Generated sample ({html.escape(summary.sample_stage or '')})</h2>")
        parts.append(f"<pre>{html.escape(summary.sample)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------- markdown


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def clean(cell: str) -> str:
        return cell.replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(clean(h) for h in header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(clean(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(summary: RunSummary, figures: list[Figure], assets: str) -> str:
    by_key = {f.key: f for f in figures}
    out = [
        f"# lmforge pipeline `{summary.name}`",
        "",
        "## Stages",
        "",
        _md_table(["stage", "kind", "state", "took", "key metrics / reason"], stage_rows(summary)),
        "",
    ]
    if summary.training:
        out += ["## Training", ""]
        for key in ("loss", "throughput"):
            if key in by_key:
                out += [f"![{by_key[key].title}]({assets}/{key}.png)", ""]
                if by_key[key].caption:
                    out += [by_key[key].caption, ""]
    if summary.evals:
        out += ["## Evaluation", ""]
        for stage, models in summary.evals.items():
            header, rows = eval_rows(models)
            out += [f"### {stage}", "", _md_table(header, rows), ""]
            if f"eval_{stage}" in by_key:
                out += [f"![{stage}]({assets}/eval_{stage}.png)", ""]
            if stage in summary.eval_answers:
                header, rows = answer_rows(summary.eval_answers[stage])
                out += ["Greedy answers to the first held-out questions:", ""]
                out += [_md_table(header, rows), ""]
    if summary.artifacts:
        out += [
            "## Artifacts",
            "",
            _md_table(
                ["stage", "path", "weights", "quantization", "parent", "parent hash", "hash"],
                artifact_rows(summary),
            ),
            "",
        ]
        if "sizes" in by_key:
            out += [f"![sizes]({assets}/sizes.png)", ""]
        out += ["## Lineage", ""] + [f"- {' → '.join(c)}" for c in lineage_chains(summary)]
        out.append("")
    if summary.sample:
        out += [
            f"## Generated sample ({summary.sample_stage})",
            "",
            "```",
            summary.sample.rstrip(),
            "```",
            "",
        ]
    return "\n".join(out)
