"""The variables a container gets from Allocate and from a DRA claim's CDI spec: never one an
image sets for itself (ours replaces the image's, there is no appending), only those the
README's "What a container gets" table lists, for every strategy, share and MPS grant."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.control.draclaims import PreparedClaims
from agent.control.mpsgrants import MpsGrant
from agent.domain.requests import ResolvedRequest
from agent.platform.driverfiles import discover_driver_files
from agent.platform.gpu.inventory import GpuInfo
from agent.platform.gpu.mpspartition import Partition
from agent.settings import DeviceListStrategy
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.preparer import ClaimPreparer
from tests.unit.draobjects import GPUS, NODE, FakeClaims, Result, allocated_claim, ref_of

ROOT = Path(__file__).resolve().parents[2]
# Variables base, CUDA, PyTorch, conda and distribution images set (Dockerfile ENV) or that
# users set in a pod spec and expect to keep.
IMAGE_VARIABLES = frozenset(
    {
        "PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "LIBRARY_PATH", "HOME", "USER", "SHELL",
        "HOSTNAME", "TERM", "TZ", "LANG", "LANGUAGE", "LC_ALL", "PYTHONPATH", "PYTHONHOME",
        "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PIP_NO_CACHE_DIR", "CONDA_PREFIX",
        "CONDA_DIR", "VIRTUAL_ENV", "CUDA_HOME", "CUDA_PATH", "CUDA_VERSION", "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER", "CUDA_MODULE_LOADING", "CUDA_CACHE_PATH", "NVIDIA_DRIVER_CAPABILITIES",
        "NVIDIA_REQUIRE_CUDA", "NVIDIA_PRODUCT_NAME", "NV_CUDA_LIB_VERSION", "NCCL_VERSION",
        "CUDNN_VERSION", "PYTORCH_VERSION", "TORCH_CUDA_ARCH_LIST", "OMP_NUM_THREADS",
        "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR", "JAVA_HOME",
    }
)  # fmt: skip
# An ENV like a pytorch/pytorch image's: conda's bin first, the /usr/local/nvidia paths the
# nvidia/cuda bases add, and NVIDIA_VISIBLE_DEVICES=all.
PYTORCH_IMAGE_ENV = {
    "PATH": "/opt/conda/bin:/usr/local/nvidia/bin:/usr/local/cuda/bin:"
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "NVIDIA_VISIBLE_DEVICES": "all",
    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
    "PYTORCH_VERSION": "2.5.1",
}
SHARE = ResolvedRequest(30, (GPUS[1],))
WHOLE = ResolvedRequest(200, GPUS)


def documented() -> set[str]:
    """The variable names of the README's "What a container gets" table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### What a container gets", 1)[1].split("\n### ", 1)[0]
    return set(re.findall(r"^\| `([A-Z_]+)` \|", section, re.MULTILINE))


def driver_root(root: Path) -> Path:
    """A host driver root with a library and a tool, so ``mounts`` has files to hand out."""
    (root / "usr/lib64").mkdir(parents=True)
    (root / "usr/lib64/libcuda.so.1").write_bytes(b"\x7fELF")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/nvidia-smi").write_bytes(b"#!")
    return root


def grant(gpu: GpuInfo, memory_mib: int | None) -> MpsGrant:
    return MpsGrant(gpu.index, Partition(30, None, 30.0), memory_mib, Path("/p"), Path("/l"))


@dataclass
class FakeMps:
    def grant_share(self, gpu: GpuInfo, ceiling: int, memory_mib: int | None) -> MpsGrant | None:
        return grant(gpu, memory_mib)


