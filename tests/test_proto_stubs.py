"""The committed gRPC stubs are what `make proto` generates from the committed .proto files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message

from agent.platform.kubelet.pb import deviceplugin_v1beta1_pb2 as pb
from agent.platform.kubelet.pb import dra_v1_pb2 as dra_v1
from agent.platform.kubelet.pb import dra_v1beta1_pb2 as dra_v1beta1
from agent.platform.kubelet.pb import pluginregistration_v1_pb2 as reg
from agent.platform.kubelet.pb import podresources_v1_pb2 as podres

ROOT = Path(__file__).resolve().parents[1]
PB = ROOT / "agent" / "platform" / "kubelet" / "pb"
PROTOS = sorted(PB.glob("*.proto"))


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_stubs_match_proto(proto: Path, tmp_path: Path) -> None:
    rel = proto.relative_to(ROOT)
    (tmp_path / rel.parent).mkdir(parents=True)
    shutil.copy(proto, tmp_path / rel)
    bindir = Path(sys.executable).parent
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--grpc_python_out=.",
            f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
            "--mypy_out=.",
            "--mypy_grpc_out=.",
            str(rel),
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    generated = sorted((tmp_path / rel.parent).glob(f"{proto.stem}_pb2*"))
    assert len(generated) == 4
    for path in generated:
        committed = PB / path.name
        assert committed.read_text() == path.read_text(), f"{committed.name} is stale: run `make proto`"


def test_wire_names_match_kubelet() -> None:
    services = pb.DESCRIPTOR.services_by_name
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert set(services) == {"Registration", "DevicePlugin"}
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    fields = {f.name: f.number for f in pb.ContainerAllocateResponse.DESCRIPTOR.fields}
    assert fields == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    fields = {f.name: f.number for f in pb.ContainerPreferredAllocationRequest.DESCRIPTOR.fields}
    assert fields == {"available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}


def _fields(message: type[Message]) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_pod_resources_wire_names_match_kubelet() -> None:
    services = podres.DESCRIPTOR.services_by_name
    assert podres.DESCRIPTOR.package == "v1"
    assert set(services) == {"PodResourcesLister"}
    lister = services["PodResourcesLister"]
    assert lister.full_name == "v1.PodResourcesLister"
    assert [m.name for m in lister.methods] == ["List", "GetAllocatableResources", "Get"]
    assert _fields(podres.ListPodResourcesResponse) == {"pod_resources": 1}
    assert _fields(podres.PodResources) == {"name": 1, "namespace": 2, "containers": 3}
    assert _fields(podres.ContainerResources) == {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    }
    assert _fields(podres.ContainerDevices) == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert _fields(podres.GetPodResourcesRequest) == {"pod_name": 1, "pod_namespace": 2}
    assert _fields(podres.GetPodResourcesResponse) == {"pod_resources": 1}
    assert _fields(podres.AllocatableResourcesResponse) == {"devices": 1, "cpu_ids": 2, "memory": 3}
    assert _fields(podres.DynamicResource) == {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4}


def test_plugin_registration_wire_names_match_kubelet() -> None:
    # kubelet's own file says `package pluginregistration; // This should have been v1.`
    assert reg.DESCRIPTOR.package == "pluginregistration"
    service = reg.DESCRIPTOR.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    assert [m.name for m in service.methods] == ["GetInfo", "NotifyRegistrationStatus"]
    assert _fields(reg.PluginInfo) == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert _fields(reg.RegistrationStatus) == {"plugin_registered": 1, "error": 2}
    assert _fields(reg.InfoRequest) == {}
    assert _fields(reg.RegistrationStatusResponse) == {}


@pytest.mark.parametrize(("module", "version"), [(dra_v1, "v1"), (dra_v1beta1, "v1beta1")])
def test_dra_wire_names_match_kubelet(module: Any, version: str) -> None:
    assert module.DESCRIPTOR.package == f"k8s.io.kubelet.pkg.apis.dra.{version}"
    service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
    assert [m.name for m in service.methods] == ["NodePrepareResources", "NodeUnprepareResources"]
    assert _fields(module.NodePrepareResourcesRequest) == {"claims": 1}
    assert _fields(module.NodePrepareResourcesResponse) == {"claims": 1}
    assert _fields(module.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
    assert _fields(module.Device) == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
    }
    assert _fields(module.NodeUnprepareResourcesRequest) == {"claims": 1}
    assert _fields(module.NodeUnprepareResourcesResponse) == {"claims": 1}
    assert _fields(module.NodeUnprepareResourceResponse) == {"error": 1}
    assert _fields(module.Claim) == {"namespace": 1, "uid": 2, "name": 3}
    response = module.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"]
    assert response.message_type.GetOptions().map_entry  # map<string, NodePrepareResourceResponse>
