"""The deployment files, checked offline: yamllint on every YAML file; every built-in
Kubernetes object validated against the bundled schemas of a recent Kubernetes
(``kubernetes-validate``, strict: unknown fields fail); every kustomization resolves (its
resources, patches, replicas and generated files exist); the probes point at the right
endpoints of the real app; the drain fits the grace period; the Grafana dashboard loads and
queries only metrics the server exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.paths import ROOT

K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.33.0"
CRDS = {"monitoring.coreos.com/v1"}  # custom resources: checked by hand below


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object in deploy/k8s (kustomizations and Helm values aside)."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.name.endswith("-values.yaml"):
            continue
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def test_yamllint_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "yamllint", "-c", str(ROOT / ".yamllint.yaml"),
                           "-s", str(ROOT / "deploy")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(("path", "doc"), manifests(),
                         ids=lambda v: v.name if isinstance(v, Path) else v.get("kind", "?"))
def test_objects_validate_against_kubernetes_schemas(path: Path, doc: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    if doc["apiVersion"] in CRDS:
        return
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def _walk(doc: Any, pointer: str) -> bool:
    for part in pointer.strip("/").split("/"):
        if isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        elif isinstance(doc, dict) and part in doc:
            doc = doc[part]
        else:
            return False
    return True


@pytest.mark.parametrize("kustomization", sorted(K8S.rglob("kustomization.yaml")),
                         ids=lambda p: str(p.parent.relative_to(K8S)))
def test_kustomizations_resolve(kustomization: Path) -> None:
    spec = yaml.safe_load(kustomization.read_text())
    assert spec["kind"] == "Kustomization"
    here = kustomization.parent
    objects: list[dict[str, Any]] = []
    for res in spec.get("resources", []):
        target = (here / res).resolve()
        assert target.exists(), f"{res} does not exist"
        files = [target] if target.is_file() else [target / "kustomization.yaml"]
        if target.is_dir():  # a base: its own resources
            sub = yaml.safe_load(files[0].read_text())
            files = [target / r for r in sub.get("resources", []) if (target / r).is_file()]
        for f in files:
            objects += [d for d in yaml.safe_load_all(f.read_text()) if d]
    for gen in spec.get("configMapGenerator", []):
        for f in gen.get("files", []):
            assert (here / f).is_file()
    for rep in spec.get("replicas", []):
        assert any(o["metadata"]["name"] == rep["name"] for o in objects)
    for patch in spec.get("patches", []):
        tgt = patch["target"]
        matches = [o for o in objects if o["kind"] == tgt["kind"]
                   and o["metadata"]["name"] == tgt["name"]]
        assert matches, f"patch target {tgt} not found"
        for op in yaml.safe_load(patch["patch"]):
            parent = op["path"] if op["op"] == "replace" else op["path"].rsplit("/", 1)[0]
            assert _walk(matches[0], parent), f"{op['path']} not in {tgt}"


def test_probes_drain_and_security() -> None:
    from linserve.server.api.app import create_app
    from linserve.server.settings import Settings

    app = create_app(Settings.model_validate({}))
    paths = set(app.openapi()["paths"])
    (deploy,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "linserve"]
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"  # never 503 in a drain
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["startupProbe"]["httpGet"]["path"] == "/health/ready"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] in paths
    env = {e["name"]: e.get("value") for e in c["env"]}
    grace = float(env["LINSERVE_SHUTDOWN_GRACE_SECONDS"])
    pre_stop = float(re.findall(r"sleep\((\d+)\)", " ".join(
        c["lifecycle"]["preStop"]["exec"]["command"]))[0])
    assert pod["terminationGracePeriodSeconds"] >= grace + pre_stop + 5
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"]
    (pdb,) = by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"] == deploy["spec"]["selector"]
    (ingress,) = by_kind("Ingress")
    notes = ingress["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # SSE
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600


def test_service_monitor_and_autoscaler_match_the_service() -> None:
    (svc,) = [s for s in by_kind("Service") if s["metadata"]["name"] == "linserve"]
    (mon,) = by_kind("ServiceMonitor")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert all(e["port"] in ports and e["path"] == "/metrics" for e in mon["spec"]["endpoints"])
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in exported_metrics()
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    assert values["rules"]["custom"][0]["name"]["as"] == metric


def exported_metrics() -> set[str]:
    """Every series name the server exports (counters with _total, histograms' parts)."""
    from prometheus_client import REGISTRY

    import linserve.server.metrics  # noqa: F401  (registers them)

    names = set()
    for family in REGISTRY.collect():
        for sample in family.samples:
            names.add(sample.name)
        names.add(family.name)
    return names


def test_dashboard_loads_and_queries_real_metrics() -> None:
    dash = json.loads((K8S / "monitoring" / "linserve-dashboard.json").read_text())
    titles = {p["title"] for p in dash["panels"]}
    for wanted in ("Time to first token", "Inter-token latency", "Output tokens/s",
                   "Requests running and waiting", "Prefix-cache hit rate",
                   "Session and prefix-cache bytes"):
        assert wanted in titles
    known = exported_metrics()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b(linserve_[a-z_]+)", target["expr"]):
                assert name in known, f"{panel['title']}: {name} is not exported"


def test_ingress_controller_uses_the_same_affinity_map() -> None:
    values = yaml.safe_load((K8S / "ingress-nginx" / "ingress-nginx-values.yaml").read_text())
    snippet = values["controller"]["config"]["http-snippet"]
    assert snippet == (ROOT / "deploy" / "nginx" / "affinity-map.conf").read_text()
    (ingress,) = by_kind("Ingress")
    key = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
    assert 'map "$http_x_session_id|' in snippet and key.strip("$") in snippet
