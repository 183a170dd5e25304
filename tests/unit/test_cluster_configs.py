"""The cluster configs in cluster_configs/: the launcher YAML passes Ray's own schema, both configs give every
stage's label selector (the overrides their headers document) exactly one node type, and images, Ray versions and
labels agree with what vidray pins and places on."""

from __future__ import annotations

import ast
import json
import re
import shlex
import urllib.parse
from importlib import resources
from pathlib import Path

import pytest
import ray
import yaml

from vidray.config import load_job_config
from vidray.placement import STAGES, selector_matches

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "cluster_configs"


def _launcher() -> dict:
    return yaml.safe_load((CONFIGS / "aws.yaml").read_text())


def _kuberay() -> dict:
    return yaml.safe_load((CONFIGS / "kuberay.yaml").read_text())


def _node_type_labels(name: str) -> dict[str, dict[str, str]]:
    """{node type or worker group: its Ray node labels} of a config (the head has none)."""
    if name == "aws.yaml":
        return {t: dict(spec.get("labels") or {}) for t, spec in _launcher()["available_node_types"].items()}
    spec = _kuberay()["spec"]
    return {"head": {}, **{g["groupName"]: dict(g.get("labels") or {}) for g in spec["workerGroupSpecs"]}}


def _documented_overrides(name: str) -> list[str]:
    """The `section.key=value` overrides of the `ray job submit` command in a config's header comment."""
    header = [line[1:].strip() for line in (CONFIGS / name).read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(header) if "ray job submit" in line)
    command = ""
    for line in header[start:]:
        command += " " + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            break
    words = shlex.split(command)
    return [w for w in words[words.index("--config") + 2:] if "=" in w]


def test_launcher_config_passes_rays_own_schema():
    import jsonschema

    schema = json.loads(resources.files("ray.autoscaler").joinpath("ray-schema.json").read_text())
    jsonschema.validate(_launcher(), schema)
    # What `ray up` runs on it (ray.autoscaler._private: private, so a Ray upgrade that changes it fails here).
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_launcher()))
    config = _launcher()
    assert ".gitignore" in config["rsync_filter"]  # `ray up` would copy .venv/ and outputs/ to every node
    assert config["head_node_type"] in config["available_node_types"]
    assert config["available_node_types"]["head"]["resources"] == {"CPU": 0}  # no stage work on the head


@pytest.mark.parametrize("name", ["aws.yaml", "kuberay.yaml"])
def test_each_stage_of_the_documented_job_lands_on_exactly_one_node_type(name):
    overrides = _documented_overrides(name)
    assert any(o.startswith("placement.dit.label_selector=") for o in overrides), overrides
    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", overrides)
    labels = _node_type_labels(name)
    assert job.scaling.use_gpu and job.placement.vae.num_gpus > 0 and job.placement.text.num_gpus > 0  # on the GPUs
    expected = {"dit": "dit", "vae": "vae", "text": "vae", "decode": "decode"}
    for stage in STAGES:
        selector = getattr(job.placement, stage).label_selector
        matched = [t for t, node_labels in labels.items() if selector_matches(selector, node_labels)]
        assert matched == [expected[stage]], (stage, selector, matched)
    # Serve's documented pin of a stage (serve/serve_config.yaml), applied to the file's real Denoiser
    # deployment, passes Serve's schema and selects the dit node type.
    options = _serve_pinned_denoiser_options()
    assert [t for t, node_labels in labels.items() if selector_matches(options["label_selector"], node_labels)] == ["dit"]


