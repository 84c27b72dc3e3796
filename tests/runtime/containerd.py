"""A private containerd for the real-runtime tier: Debian's containerd with its own root,
state and socket in a temp dir (never the system's), an image built here as an OCI archive
(busybox-static as its only binary: no registry is reached) and imported, and containers
run the way kubelet's cgroupfs driver places them (``/kubepods/<qos>/pod<uid>/<id>``),
through ``ctr`` with runc or crun.

Each containerd runs in a private mount namespace whose /sys/fs/cgroup is the layout of one
kind of node, so the runtimes (which read the layout from their own mounts) run in that mode:

- ``v1``: a tmpfs with this host's v1 hierarchies mounted again (the same hierarchies, not
  copies), no cgroup2: a legacy node, the mode crun needs (it refuses hybrid layouts);
- ``v2``: cgroup2 at /sys/fs/cgroup: a unified node. The hierarchy is this host's v2 one
  (there is only one), seen from the host at /sys/fs/cgroup/unified.

The agent's code in the test process sees the same cgroups through
``/proc/<containerd pid>/root``: :meth:`PrivateContainerd.layout` is the agent's own layout
detection run on the namespace's mountinfo.

What ``ctr`` cannot do that kubelet's CRI calls would: a pod sandbox (pause container) and
its network namespace; the containers here are the pod's app containers only.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import shutil
import subprocess
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from agent.platform.cgroups.layout import CgroupLayout, detect_layout

IMAGE = "vcuda.test/busybox:1"
NAMESPACE = "k8s.io"  # kubelet's containerd namespace
CGROUP_MODES = ("v1", "v2")
# A socket where the agent's runtime detection looks for containerd, under --host-root.
SOCKET_IN_HOST_ROOT = "run/containerd/containerd.sock"
# The v1 hierarchies a legacy node has, by mount options (what kubelet and the runtimes use).
_V1_MOUNTS = {
    "cpu": "cpu", "cpuacct": "cpuacct", "cpuset": "cpuset", "memory": "memory", "devices": "devices",
    "freezer": "freezer", "blkio": "blkio", "pids": "pids", "systemd": "none,name=systemd",
}  # fmt: skip
APPLETS = ("sh", "sleep", "mknod", "cat", "true")


class RuntimeUnavailable(Exception):
    """A binary this tier needs is missing; the message says which and how to install it."""


def require(*binaries: str) -> None:
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        raise RuntimeUnavailable(
            f"{', '.join(missing)} not installed (apt-get install containerd runc crun busybox-static)"
        )


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def _member(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def build_image(
    path: Path,
    busybox: Path = Path("/bin/busybox"),
    *,
    name: str = IMAGE,
    env: Sequence[str] = ("PATH=/bin",),
    scripts: Mapping[str, str] | None = None,
) -> Path:
    """An OCI image layout archive with one layer: busybox and its applets' links, plus
    ``scripts`` (path in the image -> text, mode 0755) under their own directories."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        extra_dirs = {str(d) for p in scripts or {} for d in PurePosixPath(p).parents}
        for directory in sorted({"bin", "dev", "proc", "sys", "tmp", "etc", *extra_dirs} - {"."}):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(str(busybox), arcname="bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        for script, text in (scripts or {}).items():
            _member(tar, script, text.encode(), mode=0o755)
    with tarfile.open(path, "w") as tar:
        layer_digest = _blob(tar, layer.getvalue())
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": list(env), "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }
        config_bytes = json.dumps(config).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _blob(tar, config_bytes),
                "size": len(config_bytes),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest,
                    "size": len(layer.getvalue()),
                }
            ],
        }
        manifest_bytes = json.dumps(manifest).encode()
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": _blob(tar, manifest_bytes),
                    "size": len(manifest_bytes),
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name,
                    },
                }
            ],
        }
        _member(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _member(tar, "index.json", json.dumps(index).encode())
    return path


@dataclass(frozen=True)
class Container:
    id: str
    pid: int
    pod_uid: str
    qos: str  # besteffort | burstable | guaranteed

    @property
    def cgroup_path(self) -> str:
        """As kubelet's cgroupfs driver names it (guaranteed pods sit right under kubepods)."""
        qos = "" if self.qos == "guaranteed" else f"/{self.qos}"
        return f"/kubepods{qos}/pod{self.pod_uid}/{self.id}"


def new_pod_uid() -> str:
    return f"{secrets.token_hex(4)}-0000-4000-8000-{secrets.token_hex(6)}"


def _namespace_script(cgroup: str) -> str:
    """Shell run in the private mount namespace before containerd: the node's cgroup layout."""
    if cgroup == "v2":
        return "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    mounts = [
        f"mkdir -p /sys/fs/cgroup/{name} && mount -t cgroup -o {options} cgroup /sys/fs/cgroup/{name}"
        for name, options in _V1_MOUNTS.items()
        if Path("/sys/fs/cgroup", name).is_dir()  # only hierarchies this host has
    ]
    return " && ".join(["mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup", *mounts])


