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

from lmforge.manifest import TRAINING_KINDS
from lmforge.report.summary import RunSummary

# Distinct colours (tab10, then tab20's lighter shades); `MetricColors` gives each metric one of
# them, the same in every figure of a report.
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
    "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
]  # fmt: skip
# The training metrics' colours are fixed, so that learning rate is the same green in every run.
TRAINING_COLORS = {
    "loss": PALETTE[0],
    "val_loss": PALETTE[1],
    "lr": PALETTE[2],
    "grad_norm": PALETTE[3],
    "rewards_chosen": PALETTE[4],
    "rewards_rejected": PALETTE[5],
    "reward_margin": PALETTE[6],
    "reward": PALETTE[7],
    "accuracy": PALETTE[10],
    "kl": PALETTE[11],
    "val_reward": PALETTE[12],
    "val_accuracy": PALETTE[13],
    "tokens_per_s": PALETTE[9],
    "mfu": PALETTE[8],
}
METRIC_LABELS = {
    "loss": "training loss",
    "val_loss": "validation loss",
    "lr": "learning rate",
    "grad_norm": "gradient norm",
    "rewards_chosen": "reward (chosen)",
    "rewards_rejected": "reward (rejected)",
    "reward_margin": "reward margin",
    "reward": "reward (GRPO)",
    "accuracy": "accuracy (GRPO)",
    "kl": "KL to the reference",
    "val_reward": "held-out reward (greedy)",
    "val_accuracy": "held-out accuracy (greedy)",
}
# Panels of a training stage's figure: title and the metrics.jsonl keys plotted in it.
TRAINING_PANELS = (
    ("loss", ("loss", "val_loss")),
    ("learning rate", ("lr",)),
    ("gradient norm", ("grad_norm",)),
    ("DPO rewards", ("rewards_chosen", "rewards_rejected", "reward_margin")),
    ("GRPO reward", ("reward", "accuracy", "val_reward", "val_accuracy")),
    ("KL", ("kl",)),
)
# Node colours of the lineage graph, by what a stage makes.
KIND_COLORS = {
    "prepare": "#d8ecd3",
    "tokenizer": "#d8ecd3",
    "pretrain": "#cfe0f3",
    "sft": "#cfe0f3",
    "dpo": "#cfe0f3",
    "grpo": "#cfe0f3",
    "quantize": "#fde3c8",
    "export": "#fde3c8",
    "eval": "#e6dcf1",
    "generate": "#eeeeee",
}


# For other metrics (evaluation), in the order they first appear: saturated colours that stay
# apart from each other (after Kelly's list of maximally distinct colours).
OTHER_COLORS = [
    "#F3C300", "#875692", "#008856", "#BE0032", "#0067A5", "#F38400", "#A1CAF1", "#E68FAC",
    "#848482", "#8DB600", "#604E97", "#882D17", "#C2B280", "#F99379", "#B3446C", "#2B3D26",
]  # fmt: skip


class MetricColors:
    """One colour per metric name: the training metrics' fixed ones, then `OTHER_COLORS` in the
    order metrics are first asked for (repeating after 16)."""

    def __init__(self) -> None:
        self._given = dict(TRAINING_COLORS)
        self._free = OTHER_COLORS

    def __call__(self, metric: str) -> str:
        if metric not in self._given:
            index = len(self._given) - len(TRAINING_COLORS)
            self._given[metric] = self._free[index % len(self._free)]
        return self._given[metric]


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


def _new_figure(width: float, height: float):  # inches, at 100 dpi
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    figure = MplFigure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _png(figure) -> bytes:
    # Constrained layout sets the margins before the first draw has put each title where it
    # goes: a title moved up on that draw to clear an offset text beside it ("1e-3" on the
    # learning-rate panel) changes the margins too late, and a neighbour's tick labels end up
    # past the figure's edge (issue 58: "pretrain: loss" read ".00" for "2.00"). A first draw
    # puts the titles in place, so the layout that savefig runs again fits them.
    figure.canvas.draw()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def make_figures(summary: RunSummary) -> list[Figure]:
    colors = MetricColors()
    figures = []
    graph = _lineage_figure(summary)
    if graph is not None:
        figures.append(graph)
    for stage, records in summary.training.items():
        figure = _training_figure(stage, records, colors)
        if figure is not None:
            figures.append(figure)
        figure = _expert_load_figure(stage, records)
        if figure is not None:
            figures.append(figure)
    if summary.training:
        figures.append(_throughput_figure(summary, colors))
    for stage, models in summary.evals.items():
        figure = _eval_figure(stage, models, colors)
        if figure is not None:
            figures.append(figure)
    if summary.artifacts:
        figures.append(_sizes_figure(summary))
    return figures


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [step for step, _ in points], [value for _, value in points]


