"""The Slurm launcher on a real two-node Slurm cluster (tests/slurm_cluster.py), and its scripts.

On the cluster: a 2-node pretraining stage (sbatch → srun → torchrun c10d on 127.0.0.1 → FSDP2
over gloo) gives the local 2-process run's losses; a chain of stages runs in order through
`--dependency=afterok`; a failing stage leaves its dependents unstarted and `lmforge status` says
why; a preempted training job (USR2 to the batch shell) saves, is requeued, resumes and ends with
the uninterrupted run's losses. Without the cluster: the 70B example's rendered scripts.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest

from lmforge.errors import ConfigError
from lmforge.launch.base import JobHandle, JobState, LauncherSection, StageJob
from lmforge.launch.slurm import SCRIPT_NAME, SlurmLauncher
from tests.train_utils import losses, make_shards, pretrain_args, run_torchrun, write_corpus

pytest_plugins = ["tests.slurm_cluster"]  # the session fixture `slurm_cluster`

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_70B = REPO / "examples" / "llama3_70b" / "pipeline.toml"
TRAINING = ("cpt", "sft", "dpo")
# Long enough (~0.05 s a step) that the preemption signal lands mid-run.
TRAIN_ARGS = ["train.steps=150", "checkpoint.every=1000", "train.micro_batch_size=2"]
CPU_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("slurm-data"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """Losses of the same pretraining as 2 local processes (torchrun --standalone)."""
    tokenizer, shards = data
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run_torchrun(2, "pretrain", pretrain_args(run_dir, tokenizer, shards, *TRAIN_ARGS))
    return losses(run_dir)


def launcher() -> SlurmLauncher:
    return SlurmLauncher(poll_s=0.5)


def pretrain_job(root: Path, data, name: str = "pretrain") -> StageJob:
    tokenizer, shards = data
    run_dir = root / "p" / name
    return StageJob(
        name=name,
        kind="pretrain",
        argv=["pretrain", *pretrain_args(run_dir, tokenizer, shards, *TRAIN_ARGS)],
        run_dir=run_dir,
        # a free port: other torchrun jobs on this machine may hold the default 29500
        resources=LauncherSection(nodes=2, nproc_per_node=1, env=CPU_ENV, rdzv_port=free_port()),
        distributed=True,
        workdir=root,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lmforge_job(root: Path, name: str, argv: list[str], depends_on=()) -> StageJob:
    return StageJob(
        name=name,
        kind="export",
        argv=argv,
        run_dir=root / "chain" / name,
        resources=LauncherSection(env=CPU_ENV),
        depends_on=list(depends_on),
        workdir=root,
    )


def logs(job: StageJob) -> str:
    return "".join(p.read_text() for p in sorted(job.run_dir.glob("slurm-*.*")))


def explain(job: StageJob, handle: JobHandle, cluster) -> str:
    """What a failure message needs: the handle, the job's logs, the daemons' logs."""
    return f"{handle}\n--- job logs\n{logs(job)[-6000:]}\n{cluster.diagnostics()}"


# ----------------------------------------------------------------------------- on the cluster


def test_two_node_pretraining_matches_the_local_two_process_run(
    slurm_cluster, data, reference, tmp_path
):
    job = pretrain_job(tmp_path, data)
    slurm = launcher()
    handles = slurm.wait(slurm.submit([job]), timeout_s=240)
    handle = handles[job.name]
    assert handle.state == JobState.SUCCEEDED, explain(job, handle, slurm_cluster)
    info = slurm.job_info(handle.job_id)
    assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2"
    assert "rendezvous on n1 (127.0.0.1)" in logs(job)  # NodeAddr from scontrol, not DNS
    assert losses(job.run_dir) == reference


def test_chain_runs_in_order_through_dependencies(slurm_cluster, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", num_docs=50)
    tok = tmp_path / "tok"
    train = ["tokenizer", "train", "--input", str(corpus), "--vocab-size", "280", "--out", str(tok)]
    jobs = [
        lmforge_job(tmp_path, "train", train),
        # reads what `train` wrote: fails unless it ran after it
        lmforge_job(tmp_path, "encode", ["tokenizer", "encode", str(tok), "Ada likes"], ["train"]),
        lmforge_job(tmp_path, "show", ["config", "show", "pretrain"], ["encode"]),
    ]
    slurm = launcher()
    handles = slurm.submit(jobs)
    deps = slurm.job_info(handles["show"].job_id)["Dependency"]
    assert deps.startswith(f"afterok:{handles['encode'].job_id}"), deps
    handles = slurm.wait(handles, timeout_s=180)
    assert all(h.state == JobState.SUCCEEDED for h in handles.values()), handles
    times = {name: slurm.job_info(h.job_id) for name, h in handles.items()}  # to the second
    assert times["train"]["EndTime"] <= times["encode"]["StartTime"]
    assert times["encode"]["EndTime"] <= times["show"]["StartTime"]
    encoded = (jobs[1].run_dir / f"slurm-{handles['encode'].job_id}.out").read_text()
    assert re.search(r"\d", encoded), encoded  # token ids of the tokenizer `train` wrote


PIPELINE_WITH_A_FAILURE = """
[pipeline]
name = "chain"

