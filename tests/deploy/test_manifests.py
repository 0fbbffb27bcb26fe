"""The Kubernetes manifests in deploy/kuberay/: every YAML file parses; the RayCluster and
RayJobs carry the fields KubeRay's CRDs (ray.io/v1, KubeRay 1.7.0) require and the ones
this setup relies on; every container has requests and limits; the pieces refer to each
other consistently (storage URL, Secret, ConfigMaps, Services, image, Ray version).
"""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from sqlalchemy.engine import make_url

from tests.deploy.deployfiles import (
    DOCKERFILE,
    KUBERAY,
    README,
    ROOT,
    containers,
    dockerfile_stages,
    kuberay_objects,
    load_docs,
    objects_of_kind,
    pod_templates,
    quantity,
    rel,
    yaml_files,
)

RAY_CLUSTERS = objects_of_kind("RayCluster")
RAY_JOBS = objects_of_kind("RayJob")
# Ray's remote URI schemes for working_dir/py_modules (ray._private.runtime_env.protocol,
# Ray 2.60): what a RayJob's submitter can pass on without a local copy of the files.
RAY_REMOTE_SCHEMES = ("http", "https", "s3", "gs", "azure", "abfss", "file")
# RayJob fields that conflict with clusterSelector (KubeRay's ValidateRayJobSpec).
NOT_WITH_CLUSTER_SELECTOR = ("suspend", "backoffLimit")


def _image_repo(image: str) -> str:
    return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image


def _erase_tune_containers():
    return [(w, c, pod) for _, obj in kuberay_objects() for w, c, pod in containers(obj)
            if _image_repo(c["image"]) == "erase-tune"]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


@pytest.mark.parametrize("path", yaml_files(), ids=rel)
def test_yaml_parses(path) -> None:
    docs = load_docs(path)
    assert docs, f"{rel(path)} holds no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{rel(path)}: a document is not a mapping"


def test_every_kubernetes_object_is_named_and_typed() -> None:
    objects = kuberay_objects()
    assert objects
    for path, obj in objects:
        assert obj.get("apiVersion") and obj.get("kind"), f"{rel(path)}: apiVersion and kind"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"]), f"{rel(path)}: metadata.name"
        assert "namespace" not in obj["metadata"], f"{rel(path)}: namespace is the user's choice (kubectl -n)"


# -- RayCluster ---------------------------------------------------------------------------------


def test_one_raycluster_with_the_required_fields() -> None:
    assert len(RAY_CLUSTERS) == 1
    path, rc = RAY_CLUSTERS[0]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    spec = rc["spec"]
    # ray.io/v1 RayClusterSpec: headGroupSpec (with template) is required.
    head = spec["headGroupSpec"]
    assert head["template"]["spec"]["containers"], "headGroupSpec.template needs a container"
    assert isinstance(spec["rayVersion"], str) and spec["rayVersion"].startswith("2.60."), "rayVersion: Ray 2.60.x"
    for group in [head, *spec["workerGroupSpecs"]]:
        # rayStartParams is map[string]string: a bare number would be refused by the API server.
        params = group.get("rayStartParams") or {}
        assert all(isinstance(v, str) for v in params.values()), params


def test_raycluster_worker_groups_are_complete_and_autoscaled() -> None:
    spec = RAY_CLUSTERS[0][1]["spec"]
    groups = spec["workerGroupSpecs"]
    assert groups
    for g in groups:
        # Required by the CRD: groupName, minReplicas, maxReplicas, template.
        for field in ("groupName", "replicas", "minReplicas", "maxReplicas", "template"):
            assert field in g, f"worker group {g.get('groupName')}: {field}"
        assert all(isinstance(g[f], int) for f in ("replicas", "minReplicas", "maxReplicas"))
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
        assert g["maxReplicas"] > g["minReplicas"], f"{g['groupName']}: no room to autoscale"
    assert spec["enableInTreeAutoscaling"] is True
    autoscaler = spec["autoscalerOptions"]
    assert autoscaler.get("version") in ("v1", "v2")
    for kind in ("requests", "limits"):  # the autoscaler is a container KubeRay adds to the head pod
        assert {"cpu", "memory"} <= set(autoscaler["resources"][kind]), f"autoscalerOptions.resources.{kind}"


