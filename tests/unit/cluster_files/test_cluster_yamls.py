"""Static checks of cluster/: launcher YAMLs, KubeRay manifests, job runtime env, pins.

No Ray runtime is started. Ray's own cluster-config validator (the one `ray up` calls) and its
runtime_env parser run as plain functions.
"""

from __future__ import annotations

import copy
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "cluster"
CLOUDS = ("aws", "gcp", "azure")
KUBERAY = CLUSTER / "kuberay"

BEGIN_SHARED = "# ==== BEGIN SHARED"
END_SHARED = "# ==== END SHARED ===="
# Top-level launcher keys that must not differ between clouds.
SHARED_KEYS = (
    "cluster_name",
    "max_workers",
    "upscaling_speed",
    "idle_timeout_minutes",
    "metadata",
    "auth",
    "docker",
    "file_mounts",
    "cluster_synced_files",
    "file_mounts_sync_continuously",
    "rsync_filter",
    "rsync_exclude",
    "initialization_commands",
    "setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
    "head_node_type",
)

# What each instance type really is: (GPUs, vCPUs, Ray accelerator_type or None).
# Catches a changed instance type whose resources were not updated.
KNOWN_SHAPES: dict[str, tuple[int, int, str | None]] = {
    # AWS
    "m6i.2xlarge": (0, 8, None),
    "p4d.24xlarge": (8, 96, "A100"),
    "p5.48xlarge": (8, 192, "H100"),
    "g5.2xlarge": (1, 8, "A10G"),
    # GCP
    "n2-standard-8": (0, 8, None),
    "a2-highgpu-8g": (8, 96, "A100"),
    "a3-highgpu-8g": (8, 208, "H100"),
    "n1-standard-8+nvidia-tesla-t4": (1, 8, "T4"),
    # Azure
    "Standard_D8s_v5": (0, 8, None),
    "Standard_ND96asr_v4": (8, 96, "A100"),
    "Standard_ND96isr_H100_v5": (8, 96, "H100"),
    "Standard_NC8as_T4_v3": (1, 8, "T4"),
}

SECRET_KEY_PATTERN = re.compile(
    r"SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|API_KEY|PRIVATE|CREDENTIAL|SAS|CONNECTION_STRING",
    re.IGNORECASE,
)
SECRET_VALUE_PATTERNS = (
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key id
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"://[^/\s:@]+:[^/\s@]+@"),  # user:password@ in a URI
    re.compile(r"(?i)(secret|password|token)\s*[:=]\s*['\"]?[A-Za-z0-9/+=_-]{12,}"),
)


# --------------------------------------------------------------------------- helpers


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def launcher() -> dict[str, dict[str, Any]]:
    return {cloud: _load(CLUSTER / f"{cloud}.yaml") for cloud in CLOUDS}


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    # Deliberately no skip: the cluster pins are only meaningful against pyproject.toml.
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def ray_pin(pyproject: dict[str, Any]) -> Requirement:
    reqs = [Requirement(d) for d in pyproject["project"]["dependencies"]]
    ray_reqs = [r for r in reqs if r.name == "ray"]
    assert len(ray_reqs) == 1, "pyproject.toml must depend on ray exactly once"
    return ray_reqs[0]


