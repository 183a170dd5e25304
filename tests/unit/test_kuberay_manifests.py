"""The KubeRay manifests in cluster_configs/ (RayCluster, RayJob, RayService) against KubeRay's own CRDs
(tests/data/kuberay-crds-v1.7.0): each validates against its kind's `openAPIV3Schema`, holds no field the API
server would prune, and carries what vidray needs (labeled groups, token auth, a job config and a serve config
that vidray itself accepts)."""

from __future__ import annotations

import copy
import shlex
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from vidray.config import load_job_config
from vidray.placement import selector_matches
from vidray.serve.app import ServeSettings

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "tests/data/kuberay-crds-v1.7.0"
MANIFESTS = sorted((REPO / "cluster_configs").glob("kuberay*.yaml"))


@cache
def crd_schema(kind: str) -> dict:
    """The `v1` openAPIV3Schema of KubeRay's CRD for `kind` (RayCluster, RayJob, RayService)."""
    # libyaml's loader: the CRDs are 1-1.4 MB each (pure-Python safe_load takes seconds per file)
    crd = yaml.load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=yaml.CSafeLoader)
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def pruned_fields(value, schema: dict, path: str = "") -> list[str]:
    """Paths of the fields in `value` that a Kubernetes API server would prune under the structural `schema`: an
    object key that is not in `properties`, where the schema neither preserves unknown fields
    (`x-kubernetes-preserve-unknown-fields`) nor gives `additionalProperties`."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                found += pruned_fields(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += pruned_fields(item, extra, f"{path}.{key}")
            elif properties is not None or extra is False:
                found.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += pruned_fields(item, schema["items"], f"{path}[{i}]")
    return found


def check_manifest(doc: dict) -> list[str]:
    """Problems of one manifest against its CRD: schema errors (types, enums, required) and pruned fields."""
    schema = crd_schema(doc["kind"])
    problems = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    return problems + [f"{p}: unknown field (the API server would prune it)" for p in pruned_fields(doc, schema)]


def manifest(name: str) -> dict:
    return yaml.safe_load((REPO / "cluster_configs" / name).read_text())


def test_every_kuberay_manifest_is_valid_and_loses_no_field_to_pruning():
    assert {p.name for p in MANIFESTS} == {"kuberay.yaml", "kuberay-rayjob.yaml", "kuberay-rayservice.yaml"}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] == "ray.io/v1", path
            assert check_manifest(doc) == [], path.name


@pytest.mark.parametrize("name, break_it, expected", [
    ("kuberay.yaml", lambda d: d["spec"]["workerGroupSpecs"][0].update(lables={"a": "b"}),
     ".spec.workerGroupSpecs[0].lables: unknown field"),
    ("kuberay-rayjob.yaml", lambda d: d["spec"].update(entrypointNumCPUs=1), ".spec.entrypointNumCPUs: unknown"),
    ("kuberay-rayservice.yaml", lambda d: d["spec"]["rayClusterConfig"].update(authOptions={"mode": "tokens"}),
     "spec.rayClusterConfig.authOptions.mode: 'tokens' is not one of"),
])
def test_the_check_catches_a_misspelt_field_and_a_bad_value(name, break_it, expected):
    doc = copy.deepcopy(manifest(name))
    break_it(doc)
    assert any(expected in problem for problem in check_manifest(doc)), check_manifest(doc)


def groups(cluster_spec: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in cluster_spec["workerGroupSpecs"]}


def test_the_rayjob_trains_a_valid_job_config_on_the_rayclusters_groups_with_its_token():
    cluster, job = manifest("kuberay.yaml"), manifest("kuberay-rayjob.yaml")
    spec = job["spec"]
    assert spec["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = shlex.split(spec["entrypoint"].replace("<bucket>", "my-bucket"))
    assert argv[:4] == ["python", "jobs/train.py", "--config", "jobs/configs/tiny_t2v.yaml"]
    overrides = [a for a in argv[4:] if not a.startswith("--")]
    config = load_job_config(REPO / argv[3], overrides)  # vidray itself accepts every override
    labels = [g["labels"] for g in groups(cluster["spec"]).values()]
    for stage in ("dit", "vae", "text", "decode"):
        selector = getattr(config.placement, stage).label_selector
        assert selector and any(selector_matches(selector, node) for node in labels), stage
    (submitter,) = spec["submitterPodTemplate"]["spec"]["containers"]
    env = {e["name"]: e for e in submitter["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": cluster["metadata"]["name"],
                                                                  "key": "auth_token"}
    head_image = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert submitter["image"] == head_image


def test_the_rayservice_carries_the_serve_app_on_the_rayclusters_groups_with_token_auth():
    cluster, service = manifest("kuberay.yaml"), manifest("kuberay-rayservice.yaml")
    cluster_spec = service["spec"]["rayClusterConfig"]
    assert cluster_spec["authOptions"] == {"mode": "token"} == cluster["spec"]["authOptions"]
    assert cluster_spec["rayVersion"] == cluster["spec"]["rayVersion"]
    assert cluster_spec["headGroupSpec"] == cluster["spec"]["headGroupSpec"]
    serving_groups, training_groups = groups(cluster_spec), groups(cluster["spec"])
    for name, group in serving_groups.items():  # the same labels, image, resources: the two cannot drift apart
        assert group == training_groups[name], name

    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    shipped = yaml.safe_load((REPO / "serve/serve_config.yaml").read_text())
    (app,), (shipped_app,) = serve_config["applications"], shipped["applications"]
    assert app["import_path"] == shipped_app["import_path"] == "serve.app:build_app"
    ServeSettings(**app["args"])  # the app's own settings model (unknown keys refused) accepts the args
    assert app["args"]["auth"] == shipped_app["args"]["auth"]
    names = {d["name"] for d in app["deployments"]}
    assert names == {d["name"] for d in shipped_app["deployments"]}
    labels = [g["labels"] for g in serving_groups.values()]
    for deployment in app["deployments"]:
        selector = deployment["ray_actor_options"].get("label_selector")
        if deployment["name"] == "VideoIngress":
            continue
        assert selector and any(selector_matches(selector, node) for node in labels), deployment["name"]
    denoiser = next(d for d in app["deployments"] if d["name"] == "Denoiser")
    assert denoiser["max_ongoing_requests"] >= app["args"]["policy"]["max_batch_size"]
    for container in [*cluster_spec["headGroupSpec"]["template"]["spec"]["containers"],
                      *(c for g in serving_groups.values() for c in g["template"]["spec"]["containers"])]:
        (env,) = [e for e in container["env"] if e["name"] == "VIDRAY_API_TOKEN"]
        assert env["valueFrom"]["secretKeyRef"]["name"] == "vidray-api-token"
