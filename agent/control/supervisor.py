"""Supervised background threads: restarted with back-off when they crash, all
stopped through one event, so a failing loop never takes the agent down."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.clock import Clock, SystemClock
from agent.platform.threadname import set_native_name
from agent.stopsignal import StopSignal

log = logging.getLogger(__name__)

Task = Callable[[threading.Event], None]


@dataclass
class TaskState:
    name: str
    restarts: int = 0
    last_error: str = ""
    running: bool = False


@dataclass
class Supervisor:
    clock: Clock = field(default_factory=SystemClock)
    min_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # Also wakes the loops that wait on their own conditions (agent/stopsignal.py).
    stop_event: threading.Event = field(default_factory=StopSignal)
    _threads: list[threading.Thread] = field(default_factory=list)
    tasks: dict[str, TaskState] = field(default_factory=dict)

    def spawn(self, name: str, task: Task) -> None:
        """Run ``task(stop_event)`` in a thread; if it raises, log it and run it again."""
        state = self.tasks[name] = TaskState(name)
        thread = threading.Thread(target=self._run, args=(name, task, state), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self, name: str, task: Task, state: TaskState) -> None:
        set_native_name(name)  # per-thread CPU (top -H, /proc/<pid>/task/*/comm) names the loop
        backoff = self.min_backoff_s
        while not self.stop_event.is_set():
            state.running = True
            try:
                task(self.stop_event)
            except Exception as err:
                state.restarts += 1
                state.last_error = f"{type(err).__name__}: {err}"
                log.exception(
                    "background task %s failed (restart %d in %.1f s)", name, state.restarts, backoff
                )
                delay, backoff = backoff, min(self.max_backoff_s, backoff * 2)
            else:
                delay = backoff = self.min_backoff_s
                if not self.stop_event.is_set():
                    log.warning("background task %s returned early; starting it again", name)
            finally:
                state.running = False
            if self.clock.sleep(delay, self.stop_event):
                break

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                log.warning("background task %s did not stop within %.0f s", thread.name, timeout_s)