def test_raycluster_has_a_gpu_group_with_one_gpu_per_pod() -> None:
    spec = RAY_CLUSTERS[0][1]["spec"]
    gpu_groups = []
    for g in spec["workerGroupSpecs"]:
        ray_container = g["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first
        limits = ray_container["resources"]["limits"]
        if "nvidia.com/gpu" in limits:
            gpu_groups.append(g["groupName"])
            assert int(limits["nvidia.com/gpu"]) == 1, "one trial per pod, one GPU per trial"
            requests = ray_container["resources"].get("requests", {})
            assert int(requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"])) == 1, "GPU requests must equal limits"
    assert gpu_groups, "no worker group asks for nvidia.com/gpu"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-cpus") == "0", "trials must not be scheduled on the head"


def test_raycluster_uses_token_auth() -> None:
    spec = RAY_CLUSTERS[0][1]["spec"]
    assert spec["authOptions"]["mode"] == "token"
    # KubeRay refuses token mode below Ray 2.52.0.
    assert tuple(int(x) for x in spec["rayVersion"].split(".")[:2]) >= (2, 52)


# -- every pod -----------------------------------------------------------------------------------


def test_every_container_has_requests_and_limits() -> None:
    seen = 0
    for path, obj in kuberay_objects():
        for where, c, _ in containers(obj):
            seen += 1
            res = c.get("resources") or {}
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind) or {}), f"{rel(path)} {where}: {kind} cpu and memory"
            for name, limit in res["limits"].items():
                request = res["requests"].get(name)
                if request is not None:
                    assert quantity(request) <= quantity(limit), f"{rel(path)} {where}: {name} request above its limit"
    assert seen >= 4  # Ray head, GPU worker, postgres, dashboard


def test_erase_tune_pods_run_as_the_images_non_root_user() -> None:
    user = _dockerfile_user()
    found = _erase_tune_containers()
    assert found
    for where, c, pod in found:
        ctx = {**(pod.get("securityContext") or {}), **(c.get("securityContext") or {})}
        assert ctx.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
        assert str(ctx.get("runAsUser")) == user, f"{where}: runAsUser {ctx.get('runAsUser')}, the image's USER {user}"


def test_all_erase_tune_containers_use_one_image_that_kustomize_sets() -> None:
    images = {c["image"] for _, c, _ in _erase_tune_containers()}
    assert len(images) == 1, images
    (image,) = images
    kustomization = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())
    entry = next(i for i in kustomization["images"] if i["name"] == _image_repo(image))
    assert entry["newTag"] == image.rsplit(":", 1)[1], "kustomization's newTag differs from the manifests' tag"


def test_kustomization_lists_every_long_lived_manifest() -> None:
    kustomization = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in KUBERAY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, f"listed {sorted(listed)}, present {sorted(present)}"
    # Jobs run once each, created by hand: `apply -k` must not start one.
    assert not any(r.startswith("jobs") for r in listed)


# -- RayJobs -------------------------------------------------------------------------------------


def _entrypoint_words(job: dict) -> list[str]:
    return shlex.split(job["spec"]["entrypoint"])


