"""Helpers for the deploy/ and Dockerfile tests: render kustomizations with the real kubectl,
pick objects out of the output, validate them, and read a Dockerfile's stages."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = (
    "deploy",
    "deploy/overlays/monitoring",
    "deploy/overlays/cdi",
    "deploy/overlays/scheduler",
    "deploy/overlays/mps",
    "deploy/overlays/dra",
)
SCHEMA_VERSIONS = ("1.30", "1.37")  # the oldest Kubernetes we claim, and the newest schemas shipped
# resource.k8s.io/v1 is GA from 1.34; consumable capacity (what our slices use) is beta from 1.36.
DRA_SCHEMA_VERSIONS = ("1.36", "1.37")
AGENT = ("DaemonSet", "vcuda-agent")

Doc = dict[str, Any]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` renders deploy/")
    return path


def render(directory: str) -> list[Doc]:
    """``kubectl kustomize`` of a directory relative to the repository root (offline)."""
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / directory)], capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def load_yaml(path: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all((ROOT / path).read_text()) if d]


def one(docs: Iterable[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(daemonset: Doc) -> Doc:
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "the agent pod has one container"
    result: Doc = containers[0]
    return result


def validator() -> Any:
    """The kubernetes-validate package (bundled OpenAPI schemas, no network)."""
    try:
        return importlib.import_module("kubernetes_validate")
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: it is a dev dependency (pip install -e '.[dev]')")


def validate(doc: Doc, versions: Sequence[str] | None = None) -> None:
    """Strict schema validation (unknown fields fail) for every Kubernetes version we claim
    (``versions``; by default SCHEMA_VERSIONS, DRA_SCHEMA_VERSIONS for resource.k8s.io objects)."""
    kv = validator()
    if versions is None:
        dra = str(doc.get("apiVersion", "")).startswith("resource.k8s.io/")
        versions = DRA_SCHEMA_VERSIONS if dra else SCHEMA_VERSIONS
    for version in versions:
        problem = ""
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as err:  # its str() is the whole schema: keep the gist
            where = "/".join(str(p) for p in err.absolute_path)
            problem = f"at {where or '(top)'}: {err.message}"
        if problem:
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            pytest.fail(f"{name} is not a valid Kubernetes {version} object {problem}")


def check_service_monitor(monitor: Doc, service: Doc) -> None:
    """ServiceMonitor is a CRD outside the core schemas: the fields the Prometheus Operator
    needs to find the Service and scrape its metrics port, checked by hand."""
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    assert set(monitor) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}, spec
    selector = spec["selector"]["matchLabels"]
    assert selector and selector.items() <= service["metadata"]["labels"].items(), "selects the Service"
    assert service["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert spec["endpoints"], "at least one endpoint"
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] == "metrics" and "metrics" in port_names
        assert endpoint.get("path", "/metrics") == "/metrics"
        assert re.fullmatch(r"[0-9]+(ms|s|m)", endpoint["interval"]), endpoint["interval"]
        assert set(endpoint) <= _ENDPOINT_FIELDS, set(endpoint) - _ENDPOINT_FIELDS
        if "authorization" in endpoint:  # monitoring.coreos.com/v1 SafeAuthorization
            authorization = endpoint["authorization"]
            assert authorization.get("type", "Bearer") == "Bearer"
            assert set(authorization["credentials"]) == {"name", "key"}


# The Endpoint fields the overlay may use (monitoring.coreos.com/v1; a typo would be dropped
# by the Operator, silently: no scrape, or a scrape without the token).
_ENDPOINT_FIELDS = {
    "port",
    "path",
    "scheme",
    "interval",
    "scrapeTimeout",
    "honorLabels",
    "relabelings",
    "metricRelabelings",
    "authorization",
    "tlsConfig",
    "bearerTokenFile",
}


def mount_for(path: PurePosixPath, mounts: Iterable[Doc]) -> Doc | None:
    """The volumeMount ``path`` is seen through (the longest mountPath that contains it)."""
    best: Doc | None = None
    for mount in mounts:
        root = PurePosixPath(mount["mountPath"])
        if (path == root or root in path.parents) and (
            best is None or len(root.parts) > len(PurePosixPath(best["mountPath"]).parts)
        ):
            best = mount
    return best


def parse_run_args(args: list[str]) -> argparse.Namespace:
    """The DaemonSet's args as the agent's own CLI parses them (after the image's `run`)."""
    from agent.surfaces.cli.main import build_parser  # noqa: PLC0415  (imports the whole CLI)

    return build_parser().parse_args(["run", *args])


def daemonset_metrics_args(directory: str = "deploy") -> list[str]:
    """The DaemonSet's ``--metrics-auth MODE`` (what the agent's API rights and a scrape need)."""
    args: list[str] = container(one(render(directory), *AGENT))["args"]
    at = args.index("--metrics-auth")
    return args[at : at + 2]


def dra_directory_flags() -> dict[str, str]:
    """Every directory option of `vcuda-agent run`'s DRA group (``--dra-registry-dir``,
    ``--dra-plugin-dir``, ``--cdi-dir``, and any added later): flag -> argparse dest."""
    from agent.surfaces.cli.main import build_parser  # noqa: PLC0415

    parser = build_parser()
    assert parser._subparsers is not None
    [subparsers] = [a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)]
    run: argparse.ArgumentParser = subparsers.choices["run"]
    [group] = [g for g in run._action_groups if (g.title or "").startswith("DRA driver")]
    flags = {max(a.option_strings, key=len): a.dest for a in group._group_actions if a.dest.endswith("_dir")}
    assert flags, "the DRA group has no directory options"
    return flags


# ---- Dockerfile ----------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    text: str  # the arguments, continuation lines joined


@dataclass
class Stage:
    base: str  # the image, build args resolved
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def instructions(text: str) -> list[Instruction]:
    """Comments dropped, ``\\`` continuations joined (no heredocs: the Dockerfile has none)."""
    result: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        result.append(Instruction(keyword.upper(), rest.strip()))
    return result


def stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages in order)."""
    global_args: dict[str, str] = {}
    found: list[Stage] = []
    for ins in instructions(text):
        if ins.keyword == "ARG" and not found:
            arg, _, default = ins.text.partition("=")
            global_args[arg] = default
        elif ins.keyword == "FROM":
            words = ins.text.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
            stage_name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            found.append(Stage(base, stage_name))
        elif found:
            found[-1].instructions.append(ins)
    return global_args, found


def apt_packages(stage: Stage) -> list[str]:
    """Packages named by ``apt-get install`` in the stage's RUN instructions."""
    packages: list[str] = []
    for run in stage.all("RUN"):
        for words in shell_commands(run.text):
            if words[:2] == ["apt-get", "install"]:
                assert "--no-install-recommends" in words, f"recommends pull in extras: {words}"
                packages += [w for w in words[2:] if not w.startswith("-")]
    return packages


def shell_commands(text: str) -> list[list[str]]:
    """A RUN line's simple commands (split at ``&&``, ``||``, ``;``, ``|``), quotes respected."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def labels(stage: Stage) -> Mapping[str, str]:
    result: dict[str, str] = {}
    for label in stage.all("LABEL"):
        for word in shlex.split(label.text):
            key, _, value = word.partition("=")
            result[key] = value
    return result
