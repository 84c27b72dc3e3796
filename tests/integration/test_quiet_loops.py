"""Loops that wait for their own work wake for nothing else: under the agent's stop flag
(agent/stopsignal.py) an idle loop sleeps with no timeout, and setting the flag still ends it
at once. Where a thread sleeps, and whether with a timeout, is read from
/proc/self/task/<tid>/syscall (tests/integration/blocking.py)."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kubernetes.client import ApiClient

from agent.control.annotator import Annotator
from agent.emulators.apiserver import FakeApiServer
from agent.platform.httpserving import QuietServing
from agent.platform.kube.events import EventRecorder
from agent.platform.kube.nodes import NodeWatch
from agent.platform.kube.pods import PodInfo, pod_from_json
from agent.stopsignal import StopSignal
from tests.integration.blocking import blocked_wait, voluntary_switches
from tests.integration.kubeapi import NODE, apiserver, kube, pod_manifest, running, wait_until

__all__ = ["apiserver", "kube"]  # fixtures


def wakeups(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return voluntary_switches(thread.native_id)


def waits_with_no_timeout(thread: threading.Thread) -> bool:
    assert thread.native_id is not None
    return blocked_wait(thread.native_id) is True


def parked(thread: threading.Thread) -> None:
    wait_until(lambda: waits_with_no_timeout(thread), what=f"{thread.name} asleep with no timeout")


def thread_named(name: str) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == name)


def test_the_event_recorder_sleeps_until_an_event_or_the_stop_flag(
    apiserver: FakeApiServer, kube: ApiClient
) -> None:
    pod = pod_from_json(apiserver.create_pod(pod_manifest("p")))
    recorder = EventRecorder(kube, NODE)
    stop = StopSignal()
    with running(recorder.run, "events-under-test", stop):
        parked(thread_named("events-under-test"))
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
        parked(thread_named("annotator-under-test"))
        annotator.submit(_pod("p"), {"a": "1"})
        assert annotator.flush(10) and writer.written == ["default/p"]
    with running(annotator.run, "annotator-polling"):  # a plain Event: it polls, and still stops
        polling = thread_named("annotator-polling")
        wait_until(
            lambda: blocked_wait(polling.native_id or 0) is False,
            what="the polling loop seen in a timed wait",
        )
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
        # Its wait has the caller's timeout (120 s), so it is a timed one: it must not be cut
        # into slices that look at the flag. Over 0.3 s (a measurement, not a wait for
        # state), slices of 0.1 s would show as 2 or more wakeups; a parked waiter has none
        # on any host.
        wait_until(lambda: blocked_wait(waiter.native_id or 0) is not None, what="the waiter blocked")
        before = wakeups(waiter)
        time.sleep(0.3)
        assert wakeups(waiter) - before <= 1
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
        parked(thread)
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