@pytest.fixture(scope="module")
def ray_version(ray_pin: Requirement) -> str:
    specs = list(ray_pin.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"ray must be pinned with ==, got {ray_pin}"
    return specs[0].version


@pytest.fixture(scope="module")
def cluster_pins() -> dict[str, Requirement]:
    pins: dict[str, Requirement] = {}
    for line in (CLUSTER / "requirements.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert req.name not in pins, f"{req.name} pinned twice in cluster/requirements.txt"
            pins[req.name] = req
    return pins


@pytest.fixture(scope="module")
def runtime_env() -> dict[str, Any]:
    return _load(CLUSTER / "runtime_env.yaml")


@pytest.fixture(scope="module")
def raycluster() -> dict[str, Any]:
    return _load(KUBERAY / "raycluster.yaml")


@pytest.fixture(scope="module")
def rayjob() -> dict[str, Any]:
    return _load(KUBERAY / "rayjob.yaml")


def _shared_block(text: str) -> str:
    start = text.index(BEGIN_SHARED)
    end = text.index(END_SHARED) + len(END_SHARED)
    return text[start:end]


def _shape_key(node_config: dict[str, Any]) -> str:
    if "InstanceType" in node_config:
        return node_config["InstanceType"]
    if "azure_arm_parameters" in node_config:
        return node_config["azure_arm_parameters"]["vmSize"]
    key = node_config["machineType"]
    for acc in node_config.get("guestAccelerators", []):
        if key.startswith("n1-"):  # n1 GPUs are attached, not part of the machine type
            key += "+" + acc["acceleratorType"]
    return key


def _gcp_gpu_count(node_config: dict[str, Any]) -> int:
    return sum(a["acceleratorCount"] for a in node_config.get("guestAccelerators", []))


def _is_spot(node_config: dict[str, Any]) -> bool:
    if node_config.get("InstanceMarketOptions", {}).get("MarketType") == "spot":
        return True
    if node_config.get("scheduling", {}).get("preemptible") is True:
        return True
    if node_config.get("scheduling", {}).get("provisioningModel") == "SPOT":
        return True
    return node_config.get("azure_arm_parameters", {}).get("priority") == "Spot"


def _looks_secret(key: str, value: str) -> bool:
    return bool(SECRET_KEY_PATTERN.search(key)) or any(p.search(str(value)) for p in SECRET_VALUE_PATTERNS)


def _pod_containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group["template"]["spec"]["containers"]


# --------------------------------------------------------------------------- launcher YAMLs


@pytest.mark.parametrize("cloud", CLOUDS)
def test_launcher_config_passes_rays_own_validator(cloud: str, launcher: dict[str, dict]) -> None:
    """What `ray up` does before touching the cloud: prepare_config() then validate_config()."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(launcher[cloud]))
    validate_config(prepared)  # raises jsonschema.ValidationError / ValueError on a bad config
    # prepare_config merged the provider's defaults underneath; ours must have won.
    assert prepared["provider"]["type"] == cloud
    assert prepared["head_start_ray_commands"] == launcher[cloud]["head_start_ray_commands"]
    assert (
        prepared["head_setup_commands"][: len(launcher[cloud]["setup_commands"])]
        == launcher[cloud]["setup_commands"]
    )


def test_rays_validator_rejects_broken_configs(launcher: dict[str, dict]) -> None:
    """Guards the test above: the validator in use does reject bad launcher configs."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    unknown_key = copy.deepcopy(launcher["gcp"])
    unknown_key["max_worker"] = 8  # misspelt
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(unknown_key))

    no_resources = copy.deepcopy(launcher["azure"])
    del no_resources["available_node_types"]["gpu_spot"]["resources"]
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(no_resources))

    too_many_min = copy.deepcopy(launcher["aws"])
    too_many_min["available_node_types"]["gpu_spot"]["min_workers"] = 9
    with pytest.raises(ValueError):
        validate_config(prepare_config(too_many_min))


def test_shared_block_is_byte_identical_across_clouds() -> None:
    blocks = {
        cloud: _shared_block((CLUSTER / f"{cloud}.yaml").read_text(encoding="utf-8")) for cloud in CLOUDS
    }
    assert len(blocks["aws"].splitlines()) > 20
    for cloud in CLOUDS[1:]:
        assert blocks[cloud] == blocks["aws"], f"cluster/{cloud}.yaml's shared block drifted from aws.yaml"


