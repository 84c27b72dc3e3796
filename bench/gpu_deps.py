"""The agent's own dependencies for bench/gpu_suite.py's enforcement stage (grpcio, kubernetes,
prometheus-client, ...), which a GPU machine's Python may lack (it has PyTorch and pynvml,
not this project installed): checked in a child with the suite's PYTHONPATH, then installed
from local wheels (``--wheels``, default ``<repo>/.whl``), or else, where pip reaches a
package index, into a private directory put on PYTHONPATH; failing that the stage is skipped
with the reason. Nothing is installed into the machine's own Python.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# Import name -> distribution, for the agent process and the emulators in this one.
AGENT_MODULES = {
    "grpc": "grpcio",
    "google.protobuf": "protobuf",
    "kubernetes": "kubernetes",
    "prometheus_client": "prometheus-client",
    "yaml": "PyYAML",
    "pyroute2": "pyroute2",
}
CHECK = """
import importlib, importlib.util, json, sys
missing = []
for name in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    if not found:
        missing.append(name)
error = None
if not missing:
    try:
        import agent.emulators.enforcednode, agent.surfaces.cli.main
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
print(json.dumps({"missing": missing, "error": error}))
"""


def _check(python: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [python, "-c", CHECK, *AGENT_MODULES], capture_output=True, text=True, env=env, timeout=120
    )
    if done.returncode != 0:
        return {"missing": [], "error": f"the check exited {done.returncode}: {done.stderr.strip()[-300:]}"}
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def agent_deps(
    python: str, env: dict[str, str], *, wheels: Path | None, site: Path, timeout_s: float
) -> tuple[str | None, list[str]]:
    """(None, what was done) when the agent can run with ``env`` (PYTHONPATH extended with
    ``site`` in place where something was installed there); else (why not, what was tried)."""
    tried: list[str] = []
    state = _check(python, env)
    if not state["missing"] and not state["error"]:
        return None, ["the agent's dependencies are importable"]
    if state["error"] and not state["missing"]:
        return f"the agent does not import: {state['error']}", tried
    dists = [AGENT_MODULES[m] for m in state["missing"]]
    tried.append(f"missing: {', '.join(dists)}")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(site)]
    if wheels is not None and any(wheels.glob("*.whl")):
        cmd = [*pip, "--no-index", "--no-deps", *map(str, sorted(wheels.glob("*.whl")))]
        tried.append(f"pip install of the wheels in {wheels}")
    elif subprocess.run([python, "-m", "pip", "--version"], capture_output=True, env=env).returncode == 0:
        cmd = [*pip, "--timeout", "5", "--retries", "0", *dists]
        tried.append("pip install from the package index (no local wheels)")
    else:
        return f"missing {', '.join(dists)}, and no pip to install them with", tried
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return f"missing {', '.join(dists)}; pip failed (no package index reachable?): {last}", tried
    except subprocess.TimeoutExpired:
        return f"missing {', '.join(dists)}; pip did not finish within {timeout_s:.0f} s", tried
    env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    state = _check(python, env)
    if state["missing"] or state["error"]:
        return f"still missing {state['missing']} after pip ({state['error']})", tried
    return None, [*tried, f"installed into {site}"]
