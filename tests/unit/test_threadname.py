"""A supervised thread carries its task's name in the kernel (/proc/self/task/<tid>/comm)."""

from __future__ import annotations

import threading
from pathlib import Path

from agent.control.supervisor import Supervisor
from agent.platform.threadname import set_native_name


def test_a_thread_names_itself_in_the_kernel_cut_to_15_bytes() -> None:
    seen: list[str] = []

    def body() -> None:
        assert set_native_name("a-rather-long-loop-name")
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == ["a-rather-long-l"]


def test_supervised_tasks_are_named_after_their_task() -> None:
    supervisor = Supervisor()
    names: list[str] = []
    done = threading.Event()

    def task(stop: threading.Event) -> None:
        names.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())
        done.set()
        stop.wait()

    supervisor.spawn("enforcer", task)
    assert done.wait(5)
    supervisor.stop()
    assert names == ["enforcer"]
