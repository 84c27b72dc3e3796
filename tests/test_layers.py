"""Layers import only downwards: platform → domain → control → surfaces (docs/architecture.md,
"Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "agent"
# A module may import from its own layer and the ones listed; errors/clock/stopsignal are for everyone.
ALLOWED = {
    "platform": {"platform"},
    "domain": {"platform", "domain"},
    "control": {"platform", "domain", "control", "settings"},
    "surfaces": {"platform", "domain", "control", "surfaces", "settings", "emulators"},
    "emulators": {"platform", "domain", "emulators"},
    "settings": {"domain"},
}
FOUNDATION = {"errors", "clock", "stopsignal", ""}  # "" is `import agent` (the version)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def agent_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "agent" or m.startswith("agent.")}


def modules() -> list[Path]:
    return [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if ("_pb2" not in p.name and p.parent != PACKAGE) or p.stem in ALLOWED
    ]


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    rel = path.relative_to(PACKAGE)
    layer = rel.parts[0].removesuffix(".py")
    allowed = ALLOWED[layer] | FOUNDATION
    bad = sorted(m for m in agent_imports(path) if layer_of(m) not in allowed)
    assert not bad, f"{rel} ({layer}) imports {bad}; {layer} may use only {sorted(allowed - {''})}"


def test_the_check_sees_every_layer() -> None:
    seen = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in modules()}
    assert {"platform", "domain", "control", "surfaces", "emulators", "settings"} <= seen
