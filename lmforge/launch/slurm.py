"""The Slurm launcher: one sbatch script per stage, chained with `--dependency=afterok`.

Each stage becomes `<stage dir>/job.sbatch`. Inside the allocation the script resolves the first
node's address with `scontrol show node` (a node name need not resolve as a hostname), then
`srun` starts one task per node; for a multi-process training stage that task is
`torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint ADDR:PORT
--rdzv-id $SLURM_JOB_ID --node-rank $SLURM_NODEID ... -m lmforge ARGV`, every flag given once.
Other stages run their command in one plain task.

Preemption: training stages ask for `--signal=B:USR2@<lead>` and `--requeue`. The batch shell
traps USR2 and forwards it to the srun step (srun passes it to the tasks, torchrun to its
workers); the trainer saves a checkpoint and exits (lmforge.train.preempt), and the script then
runs `scontrol requeue $SLURM_JOB_ID`, so the same job starts again later and resumes from that
checkpoint by itself. (The trainer takes SIGUSR2 by default, `train.preempt_signal`; keep it.)

`submit` sends the scripts in order with `sbatch --parsable --kill-on-invalid-dep=yes
--dependency=afterok:<ids>`, so a failed stage leaves its dependents unstarted: Slurm (or, where
that option is not honoured, this launcher) cancels them, and their handles say which stage
failed. `status` asks `scontrol show job`, and for jobs Slurm no longer remembers, the job
completion file (`JobCompType=jobcomp/filetxt`) or `sacct`.

Secrets are never written into a script: `sbatch --export=ALL` hands the submitting
environment (with the secrets in it) to the job.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from lmforge.errors import ConfigError, UserError
from lmforge.launch.base import (
    SECRET_NAMES,
    JobCallback,
    JobHandle,
    JobState,
    StageJob,
    job_environment,
    torchrun_command,
)

SCRIPT_NAME = "job.sbatch"
PREEMPT_SIGNAL = "USR2"  # matches TrainSection.preempt_signal's default (SIGUSR2)
# Values filled in by the shell of each srun task (they differ per node or are known only
# inside the allocation); shlex leaves these markers unquoted, then they become "$VAR".
_TASK_VARS = {
    "__LMFORGE_HEAD_ADDR__": '"$LMFORGE_HEAD_ADDR"',
    "__LMFORGE_NODE_RANK__": '"$SLURM_NODEID"',
    "__LMFORGE_JOB_ID__": '"$SLURM_JOB_ID"',
}

# Slurm job states (squeue / scontrol / jobcomp / sacct spellings) → JobState.
_STATES = {
    "PENDING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SPECIAL_EXIT": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "CANCELLED": JobState.CANCELLED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "PREEMPTED": JobState.FAILED,
    "REVOKED": JobState.CANCELLED,
}
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=(\S*)")


class SlurmLauncher:
    """Renders and submits sbatch jobs; asks Slurm about them.

    Args:
        python: the interpreter the job runs `-m lmforge` / `-m torch.distributed.run` with.
            Default: `python` inside a container image (Pyxis), else this interpreter (a
            virtual environment on a shared file system).
        slurm_bin: directory of the Slurm client commands (default: found on PATH).
        poll_s: how often `wait` asks Slurm, unless it is given its own `poll_s`.
    """

    name = "slurm"

    def __init__(
        self,
        *,
        python: str | None = None,
        slurm_bin: str | Path | None = None,
        poll_s: float = 10.0,
    ) -> None:
        self.python = python
        self.slurm_bin = Path(slurm_bin) if slurm_bin else None
        self.poll_s = poll_s
        self._jobcomp: tuple[str, str] | None = None

    # ------------------------------------------------------------------------- rendering

    def render(self, job: StageJob) -> dict[str, str]:
        return {SCRIPT_NAME: self.script(job)}

    def script(self, job: StageJob) -> str:
        """The sbatch script for `job` (dependencies are given to sbatch, not written here)."""
        res = job.resources
        leaked = sorted(set(res.env) & set(SECRET_NAMES))
        if leaked:
            raise ConfigError(
                f"stage {job.name}: launcher.env.{leaked[0]} would write a secret into the job "
                "script; set it in the environment or the secrets file instead"
            )
        run_dir = job.run_dir.resolve()
        pipeline = run_dir.parent.name
        training = job.resumable
        sbatch = [
            f"--job-name={pipeline}-{job.name}",
            f"--nodes={res.nodes}",
            "--ntasks-per-node=1",
        ]
        if res.gpus_per_node:
            sbatch.append(f"--gpus-per-node={res.gpus_per_node}")
        if res.cpus_per_task:
            sbatch.append(f"--cpus-per-task={res.cpus_per_task}")
        for flag, value in (
            ("time", res.time),
            ("partition", res.partition),
            ("account", res.account),
        ):
            if value:
                sbatch.append(f"--{flag}={value}")
        sbatch += [
            f"--chdir={job.workdir.resolve()}",
            f"--output={run_dir / 'slurm-%j.out'}",
            f"--error={run_dir / 'slurm-%j.err'}",
            "--open-mode=append",  # a requeued job appends to the same logs
            "--export=ALL",
        ]
        if training:
            sbatch.append(f"--signal=B:{PREEMPT_SIGNAL}@{res.signal_lead_s}")
            sbatch.append("--requeue" if res.requeue else "--no-requeue")
        else:
            sbatch.append("--no-requeue")
        sbatch += [line.strip().removeprefix("#SBATCH").strip() for line in res.extra_sbatch]
        _check_flags_once(f"stage {job.name}: #SBATCH", sbatch)

        lines = [
            "#!/bin/bash",
            f"# lmforge stage {job.name!r} ({job.kind}) of pipeline {pipeline!r}, rendered by "
            "lmforge's Slurm launcher.",
        ]
        if job.depends_on:
            lines.append(
                "# depends on: "
                + ", ".join(job.depends_on)
                + " (submitted with sbatch --dependency=afterok:<their job ids>)"
            )
        lines += [f"#SBATCH {flag}" for flag in sbatch]
        lines += ["", "set -uo pipefail"]
        if job.secrets:
            lines.append(f"# secrets from the submitting environment: {', '.join(job.secrets)}")
        env = {"PYTHONUNBUFFERED": "1", **res.env}
        lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
        lines.append(
            'echo "lmforge: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, '
            'restart ${SLURM_RESTART_COUNT:-0}" >&2'
        )
        if job.uses_torchrun and res.nodes > 1:
            lines += _HEAD_ADDRESS.splitlines()
        srun = self._srun(job)
        if training:
            lines += _PREEMPTIBLE_STEP.format(srun=srun, signal=PREEMPT_SIGNAL).splitlines()
            lines += (_REQUEUE if res.requeue else _NO_REQUEUE).splitlines()
            lines.append('exit "$status"')
        else:
            lines += ["", srun]
        return "\n".join(lines) + "\n"

    def _srun(self, job: StageJob) -> str:
        """The srun line: one task per node running torchrun, or one task running lmforge."""
        res = job.resources
        python = self.python or ("python" if res.container_image else sys.executable)
        srun = ["srun", "--kill-on-bad-exit=1"]
        if job.uses_torchrun:
            srun += [f"--nodes={res.nodes}", "--ntasks-per-node=1"]
        else:
            srun += ["--nodes=1", "--ntasks=1"]
        if res.cpus_per_task:  # since Slurm 22.05 srun does not inherit it from sbatch
            srun.append(f"--cpus-per-task={res.cpus_per_task}")
        if res.container_image:
            srun.append(f"--container-image={res.container_image}")
            if res.container_mounts:
                srun.append(f"--container-mounts={','.join(res.container_mounts)}")
            srun.append(f"--container-workdir={job.workdir.resolve()}")
        _check_flags_once(f"stage {job.name}: srun", srun[1:])
        if not job.uses_torchrun:
            return shlex.join([*srun, *job.command(python)])
        if res.nodes > 1:
            command = torchrun_command(
                job.argv,
                nproc_per_node=res.nproc_per_node,
                nnodes=res.nodes,
                rdzv_endpoint=f"__LMFORGE_HEAD_ADDR__:{res.rdzv_port}",
                rdzv_id="__LMFORGE_JOB_ID__",
                node_rank="__LMFORGE_NODE_RANK__",
                python=python,
            )
        else:
            command = torchrun_command(job.argv, nproc_per_node=res.nproc_per_node, python=python)
        _check_flags_once(f"stage {job.name}: torchrun", command[3 : command.index("-m", 3)])
        inner = shlex.join(command)
        for marker, shell in _TASK_VARS.items():
            inner = inner.replace(marker, shell)
        # The task's own shell expands $SLURM_NODEID (it differs per node).
        return shlex.join(srun) + " bash -c " + shlex.quote("exec " + inner)

    def submission(self, jobs: list[StageJob]) -> str:
        """A shell script that submits `jobs` the way `submit` does (for reading or by hand)."""
        lines = ["#!/bin/bash", "set -euo pipefail"]
        ids: dict[str, str] = {}
        for job in jobs:
            var = "job_" + re.sub(r"\W", "_", job.name)
            ids[job.name] = var
            deps = [f"${{{ids[d]}}}" for d in job.depends_on if d in ids]
            cmd = "sbatch --parsable --kill-on-invalid-dep=yes"
            if deps:
                cmd += " --dependency=afterok:" + ":".join(deps)
            path = shlex.quote(str(job.run_dir.resolve() / SCRIPT_NAME))
            lines.append(f"{var}=$({cmd} {path})")
            lines.append(f'echo "{job.name}: job ${var}"')
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------------- submitting

    def submit(
        self,
        jobs: list[StageJob],
        *,
        secrets: Mapping[str, str] | None = None,
        on_event: JobCallback | None = None,
    ) -> dict[str, JobHandle]:
        handles: dict[str, JobHandle] = {}
        for job in jobs:
            handle = JobHandle(job.name, self.name)
            handles[job.name] = handle
            broken = [d for d in job.depends_on if d in handles and handles[d].job_id is None]
            if broken:
                handle.state = JobState.NOT_STARTED
                handle.reason = f"not started: stage {broken[0]!r} could not be submitted"
                _notify(on_event, handle)
                continue
            job.run_dir.mkdir(parents=True, exist_ok=True)
            script = job.run_dir / SCRIPT_NAME
            script.write_text(self.script(job))
            deps = [handles[d].job_id for d in job.depends_on if d in handles]
            cmd = [self._bin("sbatch"), "--parsable", "--kill-on-invalid-dep=yes"]
            if deps:
                cmd.append("--dependency=afterok:" + ":".join(deps))
            cmd.append(str(script.resolve()))
            env = job_environment(job, secrets)
            try:
                done = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=120, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as err:
                handle.state = JobState.FAILED
                handle.reason = f"sbatch failed: {err}"
                _notify(on_event, handle)
                continue
            if done.returncode != 0:
                handle.state = JobState.FAILED
                handle.reason = "sbatch refused the job: " + _one_line(done.stderr or done.stdout)
                _notify(on_event, handle)
                continue
            handle.job_id = done.stdout.strip().split(";")[0]
            handle.log = job.run_dir.resolve() / f"slurm-{handle.job_id}.out"
            handle.reason = "submitted" + (f", after {', '.join(job.depends_on)}" if deps else "")
            _notify(on_event, handle)
        return handles

    def wait(
        self,
        handles: dict[str, JobHandle],
        *,
        on_event: JobCallback | None = None,
        poll_s: float | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, JobHandle]:
        """Poll until every job is finished (or `timeout_s` passes: then return as they are)."""
        poll_s = self.poll_s if poll_s is None else poll_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        names = {h.job_id: name for name, h in handles.items() if h.job_id}
        while True:
            for name, handle in handles.items():
                if handle.state.finished:
                    continue
                before = (handle.state, handle.reason)
                handles[name] = self._status(handle, names)
                if (handles[name].state, handles[name].reason) != before:
                    _notify(on_event, handles[name])
            if all(h.state.finished for h in handles.values()):
                return handles
            if deadline is not None and time.monotonic() > deadline:
                return handles
            time.sleep(poll_s)

    # ------------------------------------------------------------------------- status

    def status(self, handle: JobHandle) -> JobHandle:
        return self._status(handle, {})

    def _status(self, handle: JobHandle, names: Mapping[str, str]) -> JobHandle:
        if handle.job_id is None or handle.state == JobState.NOT_STARTED:
            return handle
        info = self.job_info(handle.job_id)
        if info is None:
            handle.state = JobState.UNKNOWN
            handle.reason = f"Slurm has no record of job {handle.job_id}"
            return handle
        slurm_state = (info.get("JobState", "").split() or [""])[0].rstrip("+")
        state = _STATES.get(slurm_state, JobState.UNKNOWN)
        reason = info.get("Reason", "None")
        dependency = info.get("Dependency", "")
        never = reason == "DependencyNeverSatisfied" or (
            state == JobState.CANCELLED and "(failed)" in dependency
        )
        if never and state in (JobState.PENDING, JobState.CANCELLED):
            if state == JobState.PENDING:  # Slurm did not cancel it itself: do it
                self._run("scancel", handle.job_id, check=False)
            handle.state = JobState.NOT_STARTED
            handle.reason = self._dependency_reason(dependency, names)
            return handle
        handle.state = state
        handle.exit_code = _exit_code(info.get("ExitCode"))
        restarts = int(info.get("Restarts", "0") or 0)
        if state == JobState.PENDING:
            handle.reason = f"pending ({reason})" if reason not in ("", "None") else "pending"
            if restarts:
                handle.reason += f", requeued {restarts}x"
        elif state == JobState.RUNNING:
            handle.reason = f"running on {info.get('NodeList', '?')}"
            if restarts:
                handle.reason += f", requeued {restarts}x"
        elif state == JobState.SUCCEEDED:
            handle.reason = ""
        elif state == JobState.CANCELLED and info.get("NodeList") in ("", "(null)", None):
            handle.state = JobState.NOT_STARTED
            handle.reason = "cancelled before it started"
        else:
            handle.reason = f"Slurm state {slurm_state}"
            if handle.exit_code is not None:
                handle.reason += f", exit code {handle.exit_code}"
            last = _last_error(handle.log)
            if last:
                handle.reason += f": {last}"
        return handle

    def _dependency_reason(self, dependency: str, names: Mapping[str, str]) -> str:
        """'not started: stage 'b' (Slurm job 12) failed' from `afterok:12(failed)`."""
        failed = re.findall(r"afterok:(\d+)\(failed\)", dependency) or re.findall(
            r"(\d+)\(failed\)", dependency
        )
        if not failed:
            return "not started: a job it depends on did not succeed"
        job_id = failed[0]
        info = self.job_info(job_id) or {}
        name = names.get(job_id) or info.get("JobName") or info.get("Name") or "?"
        what = "failed"
        state = _STATES.get((info.get("JobState", "").split() or [""])[0].rstrip("+"))
        if state == JobState.CANCELLED:
            never = info.get("Reason") == "DependencyNeverSatisfied"
            what = "did not start" if never else "was cancelled"
        code = _exit_code(info.get("ExitCode"))
        detail = f" (exit code {code})" if what == "failed" and code else ""
        return f"not started: stage {name!r} (Slurm job {job_id}) {what}{detail}"

    def job_info(self, job_id: str) -> dict[str, str] | None:
        """Slurm's fields for a job (`JobState`, `Reason`, `ExitCode`, ...): from `scontrol`,
        else the job completion file, else `sacct`; None when nothing knows it."""
        done = self._run("scontrol", "show", "job", "-o", job_id, check=False)
        if done.returncode == 0 and done.stdout.strip():
            return _fields(done.stdout.strip().splitlines()[0])
        kind, location = self._jobcomp_config()
        if kind == "jobcomp/filetxt" and location and os.access(location, os.R_OK):
            found = None
            with open(location, errors="replace") as handle:
                for line in handle:
                    if line.startswith(f"JobId={job_id} "):
                        found = line
            if found:
                fields = _fields(found)
                fields.setdefault("JobName", fields.get("Name", ""))
                return fields
        columns = ("JobName", "JobState", "ExitCode", "NodeList")
        sacct = ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobName,State,ExitCode,NodeList"]
        done = self._run(*sacct, check=False)
        if done.returncode == 0 and done.stdout.strip():
            return dict(zip(columns, done.stdout.strip().splitlines()[0].split("|")))
        return None

    def _jobcomp_config(self) -> tuple[str, str]:
        if self._jobcomp is None:
            done = self._run("scontrol", "show", "config", check=False)
            values = {}
            for line in done.stdout.splitlines():
                key, sep, value = line.partition("=")
                if sep:
                    values[key.strip()] = value.strip()
            self._jobcomp = (values.get("JobCompType", ""), values.get("JobCompLoc", ""))
        return self._jobcomp

    # ------------------------------------------------------------------------- helpers

    def _bin(self, name: str) -> str:
        return str(self.slurm_bin / name) if self.slurm_bin else name

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        try:
            done = subprocess.run(
                [self._bin(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60
            )
        except FileNotFoundError:
            raise UserError(
                f"{argv[0]}: not found; the Slurm launcher needs the Slurm client commands "
                "(slurm-client) on PATH"
            ) from None
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 1, "", f"{argv[0]} timed out")
        if check and done.returncode != 0:
            raise UserError(f"{shlex.join(argv)}: {_one_line(done.stderr)}")
        return done


# The address of the first node, from Slurm itself: node names need not be resolvable.
_HEAD_ADDRESS = """
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
LMFORGE_HEAD_ADDR=$(scontrol show node "$head_node" | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2)
if [ -z "$LMFORGE_HEAD_ADDR" ]; then
  echo "lmforge: scontrol gave no NodeAddr for node $head_node" >&2
  exit 1
