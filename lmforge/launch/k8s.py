"""The Kubernetes launcher: one Kubeflow Training Operator `PyTorchJob` (kubeflow.org/v1) per stage.

A stage becomes `<stage dir>/pytorchjob.yaml`: a `Master` replica (node 0) and `nodes - 1`
`Worker` replicas, each a pod with a container named `pytorch` (the operator looks for that name)
running the stage's image. For a multi-process stage the operator's environment does the
rendezvous: with `spec.nprocPerNode` it sets `PET_NNODES`, `PET_NPROC_PER_NODE`,
`PET_NODE_RANK`, `MASTER_ADDR` and `MASTER_PORT` on every pod, so the command is
`python -m torch.distributed.run --master-addr=$(MASTER_ADDR) --master-port=$(MASTER_PORT)
-m lmforge ARGV` with no node counts or ranks of its own (Kubernetes expands `$(VAR)` from the
container's environment). Other stages run `python -m lmforge ARGV` in the one Master pod.

Resources: `nvidia.com/gpu` limits from `gpus_per_node`, a CPU request from `cpus_per_task`, the
stage's `env` as plain variables, and the secrets by name only, as `valueFrom.secretKeyRef` into
one Kubernetes Secret (`secret_name`). The pipeline's working directory is a shared volume
(a PersistentVolumeClaim mounted at the same path, so relative and absolute paths in stage
configs mean the same thing in the pods); `/dev/shm` is a memory-backed volume for NCCL.

Pods are given `terminationGracePeriodSeconds = signal_lead_s`: Kubernetes sends SIGTERM on
eviction, which the trainer treats as preemption (save, exit); `restartPolicy: OnFailure`
restarts the pod, which resumes from that checkpoint.

`submit` needs `kubectl`: it writes the Secret from the given values through stdin (never to a
file), then creates each PyTorchJob after the ones it depends on have succeeded.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from collections.abc import Mapping
from typing import Any

import yaml

from lmforge.errors import ConfigError, UserError
from lmforge.launch.base import (
    SECRET_NAMES,
    JobCallback,
    JobHandle,
    JobState,
    StageJob,
)

MANIFEST_NAME = "pytorchjob.yaml"
API_VERSION = "kubeflow.org/v1"
CONTAINER_NAME = "pytorch"  # the operator finds the port and sets the env on this container
PORT_NAME = "pytorchjob-port"
_DNS_LABEL = re.compile(r"[^a-z0-9-]+")


class K8sLauncher:
    """Renders (and with kubectl, runs) PyTorchJobs.

    Args:
        image: the container image when a stage sets no `container_image` (build it from the
            repository's Dockerfile).
        namespace: the Kubernetes namespace (default: kubectl's current one).
        volume_claim: the PersistentVolumeClaim holding the pipeline's working directory.
        secret_name: the Secret the secret variables are read from.
        python: the interpreter in the image.
        kubectl: the kubectl command.
    """

    name = "k8s"

    def __init__(
        self,
        *,
        image: str = "lmforge:latest",
        namespace: str | None = None,
        volume_claim: str = "lmforge-runs",
        secret_name: str = "lmforge-secrets",
        python: str = "python",
        kubectl: str = "kubectl",
    ) -> None:
        self.image = image
        self.namespace = namespace
        self.volume_claim = volume_claim
        self.secret_name = secret_name
        self.python = python
        self.kubectl = kubectl

    # ------------------------------------------------------------------------- rendering

    def render(self, job: StageJob) -> dict[str, str]:
        text = yaml.safe_dump(self.manifest(job), sort_keys=False, width=100)
        return {MANIFEST_NAME: text}

    def job_name(self, job: StageJob) -> str:
        """A DNS-1123 name: `<pipeline>-<stage>`, lowercase, at most 63 characters."""
        raw = f"{job.run_dir.parent.name}-{job.name}".lower().replace("_", "-")
        name = _DNS_LABEL.sub("-", raw).strip("-")[:63].rstrip("-")
        return name or "lmforge-stage"

    def command(self, job: StageJob) -> list[str]:
        if not job.uses_torchrun:
            return job.command(self.python)
        return [
            self.python,
            "-m",
            "torch.distributed.run",
            "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2",
            "--master-addr=$(MASTER_ADDR)",
            "--master-port=$(MASTER_PORT)",
            "-m",
            "lmforge",
            *job.argv,
        ]

    def image_for(self, container_image: str | None) -> str:
        """The pod image for a stage's `container_image`, which may be written for Pyxis:
        `docker://REF` → REF, `REGISTRY#IMAGE` → REGISTRY/IMAGE; an enroot squashfs file (a
        path) is no image, so the launcher's `image` is used, as when none is set."""
        if not container_image or container_image.startswith(("/", "./", "../")):
            return self.image
        if container_image.endswith(".sqsh"):
            return self.image
        image = container_image.removeprefix("docker://")
        return image.replace("#", "/", 1)

    def manifest(self, job: StageJob) -> dict[str, Any]:
        """The PyTorchJob for `job`, as a dict (see the module docstring)."""
        res = job.resources
        leaked = sorted(set(res.env) & set(SECRET_NAMES))
        if leaked:
            raise ConfigError(
                f"stage {job.name}: launcher.env.{leaked[0]} would write a secret into the "
                "manifest; set it in the environment or the secrets file instead"
            )
        workdir = str(job.workdir.resolve())
        env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
        env += [{"name": key, "value": str(value)} for key, value in sorted(res.env.items())]
        for secret in sorted(job.secrets):
            env.append(
                {
                    "name": secret,
                    "valueFrom": {
                        "secretKeyRef": {"name": self.secret_name, "key": secret, "optional": True}
                    },
                }
            )
        resources: dict[str, dict[str, Any]] = {}
        if res.gpus_per_node:
            resources["limits"] = {"nvidia.com/gpu": res.gpus_per_node}
        if res.cpus_per_task:
            resources["requests"] = {"cpu": str(res.cpus_per_task)}
        container: dict[str, Any] = {
            "name": CONTAINER_NAME,
            "image": self.image_for(res.container_image),
            "imagePullPolicy": "IfNotPresent",
            "command": self.command(job),
            "workingDir": workdir,
            "env": env,
            "ports": [{"name": PORT_NAME, "containerPort": res.rdzv_port, "protocol": "TCP"}],
            "volumeMounts": [
                {"name": "workdir", "mountPath": workdir},
                {"name": "dshm", "mountPath": "/dev/shm"},
            ],
        }
        if resources:
            container["resources"] = resources
        pod = {
            "metadata": {"labels": self._labels(job)},
            "spec": {
                "containers": [container],
                "volumes": [
                    {"name": "workdir", "persistentVolumeClaim": {"claimName": self.volume_claim}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                ],
                "terminationGracePeriodSeconds": res.signal_lead_s,
            },
        }
        restart = "OnFailure" if job.resumable and res.requeue else "Never"
        replicas = {"Master": {"replicas": 1, "restartPolicy": restart, "template": pod}}
        if job.uses_torchrun and res.nodes > 1:
            replicas["Worker"] = {
                "replicas": res.nodes - 1,
                "restartPolicy": restart,
                "template": pod,
            }
        spec: dict[str, Any] = {
            "runPolicy": {
                "cleanPodPolicy": "None",  # keep finished pods for their logs
                "backoffLimit": 3 if restart == "OnFailure" else 0,
            },
            "pytorchReplicaSpecs": replicas,
        }
        if job.uses_torchrun:
            spec["nprocPerNode"] = str(res.nproc_per_node)
        metadata: dict[str, Any] = {"name": self.job_name(job), "labels": self._labels(job)}
        if self.namespace:
            metadata["namespace"] = self.namespace
        if job.depends_on:
            metadata["annotations"] = {"lmforge.dev/depends-on": ",".join(job.depends_on)}
        manifest = {"apiVersion": API_VERSION, "kind": "PyTorchJob", "metadata": metadata}
        manifest["spec"] = spec
        # Master and Worker share `pod`: copy, or YAML would write anchors and aliases.
        return json.loads(json.dumps(manifest))

    def _labels(self, job: StageJob) -> dict[str, str]:
        return {
            "app.kubernetes.io/managed-by": "lmforge",
            "lmforge.dev/pipeline": _label_value(job.run_dir.parent.name),
            "lmforge.dev/stage": _label_value(job.name),
        }

    # ------------------------------------------------------------------------- running

    def submit(
        self,
        jobs: list[StageJob],
        *,
        secrets: Mapping[str, str] | None = None,
        on_event: JobCallback | None = None,
        poll_s: float = 10.0,
    ) -> dict[str, JobHandle]:
        """Create the Secret, then each PyTorchJob once its dependencies succeeded (blocks)."""
        handles = {job.name: JobHandle(job.name, self.name) for job in jobs}
        if secrets:
            self._apply_secret(secrets)
        for job in jobs:
            handle = handles[job.name]
            broken = [d for d in job.depends_on if d in handles and not _ok(handles[d])]
            if broken:
                handle.state = JobState.NOT_STARTED
                handle.reason = f"not started: stage {broken[0]!r} {handles[broken[0]].state}"
                _notify(on_event, handle)
                continue
            job.run_dir.mkdir(parents=True, exist_ok=True)
            path = job.run_dir / MANIFEST_NAME
            path.write_text(self.render(job)[MANIFEST_NAME])
            done = self._kubectl("create", "-f", str(path), check=False)
            if done.returncode != 0:
                handle.state = JobState.FAILED
                handle.reason = "kubectl create failed: " + _last_line(done.stderr)
                _notify(on_event, handle)
                continue
            handle.job_id = self.job_name(job)
            handle.log = path
            _notify(on_event, handle)
            self.wait({job.name: handle}, on_event=on_event, poll_s=poll_s)
        return handles

    def wait(
        self,
        handles: dict[str, JobHandle],
        *,
        on_event: JobCallback | None = None,
        poll_s: float = 10.0,
    ) -> dict[str, JobHandle]:
        while True:
            for name, handle in handles.items():
                if handle.state.finished:
                    continue
                before = (handle.state, handle.reason)
                handles[name] = self.status(handle)
                if (handle.state, handle.reason) != before:
                    _notify(on_event, handle)
            if all(h.state.finished for h in handles.values()):
                return handles
            time.sleep(poll_s)

    def status(self, handle: JobHandle) -> JobHandle:
        if handle.job_id is None or handle.state == JobState.NOT_STARTED:
            return handle
        done = self._kubectl("get", "pytorchjob", handle.job_id, "-o", "json", check=False)
        if done.returncode != 0:
            handle.state = JobState.UNKNOWN
            handle.reason = _last_line(done.stderr)
            return handle
        conditions = json.loads(done.stdout).get("status", {}).get("conditions", [])
        current = [c for c in conditions if c.get("status") == "True"]
        kind = current[-1]["type"] if current else "Created"
        handle.state = {
            "Created": JobState.PENDING,
            "Running": JobState.RUNNING,
            "Restarting": JobState.RUNNING,
            "Suspended": JobState.PENDING,
            "Succeeded": JobState.SUCCEEDED,
            "Failed": JobState.FAILED,
        }.get(kind, JobState.UNKNOWN)
        handle.reason = (
            "" if kind == "Succeeded" else (current[-1].get("message", kind) if current else kind)
        )
        return handle

    def _apply_secret(self, secrets: Mapping[str, str]) -> None:
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": self.secret_name},
            "type": "Opaque",
            "stringData": dict(secrets),
        }
        if self.namespace:
            secret["metadata"]["namespace"] = self.namespace
        # Through stdin only: the values never touch the disk.
        self._kubectl("apply", "-f", "-", input=json.dumps(secret))

    def _kubectl(self, *argv: str, check: bool = True, input: str | None = None):
        cmd = [self.kubectl, *(["--namespace", self.namespace] if self.namespace else []), *argv]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=120)
        except FileNotFoundError:
            raise UserError(
                f"{self.kubectl}: not found; the k8s launcher needs kubectl (or use --dry-run to "
                "write the PyTorchJob manifests)"
            ) from None
        if check and done.returncode != 0:
            # Never echo `input`: it may be the Secret.
            raise UserError(f"{shlex.join(cmd)}: {_last_line(done.stderr)}")
        return done


def _label_value(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")[:63] or "x"


def _ok(handle: JobHandle) -> bool:
    return handle.state == JobState.SUCCEEDED


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _notify(on_event: JobCallback | None, handle: JobHandle) -> None:
    if on_event is not None:
        on_event(handle)
