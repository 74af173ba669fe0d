"""``deploy/kubernetes/`` holds together: schema-valid manifests that wire up pod discovery.

Validated offline against the Kubernetes OpenAPI schemas ``kubernetes-validate``
ships (strict: an unknown field is an error), for the oldest and newest
releases it knows of that we claim; then checked for what the daemon needs:
pods readable by its service account, the fleet file from the ConfigMap.
"""

from __future__ import annotations

import re
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


def manifests() -> dict[str, dict[str, Any]]:
    """Every resource of deploy/kubernetes/, by kind."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                out[document["kind"]] = document
    return out


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


def test_the_manifests_wire_up_pod_discovery() -> None:
    found = manifests()
    assert set(found) == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment",
                          "Service"}
    (rule,) = found["Role"]["rules"]
    assert rule["resources"] == ["pods"] and sorted(rule["verbs"]) == ["get", "list", "watch"]
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
