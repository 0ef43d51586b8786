"""deploy/: the Dockerfile and the KubeRay manifests, parsed and checked field by field.

kubeconform is a Go binary that no package registry here offers (PyPI, npm and Debian have no
`kubeconform`), so the manifests are checked in Python instead:
* the ray.io/v1 RayCluster / RayJob fields KubeRay requires, with the types its CRDs declare
  (ray-operator/apis/ray/v1: headGroupSpec{template, rayStartParams}, workerGroupSpecs[]{groupName,
  minReplicas, maxReplicas, rayStartParams, template}, rayStartParams values are strings) and the
  rules of its validation (at least one container per group, no rayStartParams `labels`,
  min <= replicas <= max, a RayJob needs rayClusterSpec or clusterSelector, TTL >= 0, ...);
* the pod templates, the ConfigMap and the PVC against the Kubernetes OpenAPI schemas bundled
  in the `kubernetes-validate` package, when it is installed;
* what vlcurate needs: a GPU worker group, the shared volume and the config on every pod, a
  config that vlcurate's own loader accepts, the same Ray version as the image.
The checker is itself tested on broken manifests, so that it cannot pass vacuously.
"""
from __future__ import annotations

import ast
import copy
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from vlcurate.pipeline import config as C

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE = DEPLOY / "kuberay"
KUBE_S3 = DEPLOY / "kuberay-s3"

QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)"
                      r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(\d+(\.\d*)?|\.\d+)))?$")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
VOLUME_SOURCES = {"persistentVolumeClaim", "configMap", "emptyDir", "secret", "hostPath", "nfs",
                  "csi", "projected", "ephemeral"}


def docs(name: str, folder: Path = KUBE) -> list[dict]:
    return [d for d in yaml.safe_load_all((folder / name).read_text()) if d]


def kind(name: str, k: str, folder: Path = KUBE) -> dict:
    found = [d for d in docs(name, folder) if d.get("kind") == k]
    assert len(found) == 1, f"{name}: expected one {k}"
    return found[0]


# --- a checker for the KubeRay ray.io/v1 fields ------------------------------------------------
def check_pod_template(t, where: str) -> list[str]:
    errs: list[str] = []
    spec = (t or {}).get("spec") if isinstance(t, dict) else None
    if not isinstance(spec, dict):
        return [f"{where}.template.spec: required mapping"]
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return [f"{where}: at least one container is required"]
    volumes = spec.get("volumes") or []
    vnames = [v.get("name") for v in volumes]
    if len(set(vnames)) != len(vnames):
        errs.append(f"{where}: duplicate volume names {vnames}")
    for v in volumes:
        if len(VOLUME_SOURCES & set(v)) != 1:
            errs.append(f"{where}: volume {v.get('name')} needs exactly one source")
    for i, c in enumerate(containers):
        cw = f"{where}.containers[{i}]"
        if not isinstance(c.get("name"), str) or not DNS1123.match(c["name"]):
            errs.append(f"{cw}.name: a DNS-1123 label is required")
        if not isinstance(c.get("image"), str) or not c["image"]:
            errs.append(f"{cw}.image: required")
        res = c.get("resources") or {}
        for section in ("limits", "requests"):
            for k, q in (res.get(section) or {}).items():
                if not isinstance(q, (str, int)) or not QUANTITY.match(str(q)):
                    errs.append(f"{cw}.resources.{section}.{k}: not a quantity: {q!r}")
        gpu = [res.get(s, {}).get("nvidia.com/gpu") for s in ("limits", "requests")]
        if gpu[0] is not None and not str(gpu[0]).isdigit():
            errs.append(f"{cw}: nvidia.com/gpu must be a whole number")
        if gpu[1] is not None and gpu[1] != gpu[0]:
            errs.append(f"{cw}: nvidia.com/gpu request must equal its limit")
        for p in c.get("ports") or []:
            if not isinstance(p.get("containerPort"), int) or not 0 < p["containerPort"] < 65536:
                errs.append(f"{cw}: bad containerPort {p}")
            if "name" in p and (len(p["name"]) > 15 or not DNS1123.match(p["name"])):
                errs.append(f"{cw}: port name {p['name']!r} must be a DNS label of <= 15 chars")
        paths = []
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in vnames:
                errs.append(f"{cw}: volumeMount {m.get('name')!r} names no volume")
            if not str(m.get("mountPath", "")).startswith("/"):
                errs.append(f"{cw}: mountPath must be absolute: {m.get('mountPath')!r}")
            paths.append(m.get("mountPath"))
        if len(set(paths)) != len(paths):
            errs.append(f"{cw}: duplicate mountPath")
        for e in c.get("env") or []:
            if not isinstance(e.get("name"), str) or \
                    ("value" in e and not isinstance(e["value"], str)):
                errs.append(f"{cw}: env entries need a name and a string value: {e}")
    for tol in spec.get("tolerations") or []:
        if tol.get("operator", "Equal") not in ("Exists", "Equal") or \
                tol.get("effect", "NoSchedule") not in ("NoSchedule", "PreferNoSchedule",
                                                        "NoExecute"):
            errs.append(f"{where}: bad toleration {tol}")
    return errs