def _training_figure(stage: str, records: list[dict], colors: MetricColors) -> Figure | None:
    """One row of panels for a training stage: loss with validation loss, learning rate,
    gradient norm and, for DPO, the rewards of the chosen and rejected answers; for GRPO,
    the rollouts' reward, accuracy and KL."""
    panels = [
        (title, [key for key in keys if _series(records, key)[0]])
        for title, keys in TRAINING_PANELS
    ]
    panels = [(title, keys) for title, keys in panels if keys]
    if not panels:
        return None
    figure = _new_figure(3.1 * len(panels), 2.7)
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            steps, values = _series(records, key)
            ax.plot(
                steps,
                values,
                marker="o",
                markersize=3,
                color=colors(key),
                label=METRIC_LABELS.get(key, key),
            )
        ax.set_title(f"{stage}: {title}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        if title == "loss":
            values = [v for key in keys for v in _series(records, key)[1]]
            if min(values) > 0 and max(values) / min(values) > 20:
                ax.set_yscale("log")
        if title == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    return Figure(
        f"training_{stage}", f"Training: {stage}", _png(figure), _training_caption(records)
    )


# metrics.jsonl's per-layer spread of a Mixture-of-Experts stage: "expert_load_max_mean/<layer>"
EXPERT_LOAD_PREFIX = "expert_load_max_mean/"


def expert_load_layers(records: list[dict]) -> list[int]:
    """The sparse layers whose load a stage's records carry, in layer order."""
    found = {
        key.removeprefix(EXPERT_LOAD_PREFIX)
        for record in records
        for key in record
        if key.startswith(EXPERT_LOAD_PREFIX)
    }
    return sorted(int(layer) for layer in found if layer.isdigit())


def _expert_load_figure(stage: str, records: list[dict]) -> Figure | None:
    """A Mixture-of-Experts stage's load spread over steps, one line a sparse layer: the busiest
    expert's share of the layer's top-k choices over the mean share (1: balanced; E / k: every
    token picks the same k experts). None for a dense model."""
    layers = expert_load_layers(records)
    if not layers:
        return None
    from matplotlib import colormaps

    figure = _new_figure(6.2, 2.9)
    ax = figure.subplots()
    cmap = colormaps["viridis"]
    labelled = set(layers) if len(layers) <= 8 else {layers[0], layers[-1]}
    for i, layer in enumerate(layers):
        steps, values = _series(records, f"{EXPERT_LOAD_PREFIX}{layer}")
        ax.plot(
            steps,
            values,
            marker="o" if len(steps) <= 50 else None,
            markersize=2.5,
            linewidth=1.2,
            color=cmap(i / max(1, len(layers) - 1) * 0.9),
            label=f"layer {layer}" if layer in labelled else None,
        )
    ax.axhline(1.0, color="#7f7f7f", linewidth=0.8, linestyle="--")
    ax.set_title(f"{stage}: expert load, max / mean per layer", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncols=2 if len(labelled) > 4 else 1)
    _, worst = _series(records, "expert_load_max_mean")
    caption = (
        f"{len(layers)} sparse layers; worst layer's max / mean {worst[0]:.2f} → {worst[-1]:.2f}"
        if worst
        else f"{len(layers)} sparse layers"
    )
    return Figure(f"experts_{stage}", f"Experts' load: {stage}", _png(figure), caption)


def _training_caption(records: list[dict]) -> str:
    parts = []
    for key in ("loss", "val_loss", "reward_margin", "reward", "val_accuracy"):
        _, values = _series(records, key)
        if values:
            parts.append(f"{METRIC_LABELS[key]} {values[0]:.3f} → {values[-1]:.3f}")
    return "; ".join(parts)


def _throughput_figure(summary: RunSummary, colors: MetricColors) -> Figure:
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
    left.bar(stages, speeds, color=colors("tokens_per_s"))
    left.set_title("throughput (tokens/s, mean)")
    left.grid(axis="y", alpha=0.3)
    right.bar(stages, mfus, color=colors("mfu"))
    right.set_title("MFU (%)")
    right.grid(axis="y", alpha=0.3)
    for ax, values, fmt in ((left, speeds, "{:,.0f}"), (right, mfus, "{:.2g}")):
        ax.margins(y=0.15)  # room for the tallest bar's label inside the frame
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


def _eval_figure(stage: str, models: dict[str, dict], colors: MetricColors) -> Figure | None:
    metrics = eval_bar_metrics(models)
    if not metrics:
        return None
    labels = list(models)
    figure = _new_figure(max(5.0, 1.3 * len(labels) * max(1, len(metrics)) ** 0.5 + 2), 3.8)
    ax = figure.subplots()
    width = 0.8 / len(metrics)
    for j, metric in enumerate(metrics):
        values = [models[m].get(metric, 0.0) for m in labels]
        errors = [models[m].get(f"{metric}_stderr", 0.0) or 0.0 for m in labels]
        positions = [i - 0.4 + width * (j + 0.5) for i in range(len(labels))]
        ax.bar(
            positions,
            values,
            width=width,
            yerr=errors,
            capsize=2,
            label=metric,
            color=colors(metric),
        )
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
    scale, unit = _decimal_unit(max(a.weight_bytes for a in artifacts))
    sizes = [a.weight_bytes / scale for a in artifacts]
    original, quantized = PALETTE[0], PALETTE[1]
    ax.barh(names, sizes, color=[quantized if a.scheme else original for a in artifacts])
    ax.invert_yaxis()
    for i, artifact in enumerate(artifacts):
        ax.annotate(
            format_bytes(artifact.weight_bytes),
            (sizes[i], i),
            va="center",
            fontsize=8,
            xytext=(3, 0),
            textcoords="offset points",
        )
    ax.set_xlabel(f"weights on disk ({unit})")
    ax.set_xlim(0, max(sizes or [1]) * 1.25)
    ax.set_title("artifact sizes: original (blue) vs quantized (orange)")
    return Figure("sizes", "Artifact sizes", _png(figure))


ARC_BEND = 0.18  # curvature of an arrow that skips columns (matplotlib's arc3 rad)
NODE_HALF_WIDTH, NODE_HALF_HEIGHT = 0.36, 0.26  # a stage's box, in column / row units


def _lineage_figure(summary: RunSummary) -> Figure | None:
    """The stages as a graph, inputs left of what they feed (world → tokenizer → shards →
    models → evaluations): each stage in the column after its deepest input."""
    from matplotlib.patches import FancyBboxPatch

    known = {s.name for s in summary.stages}
    inputs = {s.name: [d for d in s.depends_on if d in known] for s in summary.stages}
    if not any(inputs.values()):
        return None
    position = _graph_positions(summary.stages, inputs)
    edges = [(position[parent], position[child]) for child in inputs for parent in inputs[child]]
    num_columns = 1 + max(x for x, _ in position.values())
    tallest = 1 + max(y for _, y in position.values())
    # An arrow that skips columns arcs above them rather than through their boxes; its peak is
    # ARC_BEND × its length / 2 above the straight line.
    top = max(
        [tallest - 0.5]
        + [max(y0, y1) + ARC_BEND * (x1 - x0) / 2 for (x0, y0), (x1, y1) in edges if x1 - x0 > 1]
    )
    figure = _new_figure(1.55 * num_columns + 0.4, 0.75 * (top + 0.6) + 0.3)
    ax = figure.subplots()
    for (x0, y0), (x1, y1) in edges:
        ax.annotate(
            "",
            xy=(x1 - NODE_HALF_WIDTH, y1),
            xytext=(x0 + NODE_HALF_WIDTH, y0),
            arrowprops={
                "arrowstyle": "->",
                "color": "#777",
                "lw": 0.8,
                "connectionstyle": f"arc3,rad={-ARC_BEND if x1 - x0 > 1 else 0.0}",
            },
            zorder=1,
        )
    kinds = {s.name: s.kind for s in summary.stages}
    for name, (x, y) in position.items():
        box = FancyBboxPatch(
            (x - NODE_HALF_WIDTH, y - NODE_HALF_HEIGHT),
            2 * NODE_HALF_WIDTH,
            2 * NODE_HALF_HEIGHT,
            boxstyle="round,pad=0,rounding_size=0.06",
            facecolor=KIND_COLORS.get(kinds[name], "#ffffff"),
            edgecolor="#555",
            lw=0.8,
            zorder=2,
        )
        ax.add_patch(box)
        ax.text(x, y + 0.07, name, ha="center", va="center", fontsize=8, weight="bold", zorder=3)
        ax.text(x, y - 0.12, kinds[name], ha="center", va="center", fontsize=7, color="#444")
    ax.set_xlim(-0.5, num_columns - 0.5)
    ax.set_ylim(-0.5, top + 0.1)
    ax.axis("off")
    return Figure(
        "lineage",
        "Data and model lineage",
        _png(figure),
        "each arrow: a stage's output read by the next (green: data, blue: training, orange: "
        "quantization, purple: evaluation, grey: generation)",
    )


def _graph_positions(stages, inputs: dict[str, list[str]]) -> dict[str, tuple[float, float]]:
    """(column, row from the bottom) of each stage: the column after its deepest input; a
    column shorter than the tallest is centred."""
    column: dict[str, int] = {}
    for stage in stages:  # a pipeline lists a stage after its inputs
        column[stage.name] = 1 + max((column[d] for d in inputs[stage.name]), default=-1)
    columns: dict[int, list[str]] = {}
    for stage in stages:
        columns.setdefault(column[stage.name], []).append(stage.name)
    tallest = max(len(names) for names in columns.values())
    position = {}
    for col, names in columns.items():
        offset = (tallest - len(names)) / 2
        for index, name in enumerate(names):
            position[name] = (col, tallest - 1 - offset - index)
    return position


# ----------------------------------------------------------------------------- tables


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _decimal_unit(num_bytes: int) -> tuple[int, str]:
    """The report's one unit system: decimal, as `lmforge generate` prints the sample's sizes
    and bandwidth (MB, GB/s) that the report shows as they are."""
    for scale, unit in ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB")):
        if num_bytes >= scale:
            return scale, unit
    return 1, "B"


def format_bytes(num_bytes: int | None) -> str:
    """`1.32 MB`: every size in the report, in decimal units."""
    if not num_bytes:
        return "-"
    scale, unit = _decimal_unit(num_bytes)
    return f"{num_bytes} B" if scale == 1 else f"{num_bytes / scale:.2f} {unit}"


def stage_rows(summary: RunSummary) -> list[list[str]]:
    weights = {a.stage: a.weight_bytes for a in summary.artifacts}
    rows = []
    for s in summary.stages:
        took = f"{s.duration_s:.1f}s" if isinstance(s.duration_s, int | float) else "-"
        if s.status in ("succeeded", "skipped"):
            detail = _stage_detail(s, weights.get(s.name))
        else:
            detail = s.reason
        status = "up to date" if s.status == "skipped" else s.status
        rows.append([s.name, s.kind, status, took, detail])
    return rows


def _stage_detail(s, weight_bytes: int | None) -> str:
    m = s.metrics
    if s.kind in TRAINING_KINDS and "loss" in m:
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
        # The weights, as in the artifact table (the directory also holds the tokenizer).
        text = f"{format_bytes(weight_bytes or m.get('bytes'))} of weights"
        return text + (f" ({m['scheme']})" if m.get("scheme") else "")
    if s.kind == "generate" and m.get("decode_tokens_per_s"):
        return f"{m['decode_tokens_per_s']:.1f} tokens/s decode"
    return ", ".join(f"{k} {_fmt(v)}" for k, v in m.items() if isinstance(v, int | float))


def eval_rows(models: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """One row per metric, one column per model (value ± standard error): as many metrics as
    the tasks give, and the table stays as wide as the models."""
    names: list[str] = []
    for metrics in models.values():
        for key in metrics:
            if not key.endswith("_stderr") and key not in names:
                names.append(key)
    header = ["metric", *models]
    rows = []
    for key in names:
        row = [key]
        for metrics in models.values():
            value = metrics.get(key)
            stderr = metrics.get(f"{key}_stderr")
            cell = "-" if value is None else f"{value:.3f}"
            if value is not None and isinstance(stderr, int | float):
                cell += f" ± {stderr:.3f}"
            row.append(cell)
        rows.append(row)
    return header, rows


# Settings worth a glance, in this order, where a stage has them (all are in "all settings").
KEY_SETTINGS = (
    "model.source",
    "train.steps",
    "train.micro_batch_size",
    "train.global_batch_size",
    "data.seq_len",
    "data.max_seq_len",
    "optim.lr",
    "optim.weight_decay",
    "scheduler.warmup_steps",
    "scheduler.decay",
    "train.mixed_precision",
    "lora.rank",
    "lora.alpha",
    "lora.quantize_base",
    "dpo.beta",
    "vocab_size",
    "scheme",
    "group_size",
    "tasks",
    "chat_tasks",
    "limit",
    "max_new_tokens",
    "temperature",
)


def flat_settings(config: dict, prefix: str = "") -> dict[str, object]:
    """`{"train": {"steps": 5}}` → `{"train.steps": 5}`; unset (None) values left out."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flat_settings(value, f"{prefix}{key}."))
        elif value is not None and value != {}:
            flat[f"{prefix}{key}"] = value
    return flat


def settings_rows(summary: RunSummary) -> list[list[str]]:
    """Per stage: its code version and key hyperparameters."""
    rows = []
    for stage in summary.stages:
        flat = flat_settings(stage.config)
        if not flat.get("lora.enabled", True):
            flat = {k: v for k, v in flat.items() if not k.startswith("lora.")}
        shown = [f"{key} = {_setting(flat[key])}" for key in KEY_SETTINGS if key in flat]
        if flat.get("lora.enabled"):
            shown.insert(1, "lora.enabled = true")
        rows.append([stage.name, stage.code_version or "-", ", ".join(shown) or "-"])
    return rows


def _setting(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_setting(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


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
                format_bytes(a.weight_bytes),
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
       max-width: 1180px; color: #222; padding: 0 1em; }
h1 { border-bottom: 2px solid #4C72B0; padding-bottom: .2em; }
h2 { margin-top: 1.6em; color: #333; }
table { border-collapse: collapse; margin: .6em 0; font-size: 14px; max-width: 100%; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; }
th { background: #f2f4f8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; border: 1px solid #e4e4e4; }
.status-succeeded, .status-skipped { color: #2e7d32; }
.status-failed, .status-cancelled { color: #c62828; font-weight: bold; }
.status-not_started, .status-pending, .status-running, .status-unavailable { color: #ef6c00; }
.chain { font-family: monospace; }
td.nowrap { white-space: nowrap; }
details { margin: .3em 0; }
details pre { font-size: 12px; white-space: pre-wrap; overflow-wrap: anywhere; }
"""


def _table(
    header: list[str],
    rows: list[list[str]],
    status_col: int | None = None,
    nowrap_cols: tuple[int, ...] = (0,),
) -> str:
    """A table whose `nowrap_cols` (names, versions) stay on one line while the other cells
    wrap (anywhere, for long paths), so it fits the page."""
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            classes = []
            if status_col is not None and i == status_col:
                classes.append(f"status-{html.escape(cell.replace(' ', '_'))}")
            if i in nowrap_cols:
                classes.append("nowrap")
            cls = f' class="{" ".join(classes)}"' if classes else ""
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
        f"{now}. Sizes are in decimal units (1 MB = 10⁶ bytes).</p>",
        "<h2>Stages</h2>",
        _table(STAGE_HEADER, stage_rows(summary), status_col=2, nowrap_cols=(0, 1, 2, 3)),
    ]
    if "lineage" in by_key or summary.artifacts:
        parts.append("<h2>Lineage</h2>")
        if "lineage" in by_key:
            parts.append(_figure_html(by_key["lineage"]))
        if summary.artifacts:
            parts.append("<p>Models, each from its parent (as their lmforge.json records):</p><ul>")
            for chain in lineage_chains(summary):
                parts.append(f'<li class="chain">{html.escape(" → ".join(chain))}</li>')
            parts.append("</ul>")
    if summary.training:
        parts.append("<h2>Training</h2>")
        for stage in summary.training:
            for key in (f"training_{stage}", f"experts_{stage}"):
                if key in by_key:
                    parts.append(_figure_html(by_key[key]))
        if "throughput" in by_key:
            parts.append(_figure_html(by_key["throughput"]))
    parts.append("<h2>Settings</h2>")
    parts.append(_table(SETTINGS_HEADER, settings_rows(summary), nowrap_cols=(0, 1)))
    for stage in summary.stages:
        flat = flat_settings(stage.config)
        if flat:
            text = "\n".join(f"{key} = {_setting(value)}" for key, value in flat.items())
            parts.append(
                f"<details><summary>all settings of {html.escape(stage.name)}</summary>"
                f"<pre>{html.escape(text)}</pre></details>"
            )
    if summary.evals:
        parts.append("<h2>Evaluation</h2>")
        for stage, models in summary.evals.items():
            parts.append(f"<h3>{html.escape(stage)}</h3>")
            header, rows = eval_rows(models)
            parts.append(_table(header, rows, nowrap_cols=tuple(range(len(header)))))
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
                parts.append(_table(header, rows, nowrap_cols=()))
    if summary.artifacts:
        parts.append("<h2>Artifacts</h2>")
        if "sizes" in by_key:
            parts.append(_figure_html(by_key["sizes"]))
        parts.append(_table(ARTIFACT_HEADER, artifact_rows(summary), nowrap_cols=(0, 2, 3, 5, 6)))
    if summary.sample:
        parts.append(f"<h2>Generated sample ({html.escape(summary.sample_stage or '')})</h2>")
        parts.append(f"<pre>{html.escape(summary.sample)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


STAGE_HEADER = ["stage", "kind", "state", "took", "key metrics / reason"]
SETTINGS_HEADER = ["stage", "code version", "key settings"]
ARTIFACT_HEADER = ["stage", "path", "weights", "quantization", "parent", "parent hash", "hash"]


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

    def image(key: str) -> list[str]:
        if key not in by_key:
            return []
        figure = by_key[key]
        caption = [figure.caption, ""] if figure.caption else []
        return [f"![{figure.title}]({assets}/{key}.png)", "", *caption]

    out = [
        f"# lmforge pipeline `{summary.name}`",
        "",
        "Sizes are in decimal units (1 MB = 10⁶ bytes).",
        "",
        "## Stages",
        "",
        _md_table(STAGE_HEADER, stage_rows(summary)),
        "",
    ]
    if "lineage" in by_key or summary.artifacts:
        out += ["## Lineage", "", *image("lineage")]
        out += [f"- {' → '.join(c)}" for c in lineage_chains(summary)] + [""]
    if summary.training:
        out += ["## Training", ""]
        for stage in summary.training:
            out += image(f"training_{stage}") + image(f"experts_{stage}")
        out += image("throughput")
    out += ["## Settings", "", _md_table(SETTINGS_HEADER, settings_rows(summary)), ""]
    if summary.evals:
        out += ["## Evaluation", ""]
        for stage, models in summary.evals.items():
            header, rows = eval_rows(models)
            out += [f"### {stage}", "", _md_table(header, rows), "", *image(f"eval_{stage}")]
            if stage in summary.eval_answers:
                header, rows = answer_rows(summary.eval_answers[stage])
                out += ["Greedy answers to the first held-out questions:", ""]
                out += [_md_table(header, rows), ""]
    if summary.artifacts:
        out += ["## Artifacts", "", *image("sizes")]
        out += [_md_table(ARTIFACT_HEADER, artifact_rows(summary)), ""]
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
