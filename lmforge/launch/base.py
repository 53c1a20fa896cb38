"""The launcher interface: how a pipeline stage becomes a running job.

The pipeline runner (`lmforge.pipeline`) turns each stage into a `StageJob`: an lmforge command
line (`argv`, e.g. `["sft", "--config", "runs/p/sft/stage.toml"]`), the stage's run directory,
its resources (`LauncherSection`) and the stages it depends on. A `Launcher` runs those jobs:
`LocalLauncher` (lmforge.launch.local) in subprocesses on this machine, `SlurmLauncher`
(lmforge.launch.slurm) as sbatch jobs chained with `--dependency=afterok`, `K8sLauncher`
(lmforge.launch.k8s) as PyTorchJob manifests. `lmforge.launch.make_launcher(name)` picks one by name.

Secrets (`SECRET_NAMES`: HF_TOKEN, WANDB_API_KEY, LMFORGE_API_KEY) reach jobs only through the
environment: `load_secrets` reads them from the environment or a `KEY=VALUE` file, the runner
passes the values to `submit(..., secrets=...)`, and a launcher must never write a value into a
rendered script, manifest or log (`redact` scrubs text that might contain one).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import Field, PositiveInt, field_validator

from lmforge.config import Section
from lmforge.errors import ConfigError
from lmforge.manifest import TRAINING_KINDS

SECRET_NAMES = ("HF_TOKEN", "WANDB_API_KEY", "LMFORGE_API_KEY")
"""Environment variables that carry secrets: passed to jobs, never written anywhere."""

REDACTED = "***"


# Kubernetes names: a DNS-1123 label (namespaces) and subdomain (claims, secrets); a quantity.
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
# Slurm's `--time`: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
UNLIMITED_TIMES = ("UNLIMITED", "INFINITE")


class K8sSection(Section):
    """The Kubernetes launcher's settings (a `[launcher.k8s]` table: defaults for every stage,
    which a stage's `[stages.X.launcher.k8s]` can change)."""

    image: str | None = None
    """The pod image; None takes `container_image` when it is an image reference (not a Pyxis
    squashfs file), else `lmforge:latest` (the repository's Dockerfile)."""
    namespace: str | None = None
    """None: kubectl's current namespace."""
    volume_claim: str = "lmforge-runs"
    """The PersistentVolumeClaim holding the pipeline's working directory, mounted at its path."""
    secret_name: str = "lmforge-secrets"
    """The Secret that HF_TOKEN / WANDB_API_KEY / LMFORGE_API_KEY are written to and read from."""
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Secrets holding registry credentials for a private image."""
    memory: str | None = None
    """Memory per pod (request = limit), a Kubernetes quantity: "1800Gi"; None: no request."""
    gpu_resource: str = "nvidia.com/gpu"
    """The extended resource `gpus_per_node` counts (`amd.com/gpu` on AMD nodes)."""
    efa_devices: int = Field(0, ge=0)
    """AWS EFA interfaces per pod (`vpc.amazonaws.com/efa`: 32 on p5.48xlarge, 16 on p5en);
    needed when `env.FI_PROVIDER = "efa"`."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Pod node selector, e.g. {"node.kubernetes.io/instance-type" = "p5.48xlarge"}."""

    @field_validator("namespace")
    @classmethod
    def _label(cls, value: str | None) -> str | None:
        if value is not None and not re.match(_DNS_LABEL, value):
            raise ValueError(
                "not a Kubernetes namespace: lowercase letters, digits and '-', at most 63"
            )
        return value

    @field_validator("volume_claim", "secret_name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.match(_DNS_SUBDOMAIN, value):
            raise ValueError("not a Kubernetes object name: lowercase letters, digits, '-', '.'")
        return value

    @field_validator("image_pull_secrets")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for name in value:
            cls._name(name)
        return value

    @field_validator("memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not re.match(_QUANTITY, value):
            raise ValueError("not a Kubernetes quantity: e.g. 1800Gi, 512Mi, 2Ti")
        return value


class LauncherSection(Section):
    """Where and with what resources one stage runs (a `[stages.NAME.launcher]` table)."""

    nodes: PositiveInt = 1
    nproc_per_node: PositiveInt = 1
    """Processes per node; more than 1 (or nodes > 1) runs a training stage under torchrun; an
    eval or generate stage (one node) splits its model over that many GPUs (tensor parallel)."""
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: PositiveInt | None = None
    """CPUs for each node's task (Slurm `--cpus-per-task`, Kubernetes CPU request)."""
    time: str | None = None
    """Wall-clock limit, Slurm format (`HH:MM:SS`, `D-HH:MM:SS`)."""
    partition: str | None = None
    account: str | None = None
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` lines, without the `#SBATCH` prefix (e.g. `--exclusive`)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment exported to the job (e.g. NCCL / EFA knobs). Never put secrets here."""
    container_image: str | None = None
    """Pyxis `--container-image` on Slurm; the pod image on Kubernetes."""
    container_mounts: list[str] = Field(default_factory=list)
    """Pyxis `--container-mounts` entries (`SRC:DST`)."""
    requeue: bool = True
    """Slurm: requeue on preemption / node failure (training resumes from its checkpoint)."""
    signal_lead_s: PositiveInt = 120
    """Slurm: seconds before the time limit at which the preemption signal is sent."""
    rdzv_port: PositiveInt = 29500
    """torchrun c10d rendezvous port on the first node (multi-node)."""
    k8s: K8sSection = Field(default_factory=K8sSection)
    """Kubernetes launcher settings (image, namespace, volume claim, secrets, memory, EFA)."""

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str | None) -> str | None:
        if value is not None:
            time_limit_seconds(value)
        return value


def time_limit_seconds(text: str) -> int | None:
    """Seconds in a Slurm time limit (`M`, `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S`); None for
    UNLIMITED. Raises ValueError naming the formats for anything else."""
    if text.strip().upper() in UNLIMITED_TIMES:
        return None
    match = _SLURM_TIME.match(text.strip())
    if match is None:
        raise ValueError(
            f"time {text!r} is not a Slurm time limit: use MM, HH:MM:SS, D-HH, D-HH:MM:SS or "
            "UNLIMITED"
        )
    days, first, second, third = (int(x) if x else None for x in match.groups())
    if days is not None:  # D-H[:M[:S]]
        return ((days * 24 + first) * 60 + (second or 0)) * 60 + (third or 0)
    if third is not None:  # H:M:S
        return (first * 60 + second) * 60 + third
    return first * 60 + (second or 0)  # M[:S]


@dataclasses.dataclass
class StageJob:
    """One stage, ready for a launcher.

    Attributes:
        name: the stage name (unique in the pipeline).
        kind: prepare | tokenizer | pretrain | sft | dpo | eval | quantize | generate | export.
        argv: the lmforge subcommand and its arguments, i.e. what follows `lmforge` (or
            `python -m lmforge`, or `torchrun ... -m lmforge`), e.g. `["sft", "--config", "..."]`.
        run_dir: the stage's directory `runs/<pipeline>/<stage>/` (logs and scripts go here).
        resources: nodes, processes, GPUs, time, partition, environment, container.
        depends_on: names of the stages that must succeed first.
        distributed: True for training, eval and generate stages (run under torchrun when
            `resources.nodes * resources.nproc_per_node > 1`; eval and generate split the
            model over the processes, tensor parallel).
        workdir: the directory the command runs in; relative paths in `argv` and in the
            rendered config resolve against it.
        secrets: names (not values) of the secret variables this job receives.
    """

    name: str
    kind: str
    argv: list[str]
    run_dir: Path
    resources: LauncherSection = dataclasses.field(default_factory=LauncherSection)
    depends_on: list[str] = dataclasses.field(default_factory=list)
    distributed: bool = False
    workdir: Path = dataclasses.field(default_factory=Path.cwd)
    secrets: list[str] = dataclasses.field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.nproc_per_node

    @property
    def uses_torchrun(self) -> bool:
        return self.distributed and self.world_size > 1

    @property
    def resumable(self) -> bool:
        """A training stage: preemption saves a checkpoint and a restart resumes from it
        (Slurm's requeue and preemption signal, Kubernetes' restart on failure)."""
        return self.distributed and self.kind in TRAINING_KINDS

    @property
    def log_file(self) -> Path:
        """Where the local launcher writes the stage's output (others may add their own)."""
        return self.run_dir / "stage.log"

    def command(self, python: str | None = None) -> list[str]:
        """The command without torchrun: `lmforge ARGV`, or `PYTHON -m lmforge ARGV`."""
        if python is None:
            return ["lmforge", *self.argv]
        return [python, "-m", "lmforge", *self.argv]


class JobState(enum.StrEnum):
    PENDING = "pending"
    """Submitted, not started (queued, or waiting on a dependency)."""
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    NOT_STARTED = "not_started"
    """Never started because a stage it depends on failed or was cancelled."""
    UNKNOWN = "unknown"

    @property
    def finished(self) -> bool:
        return self in (
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.NOT_STARTED,
        )


@dataclasses.dataclass
class JobHandle:
    """A launcher's handle on one submitted job; stored in the stage manifest (`to_dict`).

    Attributes:
        name: the stage name.
        launcher: the launcher's name (`local`, `slurm`, `k8s`); `make_launcher(launcher)`
            gives back a launcher that can `status()` this handle.
        job_id: the scheduler's id (Slurm job id, Kubernetes job name, local pid), or None.
        state: the last known state.
        reason: why it failed or did not start (one line), or the scheduler's state text.
        exit_code: the command's exit status once finished, when known.
        log: the job's log file, when known.
    """

    name: str
    launcher: str
    job_id: str | None = None
    state: JobState = JobState.PENDING
    reason: str = ""
    exit_code: int | None = None
    log: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["state"] = str(self.state)
        data["log"] = None if self.log is None else str(self.log)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobHandle:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["state"] = JobState(values.get("state", JobState.UNKNOWN))
        if values.get("log") is not None:
            values["log"] = Path(values["log"])
        return cls(**values)


JobCallback = Callable[[JobHandle], None]
"""Called by a launcher whenever a job's state changes (start, finish, not started)."""


@runtime_checkable
class Launcher(Protocol):
    """Runs StageJobs. Implementations: local, slurm, k8s (see `make_launcher`)."""

    name: str

    def render(self, job: StageJob) -> dict[str, str]:
        """The files this launcher would write for `job` (file name → text), for `--dry-run`
        and for inspection: the sbatch script, the PyTorchJob manifest, or (local) the command
        line. Must contain no secret values. Does not write or submit anything."""
        ...

    def submit(
        self,
        jobs: list[StageJob],
        *,
        secrets: Mapping[str, str] | None = None,
        on_event: JobCallback | None = None,
    ) -> dict[str, JobHandle]:
        """Start `jobs` (in order; each waits for its `depends_on`); returns a handle per job
        name. `secrets` are passed through the environment only. A launcher may block until the
        jobs are done (local) or return at once (slurm, k8s); `on_event` is called on each
        state change seen while it runs."""
        ...

    def wait(
        self,
        handles: dict[str, JobHandle],
        *,
        on_event: JobCallback | None = None,
        poll_s: float = 10.0,
    ) -> dict[str, JobHandle]:
        """Block until every handle is finished; returns the updated handles."""
        ...

    def status(self, handle: JobHandle) -> JobHandle:
        """The handle refreshed from the scheduler (state, reason, exit code)."""
        ...


def torchrun_command(
    argv: list[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    node_rank: str | int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """`python -m torch.distributed.run ... -m lmforge ARGV`, every flag given once.

    One node: `--standalone`. Several: c10d rendezvous at `rdzv_endpoint` (HOST:PORT of the
    first node); `node_rank` may be a shell expression such as `$SLURM_NODEID` (c10d assigns
    ranks itself when it is None). torchrun forwards SIGUSR1/SIGUSR2 to its workers so a
    preemption signal reaches the trainer.
    """
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2",
    ]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ConfigError("a multi-node torchrun needs a rendezvous endpoint HOST:PORT")
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if rdzv_id is not None:
            cmd.append(f"--rdzv-id={rdzv_id}")
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    else:
        cmd.append("--standalone")
    return [*cmd, "-m", "lmforge", *argv]


def run_torchrun(command: list[str]) -> int:
    """Run a `torchrun_command` in this process (torchrun's own launcher, not a copy of it) and
    return its exit code. A SIGTERM or SIGINT reaches the workers (torchrun passes it on and
    waits for them: training saves, a server drains) and ends the launch with 128 + the
    signal's number, without torchrun's traceback. A first failure that is a user error (exit
    code 2, the process's own message above) ends it with 2 (the others are stopped); another
    failure gets torchrun's report of the first failure and 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    start = command.index("torch.distributed.run") + 1  # after `python -m`
    try:
        run(parse_args(command[start:]))
    except SignalException as err:
        print(f"lmforge launch: stopped by {err.sigval.name}", file=sys.stderr)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        if first.exitcode == 2:  # a user error, reported by the process itself
            print("lmforge launch: stopped on the error above", file=sys.stderr)
            return 2
        print(err.format_msg(), file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- secrets


def load_secrets(
    file: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The secrets in `SECRET_NAMES` that are set: from `file` (lines `NAME=VALUE`, `#`
    comments, optional `export ` prefix and quotes), then the environment, which wins.

    Raises:
        ConfigError: the file is missing or has a line that is not `NAME=VALUE`.
    """
    secrets: dict[str, str] = {}
    if file is not None:
        path = Path(file)
        try:
            lines = path.read_text().splitlines()
        except OSError as err:
            raise ConfigError(f"secrets file {path}: cannot read ({err.strerror})") from None
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            text = text.removeprefix("export ").strip()
            key, sep, value = text.partition("=")
            key = key.strip()
            if not sep or not key.isidentifier():
                # Never echo the line: it may hold a secret.
                raise ConfigError(f"{path}:{number}: expected NAME=VALUE")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if key in SECRET_NAMES and value:
                secrets[key] = value
    environ = os.environ if environ is None else environ
    for name in SECRET_NAMES:
        if environ.get(name):
            secrets[name] = environ[name]
    return secrets


def redact(text: str, secrets: Mapping[str, str] | Any) -> str:
    """`text` with every secret value replaced by `***` (values shorter than 4 characters are
    left alone: they would match ordinary text and are not secrets worth the name)."""
    values = secrets.values() if isinstance(secrets, Mapping) else secrets
    for value in sorted(set(values), key=len, reverse=True):
        if value and len(value) >= 4:
            text = text.replace(value, REDACTED)
    return text


def job_environment(
    job: StageJob, secrets: Mapping[str, str] | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment a job's process gets: `base` (default: this process's environment)
    + the stage's `resources.env` + the secrets it is given."""
    env = dict(os.environ if base is None else base)
    env.update(job.resources.env)
    for name, value in (secrets or {}).items():
        if not job.secrets or name in job.secrets:
            env[name] = value
    return env