def test_shared_sections_are_identical_after_yaml_load(launcher: dict[str, dict]) -> None:
    shared_block_keys = set(yaml.safe_load(_shared_block((CLUSTER / "aws.yaml").read_text(encoding="utf-8"))))
    assert shared_block_keys == set(SHARED_KEYS)
    for key in SHARED_KEYS:
        values = {cloud: launcher[cloud].get(key) for cloud in CLOUDS}
        assert values["aws"] is not None or key == "docker", key
        assert values["gcp"] == values["aws"] and values["azure"] == values["aws"], f"{key} differs: {values}"
    names = {cloud: list(launcher[cloud]["available_node_types"]) for cloud in CLOUDS}
    assert names["gcp"] == names["aws"] == names["azure"], names


@pytest.mark.parametrize("cloud", CLOUDS)
def test_node_counts_follow_the_elastic_range(cloud: str, launcher: dict[str, dict]) -> None:
    cfg = launcher[cloud]
    meta = cfg["metadata"]["orchestrator"]
    lo, hi = meta["elastic_num_workers"]
    gpus_per_worker = meta["gpus_per_worker"]
    assert lo >= 1 and hi >= lo, (lo, hi)  # read from the launcher YAML

    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head.get("max_workers", 0) == 0 and head.get("min_workers", 0) == 0
    assert head["resources"].get("GPU", 0) == 0, "the head must not host training workers"

    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert len(gpu_types) >= 3
    for name, t in gpu_types.items():
        gpus = t["resources"]["GPU"]
        needed_min = math.ceil(lo * gpus_per_worker / gpus)
        needed_max = math.ceil(hi * gpus_per_worker / gpus)
        assert t["max_workers"] == needed_max, f"{cloud}/{name}: max_workers should be {needed_max}"
        assert t["min_workers"] == 0, f"{cloud}/{name}: idle GPU nodes cost money; keep min_workers 0"
        assert needed_min <= t["max_workers"]
    assert cfg["max_workers"] == max(t["max_workers"] for t in gpu_types.values())
    assert cfg["max_workers"] >= sum(t.get("min_workers", 0) for t in types.values())


@pytest.mark.parametrize("cloud", CLOUDS)
def test_declared_resources_match_the_instance_types(cloud: str, launcher: dict[str, dict]) -> None:
    for name, t in launcher[cloud]["available_node_types"].items():
        key = _shape_key(t["node_config"])
        assert key in KNOWN_SHAPES, f"{cloud}/{name}: unknown shape {key}; add it to KNOWN_SHAPES"
        gpus, vcpus, accel = KNOWN_SHAPES[key]
        res = t["resources"]
        assert res.get("GPU", 0) == gpus, f"{cloud}/{name}"
        assert res["CPU"] == vcpus, f"{cloud}/{name}"
        accel_keys = [k for k in res if k.startswith("accelerator_type:")]
        assert accel_keys == ([f"accelerator_type:{accel}"] if accel else []), f"{cloud}/{name}"
        if cloud == "gcp" and gpus:
            assert _gcp_gpu_count(t["node_config"]) == gpus
            assert t["node_config"]["scheduling"]["onHostMaintenance"] == "TERMINATE"


@pytest.mark.parametrize("cloud", CLOUDS)
def test_exactly_the_spot_type_is_spot(cloud: str, launcher: dict[str, dict]) -> None:
    spot = {name for name, t in launcher[cloud]["available_node_types"].items() if _is_spot(t["node_config"])}
    assert spot == {"gpu_spot"}
    # Each GPU type has its own accelerator, so ScalingConfig(accelerator_type=...) picks one.
    accels = [
        k
        for t in launcher[cloud]["available_node_types"].values()
        for k in t["resources"]
        if k.startswith("accelerator_type:")
    ]
    assert len(accels) == len(set(accels)) == 3


def test_setup_installs_pinned_ray_python_and_requirements(
    launcher: dict[str, dict], ray_version: str
) -> None:
    cfg = launcher["aws"]  # shared block: identical on all clouds (checked above)
    setup = "\n".join(cfg["setup_commands"])
    assert f'"ray[default,train,tune,data]=={ray_version}"' in setup
    assert "--python 3.11" in setup
    assert "-r ~/orchestrator/cluster/requirements.txt" in setup
    assert cfg["file_mounts"]["~/orchestrator"] == "."
    assert ".gitignore" in cfg["rsync_filter"]
    dockerfile = (KUBERAY / "Dockerfile").read_text(encoding="utf-8")
    assert "-r cluster/requirements.txt" in dockerfile
    assert f'"ray[default,train,tune,data]=={ray_version}"' in dockerfile