def check_start_params(p, where: str, has_group_resources: bool = False) -> list[str]:
    if not isinstance(p, dict):
        return [f"{where}.rayStartParams: required mapping (may be empty)"]
    errs = [f"{where}.rayStartParams.{k}: values must be strings, got {v!r}"
            for k, v in p.items() if not isinstance(v, str)]
    if "labels" in p:
        errs.append(f"{where}.rayStartParams: 'labels' is not supported")
    if has_group_resources and any(p.get(k) for k in ("num-cpus", "num-gpus", "memory",
                                                      "resources")):
        errs.append(f"{where}: resources set both in rayStartParams and in resources")
    return errs


def check_raycluster_spec(spec, where: str = "spec") -> list[str]:
    if not isinstance(spec, dict):
        return [f"{where}: required mapping"]
    errs: list[str] = []
    if "rayVersion" in spec and not isinstance(spec["rayVersion"], str):
        errs.append(f"{where}.rayVersion: must be a string")
    if "enableInTreeAutoscaling" in spec and not isinstance(spec["enableInTreeAutoscaling"], bool):
        errs.append(f"{where}.enableInTreeAutoscaling: must be a boolean")
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        return errs + [f"{where}.headGroupSpec: required"]
    errs += check_start_params(head.get("rayStartParams"), f"{where}.headGroupSpec",
                               "resources" in head)
    errs += check_pod_template(head.get("template"), f"{where}.headGroupSpec")
    groups = spec.get("workerGroupSpecs", [])
    if not isinstance(groups, list):
        return errs + [f"{where}.workerGroupSpecs: must be a list"]
    names = [g.get("groupName") for g in groups]
    if len(set(names)) != len(names):
        errs.append(f"{where}.workerGroupSpecs: duplicate groupName")
    for i, g in enumerate(groups):
        gw = f"{where}.workerGroupSpecs[{i}]"
        if not isinstance(g.get("groupName"), str) or not g["groupName"]:
            errs.append(f"{gw}.groupName: required")
        for k in ("minReplicas", "maxReplicas"):
            if not isinstance(g.get(k), int) or isinstance(g.get(k), bool) or g[k] < 0:
                errs.append(f"{gw}.{k}: required non-negative integer")
        lo, hi = g.get("minReplicas"), g.get("maxReplicas")
        if isinstance(lo, int) and isinstance(hi, int):
            if lo > hi:
                errs.append(f"{gw}: minReplicas > maxReplicas")
            r = g.get("replicas", lo)
            if not isinstance(r, int) or not lo <= r <= hi:
                errs.append(f"{gw}.replicas: must lie in [minReplicas, maxReplicas]")
        errs += check_start_params(g.get("rayStartParams"), gw, "resources" in g)
        errs += check_pod_template(g.get("template"), gw)
    return errs


