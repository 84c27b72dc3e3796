"""An image with its own PATH and LD_LIBRARY_PATH (a conda/PyTorch layout: python in
/opt/conda/bin) run by a real containerd with runc and with crun, with what the agent hands
the runtime for a share applied: Allocate's variables and driver mounts (``mounts``
strategy), or a DRA claim's CDI edits. The image keeps its PATH and LD_LIBRARY_PATH, its
python still runs, and the driver's tool and library are where the image looks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.control.draclaims import PreparedClaims
from agent.domain.requests import ResolvedRequest
from agent.platform.driverfiles import DriverFiles, container_library_dirs, discover_driver_files
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.preparer import ClaimPreparer
from tests.runtime.containerd import PrivateContainerd
from tests.unit.draobjects import GPUS, NODE, FakeClaims, Result, allocated_claim, ref_of

pytestmark = pytest.mark.privileged

CONDA_PATH = "/opt/conda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CONDA_LIBS = "/opt/conda/lib"
IMAGE = "vcuda.test/conda:1"
PROBE = (
    'echo "PATH=$PATH"; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; python; nvidia-smi; '
    'echo "smi-at=$(command -v nvidia-smi)"; '
    + "; ".join(f'echo "lib {d}=$(cat {d}/libcuda.so.1)"' for d in container_library_dirs())
)


def driver(root: Path) -> DriverFiles:
    """A host driver root with a tool that prints who it is and a library with known bytes."""
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15").write_text("host-libcuda")
    (root / "usr/lib/x86_64-linux-gnu/libcuda.so.1").symlink_to("libcuda.so.550.54.15")
    (root / "usr/bin").mkdir(parents=True)
    smi = root / "usr/bin/nvidia-smi"
    smi.write_text("#!/bin/sh\necho host-nvidia-smi\n")
    smi.chmod(0o755)
    return discover_driver_files(root)


def allocate_edits(files: DriverFiles) -> tuple[dict[str, str], list[tuple[str, str]]]:
    response = ResponseBuilder(DeviceListStrategy.MOUNTS, files).build(ResolvedRequest(30, (GPUS[1],)))
    return dict(response.envs), [(m.container_path, m.host_path) for m in response.mounts]


def cdi_edits(files: DriverFiles, work: Path) -> tuple[dict[str, str], list[tuple[str, str]]]:
    claim = allocated_claim("train", [Result("gpu", 1, 30, "4Gi")])
    preparer = ClaimPreparer(
        node_name=NODE,
        gpus=GPUS,
        claims=FakeClaims(claim),
        responses=ResponseBuilder(DeviceListStrategy.MOUNTS, files),
        store=PreparedClaims(work / "state"),
        cdi_dir=work / "cdi",
    )
    preparer.prepare(ref_of(claim))
    [device] = json.loads(preparer.spec_path(claim["metadata"]["uid"]).read_text())["devices"]
    edits = device["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    return env, [(m["containerPath"], m["hostPath"]) for m in edits["mounts"]]


@pytest.mark.parametrize("source", ["allocate", "cdi"])
def test_an_image_keeps_its_path_and_finds_the_driver_files(
    containerd: PrivateContainerd, tmp_path: Path, source: str
) -> None:
    containerd.import_image(
        IMAGE,
        [f"PATH={CONDA_PATH}", f"LD_LIBRARY_PATH={CONDA_LIBS}"],
        {"opt/conda/bin/python": "#!/bin/sh\necho conda-python\n"},
    )
    files = driver(tmp_path / "driver")
    env, mounts = allocate_edits(files) if source == "allocate" else cdi_edits(files, tmp_path)
    assert mounts, "the mounts strategy hands out the driver files"
    box = containerd.run(image=IMAGE, env=env, mounts=mounts)
    done = containerd.exec(box, "/bin/sh", "-c", PROBE)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"PATH={CONDA_PATH}" in lines
    assert f"LD_LIBRARY_PATH={CONDA_LIBS}" in lines
    assert "conda-python" in lines  # the image's python, found through its own PATH
    assert "host-nvidia-smi" in lines
    assert "smi-at=/usr/bin/nvidia-smi" in lines
    for directory in container_library_dirs():
        assert f"lib {directory}=host-libcuda" in lines
    # Our own variables did arrive: the edits were applied, not dropped.
    vcuda = containerd.exec(box, "/bin/sh", "-c", 'echo "core=$VCUDA_CORE"')
    assert vcuda.stdout.strip() == "core=30"
