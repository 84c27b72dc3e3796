"""A private containerd for the real-runtime tier: Debian's containerd with its own root,
state and socket in a temp dir (never the system's), an image built here as an OCI archive
(busybox-static as its only binary: no registry is reached) and imported, and containers
run the way kubelet's cgroupfs driver places them (``/kubepods/<qos>/pod<uid>/<id>``),
through ``ctr`` with runc or a runc-compatible binary.

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
from dataclasses import dataclass
from pathlib import Path

IMAGE = "vcuda.test/busybox:1"
NAMESPACE = "k8s.io"  # kubelet's containerd namespace
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


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def build_image(path: Path, busybox: Path = Path("/bin/busybox")) -> Path:
    """An OCI image layout archive with one layer: busybox and its applets' links."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for directory in ("bin", "dev", "proc", "sys", "tmp", "etc"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(str(busybox), arcname="bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    with tarfile.open(path, "w") as tar:
        layer_digest = _blob(tar, layer.getvalue())
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
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
                        "io.containerd.image.name": IMAGE,
                        "org.opencontainers.image.ref.name": IMAGE,
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


class PrivateContainerd:
    def __init__(self, workdir: Path) -> None:
        require("containerd", "ctr")
        self.workdir = workdir
        self.socket = workdir / "containerd.sock"
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
        log = (self.workdir / "containerd.log").open("wb")
        self._proc = subprocess.Popen(
            ["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode != 0:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"containerd did not start: {(self.workdir / 'containerd.log').read_text()[-800:]}"
                )
            time.sleep(0.1)
        self.ctr("images", "import", str(build_image(self.workdir / "image.tar")))

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        return done

    def run(
        self,
        *,
        runtime_binary: str,
        qos: str = "besteffort",
        command: tuple[str, ...] = ("/bin/sleep", "600"),
    ) -> Container:
        """A running container, placed where kubelet would place it; returns once its task runs."""
        pod_uid = f"{secrets.token_hex(4)}-0000-4000-8000-{secrets.token_hex(6)}"
        container = Container(secrets.token_hex(32), 0, pod_uid, qos)
        self.ctr(
            "run", "-d", "--runc-binary", runtime_binary, "--runc-root", str(self.runc_root),
            "--cgroup", container.cgroup_path, IMAGE, container.id, *command,
        )  # fmt: skip
        pid = self.task_pid(container.id)
        running = Container(container.id, pid, pod_uid, qos)
        self.containers.append(running)
        return running

    def task_pid(self, container_id: str) -> int:
        for line in self.ctr("task", "ls").stdout.splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == container_id:
                return int(fields[1])
        raise RuntimeError(f"container {container_id} has no task")

    @property
    def runc_root(self) -> Path:
        """The runtime's own state (not the shim default under /run/containerd: private)."""
        return self.workdir / "runc"

    def update(self, container: Container, runtime_binary: str, *args: str) -> None:
        """``runc update`` (what ``crictl update`` / kubelet's in-place resize end in): the
        runtime re-applies the container's resources, its device rules among them."""
        cmd = [runtime_binary, "--root", str(self.runc_root / NAMESPACE), "update", *args, container.id]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def exec(self, container: Container, *command: str) -> subprocess.CompletedProcess[str]:
        return self.ctr(
            "task", "exec", "--exec-id", secrets.token_hex(4), container.id, *command, check=False
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