def test_dashboard_is_loopback_only_and_token_auth_is_on(
    launcher: dict[str, dict], raycluster: dict[str, Any]
) -> None:
    for cloud in CLOUDS:
        cfg = launcher[cloud]
        head = " ".join(cfg["head_start_ray_commands"])
        assert "--dashboard-host=127.0.0.1" in head
        assert "0.0.0.0" not in (CLUSTER / f"{cloud}.yaml").read_text(encoding="utf-8")
        for cmds in (cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]):
            assert "RAY_AUTH_MODE=token" in " ".join(cmds)
        assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    spec = raycluster["spec"]
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP"


# --------------------------------------------------------------------------- versions and pins


def test_installed_ray_is_the_pinned_one(ray_version: str, ray_pin: Requirement) -> None:
    import ray

    assert ray.__version__ == ray_version, "the validator used above must come from the pinned Ray"
    assert {"default", "train", "tune", "data"} <= ray_pin.extras


def test_every_ray_and_python_version_in_cluster_agrees_with_pyproject(
    pyproject: dict[str, Any], ray_version: str
) -> None:
    requires = SpecifierSet(pyproject["project"]["requires-python"])
    assert "3.11" in requires and "3.10" not in requires, "cluster/ targets Python 3.11"

    ray_patterns = (
        re.compile(r"ray\[[a-z,]+\]==([0-9][0-9.]*[0-9])"),
        re.compile(r"rayproject/ray:([0-9][0-9.]*[0-9])"),
        re.compile(r"rayVersion:\s*\"?([0-9][0-9.]*[0-9])"),
        re.compile(r"ray_version:\s*\"?([0-9][0-9.]*[0-9])"),
        re.compile(r"-ray([0-9][0-9.]*[0-9])-"),
    )
    python_patterns = (
        re.compile(r"--python (3\.\d+)"),
        re.compile(r"python_version:\s*\"?(3\.\d+)"),
        re.compile(r"-py3(\d+)\b"),
    )
    must_mention = {"aws.yaml", "gcp.yaml", "azure.yaml", "raycluster.yaml", "rayjob.yaml", "Dockerfile"}
    mentioned = set()
    for path in sorted(p for p in CLUSTER.rglob("*") if p.is_file()):
        text = path.read_text(encoding="utf-8")
        for pattern in ray_patterns:
            for found in pattern.findall(text):
                assert found == ray_version, (
                    f"{path.relative_to(REPO)}: Ray {found}, pyproject pins {ray_version}"
                )
                mentioned.add(path.name)
        for pattern in python_patterns:
            for found in pattern.findall(text):
                version = found if "." in found else f"3.{found}"
                assert version == "3.11", f"{path.relative_to(REPO)}: Python {version}"
    assert must_mention <= mentioned, f"no Ray version found in {must_mention - mentioned}"


def test_every_project_dependency_is_pinned_for_the_cluster(
    pyproject: dict[str, Any], cluster_pins: dict[str, Requirement]
) -> None:
    assert "ray" not in cluster_pins, "nodes bring Ray; a job must not reinstall it"
    for req in cluster_pins.values():
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{req} is not an exact pin"
    for dep in map(Requirement, pyproject["project"]["dependencies"]):
        if dep.name == "ray":
            continue
        assert dep.name in cluster_pins, (
            f"pyproject depends on {dep.name}; pin it in cluster/requirements.txt"
        )
        pinned = list(cluster_pins[dep.name].specifier)[0].version
        assert dep.specifier.contains(pinned, prereleases=True), f"{dep.name}=={pinned} is outside {dep}"