[launcher]
env = {{ OMP_NUM_THREADS = "1" }}

[stages.tok]
kind = "tokenizer"
input = ["{corpus}"]
vocab_size = 280

[stages.bad]
kind = "prepare"
input = ["{corpus}.missing"]
tokenizer = "${{tok}}"

[stages.train]
kind = "pretrain"
data.shards = "${{bad}}"
data.seq_len = 32
model.source = "tiny"
model.tokenizer = "${{tok}}"
train.steps = 2
"""


def test_a_failed_stage_leaves_its_dependents_unstarted_and_status_says_why(
    slurm_cluster, tmp_path, monkeypatch
):
    from lmforge.pipeline import format_status, load_pipeline, pipeline_status, run_pipeline

    token = "hf_SLURMTESTtoken1234567890"
    monkeypatch.setenv("HF_TOKEN", token)  # reaches the jobs through sbatch --export=ALL only
    corpus = write_corpus(tmp_path / "corpus.txt", num_docs=50)
    file = tmp_path / "pipeline.toml"
    file.write_text(PIPELINE_WITH_A_FAILURE.format(corpus=corpus))
    pipeline = load_pipeline(file, workdir=tmp_path)
    lines: list[str] = []
    result = run_pipeline(pipeline, launcher=launcher(), echo=lines.append)
    assert not result.ok
    states = {name: h.state for name, h in result.handles.items()}
    assert states == {
        "tok": JobState.SUCCEEDED,
        "bad": JobState.FAILED,
        "train": JobState.NOT_STARTED,
    }, lines
    bad, train = result.handles["bad"], result.handles["train"]
    assert bad.exit_code == 2 and ".missing" in bad.reason, bad
    assert f"stage 'bad' (Slurm job {bad.job_id}) failed (exit code 2)" in train.reason
    # Slurm cancelled the dependent (--kill-on-invalid-dep); it never ran.
    assert (
        slurm_cluster.run("scontrol", "show", "job", train.job_id).stdout.count(
            "JobState=CANCELLED Reason=DependencyNeverSatisfied"
        )
        == 1
    )

    # `lmforge status`, asking a fresh launcher: the same answer.
    fresh = SlurmLauncher().status(JobHandle("train", "slurm", job_id=train.job_id))
    assert fresh.state == JobState.NOT_STARTED and "failed" in fresh.reason
    assert f"Slurm job {bad.job_id}" in fresh.reason and "chain-bad" in fresh.reason
    # Once Slurm forgets the jobs (MinJobAge), the job completion file still knows them.
    forgetful = Forgetful(poll_s=0.5)
    for name, state in states.items():
        handle = JobHandle(name, "slurm", job_id=result.handles[name].job_id)
        assert forgetful.status(handle).state == state, (name, handle)
    run_dir = tmp_path / "runs" / "chain"
    table = format_status(pipeline_status(run_dir))
    row = next(line for line in table.splitlines() if line.startswith("train"))
    assert "not_started" in row and "stage 'bad'" in row, table

    # The secret went to the jobs through the environment, never into a file.
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


class Forgetful(SlurmLauncher):
    """A launcher whose `scontrol show job` knows no job, as after slurmctld purged them."""

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        if argv[:3] == ("scontrol", "show", "job"):
            return subprocess.CompletedProcess(argv, 1, "", "Invalid job id specified")
        return super()._run(*argv, check=check)


def test_a_job_sbatch_refuses_leaves_its_dependents_unsubmitted(slurm_cluster, tmp_path):
    first = lmforge_job(tmp_path, "first", ["config", "show", "pretrain"])
    first.resources = LauncherSection(partition="no_such_partition")
    second = lmforge_job(tmp_path, "second", ["config", "show", "pretrain"], ["first"])
    handles = launcher().submit([first, second])
    assert handles["first"].state == JobState.FAILED and handles["first"].job_id is None
    assert "sbatch refused the job" in handles["first"].reason
    assert "partition" in handles["first"].reason.lower()
    assert handles["second"].state == JobState.NOT_STARTED
    assert "could not be submitted" in handles["second"].reason


def test_preempted_job_saves_requeues_and_resumes_with_the_same_losses(
    slurm_cluster, data, reference, tmp_path
):
    job = pretrain_job(tmp_path, data)
    slurm = launcher()
    handle = slurm.submit([job])[job.name]
    metrics = job.run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert time.monotonic() < deadline, explain(job, handle, slurm_cluster)
        assert not slurm.status(handle).state.finished, explain(job, handle, slurm_cluster)
        time.sleep(0.05)
    # What Slurm does `lead` seconds before the time limit with --signal=B:USR2@lead.
    slurm_cluster.run("scancel", "--signal=USR2", "--batch", handle.job_id)
    handle = slurm.wait({job.name: handle}, timeout_s=240)[job.name]
    text = logs(job)
    assert handle.state == JobState.SUCCEEDED, explain(job, handle, slurm_cluster)

    info = slurm.job_info(handle.job_id)
    assert info["Restarts"] == "1", info  # requeued once: the same job id ran again
    assert "SIGUSR2 received" in text and "requeueing job" in text
    assert "restart 1" in text
    saved = re.search(r"preempted by SIGUSR2: saved step (\d+)", text)
    assert saved, text
    stopped_at = int(saved.group(1))
    assert 5 <= stopped_at < 150
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    # every step exactly once: the requeued run resumed after the preemption checkpoint
    assert steps == list(range(1, 151)), steps
    assert losses(job.run_dir) == reference


# ----------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def rendered_70b(tmp_path_factory):
    """`lmforge run examples/llama3_70b/pipeline.toml --dry-run --launcher slurm`."""
    from lmforge.pipeline import load_pipeline, run_pipeline

    workdir = tmp_path_factory.mktemp("llama3_70b")
    pipeline = load_pipeline(EXAMPLE_70B, workdir=workdir)
    lines: list[str] = []
    result = run_pipeline(pipeline, launcher="slurm", dry_run=True, echo=lines.append)
    assert result.ok
    stage_dirs = {s.name: workdir / s.stage_dir for s in pipeline.stages}
    scripts = {name: (d / SCRIPT_NAME).read_text() for name, d in stage_dirs.items()}
    return pipeline, scripts, "\n".join(lines)


def sbatch_flags(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ").strip() for line in script.splitlines()
            if line.startswith("#SBATCH ")]  # fmt: skip


def srun_line(script: str) -> list[str]:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    return shlex.split(line.removesuffix(" &"))


def flag_names(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0].split()[0] for a in args if a.startswith("--")]


def torchrun_args(script: str) -> list[str]:
    srun = srun_line(script)
    assert srun[-3:-1] == ["bash", "-c"], srun
    inner = shlex.split(srun[-1])
    assert inner[:4] == ["exec", "python", "-m", "torch.distributed.run"], inner
    return inner[4:]


def test_70b_example_renders_every_stage(rendered_70b):
    pipeline, scripts, printed = rendered_70b
    assert list(scripts) == [
        "wikitext", "cpt", "sft", "dpo", "eval", "int4", "eval_int4", "sample"
    ]  # fmt: skip
    for name, script in scripts.items():
        assert f"--- {pipeline.workdir}" in printed and f"# stage {name}" in printed
        check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert check.returncode == 0, (name, check.stderr)
        for what, args in (("#SBATCH", sbatch_flags(script)), ("srun", srun_line(script))):
            names = flag_names(args)
            assert len(names) == len(set(names)), (name, what, names)


def test_70b_training_scripts(rendered_70b):
    pipeline, scripts, _ = rendered_70b
    for name in TRAINING:
        script = scripts[name]
        flags = sbatch_flags(script)
        for expected in (
            f"--job-name=llama3_70b-{name}",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--gpus-per-node=8",
            "--cpus-per-task=96",
            "--partition=gpu",
            "--account=llm",
            "--signal=B:USR2@120",
            "--requeue",
            "--open-mode=append",
            "--export=ALL",
            "--exclusive",
            f"--output={pipeline.workdir}/runs/llama3_70b/{name}/slurm-%j.out",
            f"--error={pipeline.workdir}/runs/llama3_70b/{name}/slurm-%j.err",
        ):
            assert expected in flags, (name, expected, flags)
        assert ("--time=48:00:00" if name == "cpt" else "--time=12:00:00") in flags
        # the first node's address from scontrol, then one torchrun per node with c10d on it
        assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
        assert 'scontrol show node "$head_node" | grep -o \'NodeAddr=' in script
        srun = srun_line(script)
        assert "--nodes=2" in srun and "--ntasks-per-node=1" in srun
        assert "--container-image=/fsx/containers/lmforge.sqsh" in srun
        assert "--container-mounts=/fsx:/fsx" in srun
        args = torchrun_args(script)
        names = flag_names(args)
        assert len(names) == len(set(names)), names  # the seed passed --nnodes twice
        for expected in (
            "--nnodes=2",
            "--nproc-per-node=8",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=$LMFORGE_HEAD_ADDR:29500",
            "--rdzv-id=$SLURM_JOB_ID",
            "--node-rank=$SLURM_NODEID",
            "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2",
        ):
            assert expected in args, (expected, args)
        kind = "pretrain" if name == "cpt" else name
        config = f"runs/llama3_70b/{name}/stage.toml"
        assert args[-5:] == ["-m", "lmforge", kind, "--config", config], args
        # preemption: forward USR2 to the step, then requeue
        assert "trap forward_preemption USR2" in script
        assert 'kill -USR2 "$step_pid"' in script
        assert 'scontrol requeue "$SLURM_JOB_ID"' in script
        assert "export NCCL_SOCKET_IFNAME='^docker,lo,veth'" in script
        assert "export FI_PROVIDER=efa" in script


def test_70b_other_stages_run_one_plain_task(rendered_70b):
    _, scripts, _ = rendered_70b
    for name in ("wikitext", "eval", "int4", "eval_int4", "sample"):
        script = scripts[name]
        flags = sbatch_flags(script)
        assert "--no-requeue" in flags and not any(f.startswith("--signal") for f in flags)
        assert "trap" not in script
        srun = srun_line(script)
        if name == "eval":  # tensor parallel: torchrun's 8 processes on one node
            assert "--nodes=1" in srun and "--ntasks-per-node=1" in srun
            assert "torch.distributed.run --nproc-per-node=8 --nnodes=1" in script
            assert "--standalone" in script
            continue
        assert "--nodes=1" in srun and "--ntasks=1" in srun
        assert srun[srun.index("python") :][:3] == ["python", "-m", "lmforge"]
        assert "torch.distributed.run" not in script
    assert "--gpus-per-node=1" in sbatch_flags(scripts["sample"])
    cpu_only = sbatch_flags(scripts["wikitext"])  # tokenizing: no GPU node asked for
    assert not [f for f in cpu_only if f.startswith(("--gpus", "--exclusive", "--mem=0"))]
    assert "--partition=cpu" in cpu_only and "--partition=gpu" in sbatch_flags(scripts["cpt"])


def test_70b_dependency_chain(rendered_70b):
    pipeline, scripts, _ = rendered_70b
    expected = {
        "wikitext": [],
        "cpt": ["wikitext"],
        "sft": ["cpt"],
        "dpo": ["sft"],
        "eval": ["cpt", "sft", "dpo"],
        "int4": ["dpo"],
        "eval_int4": ["int4"],
        "sample": ["int4"],
    }
    for name, script in scripts.items():
        found = re.search(r"^# depends on: (.*) \(submitted with", script, re.M)
        assert (found.group(1).split(", ") if found else []) == expected[name], name
    # the submission script chains them exactly so
    from lmforge.pipeline import stage_job

    jobs = [stage_job(pipeline, s, s.depends_on, {}) for s in pipeline.stages]
    submit = SlurmLauncher().submission(jobs)
    assert "job_cpt=$(sbatch --parsable --kill-on-invalid-dep=yes --dependency=afterok:" \
           "${job_wikitext} " in submit  # fmt: skip
    assert "--dependency=afterok:${job_cpt}:${job_sft}:${job_dpo} " in submit
    assert "job_wikitext=$(sbatch --parsable --kill-on-invalid-dep=yes /" in submit


def test_70b_training_stages_are_planned_and_fit(rendered_70b, capsys):
    pipeline, _, printed = rendered_70b
    from lmforge.cli import main

    for name in TRAINING:
        (line,) = [x for x in printed.splitlines() if x.startswith(f"  {name} ") and "GPU" in x]
        assert "16 GPUs:" in line and "of 140.4 GiB per GPU, fits" in line, line
        table = (pipeline.workdir / f"runs/llama3_70b/{name}/memory_plan.txt").read_text()
        assert "16 GPUs (2 nodes × 8)" in table and "->  FITS" in table, table
        # The pipeline plans exactly as `lmforge plan` does with the stage's own config.
        kind = "pretrain" if name == "cpt" else name
        config = pipeline.workdir / f"runs/llama3_70b/{name}/stage.toml"
        argv = ["plan", "--config", str(config), "--job", kind, "--model", "llama3.1-70b"]
        assert main([*argv, "--gpus", "2x8", "--gpu-memory", "h200"]) == 0
        total = re.search(r"total +([0-9.]+ GiB)", capsys.readouterr().out).group(1)
        assert f"{total} of 140.4 GiB" in table
    assert "WARNING" not in printed


def test_70b_on_80gb_gpus_warns_that_pretraining_will_not_fit(tmp_path):
    from lmforge.pipeline import load_pipeline, run_pipeline

    text = EXAMPLE_70B.read_text()
    assert 'gpu_memory = "h200"' in text
    (tmp_path / "p.toml").write_text(text.replace('gpu_memory = "h200"', 'gpu_memory = "80GB"'))
    pipeline = load_pipeline(tmp_path / "p.toml", workdir=tmp_path)
    lines: list[str] = []
    assert run_pipeline(pipeline, launcher="slurm", dry_run=True, echo=lines.append).ok
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert len(warnings) == 1 and "stage 'cpt' will not fit" in warnings[0], warnings
    assert "--cpu-offload" in "\n".join(lines[lines.index(warnings[0]) :][:8])
    assert "DOES NOT FIT" in (tmp_path / "runs/llama3_70b/cpt/memory_plan.txt").read_text()
    # the inference stages are planned too, and fit: eval split over 8 GPUs, int4 on one
    planned = {line.split()[0]: line for line in lines if " GiB per GPU, " in line}
    assert {"eval", "int4", "eval_int4", "sample"} <= set(planned), lines
    assert "8 GPUs" in planned["eval"] and "1 GPU:" in planned["eval_int4"]
    assert all("fits" in planned[n] for n in ("eval", "int4", "eval_int4", "sample"))
    table = (tmp_path / "runs/llama3_70b/eval/memory_plan.txt").read_text()
    assert "70.6B in bf16 on 8 GPUs (tensor parallel)" in table
    assert "scoring forward" in table and "KV cache" in table  # lm-eval scores and generates
    assert re.search(r"^fits: 24\.\d of 80\.0 GiB per GPU", table, re.M), table
    # one eval on one GPU would not fit (131 GiB of bf16 weights): the warning says what would
    text = text.replace('gpu_memory = "h200"', 'gpu_memory = "80GB"')
    (tmp_path / "p.toml").write_text(
        text.replace("launcher.nproc_per_node = 8\nlauncher.time", "launcher.time")
    )
    lines = []
    assert run_pipeline(
        load_pipeline(tmp_path / "p.toml", workdir=tmp_path),
        launcher="slurm",
        dry_run=True,
        echo=lines.append,
    ).ok
    (warning,) = [line for line in lines if line.startswith("WARNING: stage 'eval' ")]
    assert "tensor parallelism over 2 GPUs (launcher.nproc_per_node = 2" in warning
    assert "lmforge launch --nproc 2 eval" in warning and 'scheme = "int4-wo"' in warning
    # a quantized model cannot be split: planning says the stage will fail
    tp_int4 = text.replace(
        'labels = ["int4-g256"]', 'labels = ["int4-g256"]\nlauncher.nproc_per_node = 8'
    )
    (tmp_path / "p.toml").write_text(tp_int4)
    lines = []
    run_pipeline(
        load_pipeline(tmp_path / "p.toml", workdir=tmp_path),
        launcher="slurm",
        dry_run=True,
        echo=lines.append,
    )
    assert any(
        line.startswith("WARNING: stage 'eval_int4' will fail: tensor-parallel") for line in lines
    )


def test_stages_are_not_planned_without_gpu_memory_or_model_shape(tmp_path):
    from lmforge.pipeline import load_pipeline, run_pipeline

    text = EXAMPLE_70B.read_text()
    variants = {
        "no memory": (text.replace('gpu_memory = "h200"', ""), "set [plan] gpu_memory"),
        "no shape": (
            text.replace('model = "llama3.1-70b"', ""),
            "the model models/Llama-3.1-70B is not on disk yet; set [plan] model = PRESET",
        ),
    }
    for name, (variant, reason) in variants.items():
        (tmp_path / "p.toml").write_text(variant)
        pipeline = load_pipeline(tmp_path / "p.toml", workdir=tmp_path)
        lines: list[str] = []
        assert run_pipeline(pipeline, launcher="slurm", dry_run=True, echo=lines.append).ok
        planned = [line for line in lines if line.startswith(("  cpt ", "  sft ", "  dpo "))]
        assert len(planned) == 6, (name, planned)  # the stage list, then the memory plan
        assert all(reason in line for line in planned[3:]), (name, planned)
    (tmp_path / "p.toml").write_text(text.replace('gpu_memory = "h200"', 'gpu_memory = "lots"'))
    with pytest.raises(ConfigError, match=r"plan.gpu_memory.*'lots'"):
        load_pipeline(tmp_path / "p.toml", workdir=tmp_path)


def test_rendered_scripts_hold_no_secret(tmp_path, monkeypatch):
    from lmforge.pipeline import load_pipeline, run_pipeline

    token = "hf_RENDERtoken0987654321abc"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("WANDB_API_KEY", "wandb_RENDERkey_55555")
    pipeline = load_pipeline(EXAMPLE_70B, workdir=tmp_path)
    lines: list[str] = []
    run_pipeline(pipeline, launcher="slurm", dry_run=True, echo=lines.append)
    assert token not in "\n".join(lines)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert token not in text and "wandb_RENDERkey_55555" not in text, path


def test_a_flag_given_twice_is_refused(tmp_path):
    job = StageJob(
        name="pretrain",
        kind="pretrain",
        argv=["pretrain"],
        run_dir=tmp_path / "p" / "pretrain",
        resources=LauncherSection(nodes=2, extra_sbatch=["--nodes=4"]),
        distributed=True,
        workdir=tmp_path,
    )
    with pytest.raises(ConfigError, match="--nodes is given twice"):
        SlurmLauncher().render(job)
    job.resources = LauncherSection(env={"HF_TOKEN": "x"})
    with pytest.raises(ConfigError, match="HF_TOKEN would write a secret"):
        SlurmLauncher().render(job)
