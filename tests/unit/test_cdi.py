"""CDI spec files: names the CDI spec allows, the JSON written, atomic replacement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.platform.cdi import (
    CdiDevice,
    CdiError,
    ContainerEdits,
    DeviceNode,
    Mount,
    check_kind,
    qualified_name,
    remove_spec,
    spec_json,
    transient_spec_path,
    write_spec,
)
from tests.unit.cdischema import cdi_problems

EDITS = ContainerEdits(
    env=("A=1", "B=two"),
    device_nodes=(DeviceNode("/dev/nvidia0", "/host/dev/nvidia0"),),
    mounts=(Mount("/run/pipe", "/run/vcuda/mps/pipe", read_only=False),),
)


def test_kinds_and_names() -> None:
    assert check_kind("vcuda.io/gpu") == ("vcuda.io", "gpu")
    for bad in ("gpu", "vcuda.io/", "Vcuda.io/gpu", "vcuda.io/gpu/x", "vcuda.io/-gpu"):
        with pytest.raises(CdiError, match="CDI kind"):
            check_kind(bad)
    assert qualified_name("vcuda.io/gpu", "abc-req.sub-gpu0") == "vcuda.io/gpu=abc-req.sub-gpu0"
    for bad in ("", "-a", "a/b", "a=b", "a-"):
        with pytest.raises(CdiError, match="CDI device name"):
            qualified_name("vcuda.io/gpu", bad)


def test_transient_spec_path_is_cdis_name() -> None:
    assert transient_spec_path(Path("/var/run/cdi"), "vcuda.io/gpu", "1234-ab") == Path(
        "/var/run/cdi/vcuda.io-gpu_1234-ab.json"
    )
    with pytest.raises(CdiError, match="transient"):
        transient_spec_path(Path("/x"), "vcuda.io/gpu", "../etc")


def test_spec_json_is_a_valid_spec() -> None:
    spec = spec_json("vcuda.io/gpu", [CdiDevice("d0", EDITS), CdiDevice("d1", ContainerEdits())], {"k": "v"})
    assert cdi_problems(spec) == []
    assert spec["devices"][0]["containerEdits"] == {
        "env": ["A=1", "B=two"],
        "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/host/dev/nvidia0", "permissions": "rw"}],
        "mounts": [
            {
                "hostPath": "/run/vcuda/mps/pipe",
                "containerPath": "/run/pipe",
                "options": ["rw", "nosuid", "nodev", "bind"],
            }
        ],
    }
    assert spec["devices"][1]["containerEdits"] == {}


def test_spec_json_refuses_what_cdi_refuses() -> None:
    with pytest.raises(CdiError, match="at least one device"):
        spec_json("vcuda.io/gpu", [])
    with pytest.raises(CdiError, match="repeated in one spec: d0"):
        spec_json("vcuda.io/gpu", [CdiDevice("d0", EDITS), CdiDevice("d0", EDITS)])


def test_the_checker_catches_what_cdi_refuses() -> None:
    # The schema checker the plugin's specs are held to must itself be able to fail.
    spec = spec_json("vcuda.io/gpu", [CdiDevice("d0", EDITS)])
    spec["devices"][0]["containerEdits"]["deviceNodes"][0]["permissions"] = "rwx"
    spec["devices"][0]["containerEdits"]["env"].append("NOVALUE")
    spec["devices"][0]["name"] = "a/b"
    spec["extra"] = 1
    assert len(cdi_problems(spec)) == 4


def test_write_replaces_atomically_and_remove_is_idempotent(tmp_path: Path) -> None:
    path = tmp_path / "cdi" / "vcuda.io-gpu_x.json"
    write_spec(path, {"a": 1})
    write_spec(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    assert path.stat().st_mode & 0o777 == 0o644  # runtimes read it as another user too
    assert remove_spec(path) is True
    assert remove_spec(path) is False


def test_write_failure_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "cdi").write_text("not a directory")
    with pytest.raises(CdiError, match=r"cannot write the CDI spec .*cdi/s\.json"):
        write_spec(tmp_path / "cdi" / "s.json", {})