def check_rayjob(job) -> list[str]:
    errs: list[str] = []
    if job.get("apiVersion") != "ray.io/v1" or job.get("kind") != "RayJob":
        errs.append("apiVersion/kind must be ray.io/v1 RayJob")
    name = (job.get("metadata") or {}).get("name", "")
    if not DNS1035.match(name) or len(name) > 47:
        errs.append("metadata.name: a DNS-1035 label of <= 47 characters")
    spec = job.get("spec") or {}
    if not isinstance(spec.get("entrypoint"), str) or not spec["entrypoint"].strip():
        errs.append("spec.entrypoint: required (K8sJobMode submits it)")
    if spec.get("submissionMode", "K8sJobMode") not in ("K8sJobMode", "HTTPMode", "InteractiveMode",
                                                          "SidecarMode"):
        errs.append("spec.submissionMode: unknown")
    if spec.get("rayClusterSpec") is None and not spec.get("clusterSelector"):
        errs.append("spec: one of rayClusterSpec or clusterSelector must be set")
    for k, lo in (("ttlSecondsAfterFinished", 0), ("backoffLimit", 0),
                  ("activeDeadlineSeconds", 1)):
        if k in spec and (not isinstance(spec[k], int) or spec[k] < lo):
            errs.append(f"spec.{k}: an integer >= {lo}")
    if not isinstance(spec.get("shutdownAfterJobFinishes", False), bool):
        errs.append("spec.shutdownAfterJobFinishes: must be a boolean")
    if spec.get("suspend") and not spec.get("shutdownAfterJobFinishes"):
        errs.append("spec: suspend needs shutdownAfterJobFinishes")
    if "runtimeEnvYAML" in spec:
        try:
            env = yaml.safe_load(spec["runtimeEnvYAML"])
            if env is not None and not isinstance(env, dict):
                errs.append("spec.runtimeEnvYAML: must be a YAML mapping")
        except yaml.YAMLError as e:
            errs.append(f"spec.runtimeEnvYAML: not YAML: {e}")
    if spec.get("rayClusterSpec") is not None:
        errs += check_raycluster_spec(spec["rayClusterSpec"], "spec.rayClusterSpec")
    return errs


# --- the manifests -------------------------------------------------------------------------------
def pods(spec: dict) -> dict[str, dict]:
    out = {"head": spec["headGroupSpec"]["template"]["spec"]}
    out.update({g["groupName"]: g["template"]["spec"] for g in spec.get("workerGroupSpecs", [])})
    return out


