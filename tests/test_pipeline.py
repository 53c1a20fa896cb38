"""The pipeline runner with cheap stages (demo data → tokenizer → token shards), run for real
through the local launcher: up-to-date skips, reruns downstream of a change, --from / --only,
a failure that leaves its dependents unstarted, --dry-run, manifests, and secrets."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.cli import main as cli_main
from lmforge.errors import ConfigError, UserError
from lmforge.launch.base import (
    JobState,
    LauncherSection,
    StageJob,
    load_secrets,
    redact,
    torchrun_command,
)
from lmforge.launch.local import LocalLauncher
from lmforge.pipeline import (
    format_status,
    load_pipeline,
    pipeline_status,
    read_manifest,
    run_pipeline,
    write_manifest,
)

CHEAP = """
[pipeline]
name = "cheap"
report = false

[data.corpus]
path = "${{world}}/corpus.txt"

[stages.world]
kind = "prepare"
demo = {{ seed = 0, num_people = 12, repeats = 4 }}

[stages.tok]
kind = "tokenizer"
input = ["${{data.corpus}}"]
vocab_size = {vocab_size}

[stages.shards]
kind = "prepare"
input = ["${{data.corpus}}"]
tokenizer = "${{tok}}"
text_split = "paragraph"
"""

TOKEN = "hf_PIPELINEtestTOKEN_0123456789abcdef"
WANDB_KEY = "wandb_PIPELINE_key_9876543210"


def write(tmp_path: Path, vocab_size: int = 300) -> Path:
    file = tmp_path / "pipeline.toml"
    file.write_text(CHEAP.format(vocab_size=vocab_size))
    return file


def run(tmp_path: Path, file: Path, **kwargs):
    lines: list[str] = []
    pipeline = load_pipeline(file, workdir=tmp_path)
    launcher = kwargs.pop("launcher", None) or LocalLauncher(stream=None)
    result = run_pipeline(pipeline, launcher=launcher, echo=lines.append, **kwargs)
    return result, "\n".join(lines)


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> Path:
    """A workdir where the cheap pipeline ran once, successfully."""
    workdir = tmp_path_factory.mktemp("done")
    result, out = run(workdir, write(workdir))
    assert result.ok, out
    assert {h.state for h in result.handles.values()} == {JobState.SUCCEEDED}
    return workdir


def copy_of(done: Path, tmp_path: Path) -> Path:
    """A copy of the finished workdir (paths in a pipeline are relative to it)."""
    target = tmp_path / "work"
    shutil.copytree(done, target)
    return target


def manifests(tmp_path: Path) -> dict[str, dict]:
    run_dir = tmp_path / "runs" / "cheap"
    return {name: read_manifest(run_dir / name) for name in ("world", "tok", "shards")}


def test_run_skip_when_unchanged_and_rerun_downstream_of_a_change(done, tmp_path):
    first = manifests(done)

    # the manifest: resolved config, inputs and their hashes, code version, timings, metrics
    tok = first["tok"]
    assert tok["status"] == "succeeded" and tok["kind"] == "tokenizer"
    assert tok["config"]["vocab_size"] == 300 and len(tok["config_hash"]) == 64
    assert tok["command"] == [
        "lmforge",
        "tokenizer",
        "train",
        "--config",
        "runs/cheap/tok/stage.toml",
    ]
    assert set(tok["inputs"]) == {"stage:world"} and tok["inputs"]["stage:world"]
    assert tok["input"] is None  # no `from`: its inputs are references
    assert tok["output"]["path"] == "runs/cheap/tok/out" and len(tok["output"]["hash"]) == 64
    assert tok["code_version"] and tok["started_at"] and tok["ended_at"]
    assert tok["duration_s"] > 0 and tok["metrics"]["vocab_size"] == 300
    assert first["shards"]["metrics"]["num_tokens"] > 0
    assert first["shards"]["depends_on"] == ["world", "tok"]
    assert first["shards"]["inputs"]["stage:tok"] == tok["output"]["hash"]
    assert (done / "runs/cheap/shards/stage.toml").read_text().count("runs/cheap/tok/out")
    assert (done / "runs/cheap/tok/stage.log").read_text().count("vocab size: 300")

    tmp_path = copy_of(done, tmp_path)
    file = tmp_path / "pipeline.toml"
    # unchanged: nothing runs, each stage says so
    result, out = run(tmp_path, file)
    assert result.ok and result.handles == {}
    assert out.count("up to date, skipped") == 3, out
    assert {m["status"] for m in manifests(tmp_path).values()} == {"skipped"}

    # a changed stage reruns, and so does everything downstream of it; upstream is skipped
    file = write(tmp_path, vocab_size=320)
    result, out = run(tmp_path, file)
    assert result.ok, out
    assert set(result.handles) == {"tok", "shards"}
    assert "tok            tokenizer run (config changed)" in out
    assert "shards         prepare   run (upstream stage 'tok' runs)" in out
    after = manifests(tmp_path)
    assert after["world"]["status"] == "skipped"
    assert after["tok"]["metrics"]["vocab_size"] == 320
    assert after["shards"]["inputs"]["stage:tok"] != first["shards"]["inputs"]["stage:tok"]

    # a deleted output is noticed
    (tmp_path / "runs/cheap/shards/out/meta.json").unlink()
    result, out = run(tmp_path, file, dry_run=True)
    assert "shards         prepare   run (output missing or changed)" in out


def test_from_and_only(done, tmp_path):
    with pytest.raises(UserError, match="stage 'shards' needs the output of stage 'world'"):
        run(tmp_path, write(tmp_path), only="shards")
    tmp_path = copy_of(done, tmp_path)
    file = tmp_path / "pipeline.toml"

    result, out = run(tmp_path, file, only="tok")
    assert set(result.handles) == {"tok"}, out
    assert "shards         prepare   left as is" in out

    result, out = run(tmp_path, file, from_stage="tok")
    assert set(result.handles) == {"tok", "shards"}, out
    assert "world          prepare   left as is" in out
    with pytest.raises(ConfigError, match="no stage named 'nope'"):
        run(tmp_path, file, from_stage="nope")


def test_a_failure_stops_dependents_and_status_says_why(done, tmp_path, capsys):
    tmp_path = copy_of(done, tmp_path)
    file = write(tmp_path, vocab_size=100)  # train_bpe needs at least 262 ids
    result, out = run(tmp_path, file)
    assert not result.ok
    states = {name: h.state for name, h in result.handles.items()}
    assert states == {"tok": JobState.FAILED, "shards": JobState.NOT_STARTED}, out
    assert result.handles["tok"].exit_code == 2
    found = manifests(tmp_path)
    assert found["tok"]["status"] == "failed" and "exit code 2" in found["tok"]["reason"]
    assert found["shards"]["status"] == "not_started"
    assert found["shards"]["reason"] == "not started: stage 'tok' failed"
    assert not (tmp_path / "runs/cheap/shards/out").exists()

    table = format_status(pipeline_status(tmp_path / "runs" / "cheap"))
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert "failed" in rows["tok"] and "262" in rows["tok"], table
    assert "not_started" in rows["shards"] and "stage 'tok' failed" in rows["shards"], table
    # the CLI: exit 1 while a stage is not done
    assert cli_main(["status", str(tmp_path / "runs" / "cheap")]) == 1
    assert "not started: stage 'tok' failed" in capsys.readouterr().out

    # fixed: the failed stage and its dependents run, the good one is skipped
    result, out = run(tmp_path, write(tmp_path))
    assert result.ok and set(result.handles) == {"tok", "shards"}, out


def test_status_without_run_dir_reads_the_run_written_last(done, tmp_path, monkeypatch, capsys):
    workdir = copy_of(done, tmp_path)
    monkeypatch.chdir(workdir)
    runs = workdir / "runs"
    shutil.copytree(runs / "cheap", runs / "older")
    (runs / "notes.txt").write_text("not a run")  # neither this file nor an empty directory
    (runs / "empty").mkdir()  # is a run
    for age, name in ((100, "older"), (50, "cheap")):  # seconds ago, all of a run's records
        for record in [runs / name / "pipeline.json", *(runs / name).glob("*/manifest.json")]:
            when = time.time() - age
            os.utime(record, (when, when))
    assert cli_main(["status"]) == 0
    captured = capsys.readouterr()
    assert "status of runs/cheap (the run written last)" in captured.err
    assert "shards" in captured.out and "tok" in captured.out
    # one stage manifest newer than any of cheap's records makes `older` the last run
    os.utime(runs / "older" / "tok" / "manifest.json")
    assert cli_main(["status", "--json"]) == 0
    captured = capsys.readouterr()
    assert "status of runs/older" in captured.err
    assert [s["name"] for s in json.loads(captured.out)] == ["world", "tok", "shards"]

    monkeypatch.chdir(tmp_path)  # no runs/ here
    assert cli_main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no run directory under runs/") and "pass RUN_DIR" in err
    assert len(err.strip().splitlines()) == 1


def test_status_tells_a_killed_runner_from_a_live_one(done, tmp_path):
    tmp_path = copy_of(done, tmp_path)
    stage_dir = tmp_path / "runs" / "cheap" / "shards"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid, expected in ((dead.pid, "interrupted"), (os.getpid(), "running")):
        manifest = read_manifest(stage_dir)
        manifest.update(status="running", runner={"pid": pid, "host": socket.gethostname()})
        manifest["launcher"] = {"name": "local"}
        write_manifest(stage_dir, manifest)
        (status,) = [s for s in pipeline_status(tmp_path / "runs" / "cheap") if s.name == "shards"]
        assert status.status == expected, status
    manifest = read_manifest(stage_dir)
    manifest["runner"]["pid"] = dead.pid
    write_manifest(stage_dir, manifest)
    table = format_status(pipeline_status(tmp_path / "runs" / "cheap"))
    assert f"(pid {dead.pid}) is gone" in table


def test_dry_run_prints_the_plan_and_commands_and_runs_nothing(tmp_path, capsys):
    file = write(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert cli_main(["run", str(file), "--dry-run"]) == 0
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "world          prepare   run (no previous run)" in out
    # every stage runs as `lmforge COMMAND --config stage.toml`, the config printed below it
    assert "$ lmforge demo --config runs/cheap/world/stage.toml" in out
    assert 'out = "runs/cheap/world/out"\nseed = 0\nnum_people = 12' in out
    assert "$ lmforge tokenizer train --config runs/cheap/tok/stage.toml" in out
    assert 'input = [\n    "runs/cheap/world/out/corpus.txt",\n]' in out
    assert "$ lmforge prepare --config runs/cheap/shards/stage.toml" in out
    assert 'tokenizer = "runs/cheap/tok/out"' in out  # the resolved config is printed
    assert "command.sh" in out
    run_dir = tmp_path / "runs" / "cheap"
    assert not list(run_dir.rglob("manifest.json")) and not list(run_dir.rglob("out"))


def test_config_errors_name_the_stage_and_key(tmp_path):
    file = tmp_path / "p.toml"
    base = '[pipeline]\nname = "p"\n[stages.pre]\nkind = "pretrain"\n'
    file.write_text(base + "train.stepz = 3\n")
    with pytest.raises(ConfigError) as err:
        load_pipeline(file, workdir=tmp_path)
    assert "stage 'pre'" in str(err.value) and "train.stepz" in str(err.value)
    assert "did you mean 'steps'" in str(err.value)

    cases = {
        'kind = "pretrain"\ntrain.steps = 0\n': "train.steps",
        'kind = "bake"\n': "kind = 'bake'; allowed: prepare, tokenizer",
        'kind = "sft"\nfrom = "later"\n[stages.later]\nkind = "pretrain"\n': "from = 'later' names a stage that comes after it",
        'kind = "tokenizer"\ninput = ["${nothing}"]\nvocab_size = 300\n': "${nothing} names no earlier stage",
        'kind = "quantize"\nscheme = "int8-wo"\n': "needs from = STAGE",
        'kind = "pretrain"\nlauncher.nodez = 2\n': "unknown key 'nodez'",
        'kind = "pretrain"\nrun_dir = "x"\n': "'run_dir' is set by the pipeline",
        'kind = "pretrain"\nlauncher.nodes = 0\n': "launcher: nodes = 0: must be greater than 0",
        'kind = "pretrain"\n': "stage 's': data.shards is not set",
        'kind = "sft"\n': "stage 's': data.path (or data.dataset) is not set",
        'kind = "quantize"\nsource = "x"\n': "stage 's': 'source' is set by the pipeline",
        'kind = "eval"\nmodels = ["m"]\n': "nothing to evaluate: set tasks",
    }
    for body, message in cases.items():
        file.write_text('[pipeline]\nname = "p"\n[stages.s]\n' + body)
        with pytest.raises(ConfigError, match=None) as err:
            load_pipeline(file, workdir=tmp_path)
        assert message in str(err.value), (body, str(err.value))

    file.write_text('[pipeline]\nname = "p"\n')
    with pytest.raises(ConfigError, match=r"p.toml: stages is required$"):
        load_pipeline(file, workdir=tmp_path)

    file.write_text(base + '[stages.pre.launcher.env]\nHF_TOKEN = "hf_xxx"\n')
    with pytest.raises(ConfigError, match="secrets must not be written in the pipeline file"):
        load_pipeline(file, workdir=tmp_path)


def test_training_stage_config_is_a_validated_job_config(tmp_path):
    file = tmp_path / "p.toml"
    file.write_text(
        '[pipeline]\nname = "p"\n[model]\nsource = "tiny"\ntokenizer = "tok/"\n'
        '[launcher]\npartition = "gpu"\n'
        '[stages.pre]\nkind = "pretrain"\ndata.shards = "s/"\ntrain.steps = 7\n'
        "launcher.nproc_per_node = 2\n"
        '[stages.ft]\nkind = "sft"\nfrom = "pre"\ndata.path = ["a.jsonl"]\nlora.enabled = true\n'
        '[stages.ex]\nkind = "export"\nfrom = "ft"\ndtype = "float32"\n'
        '[stages.q]\nkind = "quantize"\nfrom = "ex"\nscheme = "int4-wo"\ngroup_size = 32\n'
    )
    pipeline = load_pipeline(file, workdir=tmp_path)
    pre, ft, ex, q = pipeline.stages
    assert pre.argv == ["pretrain", "--config", "runs/p/pre/stage.toml"]
    assert pre.config.train.steps == 7 and pre.config.run_dir == "runs/p/pre"
    assert pre.config.model.source == "tiny" and pre.config.model.tokenizer == "tok/"
    assert pre.resources.nproc_per_node == 2 and pre.resources.partition == "gpu"
    assert ft.config.model.source == "runs/p/pre/artifact" and ft.config.lora.enabled
    assert ft.depends_on == ["pre"] and ft.distributed
    # export reads the training run's checkpoints; each command gets its input and output
    assert ex.argv == ["export", "--config", "runs/p/ex/stage.toml"] and not ex.distributed
    assert (ex.config.source, ex.config.out) == ("runs/p/ft", "runs/p/ex/artifact")
    assert (q.config.source, q.config.out, q.config.group_size) == (
        "runs/p/ex/artifact",
        "runs/p/q/artifact",
        32,
    )
    # a local job with 2 processes runs under torchrun, standalone
    job = StageJob("pre", "pretrain", pre.argv, tmp_path, pre.resources, distributed=True)
    command = LocalLauncher().command(job)
    assert command[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in command
    assert "--nproc-per-node=2" in command and command[-4:] == ["lmforge", *pre.argv[:3]]
    assert torchrun_command(["x"], nproc_per_node=1)[-3:] == ["-m", "lmforge", "x"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc", "0"], "--nproc 0 must be >= 1"),
        (["--nnodes", "0"], "--nnodes 0 must be >= 1"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 must be in 0..1"),
        (["--nnodes", "2"], "--nnodes > 1 needs --rdzv-endpoint"),
        ([], "name the subcommand"),
    ],
)
def test_launch_refuses_bad_flags_with_exit_2(flags, message, capsys):
    command = [] if not flags else ["pretrain"]
    assert cli_main(["launch", *flags, *command]) == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- secrets


def fake_python(tmp_path: Path) -> Path:
    """An interpreter wrapper that prints the token it was given (raw: the launcher must
    redact it) and reversed (proof that the job received it), then runs python."""
    script = tmp_path / "python-wrapper"
    script.write_text(
        "#!/bin/sh\n"
        'echo "token: $HF_TOKEN"\n'
        'echo "reversed: $(printf %s "$HF_TOKEN" | rev)"\n'
        'echo "wandb set: ${WANDB_API_KEY:+yes}"\n'
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_secrets_reach_jobs_through_the_environment_only(tmp_path, monkeypatch):
    secrets_file = tmp_path / "secrets.env"
    secrets_file.write_text(f"# tokens\nexport HF_TOKEN='{TOKEN}'\nUNRELATED=1\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    assert load_secrets(secrets_file) == {"HF_TOKEN": TOKEN, "WANDB_API_KEY": WANDB_KEY}

    file = write(tmp_path)
    launcher = LocalLauncher(python=str(fake_python(tmp_path)), stream=None)
    result, out = run(tmp_path, file, launcher=launcher, secrets_file=secrets_file)
    assert result.ok, out
    log = (tmp_path / "runs/cheap/world/stage.log").read_text()
    assert "token: ***" in log and f"reversed: {TOKEN[::-1]}" in log
    assert "wandb set: yes" in log
    manifest = manifests(tmp_path)["world"]
    assert manifest["secrets"] == ["HF_TOKEN", "WANDB_API_KEY"]  # names only
    assert TOKEN not in out and WANDB_KEY not in out
    for path in (tmp_path / "runs").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert TOKEN.encode() not in data and WANDB_KEY.encode() not in data, path


def test_redact_and_secrets_file_errors(tmp_path):
    assert redact(f"a {TOKEN} b {TOKEN}", {"HF_TOKEN": TOKEN}) == "a *** b ***"
    assert redact("abc", {"X": "ab"}) == "abc"  # too short to be a secret
    bad = tmp_path / "bad.env"
    bad.write_text(f"HF_TOKEN {TOKEN}\n")
    with pytest.raises(ConfigError) as err:
        load_secrets(bad)
    assert "bad.env:1: expected NAME=VALUE" in str(err.value) and TOKEN not in str(err.value)
    with pytest.raises(ConfigError, match="cannot read"):
        load_secrets(tmp_path / "missing.env")


def test_local_launcher_stops_at_the_first_failure(tmp_path):
    def job(name, argv, depends_on=()):
        return StageJob(
            name,
            "prepare",
            argv,
            tmp_path / name,
            LauncherSection(),
            depends_on=list(depends_on),
            workdir=tmp_path,
        )

    jobs = [
        job("good", ["tokenizer", "--help"]),
        job("bad", ["tokenizer", "info", str(tmp_path / "nothing")]),
        job("after", ["tokenizer", "--help"], ["bad"]),
        job("independent", ["tokenizer", "--help"]),
    ]
    events = []
    handles = LocalLauncher(stream=None).submit(
        jobs, on_event=lambda h: events.append((h.name, h.state))
    )
    assert [handles[j.name].state for j in jobs] == [
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.NOT_STARTED,
        JobState.NOT_STARTED,
    ]
    assert handles["after"].reason == "not started: stage 'bad' failed"
    assert "stopped after stage 'bad' failed" in handles["independent"].reason
    assert ("good", JobState.RUNNING) in events and ("bad", JobState.FAILED) in events
    assert (tmp_path / "bad" / "stage.log").read_text().startswith("+ ")
    rendered = LocalLauncher().render(jobs[0])["command.sh"]
    assert rendered.startswith("#!/bin/sh") and "-m lmforge tokenizer --help" in rendered
    assert json.loads(json.dumps(handles["bad"].to_dict()))["state"] == "failed"


def test_yaml_pipeline_files_and_command_line_overrides(tmp_path, capsys):
    import tomllib

    import yaml

    data = tomllib.loads(CHEAP.format(vocab_size=300))
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    from_yaml = load_pipeline(tmp_path / "pipe.yaml", workdir=tmp_path)
    from_toml = load_pipeline(write(tmp_path), workdir=tmp_path)
    assert [s.config for s in from_yaml.stages] == [s.config for s in from_toml.stages]

    changed = load_pipeline(
        tmp_path / "pipe.yaml", workdir=tmp_path, overrides=["stages.tok.vocab_size=280"]
    )
    assert changed.stage("tok").config.vocab_size == 280
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        args = ["run", "pipe.yaml", "--dry-run", "stages.world.demo.num_people=7"]
        assert cli_main(args) == 0
        assert "num_people = 7" in capsys.readouterr().out
        assert cli_main(["run", "pipe.yaml", "--dry-run", "pipeline.name.x=1"]) == 2
        assert "pipeline.name is a value, not a section" in capsys.readouterr().err
    finally:
        os.chdir(cwd)


def test_every_stage_runs_its_command_with_config_the_only_argument(tmp_path):
    from lmforge.cli import build_parser

    example = Path(__file__).resolve().parent.parent / "examples" / "tiny" / "pipeline.toml"
    pipeline = load_pipeline(example, workdir=tmp_path)
    assert {stage.kind for stage in pipeline.stages} >= {"prepare", "tokenizer", "eval"}
    parser = build_parser()
    for stage in pipeline.stages:
        assert stage.argv[-2:] == ["--config", f"runs/tiny/{stage.name}/stage.toml"]
        assert str(parser.parse_args(stage.argv).config) == stage.argv[-1], stage.name
    help_text = parser.format_help()
    assert "pipeline-eval" not in help_text


def test_a_stage_command_takes_its_settings_from_one_place(tmp_path, capsys):
    config = tmp_path / "q.toml"
    config.write_text('source = "tiny"\nout = "q"\nscheme = "int8-wo"\n')
    assert cli_main(["quantize", "--config", str(config), "other", "--scheme", "int4-wo"]) == 2
    assert "do not also give ARTIFACT, --scheme" in capsys.readouterr().err
    assert cli_main(["quantize", "tiny"]) == 2
    assert "required: OUT, --scheme (or --config FILE)" in capsys.readouterr().err
    config.write_text('source = "tiny"\nout = "q"\nscheme = "int2"\n')
    assert cli_main(["quantize", "--config", str(config)]) == 2
    assert "scheme" in capsys.readouterr().err
    config.write_text('models = ["a", "b"]\nlabels = ["a"]\ntasks = ["x"]\nout = "o"\n')
    assert cli_main(["eval", "--config", str(config)]) == 2
    assert "labels has 1 names for 2 models" in capsys.readouterr().err


OPTIONAL = """
[stages.gptq]
kind = "quantize"
from = "shards"
scheme = "int4-wo"
method = "gptq"
calibration = "${{shards}}"

