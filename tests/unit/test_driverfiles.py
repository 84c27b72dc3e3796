"""Finding the NVIDIA driver files to mount, with symlinks resolved inside the driver root."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agent.platform.driverfiles import DriverFiles, DriverMount, container_library_dirs, discover_driver_files

LIB = "usr/lib/x86_64-linux-gnu"
REAL_LIBCUDA = "libcuda.so.550.54.15"
HOST_ROOT = Path("/run/nvidia/driver")


def make_driver_root(root: Path) -> None:
    lib = root / LIB
    lib.mkdir(parents=True)
    (lib / REAL_LIBCUDA).write_bytes(b"\x7fELF")
    (lib / "libcuda.so.1").symlink_to(REAL_LIBCUDA)  # relative
    # Absolute: must be read as <root>/usr/lib/..., never as this machine's /usr/lib/...
    (lib / "libcuda.so").symlink_to(f"/{LIB}/libcuda.so.1")
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.550.54.15")  # dangling
    (lib / "libfoo.so").write_bytes(b"\x7fELF")  # not a driver library
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/nvidia-smi").write_bytes(b"#!")
    (root / "usr/bin/ls").write_bytes(b"#!")  # not a driver binary


def lib_mounts(host_root: Path) -> set[DriverMount]:
    """Each library in both families' linker directories (this host is x86_64 or aarch64)."""
    real = str(host_root / LIB / REAL_LIBCUDA)
    return {
        DriverMount(f"{d}/{name}", real)
        for d in container_library_dirs()
        for name in ("libcuda.so", "libcuda.so.1", REAL_LIBCUDA)
    }


def test_mounts_name_real_files_under_the_host_root(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    files = discover_driver_files(HOST_ROOT, visible_root=tmp_path)
    assert set(files.libraries) == lib_mounts(HOST_ROOT)
    assert len(files.libraries) == 3 * len(container_library_dirs())
    assert files.binaries == (DriverMount("/usr/bin/nvidia-smi", "/run/nvidia/driver/usr/bin/nvidia-smi"),)
    assert files.mounts == files.libraries + files.binaries
    # Nothing names the agent's view of the root.
    assert not any(str(tmp_path) in m.host_path for m in files.mounts)


def test_without_visible_root_host_paths_are_under_the_root(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    files = discover_driver_files(tmp_path)
    assert set(files.libraries) == lib_mounts(tmp_path)
    for mount in files.mounts:
        assert Path(mount.host_path).is_file()
        assert not Path(mount.host_path).is_symlink()


def test_skips_dangling_links_and_unrelated_files(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    names = {Path(m.container_path).name for m in discover_driver_files(tmp_path).mounts}
    assert "libnvidia-ml.so.1" not in names
    assert "libfoo.so" not in names
    assert "ls" not in names


def test_link_escaping_the_root_is_resolved_inside_it(tmp_path: Path) -> None:
    lib = tmp_path / LIB
    lib.mkdir(parents=True)
    (lib / "libnvidia-cfg.so.1").symlink_to("../../../../../../etc/hostname")
    assert discover_driver_files(tmp_path) == DriverFiles()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hostname").write_text("inside")
    assert discover_driver_files(tmp_path, machine="x86_64").libraries == (
        DriverMount("/usr/lib/x86_64-linux-gnu/libnvidia-cfg.so.1", str(tmp_path / "etc/hostname")),
        DriverMount("/usr/lib64/libnvidia-cfg.so.1", str(tmp_path / "etc/hostname")),
    )


def test_symlink_loop_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lib = tmp_path / LIB
    lib.mkdir(parents=True)
    (lib / "libnvidia-cfg.so.1").symlink_to("libnvidia-cfg.so.2")
    (lib / "libnvidia-cfg.so.2").symlink_to("libnvidia-cfg.so.1")
    with caplog.at_level(logging.WARNING, logger="agent.platform.driverfiles"):
        assert discover_driver_files(tmp_path).libraries == ()
    assert "too many symlinks" in caplog.text


def test_directory_named_like_a_library_is_skipped(tmp_path: Path) -> None:
    (tmp_path / LIB / "libcuda.so.1").mkdir(parents=True)
    assert discover_driver_files(tmp_path).libraries == ()


def test_first_library_dir_wins_for_a_name(tmp_path: Path) -> None:
    for rel in (LIB, "usr/lib64"):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "libcuda.so.1").write_bytes(b"\x7fELF")
    (tmp_path / "usr/lib64/libnvidia-ml.so.1").write_bytes(b"\x7fELF")
    found = discover_driver_files(tmp_path, machine="aarch64")
    libs = {m.container_path: m.host_path for m in found.libraries}
    assert libs == {
        "/usr/lib/aarch64-linux-gnu/libcuda.so.1": str(tmp_path / LIB / "libcuda.so.1"),
        "/usr/lib64/libcuda.so.1": str(tmp_path / LIB / "libcuda.so.1"),
        "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1": str(tmp_path / "usr/lib64/libnvidia-ml.so.1"),
        "/usr/lib64/libnvidia-ml.so.1": str(tmp_path / "usr/lib64/libnvidia-ml.so.1"),
    }


@pytest.mark.parametrize(
    ("machine", "dirs"),
    [
        ("x86_64", ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"]),
        ("aarch64", ["/usr/lib/aarch64-linux-gnu", "/usr/lib64"]),
        ("riscv64", ["/usr/lib64"]),  # no triplet known: the RHEL-family directory only
    ],
)
def test_libraries_go_where_the_linker_looks_without_ld_library_path(machine: str, dirs: list[str]) -> None:
    assert [str(d) for d in container_library_dirs(machine)] == dirs


def test_nothing_is_mounted_under_a_directory_only_ld_library_path_or_path_names(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    for mount in discover_driver_files(tmp_path).mounts:
        assert not mount.container_path.startswith("/usr/local/nvidia/"), mount
        assert str(Path(mount.container_path).parent) in {"/usr/bin", *map(str, container_library_dirs())}


@pytest.mark.parametrize("populate", [False, True], ids=["empty-root", "empty-dirs"])
def test_empty_root_has_no_mounts(tmp_path: Path, populate: bool, caplog: pytest.LogCaptureFixture) -> None:
    if populate:
        for rel in (LIB, "usr/bin"):
            (tmp_path / rel).mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="agent.platform.driverfiles"):
        files = discover_driver_files(HOST_ROOT, visible_root=tmp_path)
    assert files == DriverFiles()
    assert files.mounts == ()
    assert "no NVIDIA driver libraries" in caplog.text


def test_missing_root_has_no_mounts(tmp_path: Path) -> None:
    assert discover_driver_files(tmp_path / "absent").mounts == ()


def test_fixture_links_are_as_intended(tmp_path: Path) -> None:
    """Guards the fixture: the absolute link really is absolute and the other dangles."""
    make_driver_root(tmp_path)
    assert os.readlink(tmp_path / LIB / "libcuda.so") == f"/{LIB}/libcuda.so.1"
    assert not (tmp_path / LIB / "libnvidia-ml.so.1").exists()
