"""Local lm-eval tasks shipped with lmforge, and the builder that points them at a data file.

The YAML files here are complete lm-eval task configs except for the data file, which belongs to
one run (the demo writes `mc_heldout.jsonl` wherever it is told). `write_demo_task` copies them
into a directory with `dataset_kwargs.data_files` set to an absolute path; that directory is then
an include path for `lm_eval.tasks.TaskManager` (`run_eval(include_path=...)`, `--include-path`).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from lmforge.errors import DataError

TASKS_DIR = Path(__file__).parent
DEMO_TASKS = ("demo_mc", "demo_mc_chat")


def write_demo_task(data_file: str | Path, out_dir: str | Path) -> Path:
    """Write the demo multiple-choice tasks (`demo_mc`, `demo_mc_chat`) reading `data_file`.

    Args:
        data_file: a JSONL file of {"question", "choices", "label"} rows (mc_heldout.jsonl).
        out_dir: where to write demo_mc.yaml and demo_mc_chat.yaml (created if absent).

    Returns:
        `out_dir`, to pass as an include path.
    """
    data_file = Path(data_file).expanduser().resolve()
    if not data_file.is_file():
        raise DataError(
            f"{data_file}: no such file (expected the demo's mc_heldout.jsonl: rows of "
            '{"question", "choices", "label"})'
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in DEMO_TASKS:
        config = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
        config["dataset_kwargs"]["data_files"]["test"] = str(data_file)
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dir