[stages.sample]
kind = "generate"
from = "gptq"
prompt = ["hello"]

[stages.compare]
kind = "eval"
models = ["shards", "gptq"]
labels = ["plain", "calibrated"]
tasks = ["demo_mc"]
"""


def test_a_stage_without_its_optional_environment_is_skipped_with_what_enables_it(
    done, tmp_path, monkeypatch, capsys
):
    """GPTQ's stage without llm-compressor's environment: skipped with one line saying how to
    enable it, and so is what reads its output (`from`); an eval drops it from its models; the
    rest runs, and status and the manifests say why. With the environment, it is planned."""
    work = copy_of(done, tmp_path)
    file = work / "pipeline.toml"
    file.write_text(CHEAP.format(vocab_size=300) + OPTIONAL.format())
    monkeypatch.setenv("LMFORGE_CALIBRATE_PYTHON", str(tmp_path / "missing" / "python"))
    pipeline = load_pipeline(file, workdir=work)
    assert set(pipeline.unavailable) == {"gptq", "sample"}
    assert "make calibrate" in pipeline.unavailable["gptq"]
    assert pipeline.unavailable["sample"] == "it needs stage 'gptq', which is skipped"
    compare = pipeline.stage("compare").config
    assert (compare.labels, len(compare.models)) == (["plain"], 1)
    assert pipeline.stage("compare").depends_on == ["shards"]

    lines: list[str] = []
    result = run_pipeline(
        pipeline, launcher=LocalLauncher(stream=None), echo=lines.append, only="gptq"
    )
    out = "\n".join(lines)
    assert result.ok and not result.handles, out
    assert "[pipeline] gptq: skipped: GPTQ needs llm-compressor's environment" in out
    run_dir = work / "runs" / "cheap"
    assert read_manifest(run_dir / "gptq")["status"] == "unavailable"
    rows = {s.name: s for s in pipeline_status(run_dir, refresh=False)}
    assert rows["gptq"].status == "unavailable" and "make calibrate" in rows["gptq"].reason

    monkeypatch.setenv("LMFORGE_CALIBRATE_PYTHON", sys.executable)  # the environment exists
    pipeline = load_pipeline(file, workdir=work)
    assert not pipeline.unavailable
    assert len(pipeline.stage("compare").config.models) == 2