def _serve_pinned_denoiser_options() -> dict:
    """The Denoiser's `ray_actor_options` of serve/serve_config.yaml with the documented cluster pin applied (the
    `ray_actor_options: {...}` example of its comment, parsed as YAML), checked by Ray Serve's own schema."""
    from ray.serve.schema import RayActorOptionsSchema, ServeDeploySchema

    text = (REPO / "serve/serve_config.yaml").read_text()
    config = yaml.safe_load(text)
    ServeDeploySchema.model_validate(config)  # the laptop config as shipped
    (example,) = [line.split("#", 1)[1].strip() for line in text.splitlines()
                  if line.strip().startswith("#") and "ray_actor_options:" in line]
    pin = yaml.safe_load(example)["ray_actor_options"]
    assert set(pin) <= set(RayActorOptionsSchema.model_fields), pin  # Serve's schema lets a misspelt key through
    (app,) = config["applications"]
    (denoiser,) = [d for d in app["deployments"] if d["name"] == "Denoiser"]
    denoiser["ray_actor_options"] = {**denoiser["ray_actor_options"], **pin}
    ServeDeploySchema.model_validate(config)  # the selector's type (a dict of strings)
    return denoiser["ray_actor_options"]


def test_the_shipped_serve_config_places_no_deployment_by_label():
    # On a laptop (no labels) a label_selector leaves its replica pending for ever (NOTES.md): the shipped
    # config's real deployments carry none; the cluster pin is the documented example, checked above.
    (app,) = yaml.safe_load((REPO / "serve/serve_config.yaml").read_text())["applications"]
    assert {d["name"] for d in app["deployments"]} == {"VideoIngress", "TextEncoder", "Denoiser", "VaeDecoder"}
    assert all("label_selector" not in d.get("ray_actor_options", {}) for d in app["deployments"])


def test_kuberay_groups_carry_stage_labels_gpus_and_one_image():
    spec = _kuberay()["spec"]
    assert _kuberay()["apiVersion"] == "ray.io/v1" and _kuberay()["kind"] == "RayCluster"
    assert spec["rayVersion"] == ray.__version__
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    images = {c["image"] for c in spec["headGroupSpec"]["template"]["spec"]["containers"]}
    gpus = {}
    for group in spec["workerGroupSpecs"]:
        assert 0 == group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        assert group["labels"] == {"vidray.io/stage": group["groupName"]}
        (container,) = group["template"]["spec"]["containers"]
        images.add(container["image"])
        requests = container["resources"]["requests"]
        assert requests == container["resources"]["limits"], group["groupName"]  # guaranteed QoS: no eviction
        gpus[group["groupName"]] = int(requests.get("nvidia.com/gpu", 0))
    assert len(images) == 1, images
    assert gpus["dit"] >= 1 and gpus["vae"] >= 1 and gpus["decode"] == 0