@pytest.mark.parametrize("path,job", RAY_JOBS, ids=[rel(p) for p, _ in RAY_JOBS])
def test_rayjob_required_fields_and_cluster(path, job) -> None:
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert isinstance(spec.get("entrypoint"), str) and spec["entrypoint"].strip(), "spec.entrypoint"
    # KubeRay: one of rayClusterSpec or clusterSelector must be set.
    assert ("rayClusterSpec" in spec) != ("clusterSelector" in spec)
    if "clusterSelector" in spec:
        names = {rc["metadata"]["name"] for _, rc in RAY_CLUSTERS}
        assert spec["clusterSelector"].get("ray.io/cluster") in names, "clusterSelector names no RayCluster here"
        mode = spec.get("submissionMode", "K8sJobMode")
        assert mode in ("K8sJobMode", "HTTPMode"), "SidecarMode needs rayClusterSpec"
        for field in NOT_WITH_CLUSTER_SELECTOR:
            assert not spec.get(field), f"{field} is refused with clusterSelector"


@pytest.mark.parametrize("path,job", RAY_JOBS, ids=[rel(p) for p, _ in RAY_JOBS])
def test_rayjob_entrypoint_is_one_command_for_the_submitters_shell(path, job) -> None:
    """KubeRay pastes the entrypoint unquoted into the submitter's `bash -c "... ray job
    submit ... -- ENTRYPOINT ; ..."`: a top-level && or ; would run the rest in the submitter
    pod instead of as the Ray job, so the two steps go inside one `bash -c '...'`."""
    lexer = shlex.shlex(job["spec"]["entrypoint"], posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    operators = [t for t in lexer if re.fullmatch(r"[;&|()<>]+", t)]
    assert not operators, f"{rel(path)}: shell operators {operators} outside the quoted command"
    words = _entrypoint_words(job)
    assert words[:2] == ["bash", "-c"] and len(words) == 3
    steps = [s.strip() for s in words[2].split("&&")]
    assert steps[0].startswith("erase-tune db upgrade") and steps[1].startswith("erase-tune start")


@pytest.mark.parametrize("path,job", RAY_JOBS, ids=[rel(p) for p, _ in RAY_JOBS])
def test_rayjob_driver_runs_on_the_head(path, job) -> None:
    # Ray places a job's driver on the head only when the job asks for no resources
    # (JobManager, Ray 2.60); the head is where the storage settings and spaces are.
    for field in ("entrypointNumCpus", "entrypointNumGpus", "entrypointResources"):
        assert field not in job["spec"], f"{rel(path)}: {field} would let the driver land on a GPU worker"


@pytest.mark.parametrize("path,job", RAY_JOBS, ids=[rel(p) for p, _ in RAY_JOBS])
def test_rayjob_space_and_code_reach_the_driver(path, job) -> None:
    start = shlex.split(_entrypoint_words(job)[2].split("&&")[1])
    space = start[start.index("--space") + 1]
    runtime_env = yaml.safe_load(job["spec"].get("runtimeEnvYAML") or "{}") or {}
    assert isinstance(runtime_env, dict), "runtimeEnvYAML must be a YAML mapping"
    for uri in [runtime_env.get("working_dir"), *(runtime_env.get("py_modules") or [])]:
        if uri is None:
            continue
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        # The submitter pod has no local copy to upload: only a URI the cluster fetches works.
        assert scheme in RAY_REMOTE_SCHEMES, f"{rel(path)}: {uri!r} is not a remote URI"
        assert re.search(r"\.(zip|whl|tar\.gz|tgz)$", uri), f"{rel(path)}: {uri!r}: Ray takes a .zip, .whl or tarball"
    if space.startswith("/etc/erase-tune/spaces/"):
        # From the ConfigMap the README makes out of search_spaces/, mounted on the head.
        assert (ROOT / "search_spaces" / space.rsplit("/", 1)[1]).is_file(), space
        head = RAY_CLUSTERS[0][1]["spec"]["headGroupSpec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
        volume = next(v for v in head["volumes"] if v["name"] == mounts["/etc/erase-tune/spaces"])
        assert volume["configMap"]["name"] == "erase-tune-spaces"
        assert "kubectl create configmap erase-tune-spaces" in README.read_text()
    else:
        assert not space.startswith("/"), space
        assert runtime_env.get("working_dir"), f"{rel(path)}: relative --space {space} needs a working_dir to be in"


# -- storage, Secret, ConfigMaps, Services ------------------------------------------------------------


def _configmap(name: str) -> dict:
    return next(obj for _, obj in objects_of_kind("ConfigMap") if obj["metadata"]["name"] == name)


def test_storage_url_has_no_password_and_names_the_database_service() -> None:
    users = [(w, c) for w, c, _ in _erase_tune_containers() if "ERASE_TUNE_STORAGE" in _env(c)]
    # The head (driver) and the dashboard read the studies.
    assert {w.split(",")[0] for w, _ in users} >= {"RayCluster erase-tune head", "Deployment erase-tune-dashboard"}
    for where, c in users:
        env = _env(c)
        ref = env["ERASE_TUNE_STORAGE"]["valueFrom"]["configMapKeyRef"]
        url = make_url(_configmap(ref["name"])["data"][ref["key"]])
        assert url.drivername == "postgresql+psycopg" and url.password is None, f"{where}: {url!r}"
        services = {s["metadata"]["name"] for _, s in objects_of_kind("Service")}
        assert url.host in services, f"{where}: {url.host} is no Service here"
        assert url.port == 5432
        pg = env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]
        assert pg == {"name": "erase-tune-db", "key": "password"}, where


def test_every_secret_reference_is_the_one_the_readme_makes() -> None:
    refs = set()
    for _, obj in kuberay_objects():
        for _, c, _ in containers(obj):
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    refs.add((ref["name"], ref["key"]))
    assert refs == {("erase-tune-db", "password")}
    assert "kubectl create secret generic erase-tune-db --from-file=password=" in README.read_text()
    assert not objects_of_kind("Secret"), "no Secret object is shipped: the README makes it with a generated password"


def test_services_select_their_pods() -> None:
    pods = []
    for _, obj in kuberay_objects():
        for where, template in pod_templates(obj):
            pods.append((where, template.get("metadata", {}).get("labels", {}), template["spec"]))
    for path, svc in objects_of_kind("Service"):
        selector = svc["spec"]["selector"]
        matched = [(w, spec) for w, labels, spec in pods if selector.items() <= labels.items()]
        assert len(matched) == 1, f"{rel(path)}: selector {selector} matches {[w for w, _ in matched]}"
        ports = {p["name"]: p["containerPort"] for c in matched[0][1]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{rel(path)}: targetPort {port['targetPort']} is no container port"


def test_dashboard_listens_where_its_service_and_probes_look() -> None:
    (path, dep), = [(p, d) for p, d in objects_of_kind("Deployment") if d["metadata"]["name"] == "erase-tune-dashboard"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    command = c["command"]
    assert command[:2] == ["erase-tune", "dashboard"]
    assert command[command.index("--host") + 1] == "0.0.0.0", "127.0.0.1 would be unreachable through the Service"
    port = int(command[command.index("--port") + 1])
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == port
    assert c["readinessProbe"]["httpGet"]["port"] == "http"
    svc = next(s for _, s in objects_of_kind("Service") if s["metadata"]["name"] == "erase-tune-dashboard")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", "the dashboard has no authentication: not exposed"


def test_ray_version_matches_the_image() -> None:
    stages = dockerfile_stages(DOCKERFILE.read_text())
    args = [i.args for i in stages[-1]["instructions"] if i.keyword == "ARG"]
    ray_version = next(a.split("=", 1)[1] for a in args if a.startswith("RAY_VERSION="))
    for _, rc in RAY_CLUSTERS:
        assert rc["spec"]["rayVersion"] == ray_version


def _dockerfile_user() -> str:
    stages = dockerfile_stages(DOCKERFILE.read_text())
    users = [i.args for i in stages[-1]["instructions"] if i.keyword == "USER"]
    return users[-1].split(":")[0]
