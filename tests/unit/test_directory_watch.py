"""DirectoryWatch (agent/platform/inotify.py) on a real directory: events, a read with no
timeout, and the wake-up that ends it from another thread."""

from __future__ import annotations

import threading
from pathlib import Path

from agent.platform.inotify import DirectoryWatch


def test_a_created_entry_is_read_and_a_read_with_no_timeout_ends_on_a_wake_up(tmp_path: Path) -> None:
    with DirectoryWatch(tmp_path) as watch:
        (tmp_path / "kubelet.sock").touch()
        events = watch.read(10)
        assert any(e.created and e.name == "kubelet.sock" for e in events)

        got: list[list[object]] = []
        reader = threading.Thread(target=lambda: got.append(list(watch.read(None))), daemon=True)
        reader.start()
        watch.wake()
        reader.join(10)
        assert not reader.is_alive() and got == [[]]

        watch.wake()  # before the read: the next read returns at once
        watch.wake()  # twice: still one wake-up's worth, and no error
        assert watch.read(None) == []
        (tmp_path / "kubelet.sock").unlink()
        assert any(e.deleted and e.name == "kubelet.sock" for e in watch.read(10))
    watch.close()  # closed twice, and woken after: nothing happens
    watch.wake()