def test_runtime_envs_repeat_the_cluster_pins(
    runtime_env: dict[str, Any], rayjob: dict[str, Any], cluster_pins: dict[str, Requirement]
) -> None:
    expected = [str(r) for r in cluster_pins.values()]
    assert runtime_env["pip"]["packages"] == expected
    job_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert job_env["pip"] == runtime_env["pip"]
    assert job_env["env_vars"] == runtime_env["env_vars"]


# --------------------------------------------------------------------------- runtime_env.yaml


def test_runtime_env_is_accepted_by_ray(runtime_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.runtime_env import RuntimeEnv

    monkeypatch.chdir(REPO)  # working_dir "." is resolved against the submitting shell's cwd
    parsed = RuntimeEnv(**copy.deepcopy(runtime_env))
    assert parsed.working_dir() == "."
    assert parsed.env_vars()["RAY_TRAIN_ENABLE_PRINT_PATCH"] == "0"
    assert parsed.env_vars()["MLFLOW_TRACKING_URI"].startswith("http")
    with pytest.raises(TypeError):  # the parser in use does reject bad input
        RuntimeEnv(**{**runtime_env, "env_vars": {"X": 1}})


def test_runtime_env_excludes_heavy_and_local_paths(runtime_env: dict[str, Any]) -> None:
    from ray._private.runtime_env.packaging import _get_excludes

    excluded = _get_excludes(REPO, runtime_env["excludes"])  # the matcher Ray's upload uses
    for rel in (
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        "data/digits/train/part-0.parquet",
        "runs/digits-mlp/checkpoint_000001/state.pt",
        "mlruns.db",
        ".git/HEAD",
        "pipelines/tmp/shard.parquet",
        "bench/out/report.json",
        "orchestrator/__pycache__/cli.cpython-311.pyc",
    ):
        assert excluded(REPO / rel), f"{rel} would be uploaded with every job"
    for rel in (
        "pyproject.toml",
        "orchestrator/cli.py",
        "pipelines/sources.py",
        "pipelines/data.py",
        "examples/digits.yaml",
        "cluster/runtime_env.yaml",
    ):
        assert not excluded(REPO / rel), f"{rel} must reach the cluster"


def test_runtime_env_upload_of_this_checkout_is_small(runtime_env: dict[str, Any]) -> None:
    from ray._private.runtime_env.packaging import _get_excludes

    excluded = _get_excludes(REPO, runtime_env["excludes"])
    total = 0
    stack = [REPO]
    while stack:
        for path in stack.pop().iterdir():
            if excluded(path) or path.is_symlink():
                continue
            if path.is_dir():
                stack.append(path)
            else:
                total += path.stat().st_size
    assert total < 100 * 2**20, f"working_dir upload would be {total / 2**20:.0f} MiB (Ray refuses 512)"


def test_no_secrets_in_runtime_envs_or_manifests(runtime_env: dict[str, Any], rayjob: dict[str, Any]) -> None:
    # The detector itself must fire on the obvious cases, or this test proves nothing.
    assert _looks_secret("AWS_SECRET_ACCESS_KEY", "x")
    assert _looks_secret("AWS_ACCESS_KEY_ID", "AKIA" + "ABCDEFGHIJKLMNOP")
    assert _looks_secret("DB", "postgresql://mlflow:hunter2@db:5432/mlflow")
    assert not _looks_secret("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")

    envs = [runtime_env, yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])]
    for env in envs:
        for key, value in env["env_vars"].items():
            assert not _looks_secret(key, value), f"{key} looks like a secret; use the credential chain"
    for path in [CLUSTER / "runtime_env.yaml", CLUSTER / "requirements.txt", *CLUSTER.glob("*.yaml")]:
        for pattern in SECRET_VALUE_PATTERNS[:3]:
            assert not pattern.search(path.read_text(encoding="utf-8")), (
                f"{path.name} contains something like a secret"
            )
    for path in KUBERAY.glob("*.yaml"):
        text = path.read_text(encoding="utf-8")
        for pattern in SECRET_VALUE_PATTERNS[:3]:
            assert not pattern.search(text), path.name
        manifest = yaml.safe_load(text)
        spec = manifest["spec"].get("rayClusterSpec", manifest["spec"])
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            for container in _pod_containers(group):
                for var in container.get("env", []):
                    # A secret may reach a pod only by reference (valueFrom: secretKeyRef).
                    assert not ("value" in var and _looks_secret(var["name"], var["value"])), var


