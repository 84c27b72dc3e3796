"""The Dockerfile, checked statically: two stages, no build tools in the final one, the BPF
sources where the DaemonSet says they are, OCI labels, `vcuda-agent run` as the entrypoint,
and exact Python pins that satisfy pyproject.toml. The image itself is built and run as the
DaemonSet runs it in test_image_run.py."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import tomllib
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.integration.deploy_render import (
    AGENT,
    ROOT,
    Stage,
    apt_packages,
    container,
    labels,
    one,
    parse_run_args,
    render,
    stages,
)

BUILD_TOOLS = re.compile(
    r"^(build-essential|gcc(-\d+)?|g\+\+(-\d+)?|cpp(-\d+)?|clang(-\d+)?|make|cmake|ninja-build|"
    r"libc6?-dev|python3(\.\d+)?-dev|linux-headers-.*|bpfcc-tools|libbpfcc-dev|llvm(-\d+)?(-dev)?)$"
)
CONSTRAINTS = ROOT / "requirements.lock"
FREEZE = ROOT / "deploy/image/freeze_constraints.py"


def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    return stages((ROOT / "Dockerfile").read_text())


def pyproject() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data


def pins() -> dict[str, str]:
    result: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"{line!r}: the image installs exact versions only"
            result[canonicalize_name(name)] = version.strip()
    return result


def test_two_stages_on_a_debian_base_pinned_by_tag() -> None:
    args, found = dockerfile()
    assert len(found) == 2
    build, final = found
    assert build.name == "build" and final.name is None
    assert build.base == final.base == args["BASE_IMAGE"] == "debian:bookworm-slim"
    # Only the venv crosses from the build stage.
    assert [c.text for c in final.all("COPY") if "--from=" in c.text] == [
        "--from=build /opt/vcuda-agent /opt/vcuda-agent"
    ]


def test_the_final_stage_has_bcc_from_debian_and_no_build_tools() -> None:
    _, (build, final) = dockerfile()
    packages = apt_packages(final)
    assert set(packages) == {"python3", "python3-bpfcc"}
    assert not [p for p in apt_packages(build) + packages if BUILD_TOOLS.match(p)]
    assert BUILD_TOOLS.match("build-essential") and BUILD_TOOLS.match("gcc-12")  # the check bites
    runs = " ".join(r.text for r in final.all("RUN"))
    assert "pip install" not in runs, "nothing is installed from PyPI in the final stage"
    assert "/usr/lib/python3/dist-packages/bcc" in runs, "Debian's bcc linked into the venv"


def test_the_bpf_sources_are_where_the_daemonset_looks() -> None:
    _, (_, final) = dockerfile()
    [copy] = [c for c in final.all("COPY") if c.text.split()[0].rstrip("/") == "bpf"]
    destination = copy.text.split()[1].rstrip("/")
    args = container(one(render("deploy"), *AGENT))["args"]
    assert parse_run_args(args).bpf_dir == destination
    # The package's own default (<site-packages>/bpf, agent/settings.py) resolves there too.
    runs = " ".join(r.text for r in final.all("RUN"))
    assert f'ln -s {destination} "$site/bpf"' in runs
    sources = {p.name for p in (ROOT / "bpf").glob("*.c")}
    assert {"ioctl_tracer.c", "device_guard.c", "memquota_lsm.c"} <= sources


def test_oci_labels_and_version() -> None:
    _, (_, final) = dockerfile()
    found = labels(final)
    prefix = "org.opencontainers.image."
    for key in ("title", "description", "source", "licenses", "version", "revision"):
        assert found.get(prefix + key), f"missing label {prefix + key}"
    assert found[prefix + "licenses"] == pyproject()["project"]["license"]
    assert found[prefix + "version"] == "${VERSION}"
    [version_arg] = [a.text for a in final.all("ARG") if a.text.startswith("VERSION=")]
    version = pyproject()["project"]["version"]
    assert version_arg == f"VERSION={version}"
    image = container(one(render("deploy"), *AGENT))["image"]
    assert image == f"ghcr.io/vcuda-agent/vcuda-agent:{version}", "the manifest deploys this version"


def test_the_entrypoint_is_vcuda_agent_run() -> None:
    _, (_, final) = dockerfile()
    [entrypoint] = final.all("ENTRYPOINT")
    assert json.loads(entrypoint.text) == ["vcuda-agent", "run"]
    [env] = [e for e in final.all("ENV") if "PATH=" in e.text]
    assert "PATH=/opt/vcuda-agent/bin:$PATH" in shlex.split(env.text)
    scripts = pyproject()["project"]["scripts"]
    assert scripts["vcuda-agent"] == "agent.surfaces.cli.main:main"


def test_python_packages_are_pinned_exactly_and_satisfy_pyproject() -> None:
    _, (build, _) = dockerfile()
    assert any(c.keyword == "COPY" and "requirements.lock" in c.text for c in build.instructions)
    assert any("PIP_CONSTRAINT=/src/requirements.lock" in r.text for r in build.all("RUN"))
    pinned = pins()
    project = pyproject()
    needed = [Requirement(r) for r in project["project"]["dependencies"]]
    needed += [Requirement(r) for r in project["build-system"]["requires"]]
    for req in needed:
        version = pinned.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is not pinned in {CONSTRAINTS.name}"
        assert req.specifier.contains(version, prereleases=True), f"{req.name}=={version} breaks {req}"


def test_the_venv_is_the_lock_and_the_lock_covers_every_package() -> None:
    """The tests run on what the image installs: the venv (make setup, through the same lock)
    holds exactly the locked versions, and every package the agent and its dev tools install
    is locked (a dependency's new dependency would come in unpinned: refresh with make lock)."""
    spec = importlib.util.spec_from_file_location("freeze_constraints", FREEZE)
    assert spec is not None and spec.loader is not None
    freeze = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(freeze)
    installed: dict[str, str] = freeze.locked_closure()
    pinned = pins()
    drift = {n: (v, pinned[n]) for n, v in installed.items() if n in pinned and pinned[n] != v}
    assert not drift, f"this venv is not the lock's (installed, locked): {drift}; run make setup"
    missing = set(installed) - set(pinned)
    assert not missing, f"not locked: {sorted(missing)}; run make lock"
    runtime = set(freeze.runtime_closure())
    assert runtime <= set(pinned), "the image's packages are locked too"


@pytest.mark.parametrize("line", ["RUN apt-get install -y gcc", "RUN apt-get install -y python3"])
def test_the_apt_parser_insists_on_no_install_recommends(line: str) -> None:
    _, [stage] = stages(f"FROM debian:bookworm-slim\n{line}\n")
    with pytest.raises(AssertionError, match="recommends"):
        apt_packages(stage)
