"""The tiny demo pipeline end to end (shortened: fewer people and steps), its manifests, status
and report: a self-contained HTML page that headless Chromium renders with every image loaded.
Also: a recognizable token in the environment appears nowhere in the run directory."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import tomli_w

from lmforge.cli import main as cli_main
from lmforge.launch.local import LocalLauncher
from lmforge.pipeline import load_pipeline, pipeline_status, read_manifest, run_pipeline
from lmforge.report import collect_run, write_report
from lmforge.report import html as html_module
from lmforge.report.html import make_figures, render_html
from lmforge.report.summary import RunSummary

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny" / "pipeline.toml"
TOKEN = "hf_REPORTtestTOKEN_abcdef0123456789"
API_KEY = "lmforge_REPORT_api_key_424242"


def shortened(file: Path, out: Path) -> Path:
    """The demo pipeline with a smaller world and a few steps per training stage."""
    data = tomllib.loads(file.read_text())
    data["pipeline"]["name"] = "short"
    stages = data["stages"]
    stages["world"]["demo"] = {"seed": 0, "num_people": 16, "repeats": 4}
    for name, steps in (("pretrain", 12), ("sft", 6), ("dpo", 4), ("grpo", 2)):
        stage = stages[name]
        stage["train"]["steps"] = steps
        stage["scheduler"]["warmup_steps"] = 1
        stage["metrics"]["log_every"] = 2
        stage["checkpoint"]["every"] = steps
        if "eval_every" in stage["train"]:  # validation loss on a small held-out set
            stage["train"]["eval_every"] = 2
            stage["train"]["micro_batch_size"] = 4
    stages["grpo"]["grpo"]["prompts_per_step"] = 4
    stages["grpo"]["train"]["micro_batch_size"] = 32
    stages["pretrain"]["data"]["seq_len"] = 64
    stages["pretrain"]["train"]["micro_batch_size"] = 8
    stages["generate"]["max_new_tokens"] = 8
    out.write_text(tomli_w.dumps(data))
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("short")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_TOKEN", TOKEN)
    mp.setenv("LMFORGE_API_KEY", API_KEY)
    try:
        file = shortened(EXAMPLE, workdir / "pipeline.toml")
        lines: list[str] = []
        pipeline = load_pipeline(file, workdir=workdir)
        result = run_pipeline(pipeline, launcher=LocalLauncher(stream=None), echo=lines.append)
    finally:
        mp.undo()
    assert result.ok, "\n".join(lines)
    return workdir, pipeline, result, "\n".join(lines)


def test_every_stage_ran_and_recorded_its_metrics(finished):
    workdir, pipeline, _, out = finished
    run_dir = workdir / "runs" / "short"
    names = [s.name for s in pipeline.stages]
    assert names == [
        "world",
        "tokenizer",
        "shards",
        "pretrain",
        "sft",
        "dpo",
        "grpo",
        "eval",
        "quantize_int8",
        "quantize_int4",
        "quantize_int4_gptq",
        "quantize_fp8",
        "eval_quantized",
        "generate",
    ]
    found = {name: read_manifest(run_dir / name) for name in names}
    assert {m["status"] for m in found.values()} == {"succeeded"}
    pretrain = found["pretrain"]["metrics"]
    assert pretrain["step"] == 12 and pretrain["loss"] < pretrain["first_loss"]
    assert found["sft"]["input"]["path"] == "runs/short/pretrain/artifact"
    assert found["sft"]["input"]["hash"] == found["pretrain"]["output"]["hash"]
    evaluated = found["eval"]["metrics"]
    assert list(evaluated) == ["base", "sft", "dpo", "grpo"]
    for metrics in evaluated.values():
        assert {"demo_mc/acc", "demo_mc_chat/acc", "preference/accuracy"} <= set(metrics)
    quantized = found["eval_quantized"]["metrics"]
    assert list(quantized) == ["dpo", "int8", "int4", "int4-gptq", "fp8"]
    assert all("perplexity/prose_heldout.txt" in m for m in quantized.values())
    int8, int4 = found["quantize_int8"]["metrics"], found["quantize_int4"]["metrics"]
    assert int8["scheme"] == "int8-wo" and int4["scheme"] == "int4-wo"
    assert found["quantize_int4_gptq"]["metrics"]["method"] == "gptq"
    assert found["quantize_fp8"]["metrics"]["scheme"] == "fp8"
    sample = (run_dir / "generate" / "out" / "sample.txt").read_text()
    assert sample.startswith("=== Where does") and "tokens/s" in sample
    assert "report:" in out and (run_dir / "report.html").exists()

    statuses = pipeline_status(run_dir)
    assert [s.status for s in statuses] == ["succeeded"] * len(names)

    # unchanged: a second run starts nothing
    lines: list[str] = []
    again = run_pipeline(
        load_pipeline(workdir / "pipeline.toml", workdir=workdir),
        launcher=LocalLauncher(stream=None),
        echo=lines.append,
    )
    assert again.ok and again.handles == {}
    assert "[pipeline] everything is up to date" in lines


def test_no_secret_anywhere_in_the_run_directory(finished):
    workdir, _, _, out = finished
    assert TOKEN not in out and API_KEY not in out
    files = [p for p in (workdir / "runs").rglob("*") if p.is_file()]
    assert len(files) > 50
    for path in files:
        data = path.read_bytes()
        assert TOKEN.encode() not in data and API_KEY.encode() not in data, path


def test_report_is_self_contained_with_every_section(finished, tmp_path, capsys):
    workdir, _, _, _ = finished
    run_dir = workdir / "runs" / "short"
    assert cli_main(["report", str(run_dir), "--out", str(tmp_path)]) == 0
    assert "report:" in capsys.readouterr().out
    page = (tmp_path / "report.html").read_text()
    headings = ("Stages", "Lineage", "Training", "Settings", "Evaluation", "Artifacts")
    for heading in (*headings, "Generated sample"):
        assert f"<h2>{heading}" in page, heading
    sources = re.findall(r'<img src="([^"]+)"', page)
    # lineage graph, one per training stage, throughput, two evaluations, sizes
    assert len(sources) == 9
    for source in sources:
        assert source.startswith("data:image/png;base64,")
        assert base64.b64decode(source.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert "pretrain → sft → dpo → quantize_int8" in page  # the models' chains
    # curves people look for: validation loss (SFT, DPO), DPO rewards, in the captions
    for stage in ("sft", "dpo"):
        caption = re.search(rf'id="fig-training_{stage}".*?<figcaption>(.*?)</figcaption>', page)
        assert "validation loss" in caption.group(1), stage
    assert "reward margin" in page
    summary = collect_run(run_dir)
    for stage, keys in (("pretrain", {"lr", "grad_norm"}), ("sft", {"val_loss"})):
        assert keys <= {key for record in summary.training[stage] for key in record}, stage
    assert {"rewards_chosen", "rewards_rejected", "reward_margin"} <= set(
        summary.training["dpo"][0]
    )
    assert {"reward", "reward_exact_match", "accuracy"} <= set(summary.training["grpo"][0])
    assert "val_accuracy" in summary.training["grpo"][-1]  # held-out people, at the last step
    assert "grpo: GRPO reward" in page or 'id="fig-training_grpo"' in page
    # each stage's hyperparameters and code version
    assert "optim.lr = 0.006" in page and "scheme = int4-wo" in page
    code_version = read_manifest(run_dir / "pretrain")["code_version"]
    assert page.count(f'<td class="nowrap">{code_version}</td>') == len(summary.stages)
    # one unit system for sizes (decimal, as the generated sample's own text has them)
    text = re.sub(r"data:image/png;base64,[^\"]+", "", page)  # the text, not the images
    assert re.search(r"\d MB", text) and not re.search(r"\d ?(KiB|MiB|GiB)", text)
    assert [a.stage for a in summary.artifacts] == [
        "pretrain",
        "sft",
        "dpo",
        "grpo",
        "quantize_int8",
        "quantize_int4",
        "quantize_int4_gptq",
        "quantize_fp8",
    ]
    schemes = {a.stage: a.scheme for a in summary.artifacts}
    assert (schemes["quantize_int4_gptq"], schemes["quantize_fp8"]) == ("int4-wo", "fp8")
    sizes = {a.stage: a.weight_bytes for a in summary.artifacts}
    # CPU int4 is stored one value per byte (the layout transformers reads), so int4 and int8
    # artifacts are about the same size; both are smaller than the bf16 model.
    assert max(sizes["quantize_int4"], sizes["quantize_int8"]) < 0.8 * sizes["dpo"]

    markdown = (tmp_path / "report.md").read_text()
    assert "| stage | kind | state |" in markdown and "![" in markdown
    for name in ("lineage", "training_pretrain", "training_dpo", "sizes"):
        assert (tmp_path / "report_assets" / f"{name}.png").exists(), name


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--virtual-time-budget=5000",
]
CHECK_SCRIPT = """
<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const loaded = images.filter((img) => img.complete && img.naturalWidth > 0).length;
  const mark = document.createElement("div");
  mark.id = "lmforge-check";
  const wide = Array.from(document.querySelectorAll("table, figure, pre")).filter(
    (el) => el.getBoundingClientRect().right > window.innerWidth).length;
  const width = document.documentElement.scrollWidth;
  mark.textContent = `images-loaded=${loaded}/${images.length} page-width=${width} ` +
    `window-width=${window.innerWidth} too-wide=${wide}`;
  document.body.appendChild(mark);
});
</script>
"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def dump_dom(page: str, script: str, tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    """The DOM headless Chromium makes of `page` with `script` run in it (a 1280 px window)."""
    checked = tmp_path / f"{name}.html"
    checked.write_text(page.replace("</body>", script + "</body>"))
    command = [
        chromium(),
        *CHROMIUM_FLAGS,
        f"--user-data-dir={tmp_path / f'{name}-profile'}",
        "--window-size=1280,2000",
        "--dump-dom",
        checked.as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(
    chromium() is None,
    reason="headless Chromium is not installed (apt-get install -y chromium): the report "
    "was not rendered in a browser",
)
def test_report_renders_in_headless_chromium_with_every_image_loaded(finished, tmp_path):
    workdir, _, _, _ = finished
    paths = write_report(workdir / "runs" / "short", out=tmp_path / "report")
    # the report plus a script that counts loaded images
    done = dump_dom(paths["html"].read_text(), CHECK_SCRIPT, tmp_path, "checked")
    match = re.search(r"images-loaded=(\d+)/(\d+)", done.stdout)
    assert match, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    loaded, total = int(match.group(1)), int(match.group(2))
    assert total == 9 and loaded == total, match.group(0)
    # every table, figure and block fits a 1280 px window: no sideways scrolling
    fit = re.search(r"page-width=(\d+) window-width=(\d+) too-wide=(\d+)", done.stdout)
    assert int(fit.group(2)) == 1280, fit.group(0)
    assert int(fit.group(1)) <= 1280 and fit.group(3) == "0", fit.group(0)
    # and a screenshot of the page itself is a real, non-empty PNG
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            chromium(),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'checked-profile'}",
            f"--screenshot={shot}",
            "--window-size=1280,2400",
            paths["html"].as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000
    json.dumps({"loaded": loaded})


# Counts, for each chart as the page shows it, the pixels that are not background within
# `pad` px of its left, top and bottom edges and in its last column. Constrained layout keeps a
# blank margin of 3 pt (4 px at 100 dpi) between the figure's edge and its outermost text, so
# there is ink there only when something was cut: a clipped tick label leaves what is left of it
# (issue 58: the '.' of '2.00', its '2' gone). On the right no text lies beyond the axes' frame,
# whose line may come within 2 px of the edge; only the last column must be blank.
EDGE_SCRIPT = """
<script>
window.addEventListener("load", () => {
  const pad = 3;
  const rows = Array.from(document.querySelectorAll("figure img")).map((img) => {
    const canvas = document.createElement("canvas");
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    const context = canvas.getContext("2d");
    context.drawImage(img, 0, 0);
    const { data, width, height } = context.getImageData(0, 0, canvas.width, canvas.height);
    const ink = { left: 0, right: 0, top: 0, bottom: 0 };
    for (let y = 0; y < height; y++) {
      for (let x = 0; x < width; x++) {
        const i = 4 * (y * width + x);
        if (Math.min(data[i], data[i + 1], data[i + 2]) > 240) continue;  // background
        if (x < pad) ink.left++;
        if (x === width - 1) ink.right++;
        if (y < pad) ink.top++;
        if (y >= height - pad) ink.bottom++;
      }
    }
    const box = img.getBoundingClientRect();  // scaled to the page's width, never cropped
    const shown = box.width > 0 && box.left >= 0 && box.right <= window.innerWidth;
    const sides = Object.entries(ink).map(([side, n]) => `${side}=${n}`).join(",");
    return `${img.closest("figure").id}:${sides},shown=${shown}`;
  });
  const mark = document.createElement("div");
  mark.id = "lmforge-edges";
  mark.textContent = rows.join(" ");
  document.body.appendChild(mark);
});
</script>
"""
CLEAN_EDGES = "left=0,right=0,top=0,bottom=0,shown=true"


def chart_edges(page: str, tmp_path: Path) -> dict[str, str]:
    """Each chart of a report page as headless Chromium shows it: figure id -> the ink at each
    of its edges and whether the image lies inside a 1280 px window."""
    done = dump_dom(page, EDGE_SCRIPT, tmp_path, "edges")
    found = re.search(r'<div id="lmforge-edges">([^<]*)</div>', done.stdout)
    assert found, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return dict(row.split(":", 1) for row in found.group(1).split())


def issue_58_summary(run_dir: Path) -> RunSummary:
    """The chart of issue 58: a pretraining loss falling from 7 to 2 beside a constant learning
    rate of 6e-3, whose offset text ('1e-3') meets its panel's title."""
    records = [
        {"step": s, "loss": 2 + 5 * math.exp(-s / 40), "lr": 6e-3, "grad_norm": 1 + 30 / s}
        for s in range(20, 320, 20)
    ]
    return RunSummary("issue58", run_dir, [], {"pretrain": records}, {}, {}, [], None, None)


