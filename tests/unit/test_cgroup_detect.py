"""Detection over fake trees: cgroup layout from mountinfo or files, driver and runtime precedence."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.errors import ConfigError, PlatformError
from agent.platform.cgroups.detect import (
    CgroupDriver,
    RuntimeFacts,
    detect_runtime_facts,
    normalize_endpoint,
    runtime_name_of,
)
from agent.platform.cgroups.layout import UNIFIED, CgroupMode, detect_layout, parse_mountinfo

# This machine's mountinfo (Debian 12, hybrid), plus unrelated mounts.
HYBRID_MOUNTINFO = """\
22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""
# Ubuntu 20.04 style: co-mounted controllers with optional fields before the separator.
V1_MOUNTINFO = """\
25 24 0:23 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid shared:10 - cgroup cgroup rw,xattr,name=systemd
29 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:13 master:2 - cgroup cgroup rw,cpu,cpuacct
30 25 0:28 / /sys/fs/cgroup/net_cls,net_prio rw shared:14 - cgroup cgroup rw,net_cls,net_prio
31 25 0:29 / /sys/fs/cgroup/devices rw,nosuid shared:15 - cgroup cgroup rw,devices
"""
V2_MOUNTINFO = (
    "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_hybrid_from_mountinfo(tmp_path: Path) -> None:
    layout = detect_layout(Path("/sys/fs/cgroup"), write(tmp_path / "mi", HYBRID_MOUNTINFO))
    assert layout.mode == CgroupMode.HYBRID
    assert layout.v2_root == Path("/sys/fs/cgroup/unified")
    assert layout.v1_roots == {
        "cpu": Path("/sys/fs/cgroup/cpu"),
        "cpuacct": Path("/sys/fs/cgroup/cpuacct"),
        "devices": Path("/sys/fs/cgroup/devices"),
        "freezer": Path("/sys/fs/cgroup/freezer"),
        "systemd": Path("/sys/fs/cgroup/systemd"),
    }
    assert layout.root_for("devices") == Path("/sys/fs/cgroup/devices")
    assert layout.root_for(UNIFIED) == Path("/sys/fs/cgroup/unified")


def test_v1_with_comounted_controllers(tmp_path: Path) -> None:
    layout = detect_layout(Path("/sys/fs/cgroup"), write(tmp_path / "mi", V1_MOUNTINFO))
    assert layout.mode == CgroupMode.V1
    assert layout.v2_root is None
    assert layout.root_for("cpu") == layout.root_for("cpuacct") == Path("/sys/fs/cgroup/cpu,cpuacct")
    assert layout.root_for("net_prio") == Path("/sys/fs/cgroup/net_cls,net_prio")
    with pytest.raises(PlatformError, match="no cgroup v2 hierarchy"):
        layout.root_for(UNIFIED)


def test_pure_v2_serves_every_controller_from_one_root(tmp_path: Path) -> None:
    layout = detect_layout(Path("/sys/fs/cgroup"), write(tmp_path / "mi", V2_MOUNTINFO))
    assert layout.mode == CgroupMode.V2
    assert layout.root_for("devices") == layout.root_for(UNIFIED) == Path("/sys/fs/cgroup")


def test_only_mounts_under_the_injected_root_count(tmp_path: Path) -> None:
    text = HYBRID_MOUNTINFO.replace("/sys/fs/cgroup", "/host/sys/fs/cgroup") + V2_MOUNTINFO
    layout = detect_layout(Path("/host/sys/fs/cgroup"), write(tmp_path / "mi", text))
    assert layout.mode == CgroupMode.HYBRID
    assert layout.v2_root == Path("/host/sys/fs/cgroup/unified")


@pytest.mark.parametrize(
    ("over", "mode"),
    [
        # A privileged container's own cgroup mount, then the host's bind-mounted over it.
        ("90 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw", CgroupMode.V2),
        # A fresh tmpfs over the hybrid root, then v1 hierarchies mounted again: a legacy node.
        (
            "90 31 0:50 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
            "91 90 0:33 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices",
            CgroupMode.V1,
        ),
    ],
)
def test_mounts_hidden_under_a_later_mount_do_not_count(tmp_path: Path, over: str, mode: CgroupMode) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(HYBRID_MOUNTINFO + over + "\n")
    layout = detect_layout(Path("/sys/fs/cgroup"), mountinfo)
    assert layout.mode is mode
    if mode is CgroupMode.V2:
        assert (layout.v2_root, layout.v1_roots) == (Path("/sys/fs/cgroup"), {})
    else:
        assert (layout.v2_root, layout.v1_roots) == (None, {"devices": Path("/sys/fs/cgroup/devices")})


def test_escaped_mount_points() -> None:
    mounts = parse_mountinfo("41 31 0:38 / /mnt/my\\040cgroups rw - cgroup2 cgroup2 rw\n")
    assert mounts[0].mount_point == Path("/mnt/my cgroups")


def test_directory_fallback_for_a_fake_hybrid_tree(tmp_path: Path) -> None:
    write(tmp_path / "unified" / "cgroup.controllers", "")
    write(tmp_path / "devices" / "devices.list", "a *:* rwm\n")
    write(tmp_path / "freezer" / "freezer.state", "THAWED\n")
    write(tmp_path / "cpu,cpuacct" / "cpu.shares", "1024\n")
    write(tmp_path / "cpu,cpuacct" / "cpuacct.usage", "0\n")
    (tmp_path / "cpu").symlink_to("cpu,cpuacct")
    (tmp_path / "empty").mkdir()
    layout = detect_layout(tmp_path, tmp_path / "no-mountinfo")
    assert layout.mode == CgroupMode.HYBRID
    assert layout.v2_root == tmp_path / "unified"
    assert layout.v1_roots == {
        "devices": tmp_path / "devices",
        "freezer": tmp_path / "freezer",
        "cpu": tmp_path / "cpu,cpuacct",
        "cpuacct": tmp_path / "cpu,cpuacct",
    }
    assert layout.source == f"files under {tmp_path}"


def test_directory_fallback_for_a_fake_v2_tree(tmp_path: Path) -> None:
    write(tmp_path / "cgroup.controllers", "cpu memory\n")
    layout = detect_layout(tmp_path, tmp_path / "no-mountinfo")
    assert (layout.mode, layout.v2_root) == (CgroupMode.V2, tmp_path)


def test_nothing_mounted_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(
        PlatformError, match=r"no cgroup hierarchy found at .* mount the host's /sys/fs/cgroup"
    ):
        detect_layout(tmp_path, tmp_path / "no-mountinfo")


@pytest.fixture
def v2_tree(tmp_path: Path) -> Path:
    write(tmp_path / "cg" / "cgroup.controllers", "")
    return tmp_path


def facts_for(
    root: Path, driver_override: str | None = None, runtime_override: str | None = None
) -> RuntimeFacts:
    return detect_runtime_facts(
        cgroup_root=root / "cg",
        mountinfo=root / "no-mountinfo",
        kubelet_config=root / "kubelet" / "config.yaml",
        host_root=root / "host",
        driver_override=driver_override,
        runtime_override=runtime_override,
    )


def test_driver_precedence(v2_tree: Path) -> None:
    facts = facts_for(v2_tree)
    assert (facts.driver, facts.driver_source) == (CgroupDriver.SYSTEMD, "default")

    (v2_tree / "cg" / "kubepods").mkdir()
    facts = facts_for(v2_tree)
    assert (facts.driver, facts.driver_source) == (
        CgroupDriver.CGROUPFS,
        f"found {v2_tree / 'cg' / 'kubepods'}",
    )

    config = write(v2_tree / "kubelet" / "config.yaml", "kind: KubeletConfiguration\ncgroupDriver: systemd\n")
    facts = facts_for(v2_tree)
    assert (facts.driver, facts.driver_source) == (CgroupDriver.SYSTEMD, str(config))

    facts = facts_for(v2_tree, driver_override="cgroupfs")
    assert (facts.driver, facts.driver_source) == (CgroupDriver.CGROUPFS, "node config")


def test_systemd_paths_found(v2_tree: Path) -> None:
    (v2_tree / "cg" / "kubepods.slice").mkdir()
    facts = facts_for(v2_tree)
    assert facts.driver == CgroupDriver.SYSTEMD
    assert facts.driver_source == f"found {v2_tree / 'cg' / 'kubepods.slice'}"


@pytest.mark.parametrize(
    ("text", "note"),
    [
        ("cgroupDriver: [unclosed\n", "not valid YAML"),
        ("- a list\n", "not a YAML mapping"),
        ("cgroupDriver: nonsense\n", "ignored cgroupDriver 'nonsense'"),
    ],
)
def test_an_unusable_kubelet_config_is_noted_and_skipped(v2_tree: Path, text: str, note: str) -> None:
    (v2_tree / "cg" / "kubepods").mkdir()
    write(v2_tree / "kubelet" / "config.yaml", text)
    facts = facts_for(v2_tree)
    assert facts.driver == CgroupDriver.CGROUPFS
    assert any(note in n for n in facts.notes), facts.notes
    assert any(note in line for line in facts.describe())


def test_invalid_driver_override_is_a_config_error(v2_tree: Path) -> None:
    with pytest.raises(ConfigError, match="must be systemd or cgroupfs"):
        facts_for(v2_tree, driver_override="openrc")


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


def listen(path: Path, made: list[socket.socket]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    made.append(sock)


def test_runtime_sockets_in_order(short_dir: Path, sockets: list[socket.socket]) -> None:
    write(short_dir / "cg" / "cgroup.controllers", "")
    host = short_dir / "host"
    assert facts_for(short_dir).runtime_endpoint is None
    assert facts_for(short_dir).runtime_source == "none found"

    write(host / "var/run/docker.sock", "")  # a plain file is not a socket
    assert facts_for(short_dir).runtime_endpoint is None

    listen(host / "run/containerd/containerd.sock", sockets)
    facts = facts_for(short_dir)
    assert (facts.runtime_endpoint, facts.runtime_name) == (
        "unix:///run/containerd/containerd.sock",
        "containerd",
    )
    assert facts.runtime_source == f"found {host / 'run/containerd/containerd.sock'}"

    listen(host / "var/run/crio/crio.sock", sockets)
    assert facts_for(short_dir).runtime_name == "cri-o"

    listen(host / "run/cri-dockerd.sock", sockets)  # docker's own containerd is not kubelet's runtime
    assert facts_for(short_dir).runtime_endpoint == "unix:///run/cri-dockerd.sock"

    write(short_dir / "kubelet" / "config.yaml", "containerRuntimeEndpoint: unix:///run/other/crio.sock\n")
    facts = facts_for(short_dir)
    assert (facts.runtime_endpoint, facts.runtime_name) == ("unix:///run/other/crio.sock", "cri-o")
    assert facts.runtime_source == str(short_dir / "kubelet" / "config.yaml")

    facts = facts_for(short_dir, runtime_override="/run/k3s/containerd/containerd.sock")
    assert facts.runtime_endpoint == "unix:///run/k3s/containerd/containerd.sock"
    assert (facts.runtime_name, facts.runtime_source) == ("containerd (k3s)", "node config")


def test_endpoint_helpers() -> None:
    assert normalize_endpoint("/run/x.sock") == "unix:///run/x.sock"
    assert normalize_endpoint("unix:///run/x.sock") == "unix:///run/x.sock"
    with pytest.raises(ConfigError):
        normalize_endpoint("tcp://1.2.3.4:5")
    assert runtime_name_of("unix:///var/run/docker.sock") == "docker"
    assert runtime_name_of("unix:///somewhere/else.sock") is None


def test_describe_and_as_dict(tmp_path: Path) -> None:
    write(tmp_path / "kubelet" / "config.yaml", "cgroupDriver: cgroupfs\n")
    facts = detect_runtime_facts(
        cgroup_root=Path("/sys/fs/cgroup"),
        mountinfo=write(tmp_path / "mi", HYBRID_MOUNTINFO),
        kubelet_config=tmp_path / "kubelet" / "config.yaml",
        host_root=tmp_path / "host",
        runtime_override="/run/containerd/containerd.sock",
    )
    lines = facts.describe()
    assert lines[0] == f"cgroup layout: hybrid (from {tmp_path / 'mi'})"
    assert "cgroup v2 hierarchy: /sys/fs/cgroup/unified" in lines
    assert f"cgroup driver: cgroupfs (from {tmp_path / 'kubelet' / 'config.yaml'})" in lines
    assert (
        "container runtime: containerd at unix:///run/containerd/containerd.sock (from node config)" in lines
    )
    data = json.loads(json.dumps(facts.as_dict()))
    assert data["cgroup"]["mode"] == "hybrid"
    assert data["cgroup"]["v1_roots"]["devices"] == "/sys/fs/cgroup/devices"
    assert data["cgroup_driver"] == {"value": "cgroupfs", "source": str(tmp_path / "kubelet" / "config.yaml")}
    assert data["runtime"]["name"] == "containerd"