def allocate_envs(tmp_path: Path) -> list[tuple[str, dict[str, str]]]:
    """(what, envs) of Allocate for every strategy, share and whole GPUs, with and without MPS."""
    driver = discover_driver_files(driver_root(tmp_path / "driver"))
    assert driver.libraries and driver.binaries
    out = []
    for strategy in DeviceListStrategy:
        builder = ResponseBuilder(strategy, driver)
        out.append((f"{strategy.value} share", dict(builder.build(SHARE).envs)))
        out.append((f"{strategy.value} whole", dict(builder.build(WHOLE).envs)))
        for memory in (None, 4096):
            mps = builder.build(SHARE, grant(GPUS[1], memory))
            out.append((f"{strategy.value} mps memory={memory}", dict(mps.envs)))
    return out


def cdi_envs(tmp_path: Path) -> list[tuple[str, dict[str, str]]]:
    """(what, envs) of each device of the CDI specs the DRA plugin writes, same variations."""
    driver = discover_driver_files(driver_root(tmp_path / "driver"))
    out = []
    for strategy in DeviceListStrategy:
        for mps in (None, FakeMps()):
            where = tmp_path / f"{strategy.value}-{mps is not None}"
            claims = FakeClaims()
            preparer = ClaimPreparer(
                node_name=NODE,
                gpus=GPUS,
                claims=claims,
                responses=ResponseBuilder(strategy, driver),
                store=PreparedClaims(where / "state"),
                cdi_dir=where / "cdi",
                mps=mps,
            )
            for results in ([Result("gpu", 1, 30, "4Gi")], [Result("gpu", 0, None, None)]):
                claim = allocated_claim("c", results)
                claims.put(claim)
                preparer.prepare(ref_of(claim))
                spec = json.loads(preparer.spec_path(claim["metadata"]["uid"]).read_text())
                for device in spec["devices"]:
                    env = dict(e.split("=", 1) for e in device["containerEdits"].get("env", []))
                    out.append((f"{strategy.value} mps={mps is not None} {device['name']}", env))
    return out


@pytest.fixture(params=["allocate", "cdi"])
def every_env(request: pytest.FixtureRequest, tmp_path: Path) -> list[tuple[str, dict[str, str]]]:
    return allocate_envs(tmp_path) if request.param == "allocate" else cdi_envs(tmp_path)


def test_no_response_or_spec_sets_a_variable_images_set(every_env: list[tuple[str, dict[str, str]]]) -> None:
    assert len(every_env) >= 12
    clashes = {what: sorted(IMAGE_VARIABLES & env.keys()) for what, env in every_env}
    assert {what: names for what, names in clashes.items() if names} == {}


def test_every_variable_set_is_in_the_readme_table(every_env: list[tuple[str, dict[str, str]]]) -> None:
    table = documented()
    assert not table & IMAGE_VARIABLES, "the table must not list a variable images set"
    set_somewhere = {name for _, env in every_env for name in env}
    assert set_somewhere - table == set()
    # And the table lists nothing the agent no longer sets (all variations are covered above).
    assert table - set_somewhere == set()


def test_an_image_keeps_its_path_and_library_path_after_allocate(tmp_path: Path) -> None:
    """What the runtime does with Allocate's variables: the image's, then ours by name."""
    for what, envs in allocate_envs(tmp_path):
        container = {**PYTORCH_IMAGE_ENV, **envs}
        assert container["PATH"] == PYTORCH_IMAGE_ENV["PATH"], what
        assert container["LD_LIBRARY_PATH"] == PYTORCH_IMAGE_ENV["LD_LIBRARY_PATH"], what
        # The one image variable replaced on purpose: an image's "all" narrowed to the grant.
        if "NVIDIA_VISIBLE_DEVICES" in envs:
            assert container["NVIDIA_VISIBLE_DEVICES"] != "all"
            assert container["NVIDIA_VISIBLE_DEVICES"] == envs["VCUDA_GPU_UUIDS"]


def test_the_readme_table_is_read() -> None:
    """Guards ``documented``: the table parses to the variables the code names."""
    assert {"VCUDA_CORE", "NVIDIA_VISIBLE_DEVICES", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"} <= documented()