fi
export LMFORGE_HEAD_ADDR
echo "lmforge: rendezvous on $head_node ($LMFORGE_HEAD_ADDR)" >&2"""

# Run the step in the background so the shell can take the preemption signal (bash runs a
# trap only between commands), pass it on to the step, and wait for the step to save and exit.
_PREEMPTIBLE_STEP = """
preempted=0
step_pid=""
forward_preemption() {{
  preempted=1
  echo "lmforge: SIG{signal} received: passing it to the job step to checkpoint and stop" >&2
  if [ -n "$step_pid" ]; then kill -{signal} "$step_pid" 2>/dev/null || true; fi
}}
trap forward_preemption {signal}
{srun} &
step_pid=$!
while kill -0 "$step_pid" 2>/dev/null; do wait "$step_pid"; done
wait "$step_pid"
status=$?"""

# 75 is lmforge.train.preempt.PREEMPTED_EXIT_CODE (a worker that got the signal directly).
_REQUEUE = """
if [ "$preempted" = 1 ] || [ "$status" = 75 ]; then
  echo "lmforge: preempted (step exit $status): requeueing job $SLURM_JOB_ID to resume" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi"""
_NO_REQUEUE = """
if [ "$preempted" = 1 ] || [ "$status" = 75 ]; then
  echo "lmforge: preempted (step exit $status); launcher.requeue = false: not requeued" >&2