# --------------------------------------------------------------------------- KubeRay


def test_raycluster_has_the_required_fields(raycluster: dict[str, Any], ray_version: str) -> None:
    assert raycluster["apiVersion"] == "ray.io/v1"
    assert raycluster["kind"] == "RayCluster"
    spec = raycluster["spec"]
    assert spec["rayVersion"] == ray_version
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert _pod_containers(head)[0]["image"]
    assert "nvidia.com/gpu" not in _pod_containers(head)[0]["resources"].get("limits", {})

    lo, hi = yaml.safe_load(raycluster["metadata"]["annotations"]["orchestrator/elastic-num-workers"])
    groups = spec["workerGroupSpecs"]
    assert groups, "no worker group"
    gpu_groups = [g for g in groups if "nvidia.com/gpu" in _pod_containers(g)[0]["resources"]["limits"]]
    assert gpu_groups, "no GPU worker group"
    for group in gpu_groups:
        limits = _pod_containers(group)[0]["resources"]["limits"]
        gpus = int(limits["nvidia.com/gpu"])
        assert gpus >= 1
        assert 0 == group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["maxReplicas"] == math.ceil(hi / gpus) and math.ceil(lo / gpus) <= group["maxReplicas"]

    images = {c["image"] for g in [head, *groups] for c in _pod_containers(g)}
    assert len(images) == 1, f"one image for head and workers, got {images}"


def test_rayjob_runs_orchestrator_train_on_the_same_cluster_spec(
    rayjob: dict[str, Any], raycluster: dict[str, Any]
) -> None:
    assert rayjob["apiVersion"] == "ray.io/v1"
    assert rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    assert "orchestrator train" in spec["entrypoint"]
    assert "--config" in spec["entrypoint"] and spec["entrypoint"].endswith("examples/digits.yaml")
    assert not re.search(r"&&|\|\||;|\|", spec["entrypoint"]), "the submitter shell would split it"
    assert spec["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" in spec or "rayClusterSpec" in spec
    assert spec["rayClusterSpec"] == raycluster["spec"], "rayjob.yaml's cluster drifted from raycluster.yaml"
    assert (
        rayjob["metadata"]["annotations"]["orchestrator/elastic-num-workers"]
        == raycluster["metadata"]["annotations"]["orchestrator/elastic-num-workers"]
    )


# --------------------------------------------------------------------------- the directory itself


def test_cluster_holds_no_importable_python() -> None:
    assert not list(CLUSTER.rglob("*.py")), "cluster/ is configuration only"


def test_readme_names_the_commands_and_only_existing_files() -> None:
    readme = (CLUSTER / "README.md").read_text(encoding="utf-8")
    for needle in (
        "ray up -y cluster/aws.yaml",
        "ray up -y cluster/gcp.yaml",
        "ray up -y cluster/azure.yaml",
        "ray dashboard cluster/aws.yaml",
        "ray job submit --address http://127.0.0.1:8265 --runtime-env cluster/runtime_env.yaml",
        "ray job logs -f",
        "ray down -y cluster/aws.yaml",
        "kubectl apply -f cluster/kuberay/raycluster.yaml",
        "kubectl apply -f cluster/kuberay/rayjob.yaml",
        "mlflow server",
        "--artifacts-destination",
        "MLFLOW_TRACKING_URI",
        "RAY_AUTH_MODE=token",
    ):
        assert needle in readme, f"cluster/README.md lost: {needle}"
    for ref in set(re.findall(r"(?<![\w/])cluster/[\w./-]*\w", readme)):
        assert (REPO / ref).exists(), f"cluster/README.md names {ref}, which does not exist"
