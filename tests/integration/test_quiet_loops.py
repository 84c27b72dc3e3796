"""Loops that wait for their own work wake for nothing else: under the agent's stop flag
(agent/stopsignal.py) an idle loop sleeps with no timeout, and setting the flag still ends it
at once. A parked thread's wakeups are read from /proc/self/task/<tid>/status."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kubernetes.client import ApiClient

from agent.control.annotator import Annotator
from agent.emulators.apiserver import FakeApiServer
from agent.platform.httpserving import QuietServing
from agent.platform.kube.events import EventRecorder
from agent.platform.kube.nodes import NodeWatch
from agent.platform.kube.pods import PodInfo, pod_from_json
from agent.stopsignal import StopSignal
from tests.integration.kubeapi import NODE, apiserver, kube, pod_manifest, running, wait_until

__all__ = ["apiserver", "kube"]  # fixtures

WINDOW_S = 0.5  # a loop that looked at its flag every 0.1-0.25 s would wake 2-5 times in it


def wakeups(thread: threading.Thread) -> int:
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches:")
    )


def parked(thread: threading.Thread) -> bool:
    """Asleep, and not woken over 50 ms."""
    before = wakeups(thread)
    time.sleep(0.05)
    state = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "S" and wakeups(thread) == before


def woken_while_idle(thread: threading.Thread) -> int:
    wait_until(lambda: parked(thread), what=f"{thread.name} asleep")
    before = wakeups(thread)
    time.sleep(WINDOW_S)
    return wakeups(thread) - before


def thread_named(name: str) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == name)


def test_the_event_recorder_sleeps_until_an_event_or_the_stop_flag(
    apiserver: FakeApiServer, kube: ApiClient
) -> None:
    pod = pod_from_json(apiserver.create_pod(pod_manifest("p")))
    recorder = EventRecorder(kube, NODE)
    stop = StopSignal()
    with running(recorder.run, "events-under-test", stop):
        assert woken_while_idle(thread_named("events-under-test")) == 0
        recorder.pod(pod, "Tested", "an event while the loop slept")
        wait_until(apiserver.events, what="the event posted")
        assert stop.waiting() == 1
    assert stop.waiting() == 0  # ended, and its wake-up went with it


class _Writer:
    def __init__(self) -> None:
        self.written: list[str] = []

    def patch_annotations(
        self,
        namespace: str,
        name: str,
        annotations: Mapping[str, str | None],
        resource_version: str | None = None,
    ) -> PodInfo:
        self.written.append(f"{namespace}/{name}")
        return _pod(name)


def _pod(name: str) -> PodInfo:
    manifest = pod_manifest(name)
    manifest["metadata"]["uid"] = f"uid-{name}"
    return pod_from_json(manifest)


def test_the_annotator_sleeps_until_a_write_or_the_stop_flag() -> None:
    writer = _Writer()
    annotator = Annotator(writer)
    with running(annotator.run, "annotator-under-test", StopSignal()):
        assert woken_while_idle(thread_named("annotator-under-test")) == 0
        annotator.submit(_pod("p"), {"a": "1"})
        assert annotator.flush(10) and writer.written == ["default/p"]
    with running(annotator.run, "annotator-polling"):  # a plain Event: it still stops
        annotator.submit(_pod("q"), {"a": "1"})
        assert annotator.flush(10) and writer.written == ["default/p", "default/q"]


def test_a_node_watch_and_its_waiters_need_no_thread_or_timeout_to_stop(
    apiserver: FakeApiServer, kube: ApiClient
) -> None:
    apiserver.create_node(NODE)
    watch = NodeWatch(kube, NODE, min_backoff_s=0.05, max_backoff_s=0.2)
    stop = StopSignal()
    with running(watch.run, "node-watch-under-test", stop):
        wait_until(watch.current, what="first list")
        assert not [t for t in threading.enumerate() if t.name.endswith("-stop")]
        abort = StopSignal()
        returned: list[int] = []
        waiter = threading.Thread(
            target=lambda: returned.append(watch.wait_for_change(watch.version, 120, abort)),
            name="node-waiter",
            daemon=True,
        )
        waiter.start()
        assert woken_while_idle(waiter) == 0
        abort.set()
        waiter.join(10)
        assert returned == [watch.version] and abort.waiting() == 0
    assert stop.waiting() == 0


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, format: str, *args: object) -> None:
        return None


class _Server(QuietServing, ThreadingHTTPServer):
    daemon_threads = True


def test_a_quiet_server_serves_sleeps_between_requests_and_shuts_down_at_once() -> None:
    server = _Server(("127.0.0.1", 0), _Hello)
    port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, name="quiet-http", daemon=True)
    thread.start()
    try:
        for _ in range(3):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/")
            assert connection.getresponse().read() == b"hello"
            connection.close()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # connected and gone before a request: the loop must not wait on it
        assert woken_while_idle(thread) == 0
    finally:
        started = time.monotonic()
        server.shutdown()
        server.server_close()
        server.server_close()  # twice: the wake pipe is closed once
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 10


def test_a_quiet_server_shut_down_before_it_served_returns_at_once() -> None:
    server = _Server(("127.0.0.1", 0), _Hello)
    server.shutdown()  # serve_forever never ran: nothing to wait for
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    server.server_close()
