"""Finding the host's NVIDIA driver libraries and tools.

With the ``mounts`` device-list strategy each container gets them read-only where an image
already looks, so plain runc runs CUDA programs without the NVIDIA container runtime and
without any variable of ours replacing the image's own PATH or LD_LIBRARY_PATH (README.md,
"What a container gets"):

- tools in /usr/bin, on every image's PATH (where nvidia-container-toolkit puts them too);
- libraries in the dynamic linker's built-in search directories: /usr/lib/<triplet> of
  Debian/Ubuntu images and /usr/lib64 of RHEL-family ones. The linker searches them after
  LD_LIBRARY_PATH and its cache, so no ldconfig run (a hook Allocate cannot ask for) is
  needed. An image's runtime creates whichever of the two it lacks; its linker never reads it.

Symlinks are resolved inside the driver root, so every mount names a real file on the host.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)

CONTAINER_BINARY_DIR = PurePosixPath("/usr/bin")
# GNU multiarch triplets by `uname -m`: the name of Debian's library directory.
_TRIPLETS = {
    "x86_64": "x86_64-linux-gnu",
    "aarch64": "aarch64-linux-gnu",
    "ppc64le": "powerpc64le-linux-gnu",
}
LIBRARY_PREFIXES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-opencl.so",
    "libnvidia-encode.so",
    "libnvcuvid.so",
    "libnvidia-opticalflow.so",
    "libnvidia-pkcs11.so",
)
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib64",
    "usr/local/nvidia/lib64",
)
BINARY_DIRS = ("usr/bin", "usr/local/bin", "bin", "usr/local/nvidia/bin")
_MAX_LINK_HOPS = 16


@dataclass(frozen=True)
class DriverMount:
    container_path: str
    host_path: str


@dataclass(frozen=True)
class DriverFiles:
    libraries: tuple[DriverMount, ...] = ()
    binaries: tuple[DriverMount, ...] = ()

    @property
    def mounts(self) -> tuple[DriverMount, ...]:
        return self.libraries + self.binaries


def container_library_dirs(machine: str | None = None) -> tuple[PurePosixPath, ...]:
    """Where a container's dynamic linker looks without LD_LIBRARY_PATH or ldconfig, for
    this node's architecture (``machine``: ``uname -m``, this host's by default)."""
    triplet = _TRIPLETS.get(machine or os.uname().machine)
    multiarch = (PurePosixPath("/usr/lib") / triplet,) if triplet else ()
    return (*multiarch, PurePosixPath("/usr/lib64"))


def discover_driver_files(
    host_root: Path, visible_root: Path | None = None, machine: str | None = None
) -> DriverFiles:
    """Driver files under ``visible_root`` (this process's view), named by their ``host_root`` paths."""
    seen_at = visible_root or host_root
    libraries = _collect(
        seen_at,
        host_root,
        LIBRARY_DIRS,
        lambda n: n.startswith(LIBRARY_PREFIXES),
        container_library_dirs(machine),
    )
    binaries = _collect(seen_at, host_root, BINARY_DIRS, lambda n: n in BINARIES, (CONTAINER_BINARY_DIR,))
    if not libraries:
        log.info("no NVIDIA driver libraries under %s: containers get device nodes only", seen_at)
    return DriverFiles(libraries, binaries)


def _collect(
    seen_at: Path,
    host_root: Path,
    dirs: tuple[str, ...],
    wanted: Callable[[str], bool],
    container_dirs: tuple[PurePosixPath, ...],
) -> tuple[DriverMount, ...]:
    mounts: dict[str, list[DriverMount]] = {}
    for rel_dir in dirs:
        directory = seen_at / rel_dir
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue  # this layout does not use the directory
        for name in names:
            if name in mounts or not wanted(name):
                continue
            target = _resolve_inside(seen_at, PurePosixPath("/") / rel_dir / name)
            if target is None:
                continue
            host_path = str(host_root / target.relative_to("/"))
            mounts[name] = [DriverMount(str(d / name), host_path) for d in container_dirs]
    return tuple(m for per_name in mounts.values() for m in per_name)


def _resolve_inside(root: Path, path: PurePosixPath) -> PurePosixPath | None:
    """Follow symlinks as the host would, treating ``root`` as ``/``; None if dangling or not a file."""
    current = path
    for _ in range(_MAX_LINK_HOPS):
        real = root / current.relative_to("/")
        if real.is_symlink():
            link = PurePosixPath(os.readlink(real))
            current = link if link.is_absolute() else current.parent / link
            current = PurePosixPath(os.path.normpath(current))
            continue
        return current if real.is_file() else None
    log.warning("too many symlinks resolving %s under %s", path, root)
    return None
