"""scripts/k8s: the KubeRay RayCluster checked against KubeRay's own CRD schema, strictly (an unknown field is an
error, as `kubectl apply --validate=strict` makes it), and kept in step with the Ray version lcap pins.

No Kubernetes cluster runs here: this is what can be checked without one. The schema is the v1 openAPIV3Schema of
rayclusters.ray.io from KubeRay v1.7.0, vendored in tests/data/kuberay (source and licence there). To refresh it:
take ray-operator/config/crd/bases/ray.io_rayclusters.yaml at a KubeRay tag, keep spec.versions[name=v1].schema.
openAPIV3Schema, write it as JSON with a `$comment` naming the tag and commit.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "scripts" / "k8s"
SCHEMA = Path(__file__).resolve().parents[1] / "data" / "kuberay" / "raycluster-v1.schema.json"


def strict(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others (what the API server's strict field
    validation does), except where Kubernetes keeps unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        keeps_unknown = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in out and not keeps_unknown:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validator() -> jsonschema.Validator:
    schema = json.loads(SCHEMA.read_text())
    assert "kuberay" in schema.pop("$comment")
    return jsonschema.Draft7Validator(strict(schema))


def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / "raycluster.yaml").read_text()) if d]


def errors(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(doc)]


def ray_pin() -> str:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    (pin,) = [re.search(r"==([\d.]+)", r)[1] for r in extras if r.startswith("ray[")]
    return pin


def test_the_raycluster_matches_kuberays_schema():
    (cluster,) = [d for d in documents() if d["kind"] == "RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert errors(cluster) == []
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"agents", "policy", "train"}
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the head runs no episode
    assert "sandbox" in groups["agents"]["rayStartParams"]["resources"]
    for name in ("policy", "train"):
        (container,) = groups[name]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    (pvc,) = [d for d in documents() if d["kind"] == "PersistentVolumeClaim"]  # (no core schema vendored)
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("spec", "workerGroupSpecs", 0, "replicaz"), 4, "Additional properties are not allowed ('replicaz'"),
        (("spec", "workerGroupSpecs", 0, "rayStartParams", "num-cpus"), 32, "32 is not of type 'string'"),
        (("spec", "headGroupSpec", "template", "spec", "containers"), "ray-head", "'ray-head' is not of type 'array'"),
    ],
)
def test_the_schema_check_catches_a_broken_manifest(path, value, message):
    (cluster,) = [copy.deepcopy(d) for d in documents() if d["kind"] == "RayCluster"]
    target = cluster
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert any(message in e for e in errors(cluster)), errors(cluster)


def test_the_image_and_the_cluster_run_the_ray_lcap_pins():
    pin = ray_pin()
    (cluster,) = [d for d in documents() if d["kind"] == "RayCluster"]
    assert cluster["spec"]["rayVersion"] == pin
    dockerfile = (K8S / "Dockerfile").read_text()
    assert re.search(rf"^ARG BASE=rayproject/ray:{re.escape(pin)}-py311", dockerfile, re.M)
    images = {
        c["image"]
        for spec in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
        for c in spec["template"]["spec"]["containers"]
    }
    assert len(images) == 1  # one lcap image for every group
