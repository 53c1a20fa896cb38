"""`lmforge export`: turn a committed training checkpoint into an artifact.

The run directory keeps `model/` (config.json + tokenizer of the model being trained) and
`job.toml`; the checkpoint holds the weights (DCP, any number of ranks). One process loads
them into a plain model on the CPU and writes the artifact.
"""

from __future__ import annotations

from pathlib import Path

from lmforge import api, artifact, models
from lmforge.errors import UserError
from lmforge.models import Transformer
from lmforge.train.checkpoint import (
    CHECKPOINTS_DIRNAME,
    Checkpointer,
    ModelOptimizerState,
    read_commit,
)
from lmforge.train.stage import MODEL_DIR


def _load_newest(source: Path, run_dir: Path, model: Transformer) -> Path:
    """Load `model` from a run directory's newest checkpoint that verifies, or from the one
    checkpoint directory given; returns the checkpoint's directory."""
    state = {"model": ModelOptimizerState(model)}
    if source != run_dir:
        Checkpointer(run_dir).load(source, state)
        return source
    if not (source / CHECKPOINTS_DIRNAME).is_dir():
        raise UserError(
            f"{source}: neither a run directory (with checkpoints/) nor a committed checkpoint"
        )
    checkpointer = Checkpointer(source)
    if checkpointer.restore_latest(state) is None:
        raise UserError(f"{source}: has no committed checkpoint to export")
    return checkpointer.last_load.path


def _run_dir_of(source: Path) -> Path:
    return source.parent.parent if read_commit(source) is not None else source


def export_checkpoint(
    source: str | Path, out: str | Path, *, dtype: str = "bfloat16", overwrite: bool = False
) -> Path:
    source = Path(source)
    run_dir = _run_dir_of(source)
    artifact.check_output(out, inputs=[run_dir], overwrite=overwrite)
    model_dir = run_dir / MODEL_DIR
    config_path = model_dir / artifact.CONFIG_NAME
    if not config_path.exists():
        raise UserError(f"{run_dir}: lacks {MODEL_DIR}/config.json (not an lmforge run directory)")
    args = models.args_from_hf_config(artifact.read_json(config_path), config_path)
    tokenizer = api.load_tokenizer_for(model_dir, args)
    model = models.new_model(args)  # fp32 on the CPU; every weight is overwritten below
    checkpoint_dir = _load_newest(source, run_dir, model)
    step = read_commit(checkpoint_dir)["step"]
    job_path = run_dir / "job.toml"
    lineage_config = {"job": job_path.read_text()} if job_path.exists() else {}
    return api.save_state(
        model.state_dict(),
        args,
        tokenizer,
        out,
        dtype=dtype,
        stage="export",
        parent=str(checkpoint_dir),
        config=lineage_config,
        metrics={"step": step},
        overwrite=overwrite,
    )
