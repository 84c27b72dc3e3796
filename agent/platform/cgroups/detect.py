"""What the node runs on: cgroup layout, cgroup driver, container runtime endpoint.

Each fact says where it came from, so the start-up log and ``vcuda-agent status``
can tell an operator why the agent decided what it did. Precedence:

- driver: node config > kubelet's config file (``cgroupDriver``) > existing kubepods
  paths (``kubepods.slice`` → systemd, ``kubepods`` → cgroupfs) > systemd (kubeadm's default).
- runtime: node config > kubelet's config file (``containerRuntimeEndpoint``) > the
  first socket found. k3s and cri-dockerd sockets are looked at before plain
  containerd, because Docker ships a containerd socket of its own that kubelet does not use.
"""

from __future__ import annotations

import enum
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent.errors import ConfigError
from agent.platform.cgroups.layout import DEFAULT_CGROUP_ROOT, DEFAULT_MOUNTINFO, CgroupLayout, detect_layout

DEFAULT_KUBELET_CONFIG = Path("/var/lib/kubelet/config.yaml")

# (runtime name, socket path on the host), in the order they are looked for.
RUNTIME_SOCKETS: tuple[tuple[str, str], ...] = (
    ("containerd (k3s)", "/run/k3s/containerd/containerd.sock"),
    ("cri-dockerd", "/run/cri-dockerd.sock"),
    ("cri-o", "/var/run/crio/crio.sock"),
    ("containerd", "/run/containerd/containerd.sock"),
    ("docker", "/var/run/docker.sock"),
)
_SOCKET_NAMES = {
    "containerd.sock": "containerd",
    "crio.sock": "cri-o",
    "cri-dockerd.sock": "cri-dockerd",
    "docker.sock": "docker",
}


class CgroupDriver(enum.StrEnum):
    SYSTEMD = "systemd"
    CGROUPFS = "cgroupfs"


@dataclass(frozen=True)
class RuntimeFacts:
    """Everything detected at start, each with its source."""

    layout: CgroupLayout
    driver: CgroupDriver
    driver_source: str  # "node config", the kubelet config path, "found <path>", "default"
    runtime_endpoint: str | None  # "unix:///run/containerd/containerd.sock"; None: none found
    runtime_name: str | None  # "containerd", "cri-o", ...; None: unknown
    runtime_source: str  # "node config", the kubelet config path, "found <socket>", "none found"
    notes: tuple[str, ...] = ()  # things ignored on the way (an unreadable kubelet config, ...)

    def describe(self) -> list[str]:
        layout = self.layout
        lines = [f"cgroup layout: {layout.mode} (from {layout.source})"]
        if layout.v2_root is not None:
            lines.append(f"cgroup v2 hierarchy: {layout.v2_root}")
        if layout.v1_roots:
            roots = ", ".join(f"{name}={path}" for name, path in sorted(layout.v1_roots.items()))
            lines.append(f"cgroup v1 controllers: {roots}")
        lines.append(f"cgroup driver: {self.driver} (from {self.driver_source})")
        if self.runtime_endpoint is None:
            lines.append(f"container runtime: unknown ({self.runtime_source})")
        else:
            name = self.runtime_name or "unknown runtime"
            lines.append(f"container runtime: {name} at {self.runtime_endpoint} (from {self.runtime_source})")
        lines += [f"note: {note}" for note in self.notes]
        return lines

    def as_dict(self) -> dict[str, object]:
        return {
            "cgroup": self.layout.as_dict(),
            "cgroup_driver": {"value": str(self.driver), "source": self.driver_source},
            "runtime": {
                "endpoint": self.runtime_endpoint,
                "name": self.runtime_name,
                "source": self.runtime_source,
            },
            "notes": list(self.notes),
        }


def normalize_endpoint(endpoint: str) -> str:
    """``/run/x.sock`` or ``unix:///run/x.sock`` → ``unix:///run/x.sock``."""
    if endpoint.startswith("unix://"):
        return endpoint
    if endpoint.startswith("/"):
        return "unix://" + endpoint
    raise ConfigError([f"container runtime endpoint {endpoint!r}: expected /path or unix:///path"])


