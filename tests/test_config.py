"""Config sections: precedence, error messages a user can act on, dumping and hashing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from lmforge.commands import config as config_command
from lmforge.config import ModelSection, Section, config_hash, dump_config, load_config
from lmforge.errors import ConfigError, UserError


class TrainSection(Section):
    lr: float = Field(3e-4, gt=0)
    steps: int = Field(10, ge=1)
    run_dir: str = "runs/default"
    schedule: Literal["cosine", "linear"] = "cosine"
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95])


class JobSection(Section):
    model: ModelSection = Field(default_factory=ModelSection)
    train: TrainSection = Field(default_factory=TrainSection)
    seed: int = 0


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


JOB_TOML = """\
seed = 7

[model]
dtype = "bfloat16"

[model.overrides]
num_layers = 2

[train]
lr = 1e-3
steps = 50
"""

JOB_YAML = """\
seed: 7
model:
  dtype: bfloat16
  overrides:
    num_layers: 2
train:
  lr: 1.0e-3
  steps: 50
"""


def test_defaults():
    cfg = load_config(JobSection)
    assert cfg == JobSection()
    assert cfg.model.source == "tiny" and cfg.model.dtype == "float32"
    assert cfg.model.tokenizer is None and cfg.model.overrides == {}


@pytest.mark.parametrize(("name", "text"), [("job.toml", JOB_TOML), ("job.yaml", JOB_YAML)])
def test_file_then_overrides(tmp_path, name, text):
    path = write(tmp_path, name, text)
    cfg = load_config(JobSection, path)
    assert (
        cfg.seed == 7 and cfg.model.dtype == "bfloat16" and cfg.model.overrides == {"num_layers": 2}
    )
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 50
    assert cfg.train.run_dir == "runs/default"  # untouched default survives

    cfg = load_config(
        JobSection,
        str(path),
        ["train.lr=3e-4", "model.dtype=float16", "model.overrides.dim=64", "seed=1", "seed=2"],
    )
    assert cfg.train.lr == 3e-4 and cfg.train.steps == 50
    assert cfg.model.dtype == "float16"
    assert cfg.model.overrides == {"num_layers": 2, "dim": 64}
    assert cfg.seed == 2  # the last override of a key wins


def test_override_values_are_toml_or_text():
    cfg = load_config(
        JobSection,
        overrides=[
            "train.run_dir=runs/a",
            'model.tokenizer="my tok"',
            "model.source=1.0",  # a text field keeps the text, not the float 1.0
            "train.betas=[0.8, 0.9]",
            "model.overrides={num_layers = 1, rope_theta = 5e5, tie = true}",
        ],
    )
    assert cfg.train.run_dir == "runs/a"
    assert cfg.model.tokenizer == "my tok"
    assert cfg.model.source == "1.0"
    assert cfg.train.betas == [0.8, 0.9]
    assert cfg.model.overrides == {"num_layers": 1, "rope_theta": 5e5, "tie": True}
    assert type(cfg.model.overrides["num_layers"]) is int
    assert type(cfg.model.overrides["tie"]) is bool


@pytest.mark.parametrize("item", ["train.lr", "=3", "train..lr=1"])
def test_malformed_override(item):
    message = config_error(JobSection, overrides=[item])
    assert repr(item) in message and "key=value" in message


def test_unknown_key_on_command_line():
    message = config_error(JobSection, overrides=["train.stesp=5"])
    assert "'train.stesp'" in message and "command line" in message
    assert "did you mean 'steps'" in message
    assert "betas, lr, run_dir, schedule, steps" in message

    message = config_error(JobSection, overrides=["sed=1"])
    assert "'sed'" in message and "did you mean 'seed'" in message
    assert "top level: model, seed, train" in message

    message = config_error(JobSection, overrides=["model.dtype.x=1"])
    assert "'model.dtype' is a value" in message


def test_unknown_keys_in_toml_file_name_path_and_line(tmp_path):
    path = write(tmp_path, "job.toml", '[model]\nsource = "tiny"\ndtpye = "float32"\n\n[trian]\n')
    lines = config_error(JobSection, path).splitlines()
    assert len(lines) == 2  # every problem, one line each
    assert "'model.dtpye'" in lines[0] and f"{path}:3" in lines[0]
    assert "did you mean 'dtype'" in lines[0]
    assert "dtype, overrides, source, tokenizer" in lines[0]
    assert "'trian'" in lines[1] and f"{path}:5" in lines[1] and "did you mean 'train'" in lines[1]


def test_unknown_key_in_yaml_file_names_line(tmp_path):
    path = write(tmp_path, "job.yml", "seed: 1\ntrain:\n  lr: 0.1\n  warmup: 3\n")
    message = config_error(JobSection, path)
    assert "'train.warmup'" in message and f"{path}:4" in message


def test_bad_literal_lists_allowed_values(tmp_path):
    message = config_error(JobSection, overrides=["model.dtype=bf16"])
    assert "model.dtype" in message and '"bf16"' in message and "command line" in message
    assert '"float32", "bfloat16", "float16"' in message

    path = write(tmp_path, "job.toml", '[train]\nsteps = 3\nschedule = "cos"\n')
    message = config_error(JobSection, path)
    assert f'train.schedule = "cos" ({path}:3)' in message
    assert '"cosine", "linear"' in message


def test_numeric_constraints_and_all_errors_together(tmp_path):
    path = write(tmp_path, "job.yaml", "train:\n  lr: -1.0\n")
    lines = config_error(JobSection, path, ["train.steps=0", "seed=abc"]).splitlines()
    assert len(lines) == 3
    assert lines[0] == f"train.lr = -1.0 ({path}:2): must be > 0"
    assert lines[1] == "train.steps = 0 (command line): must be >= 1"
    assert lines[2].startswith('seed = "abc" (command line): must be a valid integer')


def test_union_value_error_is_one_line():
    lines = config_error(ModelSection, overrides=["overrides.num_layers=many"]).splitlines()
    assert len(lines) == 1
    assert "overrides.num_layers" in lines[0] and "integer" in lines[0]


def test_section_given_a_value():
    message = config_error(JobSection, overrides=["model=big"])
    assert "model" in message and "is a section" in message and "source" in message


def test_toml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "job.toml", "seed = 1\n[train]\nlr = \n")
    message = config_error(JobSection, path)
    assert message.startswith(f"{path}:3:") and "invalid TOML" in message
    assert "\n" not in message


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "job.yaml", "seed: 1\ntrain:\n  betas: [0.9\n  lr: 2\n")
    message = config_error(JobSection, path)
    assert message.startswith(f"{path}:4:") and "invalid YAML" in message


def test_file_problems(tmp_path):
    missing = tmp_path / "nope.toml"
    assert str(missing) in config_error(JobSection, missing)
    message = config_error(JobSection, write(tmp_path, "job.json", "{}"))
    assert ".toml, .yaml, .yml" in message
    message = config_error(JobSection, write(tmp_path, "list.yaml", "- 1\n"))
    assert "mapping" in message
    assert load_config(JobSection, write(tmp_path, "empty.yaml", "")) == JobSection()


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError) and ConfigError.exit_code == 2


def test_nested_array_of_tables_line_numbers(tmp_path):
    class Stage(Section):
        name: str
        steps: int = 1

    class Pipeline(Section):
        stages: list[Stage] = Field(default_factory=list)

    text = '[[stages]]\nname = "a"\n\n[[stages]]\nname = "b"\nsteps = "x"\nsetps = 2\n'
    lines = config_error(Pipeline, write(tmp_path, "p.toml", text)).splitlines()
    assert "'stages[1].setps'" in lines[0] and "p.toml:7" in lines[0]
    assert 'stages[1].steps = "x"' in lines[1] and "p.toml:6" in lines[1]


@pytest.mark.parametrize("fmt", ["toml", "yaml"])
def test_dump_then_load_round_trip(tmp_path, fmt):
    cfg = load_config(
        JobSection,
        overrides=[
            "model.dtype=bfloat16",
            "model.overrides={num_layers = 2, norm_eps = 1e-5, tie = false}",
            "train.run_dir=runs/x y",
            "seed=3",
        ],
    )
    text = dump_config(cfg, fmt)
    if fmt == "toml":
        assert "# tokenizer = (unset)" in text  # TOML has no null: a comment says so
    again = load_config(JobSection, write(tmp_path, f"cfg.{fmt}", text))
    assert again == cfg
    assert config_hash(again) == config_hash(cfg)


def test_dump_json():
    cfg = ModelSection(source="runs/a", overrides={"num_layers": 2})
    assert json.loads(dump_config(cfg, "json")) == {
        "source": "runs/a",
        "dtype": "float32",
        "tokenizer": None,
        "chat_template": None,
        "overrides": {"num_layers": 2},
    }


def test_config_hash_stable_and_sensitive():
    first = config_hash(JobSection())
    assert first == config_hash(JobSection()) and len(first) == 64
    assert config_hash(load_config(JobSection, overrides=["seed=0"])) == first
    assert config_hash(load_config(JobSection, overrides=["seed=1"])) != first
    changed = JobSection()
    changed.model.overrides["num_layers"] = 2
    assert config_hash(changed) != first


def test_assignment_is_validated():
    cfg = ModelSection()
    cfg.dtype = "bfloat16"
    with pytest.raises(ValueError):
        cfg.dtype = "int3"


def run_config_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    config_command.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_config_show(capsys, tmp_path):
    assert run_config_command(["config", "show", "model", "dtype=bfloat16", "source=runs/a"]) == 0
    out = capsys.readouterr().out
    assert 'dtype = "bfloat16"' in out and 'source = "runs/a"' in out

    path = write(tmp_path, "m.yaml", "overrides:\n  num_layers: 2\n")
    argv = ["config", "show", "model", "--config", str(path), "--format", "json"]
    assert run_config_command(argv) == 0
    assert json.loads(capsys.readouterr().out)["overrides"] == {"num_layers": 2}

    with pytest.raises(ConfigError, match="did you mean 'model'"):
        run_config_command(["config", "show", "modle"])
    with pytest.raises(ConfigError, match="did you mean 'dtype'"):
        run_config_command(["config", "show", "model", "dtyp=float16"])


def test_cli_main_exit_code_2(capsys, monkeypatch):
    from lmforge import cli
    from lmforge.commands import config

    monkeypatch.setattr(cli, "COMMAND_MODULES", [config])
    assert cli.main(["config", "show", "model", "--format", "yaml"]) == 0
    assert "dtype: float32" in capsys.readouterr().out
    assert cli.main(["config", "show", "model", "dtype=bf16", "sorce=x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'sorce' (command line)")
    # Unknown keys first, then bad values, one line each.
    assert err.splitlines()[1].startswith('dtype = "bf16" (command line): must be one of')
    assert "Traceback" not in err
    assert cli.main(["config"]) == 2  # no action: help, exit 2


def test_overrides_may_follow_options_and_unknown_flags_still_fail(tmp_path, capsys):
    from lmforge.cli import main

    (tmp_path / "sft.yaml").write_text("train:\n  steps: 5\n")
    assert (
        main(["config", "show", "sft", "--config", str(tmp_path / "sft.yaml"), "lora.rank=16"]) == 0
    )
    shown = capsys.readouterr().out
    assert "rank = 16" in shown and "steps = 5" in shown
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show", "sft", "--config", str(tmp_path / "sft.yaml"), "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_version(capsys):
    from lmforge import __version__
    from lmforge.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"lmforge {__version__}")


def test_config_show_lists_unset_keys_and_loads_back(tmp_path, capsys):
    from lmforge.cli import main
    from lmforge.train.config import PretrainJob

    assert main(["config", "show", "pretrain"]) == 0
    shown = capsys.readouterr().out
    for key in ("tokenizer", "fused", "global_batch_size"):
        assert f"# {key} = (unset)" in shown
    (tmp_path / "job.toml").write_text(shown)
    assert load_config(PretrainJob, tmp_path / "job.toml") == PretrainJob()
