"""The Kubernetes launcher: one Kubeflow Training Operator `PyTorchJob` (kubeflow.org/v1) per stage.

A stage becomes `<stage dir>/pytorchjob.yaml`: a `Master` replica (node 0) and `nodes - 1`
`Worker` replicas, each a pod with a container named `pytorch` (the operator looks for that name)
running the stage's image. For a multi-process stage the operator's environment does the
rendezvous: with `spec.nprocPerNode` it sets `PET_NNODES`, `PET_NPROC_PER_NODE`,
`PET_NODE_RANK`, `MASTER_ADDR` and `MASTER_PORT` on every pod, so the command is
`python -m torch.distributed.run --master-addr=$(MASTER_ADDR) --master-port=$(MASTER_PORT)
-m lmforge ARGV` with no node counts or ranks of its own (Kubernetes expands `$(VAR)` from the
container's environment). Other stages run `python -m lmforge ARGV` in the one Master pod.

Settings come from each stage's `[launcher]` section (`LauncherSection`, whose `k8s` table is
`K8sSection`; the pipeline's `[launcher.k8s]` gives every stage's defaults): the image
(`k8s.image`, else `container_image` when it is an image reference; a Pyxis squashfs file is
refused), the namespace, GPU limits from `gpus_per_node` (`k8s.gpu_resource`), EFA devices
(`k8s.efa_devices`, required by a multi-node stage with `FI_PROVIDER=efa`), memory
(`k8s.memory`, request = limit), a CPU request from `cpus_per_task`, `time` as the job's
`activeDeadlineSeconds`, the stage's `env` as plain variables, and the secrets by name only, as
`valueFrom.secretKeyRef` into one Kubernetes Secret (`k8s.secret_name`). The pipeline's working
directory is a shared volume (the PersistentVolumeClaim `k8s.volume_claim`, mounted at the same
path, so relative and absolute paths in stage configs mean the same thing in the pods);
`/dev/shm` is a memory-backed volume for NCCL.

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
    time_limit_seconds,
)

MANIFEST_NAME = "pytorchjob.yaml"
DEFAULT_IMAGE = "lmforge:latest"  # what the repository's Dockerfile says to tag its image
EFA_RESOURCE = "vpc.amazonaws.com/efa"  # the AWS EFA device plugin's resource
API_VERSION = "kubeflow.org/v1"
CONTAINER_NAME = "pytorch"  # the operator finds the port and sets the env on this container
PORT_NAME = "pytorchjob-port"
_DNS_LABEL = re.compile(r"[^a-z0-9-]+")


class K8sLauncher:
    """Renders (and with kubectl, runs) PyTorchJobs.

    What goes into a manifest (image, namespace, volume claim, Secret, memory, GPU and EFA
    requests) comes from each stage's `launcher.k8s` section (`K8sSection`).

    Args:
        python: the interpreter in the image.
        kubectl: the kubectl command.
    """

    name = "k8s"

    def __init__(self, *, python: str = "python", kubectl: str = "kubectl") -> None:
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

    def image_for(self, job: StageJob) -> str:
        """The pod image: `launcher.k8s.image`, else `container_image` written for Pyxis as an
        image reference (`docker://REF` → REF, `REGISTRY#IMAGE` → REGISTRY/IMAGE), else
        `lmforge:latest`. An enroot squashfs file is no image a node can pull: an error."""
        res = job.resources
        if res.k8s.image:
            return res.k8s.image
        given = res.container_image
        if not given:
            return DEFAULT_IMAGE
        if given.startswith(("/", "./", "../", "~")) or given.endswith(".sqsh"):
            raise ConfigError(
                f"stage {job.name}: launcher.container_image = {given!r} is an enroot squashfs "
                "file (Slurm/Pyxis), which Kubernetes cannot pull; set launcher.k8s.image to a "
                "registry image, e.g. the Dockerfile's image pushed as REGISTRY/lmforge:TAG"
            )
        return given.removeprefix("docker://").replace("#", "/", 1)

    def manifest(self, job: StageJob) -> dict[str, Any]:
        """The PyTorchJob for `job`, as a dict (see the module docstring)."""
        res, k8s = job.resources, job.resources.k8s
        leaked = sorted(set(res.env) & set(SECRET_NAMES))
        if leaked:
            raise ConfigError(
                f"stage {job.name}: launcher.env.{leaked[0]} would write a secret into the "
                "manifest; set it in the environment or the secrets file instead"
            )
        _check_efa(job)
        workdir = str(job.workdir.resolve())
        container: dict[str, Any] = {
            "name": CONTAINER_NAME,
            "image": self.image_for(job),
            "imagePullPolicy": "IfNotPresent",
            "command": self.command(job),
            "workingDir": workdir,
            "env": _environment(job),
            "ports": [{"name": PORT_NAME, "containerPort": res.rdzv_port, "protocol": "TCP"}],
            "volumeMounts": [
                {"name": "workdir", "mountPath": workdir},
                {"name": "dshm", "mountPath": "/dev/shm"},
            ],
        }
        resources = _resources(job)
        if resources:
            container["resources"] = resources
        pod_spec: dict[str, Any] = {
            "containers": [container],
            "volumes": [
                {"name": "workdir", "persistentVolumeClaim": {"claimName": k8s.volume_claim}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
            "terminationGracePeriodSeconds": res.signal_lead_s,
        }
        if k8s.image_pull_secrets:
            pod_spec["imagePullSecrets"] = [{"name": name} for name in k8s.image_pull_secrets]
        if k8s.node_selector:
            pod_spec["nodeSelector"] = dict(k8s.node_selector)
        pod = {"metadata": {"labels": self._labels(job)}, "spec": pod_spec}
        restart = "OnFailure" if job.resumable and res.requeue else "Never"
        replicas = {"Master": {"replicas": 1, "restartPolicy": restart, "template": pod}}
        if job.uses_torchrun and res.nodes > 1:
            replicas["Worker"] = {
                "replicas": res.nodes - 1,
                "restartPolicy": restart,
                "template": pod,
            }
        run_policy: dict[str, Any] = {
            "cleanPodPolicy": "None",  # keep finished pods for their logs
            "backoffLimit": 3 if restart == "OnFailure" else 0,
        }
        deadline = time_limit_seconds(res.time) if res.time else None
        if deadline is not None:  # Slurm's --time: the whole job, restarts included
            run_policy["activeDeadlineSeconds"] = deadline
        spec: dict[str, Any] = {"runPolicy": run_policy, "pytorchReplicaSpecs": replicas}
        if job.uses_torchrun:
            spec["nprocPerNode"] = str(res.nproc_per_node)
        metadata: dict[str, Any] = {"name": self.job_name(job), "labels": self._labels(job)}
        if k8s.namespace:
            metadata["namespace"] = k8s.namespace
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
        if secrets:  # once into each Secret the stages read from
            for namespace, secret_name in sorted(
                {(job.resources.k8s.namespace or "", job.resources.k8s.secret_name) for job in jobs}
            ):
                self._apply_secret(secrets, secret_name=secret_name, namespace=namespace or None)
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
            namespace = job.resources.k8s.namespace
            done = self._kubectl("create", "-f", str(path), check=False, namespace=namespace)
            if done.returncode != 0:
                handle.state = JobState.FAILED
                handle.reason = "kubectl create failed: " + _last_line(done.stderr)
                _notify(on_event, handle)
                continue
            # NAMESPACE/NAME when the stage names one, so that `status` finds it later.
            handle.job_id = "/".join(filter(None, (namespace, self.job_name(job))))
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
        namespace, _, name = handle.job_id.rpartition("/")
        done = self._kubectl(
            "get", "pytorchjob", name, "-o", "json", check=False, namespace=namespace or None
        )
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

    def _apply_secret(
        self, secrets: Mapping[str, str], *, secret_name: str, namespace: str | None
    ) -> None:
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": secret_name},
            "type": "Opaque",
            "stringData": dict(secrets),
        }
        if namespace:
            secret["metadata"]["namespace"] = namespace
        # Through stdin only: the values never touch the disk.
        self._kubectl("apply", "-f", "-", input=json.dumps(secret), namespace=namespace)

    def _kubectl(
        self,
        *argv: str,
        check: bool = True,
        input: str | None = None,
        namespace: str | None = None,
    ):
        cmd = [self.kubectl, *(["--namespace", namespace] if namespace else []), *argv]
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


def _environment(job: StageJob) -> list[dict[str, Any]]:
    """The container's env: the stage's variables as values, the secrets by reference only."""
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [{"name": key, "value": str(value)} for key, value in sorted(job.resources.env.items())]
    secret_name = job.resources.k8s.secret_name
    for secret in sorted(job.secrets):
        ref = {"name": secret_name, "key": secret, "optional": True}
        env.append({"name": secret, "valueFrom": {"secretKeyRef": ref}})
    return env


def _resources(job: StageJob) -> dict[str, dict[str, str]]:
    """Requests and limits (quantities as strings, as the core/v1 API types them). GPUs and
    EFA devices are extended resources: their request is their limit."""
    res, k8s = job.resources, job.resources.k8s
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if res.gpus_per_node:
        limits[k8s.gpu_resource] = str(res.gpus_per_node)
    if k8s.efa_devices:
        limits[EFA_RESOURCE] = str(k8s.efa_devices)
    if k8s.memory:
        limits["memory"] = requests["memory"] = k8s.memory
    if res.cpus_per_task:
        requests["cpu"] = str(res.cpus_per_task)
    return {key: value for key, value in (("limits", limits), ("requests", requests)) if value}


def _check_efa(job: StageJob) -> None:
    """A multi-node stage told to use EFA (FI_PROVIDER=efa) must ask for the devices: without
    them the pods get none and NCCL fails or falls back to TCP sockets."""
    res = job.resources
    wants_efa = res.env.get("FI_PROVIDER", "").lower() == "efa"
    if wants_efa and job.uses_torchrun and res.nodes > 1 and not res.k8s.efa_devices:
        raise ConfigError(
            f"stage {job.name}: launcher.env.FI_PROVIDER = 'efa' but launcher.k8s.efa_devices = "
            "0, so the pods get no EFA device; set launcher.k8s.efa_devices (32 on p5.48xlarge, "
            "16 on p5en.48xlarge) or drop FI_PROVIDER"
        )


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