@pytest.mark.skipif(
    chromium() is None,
    reason="headless Chromium is not installed (apt-get install -y chromium): the charts were "
    "not checked in a browser",
)
def test_no_chart_is_cut_at_its_edges_in_headless_chromium(finished, tmp_path):
    workdir, _, _, _ = finished
    paths = write_report(workdir / "runs" / "short", out=tmp_path / "report")
    edges = chart_edges(paths["html"].read_text(), tmp_path)
    assert len(edges) == 9 and "fig-training_pretrain" in edges, edges
    assert {key: edge for key, edge in edges.items() if edge != CLEAN_EDGES} == {}

    summary = issue_58_summary(tmp_path)
    edges = chart_edges(render_html(summary, make_figures(summary)), tmp_path)
    assert edges == {"fig-training_pretrain": CLEAN_EDGES, "fig-throughput": CLEAN_EDGES}


def test_every_chart_keeps_its_text_inside_the_figure(finished, tmp_path, monkeypatch):
    """The layout itself, browser or not: each axes' title, tick labels, offset text, legend and
    annotations lie inside the figure as it was saved. Issue 58: the learning-rate panel's
    title, moved up on the first draw to clear its offset text, changed the margins after
    constrained layout had set them, and the loss panel's labels went past the left edge."""
    saved = []
    real_png = html_module._png
    monkeypatch.setattr(
        html_module, "_png", lambda figure: saved.append(figure) or real_png(figure)
    )
    workdir, _, _, _ = finished
    for summary in (collect_run(workdir / "runs" / "short"), issue_58_summary(tmp_path)):
        make_figures(summary)
    assert len(saved) == 9 + 2
    for figure in saved:
        renderer = figure.canvas.get_renderer()
        width, height = figure.bbox.width, figure.bbox.height
        for ax in figure.axes:
            box = ax.get_tightbbox(renderer)
            inside = box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height
            assert inside, (ax.get_title(), box, (width, height))


def test_readme_demo_results_render_from_the_run(finished):
    """scripts/update_readme.py's demo-results block from a finished run: the eval stage's
    scores by model, how each model was trained, the quantized copies in the report's units."""
    from tests.test_readme import load_script

    update_readme = load_script()
    workdir, pipeline, _, _ = finished
    run_dir = workdir / "runs" / "short"
    block = update_readme.demo_results(run_dir)
    lines = block.splitlines()
    assert lines[0] == "| | base | sft (LoRA) | dpo (LoRA, IPO loss) | grpo (full) |"
    models = json.loads((run_dir / "eval" / "out" / "results.json").read_text())["models"]
    row = next(line for line in lines if line.startswith("| answers/exact_match"))
    cells = [f"{models[label]['metrics']['answers/exact_match']:.2f}" for label in models]
    assert row.endswith("| " + " | ".join(cells) + " |")
    assert f"the {len(pipeline.stages)} stages took" in block and " MB" in block
    text = "a\n<!-- begin demo-results -->\n<!-- end demo-results -->\nb\n"
    assert update_readme.replace_block(text, "demo-results", block).count(block) == 1
