"""Walking cgroup trees whose directories vanish meanwhile (a container's runtime removing
its cgroup while a clean-up walks ``kubepods``): no ``FileNotFoundError`` escapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.errors import PlatformError
from agent.platform.cgroups import tree


def _make(top: Path, *rels: str) -> None:
    for rel in rels:
        (top / rel).mkdir(parents=True)


def _vanish_after_listing(monkeypatch: pytest.MonkeyPatch, listed: Path, gone: Path) -> list[str]:
    """os.scandir of ``listed`` returns its entries, then ``gone`` is removed (by "its runtime")
    before the walk descends into it."""
    real = os.scandir
    seen: list[str] = []

    def scandir(path: str | os.PathLike[str] = ".") -> object:
        seen.append(str(path))
        entries = list(real(path))
        if Path(path) == listed and gone.exists():
            for p in sorted(gone.rglob("*"), reverse=True):
                p.rmdir()
            gone.rmdir()
        return _Entries(entries)

    monkeypatch.setattr(os, "scandir", scandir)
    return seen


class _Entries:
    """What os.scandir returns: an iterator and a context manager."""

    def __init__(self, entries: list[os.DirEntry[str]]) -> None:
        self._it = iter(entries)

    def __iter__(self) -> _Entries:
        return self

    def __next__(self) -> os.DirEntry[str]:
        return next(self._it)

    def __enter__(self) -> _Entries:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def close(self) -> None:
        return None


def test_a_directory_removed_during_the_walk_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = tmp_path / "kubepods"
    _make(top, "besteffort/pod-a/c1", "besteffort/pod-b/c2", "burstable/pod-c")
    seen = _vanish_after_listing(monkeypatch, top / "besteffort", top / "besteffort" / "pod-a")
    found = tree.dirs_deepest_first(top)
    assert any(s.endswith("besteffort") for s in seen), "the walk never listed the parent: proved nothing"
    rel = [str(p.relative_to(top)) for p in found]
    assert "besteffort/pod-a/c1" not in rel and "besteffort/pod-b/c2" in rel and "burstable/pod-c" in rel
    depths = [len(p.parts) for p in found]
    assert depths == sorted(depths, reverse=True)


def test_remove_tree_removes_what_is_left_and_tolerates_what_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = tmp_path / "kubepods"
    _make(top, "besteffort/pod-a/c1", "besteffort/pod-b/c2")
    _vanish_after_listing(monkeypatch, top / "besteffort", top / "besteffort" / "pod-b")
    tree.remove_tree(top, busy_wait_s=0)
    assert not top.exists()


def test_a_missing_top_is_an_empty_tree(tmp_path: Path) -> None:
    assert tree.dirs_deepest_first(tmp_path / "absent") == []
    assert tree.files_named(tmp_path / "absent", "cgroup.freeze") == []
    tree.remove_tree(tmp_path / "absent", busy_wait_s=0)


def test_a_directory_that_cannot_be_removed_is_a_platform_error(tmp_path: Path) -> None:
    top = tmp_path / "kubepods"
    _make(top, "pod-a")
    (top / "pod-a" / "leftover").write_text("not a cgroup file")  # not empty: ENOTEMPTY, not EBUSY
    with pytest.raises(PlatformError, match="cannot remove cgroup"):
        tree.remove_tree(top, busy_wait_s=0)


def test_files_named_finds_each_cgroups_file(tmp_path: Path) -> None:
    top = tmp_path / "root"
    _make(top, "a/b", "c")
    for rel in ("a/cgroup.freeze", "a/b/cgroup.freeze", "c/other"):
        (top / rel).write_text("0")
    assert sorted(str(p.relative_to(top)) for p in tree.files_named(top, "cgroup.freeze")) == [
        "a/b/cgroup.freeze",
        "a/cgroup.freeze",
    ]
