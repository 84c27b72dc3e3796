"""Print requirements.lock: the exact versions the venv and the image install (``make lock``).

The pins are the dependency closure of the installed ``vcuda-agent`` distribution: its
``[project] dependencies`` and its ``dev`` extra, recursively (a requirement's own extras
followed), with environment markers evaluated for this interpreter, which matches the
image's (CPython 3.11 on Linux), taken from the environment this runs in, plus the build
backend. Both consumers read it as a pip constraints file (``PIP_CONSTRAINT``): ``make setup``
installs the package with its dev tools, the image only the runtime part; pip installs
nothing a constraint names unless something requires it. Hashes are left out: pip checks
them only in its hash-checking mode, which refuses the local project itself (an editable
install in the venv, a source directory in the image).

    make lock          # a fresh venv with the newest allowed versions, frozen into requirements.lock
    .venv/bin/python deploy/image/freeze_constraints.py > requirements.lock   # this venv's versions
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "vcuda-agent"
BUILD_BACKEND = "setuptools"  # [build-system] requires; pip builds the wheel in isolation
HEADER = """\
# The one lock: exact versions for the venv (make setup) and the image (Dockerfile), both
# through PIP_CONSTRAINT, so that the tests test what the image runs. The dependency closure
# of pyproject.toml (runtime and the dev extra) plus setuptools, the build backend.
# Refresh: make lock (deploy/image/freeze_constraints.py).
# tests/integration/test_deploy_image.py checks the pins against pyproject.toml and the venv.
"""


def runtime_closure(project: str = PROJECT) -> dict[str, str]:
    """Canonical name → installed version, for every package ``project`` needs at run time."""
    return closure(project, ())


def locked_closure(project: str = PROJECT) -> dict[str, str]:
    """What the lock pins: the runtime closure and the dev extra's."""
    return closure(project, ("dev",))


def closure(project: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Canonical name → installed version, for ``project`` with ``extras``, recursively."""
    found: dict[str, str] = {}
    expanded: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), extras) for r in distribution(project).requires or []]
    while todo:
        req, wanted = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
            continue  # extras not asked for, and other platforms' dependencies
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in expanded:
            continue
        expanded.add((name, frozenset(req.extras)))
        try:
            dist = distribution(req.name)
        except PackageNotFoundError as err:
            raise SystemExit(f"{req.name} (needed by {project}) is not installed here") from err
        found[name] = dist.version
        todo += [(Requirement(r), tuple(req.extras)) for r in dist.requires or []]
    return found


def main() -> int:
    pins = locked_closure()
    pins[BUILD_BACKEND] = distribution(BUILD_BACKEND).version
    sys.stdout.write(HEADER + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
