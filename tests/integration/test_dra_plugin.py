"""The DRA kubelet plugin on real unix sockets, driven by the kubelet emulator (plugin
watcher + DRA manager): registration, NodePrepareResources/NodeUnprepareResources over v1
and v1beta1, claims read from the emulated API server, and both restarts."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiClient, ResourceV1Api

from agent.control.mpssharing import MpsSharing
from agent.domain.dra import DRIVER, ClaimRef
from agent.emulators.apiserver import FakeApiServer
from agent.emulators.kubelet_dra import KubeletDraEmulator, PreparedDevice, PrepareResult, container_cdi_ids
from agent.errors import KubeError
from agent.platform.kube.resourceclaims import ResourceClaimClient
from agent.settings import DeviceListStrategy, DraSettings, SharingMode, SharingSettings
from agent.surfaces.deviceplugin.responses import ResponseBuilder
from agent.surfaces.draplugin.plugin import DraKubeletPlugin
from agent.surfaces.draplugin.preparer import ClaimReader
from tests.integration.kubeapi import apiserver, kube, wait_until
from tests.unit.cdischema import cdi_problems
from tests.unit.draobjects import (
    DRIVER_FILES,
    GPUS,
    NODE,
    FakeClaims,
    Result,
    allocated_claim,
    allocation_status,
    claim_manifest,
    ref_of,
)

__all__ = ["apiserver", "kube"]  # fixtures
STANDIN = Path(__file__).resolve().parents[1] / "fakes" / "mps-control-standin"


@dataclass
class Dirs:
    root: Path

    def settings(self) -> DraSettings:
        return DraSettings(
            registry_dir=self.root / "reg",
            plugin_dir=self.root / "plugins" / DRIVER,
            cdi_dir=self.root / "cdi",
            state_dir=self.root / "state",
        )

    def plugin(self, claims: ClaimReader) -> DraKubeletPlugin:
        responses = ResponseBuilder(DeviceListStrategy.MOUNTS, DRIVER_FILES, Path("/"))
        return DraKubeletPlugin(
            self.settings(), node_name=NODE, gpus=GPUS, claims=claims, responses=responses
        )


@pytest.fixture
def dirs(short_dir: Path) -> Dirs:
    return Dirs(short_dir)


@pytest.fixture
def kubelet(dirs: Dirs) -> Iterator[KubeletDraEmulator]:
    emulator = KubeletDraEmulator(dirs.settings().registry_dir)
    emulator.start()
    yield emulator
    emulator.stop()


@pytest.fixture
def claims() -> FakeClaims:
    return FakeClaims()


@pytest.fixture
def plugin(dirs: Dirs, claims: FakeClaims) -> Iterator[DraKubeletPlugin]:
    running = dirs.plugin(claims)
    running.start()
    yield running
    running.stop()


def registered(plugin: DraKubeletPlugin, count: int = 1) -> None:
    wait_until(lambda: plugin.status().registrations >= count, 10, f"registration #{count} notified")


def test_registration_round_trip(dirs: Dirs, kubelet: KubeletDraEmulator, plugin: DraKubeletPlugin) -> None:
    connection = kubelet.wait_for_plugin(DRIVER)
    registered(plugin)
    [registration] = kubelet.registrations
    assert registration.socket == dirs.root / "reg" / "gpu.vcuda.io-reg.sock"
    assert registration.info is not None
    info = registration.info
    assert (info.type, info.name) == ("DRAPlugin", "gpu.vcuda.io")
    assert info.endpoint == str(dirs.root / "plugins" / DRIVER / "dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert (registration.service, registration.error) == ("v1.DRAPlugin", "")
    assert connection.service == "v1.DRAPlugin"
    status = plugin.status()
    assert (status.serving, status.registered, status.last_error) == (True, True, "")


def test_prepare_and_unprepare_a_claim_from_the_api_server(
    dirs: Dirs, kubelet: KubeletDraEmulator, apiserver: FakeApiServer, kube: ApiClient
) -> None:
    resource: Any = ResourceV1Api(kube)  # the typed client, fed plain JSON
    resource.create_namespaced_resource_claim("default", body=claim_manifest("train"), _preload_content=False)
    claim = apiserver.get_object("resourceclaims", "train", "default")
    assert claim is not None and "status" not in claim
    resource.patch_namespaced_resource_claim_status(
        "train",
        "default",
        body={"status": allocation_status([Result("gpu", 1, 30, "4Gi")])},
        _content_type="application/merge-patch+json",
        _preload_content=False,
    )
    ref = ClaimRef("default", "train", claim["metadata"]["uid"])
    plugin = dirs.plugin(ResourceClaimClient(kube))
    plugin.start()
    try:
        kubelet.wait_for_plugin(DRIVER)
        answer = kubelet.prepare(DRIVER, [ref])
        name = f"{ref.uid}-gpu-gpu1"
        assert answer[ref.uid].error == ""
        assert answer[ref.uid].devices == [PreparedDevice(["gpu"], NODE, "gpu-1", [f"vcuda.io/gpu={name}"])]
        spec_path = dirs.root / "cdi" / f"vcuda.io-gpu_{ref.uid}.json"
        spec = json.loads(spec_path.read_text())
        assert cdi_problems(spec) == []
        assert [d["name"] for d in spec["devices"]] == [name]
        assert kubelet.prepare(DRIVER, [ref]) == answer  # idempotent
        assert [c.ref for c in plugin.prepared.prepared()] == [ref]
        assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
        assert not spec_path.exists()
        assert plugin.prepared.prepared() == []
        assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}  # unknown now: still success
    finally:
        plugin.stop()


def test_per_claim_errors_are_answered_per_claim(
    kubelet: KubeletDraEmulator, plugin: DraKubeletPlugin, claims: FakeClaims
) -> None:
    good = allocated_claim("good")
    elsewhere = allocated_claim("elsewhere", [Result("gpu", 0, pool="gpu-node-2")])
    pending = claim_manifest("pending")
    pending["metadata"]["uid"] = "55555555-5555-5555-5555-555555555555"
    for claim in (good, elsewhere, pending):
        claims.put(claim)
    stale = ClaimRef("default", "good", "66666666-6666-6666-6666-666666666666")
    kubelet.wait_for_plugin(DRIVER)
    answer = kubelet.prepare(DRIVER, [ref_of(good), ref_of(elsewhere), ref_of(pending), stale])
    assert answer[ref_of(good).uid].error == ""
    assert "not this node's pool 'gpu-node-1'" in answer[ref_of(elsewhere).uid].error
    assert (
        answer[ref_of(pending).uid].error == "claim default/pending is not allocated (no status.allocation)"
    )
    assert answer[stale.uid].error == (
        f"claim default/good has UID {ref_of(good).uid}, kubelet asked for {stale.uid}"
    )
    assert answer[stale.uid].devices == []


def test_kubelet_gives_a_container_only_the_devices_of_the_request_it_names() -> None:
    """kubelet's cdiDevicesAsList: a container naming request ``gpu`` gets the devices whose
    request names contain ``gpu`` or that name none; one naming no request gets all."""
    result = PrepareResult(
        [
            PreparedDevice(["gpu"], NODE, "gpu-0", ["k/a=0"]),
            PreparedDevice(["nic"], NODE, "eth0", ["k/a=1"]),
            PreparedDevice([], NODE, "gpu-1", ["k/a=2"]),
            PreparedDevice(["gpu/small"], NODE, "gpu-1", ["k/a=3"]),
        ]
    )
    assert container_cdi_ids(result, "gpu") == ["k/a=0", "k/a=2"]  # never a subrequest name
    assert container_cdi_ids(result, "nic") == ["k/a=1", "k/a=2"]
    assert container_cdi_ids(result) == ["k/a=0", "k/a=1", "k/a=2", "k/a=3"]


def test_a_subrequest_is_answered_under_its_main_request_so_the_container_gets_its_gpu(
    kubelet: KubeletDraEmulator, plugin: DraKubeletPlugin, claims: FakeClaims
) -> None:
    """A claim allocated from ``firstAvailable`` (result request ``gpu/small``): the answer
    names ``gpu``, the only request a container can name, so kubelet hands the container the
    device; answering ``gpu/small`` left it without."""
    claim = allocated_claim("pick", [Result("gpu/small", 0, 20, "2Gi")])
    alternatives = [
        {"name": name, "deviceClassName": DRIVER, "capacity": {"requests": {"cores": cores}}}
        for name, cores in (("small", "20"), ("large", "60"))
    ]
    claim["spec"]["devices"]["requests"] = [{"name": "gpu", "firstAvailable": alternatives}]
    claims.put(claim)
    ref = ref_of(claim)
    kubelet.wait_for_plugin(DRIVER)
    result = kubelet.prepare(DRIVER, [ref])[ref.uid]
    cdi_id = f"vcuda.io/gpu={ref.uid}-gpu.small-gpu0"
    assert (result.error, result.devices) == ("", [PreparedDevice(["gpu"], NODE, "gpu-0", [cdi_id])])
    assert container_cdi_ids(result, "gpu") == [cdi_id]
    assert kubelet.prepare(DRIVER, [ref])[ref.uid] == result  # answered again from the record


def test_a_kubelet_that_speaks_only_v1beta1(dirs: Dirs, plugin: DraKubeletPlugin, claims: FakeClaims) -> None:
    old = KubeletDraEmulator(dirs.settings().registry_dir, services=("v1beta1.DRAPlugin",))
    old.start()
    try:
        assert old.wait_for_plugin(DRIVER).service == "v1beta1.DRAPlugin"
        claim = allocated_claim("c", [Result("gpu", 0)])
        claims.put(claim)
        ref = ref_of(claim)
        answer = old.prepare(DRIVER, [ref])
        assert answer[ref.uid].devices[0].cdi_ids == [f"vcuda.io/gpu={ref.uid}-gpu-gpu0"]
        assert old.unprepare(DRIVER, [ref]) == {ref.uid: ""}
    finally:
        old.stop()


def test_a_kubelet_that_speaks_neither_refuses_and_the_plugin_says_so(
    dirs: Dirs, plugin: DraKubeletPlugin
) -> None:
    future = KubeletDraEmulator(dirs.settings().registry_dir, services=("v2.DRAPlugin",))
    future.start()
    try:
        wait_until(lambda: plugin.status().last_error, 10, "the refusal notified")
        assert "none of services supported by the plugin" in plugin.status().last_error
        assert not plugin.status().registered
        assert future.plugins == {}
    finally:
        future.stop()


def test_registration_socket_removed_or_registry_wiped(
    dirs: Dirs, kubelet: KubeletDraEmulator, plugin: DraKubeletPlugin, claims: FakeClaims
) -> None:
    kubelet.wait_for_plugin(DRIVER)
    registered(plugin)
    socket = dirs.settings().registration_socket
    os.unlink(socket)
    registered(plugin, 2)  # served again, seen by the watcher, registered anew
    assert socket.exists()
    kubelet.restart(wipe=True)  # the registry directory re-created under the plugin
    registered(plugin, 3)
    assert plugin.status().restarts == 2
    # The plugin counts a registration when kubelet's status reaches it; kubelet's own list
    # of drivers is updated on its side of that exchange, a moment apart.
    kubelet.wait_for_plugin(DRIVER)
    claim = allocated_claim("after")
    claims.put(claim)
    assert kubelet.prepare(DRIVER, [ref_of(claim)])[ref_of(claim).uid].error == ""


def test_a_kubelet_restart_registers_the_running_plugin_again(
    kubelet: KubeletDraEmulator, plugin: DraKubeletPlugin
) -> None:
    kubelet.wait_for_plugin(DRIVER)
    registered(plugin)
    kubelet.restart()
    kubelet.wait_for_plugin(DRIVER)
    registered(plugin, 2)
    assert plugin.status().restarts == 0  # nothing had to be served again


def test_dra_socket_removed_is_served_again(
    dirs: Dirs, kubelet: KubeletDraEmulator, plugin: DraKubeletPlugin, claims: FakeClaims
) -> None:
    kubelet.wait_for_plugin(DRIVER)
    os.unlink(dirs.settings().dra_socket)
    wait_until(
        lambda: plugin.status().restarts == 1 and dirs.settings().dra_socket.exists(), 5, "DRA socket back"
    )
    claim = allocated_claim("c")
    claims.put(claim)
    assert kubelet.prepare(DRIVER, [ref_of(claim)])[ref_of(claim).uid].error == ""


def test_an_agent_restart_answers_the_same_and_unprepares(
    dirs: Dirs, kubelet: KubeletDraEmulator, claims: FakeClaims
) -> None:
    claim = allocated_claim("c", [Result("a", 0, 20), Result("b", 1, None, None)])
    claims.put(claim)
    ref = ref_of(claim)
    first = dirs.plugin(claims)
    first.start()
    kubelet.wait_for_plugin(DRIVER)
    before = kubelet.prepare(DRIVER, [ref])
    first.stop()
    wait_until(lambda: DRIVER not in kubelet.plugins, 5, "the stopped plugin deregistered")
    second = dirs.plugin(FakeClaims())  # knows nothing from the API: the checkpoint answers
    second.start()
    try:
        kubelet.wait_for_plugin(DRIVER)
        assert [c.ref for c in second.prepared.prepared()] == [ref]
        assert kubelet.prepare(DRIVER, [ref]) == before
        assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
        assert list((dirs.root / "cdi").iterdir()) == []
    finally:
        second.stop()
    assert not dirs.settings().registration_socket.exists()
    assert not dirs.settings().dra_socket.exists()


@pytest.mark.parametrize("mode", [SharingMode.MPS, SharingMode.FREEZER])
def test_mps_mode_puts_the_daemons_limits_in_the_spec(
    dirs: Dirs, claims: FakeClaims, mode: SharingMode
) -> None:
    settings = SharingSettings(
        mode=mode, mps_root=dirs.root / "mps", ready_timeout_s=5.0, advisory_limits=True
    )
    sharing = MpsSharing(settings, gpus=GPUS, command=[str(STANDIN), "-f"], mode=lambda: settings.mode)
    responses = ResponseBuilder(DeviceListStrategy.MOUNTS, DRIVER_FILES, Path("/"))
    plugin = DraKubeletPlugin(
        dirs.settings(), node_name=NODE, gpus=GPUS, claims=claims, responses=responses, mps=sharing
    )
    claim = allocated_claim("c", [Result("gpu", 0, 30, "4Gi")])
    claims.put(claim)
    try:
        plugin.preparer.prepare(ref_of(claim))
    finally:
        for daemon in sharing._daemons.values():
            daemon.stop()
    spec = json.loads((dirs.root / "cdi" / f"vcuda.io-gpu_{ref_of(claim).uid}.json").read_text())
    edits = spec["devices"][0]["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    hosts = [m["hostPath"] for m in edits["mounts"]]
    if mode is SharingMode.MPS:  # the daemon's pipes, 29 % (whole TPCs of an H100's 132 SMs)
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "29"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        assert str(dirs.root / "mps" / GPUS[0].uuid / "pipe") in hosts
    else:
        assert not [k for k in env if k.startswith("CUDA_MPS_")]
        assert not [h for h in hosts if h.startswith(str(dirs.root / "mps"))]


def test_reading_a_missing_claim_is_a_kube_error(kube: ApiClient) -> None:
    with pytest.raises(KubeError) as info:
        ResourceClaimClient(kube).get("default", "nope")
    assert info.value.status == 404
    assert str(info.value).startswith("read ResourceClaim default/nope failed (HTTP 404)")
