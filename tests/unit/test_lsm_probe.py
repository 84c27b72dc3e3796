"""The BPF LSM feature probe over fake securityfs and BTF trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.platform.bpf.lsm import probe_bpf_lsm


def no_bcc() -> object:
    raise ImportError("No module named 'bcc'")


def bcc_ok() -> object:
    return object()


@pytest.fixture
def btf(tmp_path: Path) -> Path:
    path = tmp_path / "btf" / "vmlinux"
    path.parent.mkdir()
    path.write_bytes(b"\x9f\xeb\x01\x00")
    return path


def security(tmp_path: Path, lsm: str | None) -> Path:
    root = tmp_path / "security"
    root.mkdir()
    if lsm is not None:
        (root / "lsm").write_text(lsm)
    return root


def test_usable_when_bpf_is_listed_with_btf_and_bcc(tmp_path: Path, btf: Path) -> None:
    support = probe_bpf_lsm(security(tmp_path, "lockdown,capability,landlock,bpf"), btf, import_bcc=bcc_ok)
    assert support.usable and support.reason == ""


def test_not_usable_when_bpf_is_not_listed(tmp_path: Path, btf: Path) -> None:
    support = probe_bpf_lsm(security(tmp_path, "lockdown,capability,yama,apparmor"), btf, import_bcc=bcc_ok)
    assert not support.usable
    assert "BPF LSM is not active" in support.reason
    assert "lockdown,capability,yama,apparmor" in support.reason


def test_a_name_containing_bpf_is_not_bpf(tmp_path: Path, btf: Path) -> None:
    support = probe_bpf_lsm(security(tmp_path, "capability,bpfish"), btf, import_bcc=bcc_ok)
    assert not support.usable


def test_not_usable_when_the_lsm_file_is_missing(tmp_path: Path, btf: Path) -> None:
    root = security(tmp_path, None)
    support = probe_bpf_lsm(root, btf, import_bcc=bcc_ok)
    assert not support.usable
    assert str(root / "lsm") in support.reason and "securityfs is not mounted" in support.reason


def test_not_usable_without_btf(tmp_path: Path) -> None:
    support = probe_bpf_lsm(security(tmp_path, "bpf"), tmp_path / "no-btf", import_bcc=bcc_ok)
    assert not support.usable and "BTF" in support.reason


def test_not_usable_without_bcc(tmp_path: Path, btf: Path) -> None:
    support = probe_bpf_lsm(security(tmp_path, "bpf\n"), btf, import_bcc=no_bcc)
    assert not support.usable and "bcc is not importable" in support.reason