class PrivateContainerd:
    def __init__(self, workdir: Path, runtime: str = "runc", cgroup: str = "v1") -> None:
        require("containerd", "ctr", "unshare", "nsenter", runtime)
        if cgroup not in CGROUP_MODES:
            raise ValueError(f"cgroup mode {cgroup!r}: one of {', '.join(CGROUP_MODES)}")
        self.workdir = workdir
        self.runtime = runtime
        self.cgroup = cgroup
        self.host_root = workdir / "host"  # what the agent is given as --host-root
        self.socket = self.host_root / SOCKET_IN_HOST_ROOT
        self._proc: subprocess.Popen[bytes] | None = None
        self.containers: list[Container] = []

    def start(self) -> None:
        config = self.workdir / "config.toml"
        config.write_text(
            "version = 2\n"
            f'root = "{self.workdir / "root"}"\nstate = "{self.workdir / "state"}"\n'
            f'[grpc]\n  address = "{self.socket}"\n[ttrpc]\n  address = ""\n'
            '[debug]\n  address = ""\n[metrics]\n  address = ""\n'
        )
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "containerd.log").open("wb")
        # unshare execs sh, which execs containerd: the pid is containerd's, and its shims and
        # the runtimes they start inherit the namespace.
        script = f"{_namespace_script(self.cgroup)} && exec containerd --config {config}"
        self._proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode != 0:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start: {self.log()[-800:]}")
            time.sleep(0.1)
        self.ctr("images", "import", str(build_image(self.workdir / "image.tar")))

    def import_image(self, name: str, env: Sequence[str], scripts: Mapping[str, str]) -> str:
        """Another image beside the default one (see ``build_image``); its name."""
        archive = self.workdir / f"image-{secrets.token_hex(4)}.tar"
        self.ctr("images", "import", str(build_image(archive, name=name, env=env, scripts=scripts)))
        return name

    def log(self) -> str:
        return (self.workdir / "containerd.log").read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self._proc is not None, "containerd is not started"
        return self._proc.pid

    @property
    def namespace_root(self) -> Path:
        """The namespace's / as the host sees it: its /sys/fs/cgroup is the node's layout."""
        return Path(f"/proc/{self.pid}/root")

    def layout(self) -> CgroupLayout:
        """The agent's layout detection on the namespace's mounts, its paths reached from here."""
        found = detect_layout(mountinfo=Path(f"/proc/{self.pid}/mountinfo"))
        rebase = self.namespace_root.joinpath
        return replace(
            found,
            v2_root=rebase(str(found.v2_root).lstrip("/")) if found.v2_root else None,
            v1_roots={name: rebase(str(path).lstrip("/")) for name, path in found.v1_roots.items()},
        )

    def in_namespace(self, *command: str) -> list[str]:
        """``command`` run in containerd's mount namespace (the runtimes' view of cgroups)."""
        return ["nsenter", f"--mount=/proc/{self.pid}/ns/mnt", "--", *command]

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        return done

    def run(
        self,
        *,
        qos: str = "besteffort",
        devices: tuple[Path, ...] = (),
        command: tuple[str, ...] = ("/bin/sleep", "600"),
        image: str = IMAGE,
        env: Mapping[str, str] | None = None,
        mounts: Sequence[tuple[str, str]] = (),
        pod_uid: str | None = None,
        rw_mounts: dict[Path, str] | None = None,
    ) -> Container:
        """A running container, placed where kubelet would place it; returns once its task runs.

        ``--cpu-shares 0``: ctr asks for 1024 shares by default, which a v2 hierarchy without
        the cpu controller (this hybrid host's) cannot take; device rules and the freezer are
        what these tests are about, and neither needs a controller on v2.

        ``devices``: host device nodes given to the container (node and cgroup rule), the way
        the NVIDIA container runtime hands a container its GPUs.

        ``env`` and ``mounts`` ((container path, host path), read-only binds) are what kubelet
        hands the CRI from Allocate; ctr, like containerd's CRI plugin, puts ``env`` over the
        image's environment by name. ``pod_uid``: a pod whose cgroup was made beforehand
        (kubelet makes it before the containers; default: a new one). ``rw_mounts``: host
        directory -> path in the container (read-write binds)."""
        pod_uid = pod_uid or new_pod_uid()
        container = Container(secrets.token_hex(32), 0, pod_uid, qos)
        binds = [f"--mount=type=bind,src={h},dst={c},options=rbind:ro" for c, h in mounts]
        binds += [f"--mount=type=bind,src={h},dst={c},options=rbind:rw" for h, c in (rw_mounts or {}).items()]
        try:
            self._run(container, devices, command, image=image, env=env or {}, binds=binds)
        except RuntimeError:
            self.ctr("task", "delete", container.id, check=False)  # the runtime refused it:
            self.ctr("containers", "delete", container.id, check=False)  # keep no record
            raise
        running = Container(container.id, self.task_pid(container.id), pod_uid, qos)
        self.containers.append(running)
        return running

    def _run(
        self,
        container: Container,
        devices: tuple[Path, ...],
        command: tuple[str, ...],
        *,
        image: str,
        env: Mapping[str, str],
        binds: list[str],
    ) -> None:
        self.ctr(
            "run", "-d", "--cpu-shares", "0", "--runc-binary", self.runtime,
            "--runc-root", str(self.runc_root), "--cgroup", container.cgroup_path,
            *(f"--device={d}" for d in devices), *(f"--env={k}={v}" for k, v in env.items()),
            *binds, image, container.id, *command,
        )  # fmt: skip

    def _task_row(self, container_id: str) -> list[str] | None:
        """``ctr task ls``'s row of the container: id, pid, status; None without a task."""
        rows = (line.split() for line in self.ctr("task", "ls").stdout.splitlines()[1:])
        return next((row for row in rows if row and row[0] == container_id), None)

    def task_pid(self, container_id: str) -> int:
        row = self._task_row(container_id)
        if row is None:
            raise RuntimeError(f"container {container_id} has no task")
        return int(row[1])

    def task_status(self, container_id: str) -> str:
        row = self._task_row(container_id)
        return "GONE" if row is None else row[2]

    @property
    def runc_root(self) -> Path:
        """The runtime's own state (not the shim default under /run/containerd: private)."""
        return self.workdir / "runc"

    def update(self, container: Container, *args: str) -> None:
        """``<runtime> update`` (what ``crictl update`` / kubelet's in-place resize end in): the
        runtime re-applies the container's resources, its device rules among them."""
        cmd = self.in_namespace(
            self.runtime, "--root", str(self.runc_root / NAMESPACE), "update", *args, container.id
        )
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def exec(
        self, container: Container, *command: str, detach: bool = False
    ) -> subprocess.CompletedProcess[str]:
        flags = ("--detach",) if detach else ()
        return self.ctr(
            "task", "exec", *flags, "--exec-id", secrets.token_hex(4), container.id, *command, check=False
        )

    def stop(self) -> None:
        for container in self.containers:
            self.ctr("task", "kill", "--signal", "SIGKILL", container.id, check=False)
        for container in self.containers:
            deadline = time.monotonic() + 10
            while (
                self.ctr("task", "delete", container.id, check=False).returncode != 0
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            self.ctr("containers", "delete", container.id, check=False)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=20)