def test_images_are_rays_at_the_pinned_version():
    base = re.search(r"^FROM (\S+)$", (CONFIGS / "Dockerfile").read_text(), re.M).group(1)
    assert base == _launcher()["docker"]["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"
    pinned = re.search(r'"ray\[[a-z,]+\]==([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert pinned == ray.__version__


def test_the_image_copies_what_pip_install_and_the_kuberay_entrypoints_need():
    """The Dockerfile's COPY sources exist, and hold pyproject.toml, its readme, every package its setuptools
    config finds, the job script the RayJob's entrypoint runs and the Serve app module the RayService imports."""
    import tomllib

    dockerfile = (CONFIGS / "Dockerfile").read_text()
    copied = set()
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        sources = [w for w in line.split() if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
        copied.update(sources)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"]}
    includes = project["tool"]["setuptools"]["packages"]["find"]["include"]
    needed |= {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()
               and any(re.fullmatch(pattern.replace("*", ".*"), p.name) for pattern in includes)}
    entrypoint = yaml.safe_load((CONFIGS / "kuberay-rayjob.yaml").read_text())["spec"]["entrypoint"]
    needed.add(re.search(r"python (\S+\.py)", entrypoint).group(1).split("/")[0])
    service = yaml.safe_load(yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())["spec"]["serveConfigV2"])
    needed |= {app["import_path"].split(".")[0] for app in service["applications"]}
    assert "vidray" in needed and "serve" in needed and "jobs" in needed
    assert needed <= copied, f"the image lacks {sorted(needed - copied)}"


def _access_stack() -> dict:
    return yaml.safe_load((CONFIGS / "aws-access.yaml").read_text())


def test_the_launcher_names_the_access_stacks_group_and_profiles_so_ray_creates_neither(monkeypatch):
    """Ray 2.60's launcher, given no SecurityGroupIds, creates a group with SSH from 0.0.0.0/0, and given no head
    IamInstanceProfile, a role with AmazonEC2FullAccess + AmazonS3FullAccess: its own bootstrap steps, run on the
    shipped config in moto's mock AWS, create neither."""
    import boto3
    from moto import mock_aws
    from ray.autoscaler._private.aws import config as aws_config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    launcher = _launcher()
    stack = _access_stack()
    cluster = stack["Parameters"]["ClusterName"]["Default"]
    assert launcher["cluster_name"] == cluster
    profiles = {name: spec["node_config"].get("IamInstanceProfile")
                for name, spec in launcher["available_node_types"].items()}
    assert profiles.pop(launcher["head_node_type"]) == {"Name": f"{cluster}-head"}
    assert set(map(str, profiles.values())) == {str({"Name": f"{cluster}-worker"})}, profiles
    assert stack["Resources"]["HeadProfile"]["Properties"]["InstanceProfileName"] == {"Fn::Sub": "${ClusterName}-head"}
    assert stack["Resources"]["WorkerProfile"]["Properties"]["InstanceProfileName"] == {
        "Fn::Sub": "${ClusterName}-worker"}
    for name, spec in launcher["available_node_types"].items():
        assert spec["node_config"].get("SecurityGroupIds") == ["sg-VIDRAY"], name  # the documented placeholder
    with mock_aws():
        config = {**launcher, "head_node": {}}
        config = aws_config._configure_iam_role(config)
        config = aws_config._configure_security_group(config)
        ec2 = boto3.client("ec2", region_name=launcher["provider"]["region"])
        groups = ec2.describe_security_groups()["SecurityGroups"]
        assert [g["GroupName"] for g in groups] == ["default"]  # none created, so no SSH from 0.0.0.0/0
        assert boto3.client("iam", region_name="us-east-1").list_roles()["Roles"] == []
    assert "0.0.0.0/0" not in yaml.safe_dump(launcher)  # nor any rule of its own


def test_the_access_stack_opens_ssh_to_the_given_cidr_only_and_grants_one_bucket_prefix(monkeypatch):
    """cluster_configs/aws-access.yaml passes cfn-lint (no error or warning), refuses 0.0.0.0/0 (its pattern and its
    rule; no default), and deployed into moto's mock AWS gives SSH from SshCidr alone, the rest only between the
    nodes, S3 only under Bucket/Prefix, EC2 and iam:PassRole (of the worker role) to the head only."""
    import boto3
    import cfnlint.api
    from moto import mock_aws

    text = (CONFIGS / "aws-access.yaml").read_text()
    problems = [str(m) for m in cfnlint.api.lint_all(text) if m.rule.id[0] in "EW"]
    assert problems == []
    stack = _access_stack()
    ssh = stack["Parameters"]["SshCidr"]
    assert "Default" not in ssh
    assert re.fullmatch(ssh["AllowedPattern"], "203.0.113.7/32") and re.fullmatch(ssh["AllowedPattern"], "10.0.0.0/8")
    for wide in ("0.0.0.0/0", "0.0.0.0/1", "1.2.3.4/0"):
        assert not re.fullmatch(ssh["AllowedPattern"], wide), wide
    (assertion,) = stack["Rules"]["NoOpenSsh"]["Assertions"]
    assert assertion["Assert"] == {"Fn::Not": [{"Fn::Equals": [{"Ref": "SshCidr"}, "0.0.0.0/0"]}]}

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        ec2 = boto3.client("ec2", region_name="us-west-2")
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        cloudformation = boto3.client("cloudformation", region_name="us-west-2")
        params = {"SshCidr": "203.0.113.7/32", "VpcId": vpc, "Bucket": "my-bucket", "Prefix": "vidray/"}
        cloudformation.create_stack(StackName="vidray-access", TemplateBody=text, Capabilities=["CAPABILITY_NAMED_IAM"],
                                    Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in params.items()])
        outputs = {o["OutputKey"]: o["OutputValue"]
                   for o in cloudformation.describe_stacks(StackName="vidray-access")["Stacks"][0]["Outputs"]}
        (group,) = ec2.describe_security_groups(GroupIds=[outputs["SecurityGroupId"]])["SecurityGroups"]
        opened = [(r["IpProtocol"], r.get("FromPort"), r.get("ToPort"), [x["CidrIp"] for x in r["IpRanges"]])
                  for r in group["IpPermissions"] if r["IpRanges"] or r.get("Ipv6Ranges")]
        assert opened == [("tcp", 22, 22, ["203.0.113.7/32"])]
        internal = [r for r in group["IpPermissions"] if not r["IpRanges"]]
        assert [[p["GroupId"] for p in r["UserIdGroupPairs"]] for r in internal] == [[group["GroupId"]]]
        iam = boto3.client("iam", region_name="us-east-1")
        assert {outputs["HeadInstanceProfile"], outputs["WorkerInstanceProfile"]} == {"vidray-head", "vidray-worker"}
        statements = {}
        for role in ("vidray-head", "vidray-worker"):
            statements[role] = []
            for name in iam.list_role_policies(RoleName=role)["PolicyNames"]:
                document = iam.get_role_policy(RoleName=role, PolicyName=name)["PolicyDocument"]
                if isinstance(document, str):  # moto 5.2 keeps a CloudFormation-made policy as its Python repr
                    document = ast.literal_eval(urllib.parse.unquote(document))
                statements[role] += document["Statement"]
        worker_role = iam.get_role(RoleName="vidray-worker")["Role"]["Arn"]
    for role, granted in statements.items():
        for statement in granted:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            assert not any(a in ("*", "s3:*", "ec2:*", "iam:*") for a in actions), (role, actions)
            if any(a.startswith("s3:") for a in actions):
                assert statement["Resource"] in ("arn:aws:s3:::my-bucket/vidray/*", "arn:aws:s3:::my-bucket"), statement
            if role == "vidray-worker":
                assert all(a.startswith("s3:") for a in actions), actions  # a worker launches nothing
            if "iam:PassRole" in actions:
                assert statement["Resource"] == worker_role
            if "ec2:TerminateInstances" in actions:
                assert statement["Condition"] == {"StringEquals": {"ec2:ResourceTag/ray-cluster-name": "vidray"}}
    assert any("ec2:RunInstances" in s["Action"] for s in statements["vidray-head"])


def test_both_clusters_run_with_rays_token_auth_and_give_serving_its_token():
    # A new user's trial: neither config turned Ray's token auth on, and `ray start --head` without RAY_AUTH_MODE=token
    # starts a cluster that runs jobs for anyone who reaches its dashboard.
    launcher = _launcher()
    starts = launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
    assert all(c.startswith("RAY_AUTH_MODE=token ray start") for c in starts if "ray start" in c), starts
    assert launcher["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"
    spec = _kuberay()["spec"]
    assert spec["authOptions"] == {"mode": "token"}
    containers = [*spec["headGroupSpec"]["template"]["spec"]["containers"],
                  *(c for g in spec["workerGroupSpecs"] for c in g["template"]["spec"]["containers"])]
    for container in containers:
        (env,) = [e for e in container["env"] if e["name"] == "VIDRAY_API_TOKEN"]
        assert env["valueFrom"]["secretKeyRef"]["name"] == "vidray-api-token"
    serve_config = yaml.safe_load((REPO / "serve/serve_config.yaml").read_text())
    assert serve_config["applications"][0]["args"]["auth"]["token_env"] == "VIDRAY_API_TOKEN"


def test_the_autoscalers_limit_is_read_from_the_cluster_yaml(tmp_path, monkeypatch):
    """Ray 2.60's autoscaler reports no node types to the GCS (tests/integration/test_autoscaler.py), so vidray
    reads the cluster YAML: `VIDRAY_AUTOSCALER_CONFIG`, else `ray up`'s `~/ray_bootstrap_config.yaml`."""
    import math

    from vidray.errors import UserError
    from vidray.runtime import AUTOSCALER_CONFIG_ENV, autoscaler_config_path, cluster_yaml_max_resources

    # The shipped launcher YAML leaves worker resources to the instance types: CPU unbounded.
    assert cluster_yaml_max_resources(REPO / "cluster_configs" / "aws.yaml") == {"CPU": math.inf}
    config = {"max_workers": 9, "head_node_type": "head", "available_node_types": {
        "head": {"resources": {"CPU": 0}, "max_workers": 0},
        "vae": {"resources": {"CPU": 4, "GPU": 1}, "max_workers": 2},
        "dit": {"resources": {"CPU": 8, "GPU": 8}},  # the file's max_workers: 9
    }}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cluster_yaml_max_resources(path) == {"CPU": 2 * 4 + 9 * 8, "GPU": 2 * 1 + 9 * 8}
    config["available_node_types"] = {"head": {"resources": {"CPU": 4}}}
    path.write_text(yaml.safe_dump(config))
    assert cluster_yaml_max_resources(path) is None  # no type can add a node: a fixed cluster

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(AUTOSCALER_CONFIG_ENV, raising=False)
    assert autoscaler_config_path() is None
    (tmp_path / "ray_bootstrap_config.yaml").write_text("{}")
    assert autoscaler_config_path() == tmp_path / "ray_bootstrap_config.yaml"
    monkeypatch.setenv(AUTOSCALER_CONFIG_ENV, str(path))
    assert autoscaler_config_path() == path
    monkeypatch.setenv(AUTOSCALER_CONFIG_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(UserError, match=r"VIDRAY_AUTOSCALER_CONFIG='.*missing.yaml' names no file"):
        autoscaler_config_path()
    path.write_text("- a list")
    with pytest.raises(UserError, match=r"cluster.yaml' is no mapping"):
        cluster_yaml_max_resources(path)


@pytest.mark.parametrize("name", ["kuberay.yaml", "kuberay-rayservice.yaml"])
def test_both_kuberay_configs_keep_the_serve_job_store_on_a_claim_that_outlives_the_head_pod(name):
    """Issue 44 part 4: the job store (sqlite + mp4s) on the head pod's disk died with the pod. Both KubeRay
    configs mount the standalone PersistentVolumeClaim of serve-store-pvc.yaml (not an emptyDir or an ephemeral
    claim, which go with the pod) on the head, and the RayService's app keeps its store_dir on it."""
    doc = yaml.safe_load((CONFIGS / name).read_text())
    spec = doc["spec"].get("rayClusterConfig", doc["spec"])
    pod = spec["headGroupSpec"]["template"]["spec"]
    claim = yaml.safe_load((CONFIGS / "serve-store-pvc.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
    on_claim = [path for path, volume in mounts.items()
                if volume.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]]
    assert on_claim == ["/data/vidray-serve"], mounts
    if "serveConfigV2" in doc["spec"]:
        (app,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
        assert app["args"]["store_on"] == "head"
        assert Path(app["args"]["store_dir"]).is_relative_to(on_claim[0])
    else:  # the RayCluster's header tells `serve deploy` users to put store_dir there
        assert f"args.store_dir: {on_claim[0]}" in (CONFIGS / name).read_text()
