"""``deploy/kubernetes/`` holds together: schema-valid manifests that wire up pod discovery.

The manifests are what ``kubectl apply -k deploy/kubernetes`` applies: the kustomization's
resources with its namespace and images applied, rendered here the way kustomize renders
them (and compared with ``kubectl kustomize`` where kubectl is installed). They are
validated offline against the Kubernetes OpenAPI schemas ``kubernetes-validate`` ships
(strict: an unknown field is an error), for the oldest and newest releases it knows of
that we claim; then checked for what the daemon needs: pods readable by its service
account, the fleet file from the ConfigMap, and nothing outside the kustomization but what
README.md's "Deploy" section tells the reader to make.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from direct_frontend.fleet.keys import KeySources, process_sources
from direct_frontend.fleet.load import parse_fleet

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
#: the Kubernetes releases the manifests are checked against
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
#: kinds with no namespace, among those a kustomization here may hold
CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding"})


def render(directory: Path) -> list[dict[str, Any]]:
    """The resources ``kustomize build directory`` emits, for the features used here.

    kustomize reads ``resources`` in order; ``namespace`` becomes every namespaced
    resource's namespace, the name of a Namespace resource, and the namespace of a
    RoleBinding's ServiceAccount subjects that name a ServiceAccount of the kustomization;
    each ``images`` entry replaces the name (and tag) of every container image of that name.
    """
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out = [document for resource in kustomization["resources"]
           for document in yaml.safe_load_all((directory / resource).read_text()) if document]
    namespace = kustomization.get("namespace")
    accounts = {d["metadata"]["name"] for d in out if d["kind"] == "ServiceAccount"}
    for document in out:
        metadata = document["metadata"]
        if namespace and document["kind"] == "Namespace":
            metadata["name"] = namespace
        elif namespace and document["kind"] not in CLUSTER_SCOPED:
            metadata["namespace"] = namespace
        for subject in document.get("subjects", []) if namespace else []:
            if subject["kind"] == "ServiceAccount" and subject["name"] in accounts:
                subject["namespace"] = namespace
        pod = document.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name = re.split(r"[:@]", container["image"], maxsplit=1)[0]
            for image in kustomization.get("images", []):
                if image["name"] == name:
                    container["image"] = (f"{image.get('newName', name)}:"
                                          f"{image.get('newTag', 'latest')}")
    return out


def manifests() -> dict[str, dict[str, Any]]:
    """Every resource ``kubectl apply -k deploy/kubernetes`` applies, by kind."""
    out: dict[str, dict[str, Any]] = {}
    for document in render(DEPLOY):
        assert document["kind"] not in out, "one resource of each kind: keyed by kind"
        out[document["kind"]] = document
    return out


def readme_deploy_section() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Deploy\n", 1)[1]
    return section.split("\n## ", 1)[0]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", sorted(manifests()))
def test_each_manifest_is_valid_against_the_kubernetes_schema(kind: str, version: str) -> None:
    kubernetes_validate.validate(manifests()[kind], version, strict=True)


def test_a_bad_manifest_is_caught() -> None:
    """The validation can fail: a misspelt field is refused."""
    broken = manifests()["Service"]
    broken = {**broken, "spec": {**broken["spec"], "prots": broken["spec"]["ports"]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_the_kustomization_applies_every_manifest_of_the_directory() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {path.name for path in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


@pytest.mark.skipif(shutil.which("kubectl") is None,
                    reason="kubectl is not installed: the rendering is not compared with "
                           "kustomize's own")
def test_the_rendering_is_what_kubectl_kustomize_builds() -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    built = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True,
                           text=True, timeout=60, check=True).stdout

    def key(document: dict[str, Any]) -> tuple[str, str]:
        return document["kind"], document["metadata"]["name"]

    theirs = sorted((d for d in yaml.safe_load_all(built) if d), key=key)
    assert sorted(render(DEPLOY), key=key) == theirs


def test_the_rendering_applies_the_namespace_and_the_image(tmp_path: Path) -> None:
    """Another namespace and image reach every place they belong, and only those."""
    shutil.copytree(DEPLOY, tmp_path, dirs_exist_ok=True)
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    kustomization["namespace"] = "elsewhere"
    kustomization["images"] = [{"name": "direct-frontend", "newName": "registry.example/df",
                                "newTag": "1.2"}]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    found = {d["kind"]: d for d in render(tmp_path)}
    assert found["Namespace"]["metadata"]["name"] == "elsewhere"
    assert {d["metadata"].get("namespace") for d in found.values()} == {None, "elsewhere"}
    assert found["RoleBinding"]["subjects"][0]["namespace"] == "elsewhere"
    pod = found["Deployment"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example/df:1.2"


def test_everything_lives_in_the_namespace_it_creates() -> None:
    found = manifests()
    namespace = found["Namespace"]["metadata"]["name"]
    for kind, document in found.items():
        if kind not in CLUSTER_SCOPED:
            assert document["metadata"]["namespace"] == namespace, kind
    assert {s["namespace"] for s in found["RoleBinding"]["subjects"]} == {namespace}


def test_the_deployment_needs_only_the_documented_inputs() -> None:
    """What the pod refers to is in the kustomization, or README's Deploy section makes it."""
    found = manifests()
    deploy = readme_deploy_section()
    assert "kubectl apply -k deploy/kubernetes" in deploy
    pod = found["Deployment"]["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] == found["ConfigMap"]["metadata"]["name"]
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            assert claim == found["PersistentVolumeClaim"]["metadata"]["name"]
            assert claim in deploy  # the reader is told how to put the model files there
    (container,) = pod["containers"]
    for variable in container.get("env", []):
        secret = variable.get("valueFrom", {}).get("secretKeyRef")
        if secret:
            assert re.search(rf"create secret generic {secret['name']}\b.*"
                             rf"--from-(literal|file)={secret['key']}=", deploy, re.S), secret
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    assert "newName" in image and "images:" in deploy  # the reader sets the image built


def test_the_manifests_wire_up_pod_discovery() -> None:
    found = manifests()
    assert set(found) == {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                          "PersistentVolumeClaim", "Deployment", "Service"}
    (rule,) = found["Role"]["rules"]
    # pods.py lists and watches; it never reads one pod by name
    assert rule["resources"] == ["pods"] and sorted(rule["verbs"]) == ["list", "watch"]
    binding = found["RoleBinding"]
    assert binding["roleRef"]["name"] == found["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == found["ServiceAccount"]["metadata"]["name"]
    pod = found["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == found["ServiceAccount"]["metadata"]["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["fleet"]["configMap"]["name"] == found["ConfigMap"]["metadata"]["name"]
    (container,) = pod["containers"]
    assert container["args"] == ["run", "/etc/direct-frontend/fleet.toml"]
    assert found["Service"]["spec"]["selector"] == found["Deployment"]["spec"]["selector"][
        "matchLabels"]


def test_the_configmaps_fleet_file_loads_and_watches_its_own_namespace() -> None:
    found = manifests()
    container = found["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item for item in container.get("env", [])}
    sources = KeySources({name: "sk-from-the-secret" for name in env},
                         process_sources().read_text)
    fleet = parse_fleet(found["ConfigMap"]["data"]["fleet.toml"], Path("/etc/x/fleet.toml"),
                        sources=sources)
    # its API keys come from the variable the Deployment sets from a Secret, never a manifest
    name = fleet.frontend.auth.api_keys_env
    assert name is not None and "secretKeyRef" in env[name]["valueFrom"]
    assert fleet.frontend.auth.api_keys == ("sk-from-the-secret",)
    assert fleet.pools and fleet.frontend.kubernetes.kubeconfig is None  # in-cluster config
    namespace = found["Role"]["metadata"]["namespace"]
    assert {pool.namespace for pool in fleet.pools} == {namespace}
    port = found["Deployment"]["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert fleet.frontend.listen_port == port["containerPort"]
    # the admin endpoints share the Service's port: off, or behind a token
    admin = fleet.frontend.admin
    assert not admin.enabled or admin.token is not None


def test_the_systemd_unit_reads_the_environment_file_of_the_production_example() -> None:
    """production.toml reads its keys from the environment; the unit's EnvironmentFile= has them."""
    unit = (ROOT / "config" / "direct-frontend.service").read_text()
    assert re.search(r"^EnvironmentFile=-/etc/direct-frontend/env$", unit, re.M)
    production = (ROOT / "config" / "examples" / "production.toml").read_text()
    (name,) = re.findall(r'^api_keys_env = "(\w+)"$', production, re.M)
    assert f"{name}=" in (ROOT / "docs" / "systemd.md").read_text()  # the install writes it


def test_the_dockerfile_runs_the_daemon_on_the_deployments_path() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^CMD \["run", "/etc/direct-frontend/fleet.toml"\]$', text, re.M)
    assert re.search(r"^USER 10001$", text, re.M)
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 10001


def dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), one list per stage."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    stages: list[list[str]] = []
    for line in lines:
        if line.startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_the_dockerfile_base_is_an_exact_python_release() -> None:
    text = (ROOT / "Dockerfile").read_text()
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    for stage in dockerfile_stages():
        base = stage[0].split()[1]
        base = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], base)
        # python:3.11.13-slim-bookworm: a patch release on a named Debian, not "3.11-slim"
        assert re.fullmatch(r"python:3\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base), base


def test_the_dependencies_are_installed_before_the_source_is_copied() -> None:
    """A source change must not rebuild or reinstall the dependency wheels (layer cache)."""
    build, runtime = dockerfile_stages()

    def first(stage: list[str], pattern: str) -> int:
        return next(i for i, line in enumerate(stage) if re.search(pattern, line))

    source = first(build, r"^COPY (direct_frontend|protos|\.)\b")
    assert first(build, r"^COPY pyproject\.toml") < first(build, r"pip wheel .*-r ") < source
    assert all(not re.match(r"^COPY (direct_frontend|protos|\.) ", line)
               for line in build[:source])
    assert first(runtime, r"pip install .*/deps/") < first(runtime, r"pip install .*--no-deps")


def test_the_dockerfile_healthcheck_asks_health_with_python(tmp_path: Path) -> None:
    """HEALTHCHECK's command (run here for real) succeeds on a 200 and fails otherwise."""
    (runtime,) = dockerfile_stages()[-1:]
    (check,) = [line for line in runtime if line.startswith("HEALTHCHECK ")]
    command = json.loads(check.split(" CMD ", 1)[1])
    assert command[0] == "python"  # slim images have no curl or wget
    env = dict(re.findall(r"^ENV (\w+)=(\S+)$", "\n".join(runtime), re.M))
    assert urllib.parse.urlsplit(env["HEALTHCHECK_URL"]).path == "/health"

    class Handler(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_GET(self) -> None:
            self.send_response(self.status if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()  # polled often: the stop waits no half second
        url = f"http://127.0.0.1:{server.server_port}/health"
        try:
            results = []
            for status in (200, 503):
                Handler.status = status
                done = subprocess.run([sys.executable, *command[1:]], timeout=30,
                                      env={**os.environ, "HEALTHCHECK_URL": url},
                                      capture_output=True, check=False)
                results.append(done.returncode == 0)
        finally:
            server.shutdown()
    assert results == [True, False]


def test_the_pod_and_the_image_give_the_default_store_a_writable_state_directory() -> None:
    """The default store is SQLite in ``$STATE_DIRECTORY``: under a read-only root (the pod)
    or a home-less user (the image) it must name a writable volume, or the daemon cannot
    start."""
    (deployment,) = [d for d in render(DEPLOY) if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    state = mounts[env["STATE_DIRECTORY"]]
    assert not state.get("readOnly", False)
    volume = next(v for v in pod["volumes"] if v["name"] == state["name"])
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "STATE_DIRECTORY=/var/lib/direct-frontend" in dockerfile
    assert "VOLUME /var/lib/direct-frontend" in dockerfile
    assert "chown 10001 /var/lib/direct-frontend" in dockerfile