def runtime_name_of(endpoint: str) -> str | None:
    """The runtime a socket path belongs to, by its well-known name; None when unknown."""
    path = endpoint.removeprefix("unix://")
    for name, socket in RUNTIME_SOCKETS:
        if path == socket:
            return name
    return _SOCKET_NAMES.get(Path(path).name)


def read_kubelet_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """kubelet's KubeletConfiguration as a dict, and a note when it exists but is unusable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except OSError as err:
        return {}, f"ignored {path}: {err.strerror or err}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        return {}, f"ignored {path}: not valid YAML ({str(err).splitlines()[0]})"
    if not isinstance(data, dict):
        return {}, f"ignored {path}: not a YAML mapping"
    return data, None


def _driver_from_paths(layout: CgroupLayout) -> tuple[CgroupDriver, str] | None:
    roots = ([layout.v2_root] if layout.v2_root else []) + [
        layout.v1_roots[k] for k in sorted(layout.v1_roots)
    ]
    for root in roots:
        if (root / "kubepods.slice").is_dir():
            return CgroupDriver.SYSTEMD, f"found {root / 'kubepods.slice'}"
        if (root / "kubepods").is_dir():
            return CgroupDriver.CGROUPFS, f"found {root / 'kubepods'}"
    return None


def detect_driver(
    layout: CgroupLayout, override: str | None, kubelet_config: dict[str, Any], kubelet_config_path: Path
) -> tuple[CgroupDriver, str, list[str]]:
    """(driver, source, notes), by the precedence in the module docstring."""
    notes: list[str] = []
    if override is not None:
        try:
            return CgroupDriver(override), "node config", notes
        except ValueError as err:
            raise ConfigError([f"cgroupDriver {override!r}: must be systemd or cgroupfs"]) from err
    value = kubelet_config.get("cgroupDriver")
    if value is not None:
        try:
            return CgroupDriver(value), str(kubelet_config_path), notes
        except ValueError:
            notes.append(f"ignored cgroupDriver {value!r} in {kubelet_config_path}: not systemd or cgroupfs")
    found = _driver_from_paths(layout)
    if found is not None:
        return found[0], found[1], notes
    return CgroupDriver.SYSTEMD, "default", notes


def detect_runtime(
    override: str | None, kubelet_config: dict[str, Any], kubelet_config_path: Path, host_root: Path
) -> tuple[str | None, str | None, str]:
    """(endpoint, runtime name, source), by the precedence in the module docstring."""
    if override is not None:
        endpoint = normalize_endpoint(override)
        return endpoint, runtime_name_of(endpoint), "node config"
    value = kubelet_config.get("containerRuntimeEndpoint")
    if isinstance(value, str) and value:
        endpoint = normalize_endpoint(value)
        return endpoint, runtime_name_of(endpoint), str(kubelet_config_path)
    for name, socket in RUNTIME_SOCKETS:
        path = host_root / socket.lstrip("/")
        try:
            if stat.S_ISSOCK(path.stat().st_mode):
                return "unix://" + socket, name, f"found {path}"
        except OSError:
            continue
    return None, None, "none found"


def detect_runtime_facts(
    *,
    cgroup_root: Path = DEFAULT_CGROUP_ROOT,
    mountinfo: Path = DEFAULT_MOUNTINFO,
    kubelet_config: Path = DEFAULT_KUBELET_CONFIG,
    host_root: Path = Path("/"),
    driver_override: str | None = None,
    runtime_override: str | None = None,
) -> RuntimeFacts:
    """Detect everything once; overrides come from the node config (``None``: detect)."""
    layout = detect_layout(cgroup_root, mountinfo)
    config, note = read_kubelet_config(kubelet_config)
    notes = [note] if note else []
    driver, driver_source, driver_notes = detect_driver(layout, driver_override, config, kubelet_config)
    endpoint, name, runtime_source = detect_runtime(runtime_override, config, kubelet_config, host_root)
    return RuntimeFacts(
        layout=layout,
        driver=driver,
        driver_source=driver_source,
        runtime_endpoint=endpoint,
        runtime_name=name,
        runtime_source=runtime_source,
        notes=tuple(notes + driver_notes),
    )