def test_raycluster_has_the_fields_kuberay_requires_and_a_gpu_group():
    rc = kind("raycluster.yaml", "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    assert DNS1035.match(rc["metadata"]["name"]) and len(rc["metadata"]["name"]) <= 47
    assert check_raycluster_spec(rc["spec"]) == []
    gpu_groups = [g for g in rc["spec"]["workerGroupSpecs"]
                  if int(g["template"]["spec"]["containers"][0]["resources"]["limits"]
                         .get("nvidia.com/gpu", 0)) >= 1]
    assert [g["groupName"] for g in gpu_groups] == ["gpu"]
    tolerations = gpu_groups[0]["template"]["spec"]["tolerations"]
    assert any(t.get("key") == "nvidia.com/gpu" for t in tolerations)
    # the head schedules no work; the driver runs there
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_rayjob_runs_vlcurate_on_the_same_cluster_spec():
    job = kind("rayjob.yaml", "RayJob")
    assert check_rayjob(job) == []
    assert job["spec"]["entrypoint"] == "vlcurate run /config/config.yaml"
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert env == {"env_vars": {"RAY_AUTH_MODE": "disabled"}}
    rc = kind("raycluster.yaml", "RayCluster")
    assert job["spec"]["rayClusterSpec"] == rc["spec"]


def test_every_pod_mounts_the_shared_volume_and_the_config():
    shared = {d["kind"]: d for d in docs("shared.yaml")}
    pvc, cm = shared["PersistentVolumeClaim"], shared["ConfigMap"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert QUANTITY.match(pvc["spec"]["resources"]["requests"]["storage"])
    for spec in (kind("raycluster.yaml", "RayCluster")["spec"],
                 kind("rayjob.yaml", "RayJob")["spec"]["rayClusterSpec"]):
        for group, pod in pods(spec).items():
            vols = {v["name"]: v for v in pod["volumes"]}
            mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
            for path in ("/runs", "/data", "/models", "/config", "/dev/shm"):
                assert path in mounts, f"{group}: {path} not mounted"
            for path in ("/runs", "/data", "/models"):
                src = vols[mounts[path]["name"]]
                assert src["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"], group
            assert not mounts["/runs"].get("readOnly"), f"{group}: /runs must be writable"
            assert vols[mounts["/config"]["name"]]["configMap"]["name"] == cm["metadata"]["name"]
            assert vols[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory"}
            images = {c["image"] for c in pod["containers"]}
            assert images == {"ghcr.io/example/vlcurate:0.1.0"}


def test_the_configmap_config_loads_and_points_at_the_shared_volume(tmp_path):
    cm = next(d for d in docs("shared.yaml") if d["kind"] == "ConfigMap")
    assert set(cm["data"]) == {"config.yaml"}
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    cfg = C.load(path, [])            # vlcurate's own loader: unknown keys and bad types fail
    assert cfg.run.run_dir.startswith("/runs/")
    assert cfg.source.path.startswith("/data/")
    assert cfg.ray.address is None    # `ray job submit` sets RAY_ADDRESS
    assert cfg.recaption.resources.num_gpus == 1 and cfg.embed.resources.num_gpus == 0.5


def test_ray_version_agrees_with_the_image():
    rc = kind("raycluster.yaml", "RayCluster")
    pins = re.findall(r"ray\[[a-z,]+\]==([\d.]+)", (DEPLOY / "Dockerfile").read_text())
    assert pins == [rc["spec"]["rayVersion"]]


@pytest.mark.parametrize("break_it, message", [
    (lambda s: s["headGroupSpec"].pop("template"), "headGroupSpec.template.spec: required"),
    (lambda s: s["headGroupSpec"].pop("rayStartParams"), "rayStartParams: required mapping"),
    (lambda s: s["workerGroupSpecs"][1].pop("groupName"), "groupName: required"),
    (lambda s: s["workerGroupSpecs"][1].__setitem__("minReplicas", 9), "minReplicas > maxReplicas"),
    (lambda s: s["workerGroupSpecs"][0]["rayStartParams"].__setitem__("num-cpus", 4),
     "values must be strings"),
    (lambda s: s["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["resources"]["limits"]
     .__setitem__("nvidia.com/gpu", "0.5"), "nvidia.com/gpu must be a whole number"),
    (lambda s: s["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["resources"]["limits"]
     .__setitem__("memory", "96 GB"), "not a quantity"),
    (lambda s: s["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["volumeMounts"]
     .append({"name": "nope", "mountPath": "/x"}), "names no volume"),
    (lambda s: s["workerGroupSpecs"][0]["template"]["spec"].__setitem__("containers", []),
     "at least one container"),
    (lambda s: s["headGroupSpec"]["rayStartParams"].__setitem__("labels", "a=b"), "'labels'"),
])
def test_the_checker_catches_broken_clusters(break_it, message):
    spec = copy.deepcopy(kind("raycluster.yaml", "RayCluster")["spec"])
    break_it(spec)
    errs = check_raycluster_spec(spec)
    assert any(message in e for e in errs), errs


def test_the_checker_catches_broken_jobs():
    job = copy.deepcopy(kind("rayjob.yaml", "RayJob"))
    job["spec"].pop("rayClusterSpec")
    job["spec"]["ttlSecondsAfterFinished"] = -1
    job["spec"]["runtimeEnvYAML"] = "- a list"
    job["metadata"]["name"] = "Vlcurate_Run"
    errs = check_rayjob(job)
    assert len(errs) == 4, errs


def test_core_objects_against_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    version = "1.30.0"
    for d in docs("shared.yaml"):
        kv.validate(d, version, strict=True)
    for name, spec in (("raycluster", kind("raycluster.yaml", "RayCluster")["spec"]),
                       ("rayjob", kind("rayjob.yaml", "RayJob")["spec"]["rayClusterSpec"])):
        for group, pod in pods(spec).items():   # each pod template as the Pod it becomes
            kv.validate({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": f"{name}-{group}"}, "spec": pod}, version,
                        strict=True)
    with pytest.raises(kv.ValidationError):
        bad = copy.deepcopy(pods(kind("raycluster.yaml", "RayCluster")["spec"])["gpu"])
        bad["containers"][0]["resources"]["limits"]["cpu"] = {"many": 8}
        kv.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": bad},
                    version, strict=True)


# --- the variant whose run directory is a bucket (deploy/kuberay-s3) ----------------------------
def s3_job() -> dict:
    return kind("rayjob.yaml", "RayJob", KUBE_S3)


def test_the_s3_rayjob_is_the_same_cluster_without_a_shared_volume():
    job = s3_job()
    assert check_rayjob(job) == []
    assert job["spec"]["entrypoint"] == "vlcurate run /config/config.yaml"
    posix = kind("rayjob.yaml", "RayJob")["spec"]["rayClusterSpec"]
    spec = job["spec"]["rayClusterSpec"]
    assert {k: v for k, v in spec.items() if k not in ("headGroupSpec", "workerGroupSpecs")} == \
        {k: v for k, v in posix.items() if k not in ("headGroupSpec", "workerGroupSpecs")}
    config = {d["kind"]: d for d in docs("config.yaml", KUBE_S3)}
    sa, cm = config["ServiceAccount"], config["ConfigMap"]
    for group, pod in pods(spec).items():
        twin = pods(posix)[group]
        c, tc = pod["containers"][0], twin["containers"][0]
        assert (c["image"], c["resources"], pod.get("tolerations")) == \
            (tc["image"], tc["resources"], twin.get("tolerations")), group
        assert not any("persistentVolumeClaim" in v for v in pod["volumes"]), group
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert set(mounts) == {"/config", "/dev/shm"}, group
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols[mounts["/config"]]["configMap"]["name"] == cm["metadata"]["name"]
        # credentials only from the standard chains: the pod identity, or an optional Secret
        assert pod["serviceAccountName"] == sa["metadata"]["name"], group
        assert c["envFrom"] == [{"secretRef": {"name": "vlcurate-s3", "optional": True}}], group
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["AWS_REGION"] and not {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"} & set(env)


def test_the_s3_config_loads_with_its_run_directory_in_a_bucket(tmp_path):
    from vlcurate.foundation import storage
    cm = next(d for d in docs("config.yaml", KUBE_S3) if d["kind"] == "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    cfg = C.load(path, [])
    assert storage.scheme(cfg.run.run_dir) == "s3" and storage.scheme(cfg.source.path) == "s3"
    assert storage.redact(cfg.run.run_dir) == cfg.run.run_dir      # no credentials in it
    posix = next(d for d in docs("shared.yaml") if d["kind"] == "ConfigMap")
    (tmp_path / "posix.yaml").write_text(posix["data"]["config.yaml"])
    base = C.to_dict(C.load(tmp_path / "posix.yaml", []))
    mine = C.to_dict(cfg)
    for d in (base, mine):          # the same config but for where the data lives
        d["run"].pop("run_dir"), d["source"].pop("path")
    assert mine == base


def test_s3_objects_against_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for d in docs("config.yaml", KUBE_S3):
        kv.validate(d, "1.30.0", strict=True)
    for group, pod in pods(s3_job()["spec"]["rayClusterSpec"]).items():
        kv.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"s3-{group}"},
                     "spec": pod}, "1.30.0", strict=True)


# --- the Dockerfile ------------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        buf += " " + s[:-1] if s.endswith("\\") else " " + s
        if not s.endswith("\\"):
            ins, _, args = buf.strip().partition(" ")
            out.append((ins.upper(), " ".join(args.split())))
            buf = ""
    return out


def package_tops() -> tuple[str, ...]:
    """The top-level folders setup.py collects the installed packages from (its ``TOPS``)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == "TOPS")


def test_dockerfile_cuda_base_project_extras_and_debian_packages():
    steps = dockerfile()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in steps if i == "ARG" and "=" in a}
    frm = [a for i, a in steps if i == "FROM"]
    assert len(frm) == 1
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], frm[0])
    assert re.match(r"^nvidia/cuda:\d+\.\d+(\.\d+)?-(cudnn-)?runtime-ubuntu\d\d\.\d\d$", base), base
    run = " ".join(a for i, a in steps if i == "RUN")
    apt = re.search(r"apt-get install -y --no-install-recommends (.*?) &&", run).group(1).split()
    for pkg in ("python3", "python3-venv", "tesseract-ocr", "wordnet-base", "wget"):
        assert pkg in apt
    assert 'pip install ".[gpu,ocr]" "ray[default,data]==' in run
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert {"gpu", "ocr"} <= set(extras)
    copied = [src for i, a in steps if i == "COPY" for src in a.split()[:-1]]
    assert {"pyproject.toml", "setup.py", "README.md", *package_tops()} <= set(copied)
    for src in copied:
        assert (REPO / src).exists(), src
    assert ("USER", "1000") in steps
    assert not any(i == "ADD" for i, _ in steps)
    assert "curl " not in run and "wget http" not in run   # nothing fetched outside registries
    env = " ".join(a for i, a in steps if i == "ENV")
    assert "RAY_AUTH_MODE=disabled" in env and "PATH=/opt/venv/bin:$PATH" in env


# --- the scripts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["submit.sh", "local_cluster.sh"])
def test_scripts_parse_and_submit_vlcurate(script):
    path = DEPLOY / script
    assert path.stat().st_mode & 0o111, "executable"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text()
    assert re.search(r"ray job submit --address \"\$\w+\" --working-dir \"\$\w+\"", text)
    if script == "submit.sh":
        assert '-- vlcurate run "$CONFIG" "$@"' in text
    else:
        assert "ray stop" not in text.replace("bare `ray stop`", "")
        assert "ray start --head" in text and 'ray start --address "127.0.0.1:' in text
    if shutil.which("shellcheck"):
        assert subprocess.run(["shellcheck", str(path)]).returncode == 0


def test_submit_sh_needs_an_address():
    r = subprocess.run([str(DEPLOY / "submit.sh"), "cfg.yaml"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "RAY_ADDRESS" in r.stderr