fi"""


def _check_flags_once(where: str, args: list[str]) -> None:
    """Every `--flag` at most once (the seed's scripts passed `--nnodes` twice)."""
    seen: set[str] = set()
    for arg in args:
        if not arg.startswith("--"):
            continue
        flag = re.split(r"[=\s]", arg, maxsplit=1)[0]
        if flag in seen:
            raise ConfigError(f"{where}: {flag} is given twice (check launcher.extra_sbatch)")
        seen.add(flag)


def _fields(line: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _FIELD.finditer(line)}


def _exit_code(text: str | None) -> int | None:
    """Slurm's `CODE:SIGNAL`: the code, or 128 + the signal when a signal ended it."""
    if not text or ":" not in text:
        return None
    code, signal = (int(x) if x.isdigit() else 0 for x in text.split(":", 1))
    return code or (128 + signal if signal else 0)


def _one_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _last_error(log: Path | None, limit: int = 300) -> str:
    """The most telling line of a failed job's stderr: lmforge's `error: ...` line, else the
    last non-empty line."""
    if log is None:
        return ""
    err = Path(log).with_suffix(".err")
    try:
        with err.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 16384))
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    lines = [line.strip() for line in lines if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    text = (errors or lines or [""])[-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _notify(on_event: JobCallback | None, handle: JobHandle) -> None:
    if on_event is not None:
        on_event(handle)
