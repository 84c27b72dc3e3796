"""Reading the NVIDIA container toolkit's config.toml, which says whether the NVIDIA runtime
honours an unprivileged container's own NVIDIA_VISIBLE_DEVICES.

Where the toolkit keeps it (nvidia-container-toolkit internal/config/config.go): the package
reads /etc/nvidia-container-runtime/config.toml (or ``$XDG_CONFIG_HOME/...``); the GPU
Operator's toolkit container writes /usr/local/nvidia/toolkit/.config/nvidia-container-runtime
/config.toml and points its runtime wrapper there. A file that is absent, unreadable or not
TOML is reported with why, never raised: the agent serves GPUs either way.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger(__name__)

# Relative to the host's /.
DEFAULT_CONFIGS = (
    PurePosixPath("etc/nvidia-container-runtime/config.toml"),
    PurePosixPath("usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml"),
)
# Top-level keys (the Config struct's toml tags); the first is true when unset.
ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
VOLUME_MOUNTS_KEY = "accept-nvidia-visible-devices-as-volume-mounts"
_MAX_BYTES = 1 << 20  # a real one is a few KiB; a larger file is not read whole


@dataclass(frozen=True)
class ToolkitConfigFile:
    """One candidate file: ``values`` parsed, or ``problem`` says why not (``absent`` if missing)."""

    path: Path
    values: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    absent: bool = False


def default_paths(host_root: Path) -> tuple[Path, ...]:
    return tuple(host_root / p for p in DEFAULT_CONFIGS)


def read_toolkit_config(path: Path) -> ToolkitConfigFile:
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        return ToolkitConfigFile(path, absent=True, problem="no such file")
    except OSError as err:
        return ToolkitConfigFile(path, problem=f"cannot read it: {err.strerror or err}")
    if len(data) > _MAX_BYTES:
        return ToolkitConfigFile(path, problem=f"larger than {_MAX_BYTES} bytes: not a toolkit config")
    try:
        values = tomllib.loads(data.decode())
    except UnicodeDecodeError as err:
        return ToolkitConfigFile(path, problem=f"not UTF-8 text: {err}")
    except tomllib.TOMLDecodeError as err:
        return ToolkitConfigFile(path, problem=f"not valid TOML: {err}")
    return ToolkitConfigFile(path, values)
