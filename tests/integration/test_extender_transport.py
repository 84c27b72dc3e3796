"""The extender's transport against hostile or careless clients: HTTPS whose verbs
need a client certificate from the extender's own CA (made by deploy/extender-tls/make-certs.sh,
the script the docs tell admins to run), plain HTTP only on loopback or by explicit flag, and a
slow, huge or idle client that costs one connection, never the server. Real sockets, real TLS."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.domain.nodeinventory import INVENTORY_ANNOTATION
from agent.emulators.apiserver import FakeApiServer
from agent.errors import ConfigError
from agent.settings import ExtenderSettings
from agent.surfaces.extender.server import ServerLimits
from agent.surfaces.extender.transport import server_context
from tests.integration.extenderkit import (
    Extender,
    args_names,
    bind_body,
    get,
    gpu_pod,
    inventory_text,
    post,
    running_extender,
)
from tests.integration.kubeapi import apiserver, wait_until

__all__ = ["apiserver"]
ROOT = Path(__file__).resolve().parents[2]
MAKE_CERTS = ROOT / "deploy/extender-tls/make-certs.sh"
NODE = "gpu-one"
FAST = ServerLimits(read_timeout_s=0.5, idle_timeout_s=1.0, max_connections=3)


def make_certs(out: Path) -> Path:
    subprocess.run([str(MAKE_CERTS), str(out), "127.0.0.1"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second CA and its client certificate: valid, but not the extender's."""
    return make_certs(tmp_path_factory.mktemp("foreign"))


def tls_settings(certs: Path, host: str = "0.0.0.0") -> ExtenderSettings:
    return ExtenderSettings(
        host=host, tls_cert=certs / "server.crt", tls_key=certs / "server.key", client_ca=certs / "ca.crt"
    )


def client(certs: Path, cert_from: Path | None) -> ssl.SSLContext:
    """What kube-scheduler's tlsConfig builds: trust the extender's CA, present a certificate."""
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if cert_from is not None:
        context.load_cert_chain(str(cert_from / "client.crt"), str(cert_from / "client.key"))
    return context


@pytest.fixture
def kubeconfig(apiserver: FakeApiServer, tmp_path: Path) -> Path:
    apiserver.create_node(NODE, annotations={INVENTORY_ANNOTATION: inventory_text(NODE, 1)})
    return apiserver.write_kubeconfig(tmp_path / "kc")


@pytest.fixture
def https(apiserver: FakeApiServer, kubeconfig: Path, certs: Path) -> Iterator[Extender]:
    with running_extender(apiserver, kubeconfig, tls=server_context(tls_settings(certs)), limits=FAST) as ext:
        yield ext


@pytest.fixture
def plain(apiserver: FakeApiServer, kubeconfig: Path) -> Iterator[Extender]:
    with running_extender(apiserver, kubeconfig, limits=FAST) as ext:
        yield ext


def test_verbs_need_a_certificate_the_extender_ca_signed(
    apiserver: FakeApiServer, https: Extender, certs: Path, foreign: Path
) -> None:
    assert https.url.startswith("https://")
    probe = apiserver.create_pod(gpu_pod("probe", 50, 1024))
    code, answer = post(https.url, "filter", args_names(probe, [NODE]), tls=client(certs, certs))
    assert code == 200 and answer["nodenames"] == [NODE], answer
    pod = apiserver.create_pod(gpu_pod("victim", 50, 1024))
    code, answer = post(https.url, "bind", bind_body(pod, NODE), tls=client(certs, None))
    assert code == 403 and "client certificate" in answer["error"]
    assert not (apiserver.pod("default", "victim") or {}).get("spec", {}).get("nodeName")
    # Probes and scrapes present no certificate and still get their answer.
    assert get(https.url, "/healthz", tls=client(certs, None)) == (200, "ok\n")
    assert get(https.url, "/metrics", tls=client(certs, None))[0] == 200
    # A certificate from another CA fails the handshake: nothing reaches a handler.
    with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
        post(https.url, "bind", bind_body(pod, NODE), tls=client(certs, foreign))
    code, answer = post(https.url, "bind", bind_body(pod, NODE), tls=client(certs, certs))
    assert code == 200 and not answer.get("error"), answer
    assert apiserver.pod("default", "victim")["spec"]["nodeName"] == NODE  # type: ignore[index]


def test_plain_http_only_on_loopback_or_by_flag(certs: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--allow-plain-http"):
        server_context(ExtenderSettings(host="0.0.0.0"))
    assert server_context(ExtenderSettings(host="127.0.0.1")) is None
    assert server_context(ExtenderSettings(host="::1")) is None
    assert server_context(ExtenderSettings(host="0.0.0.0", allow_plain_http=True)) is None
    settings = tls_settings(certs)
    with pytest.raises(ConfigError, match="--client-ca"):
        server_context(ExtenderSettings(tls_cert=settings.tls_cert, tls_key=settings.tls_key))
    missing = tmp_path / "nowhere.crt"
    with pytest.raises(ConfigError, match=str(missing)):
        server_context(
            ExtenderSettings(tls_cert=missing, tls_key=settings.tls_key, client_ca=certs / "ca.crt")
        )
    # The CLI refuses to start plain on a routable address, and says how to fix it.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "extender",
            "--listen",
            "0.0.0.0:0",
            "--kubeconfig",
            str(tmp_path / "kc"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--tls-cert" in done.stderr, done.stderr


def connect(ext: Extender) -> socket.socket:
    return socket.create_connection(ext.server.address, timeout=5)


def answer_of(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_trickling_body_gets_408_while_others_are_served(plain: Extender) -> None:
    slow = connect(plain)
    slow.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    started = time.monotonic()
    # One deadline for the whole body: a byte every 0.2 s does not keep it open.
    for _ in range(4):
        time.sleep(0.2)
        code, _ = post(plain.url, "filter", args_names(gpu_pod("other", 10, 512), [NODE]))
        assert code == 200
        try:
            slow.sendall(b" ")
        except OSError:
            break
    reply = answer_of(slow)
    assert reply.startswith(b"HTTP/1.1 408") and b"within 0.5 s" in reply, reply
    assert time.monotonic() - started < 3


def test_a_huge_body_is_refused_before_it_is_read(plain: Extender) -> None:
    sock = connect(plain)
    sock.sendall(b"POST /bind HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
    reply = answer_of(sock)
    assert reply.startswith(b"HTTP/1.1 413") and b"over the limit" in reply, reply
    sock = connect(plain)
    sock.sendall(b"POST /bind HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert answer_of(sock).startswith(b"HTTP/1.1 411")


def test_connections_over_the_limit_are_closed_and_idle_ones_reaped(plain: Extender) -> None:
    held = [connect(plain) for _ in range(FAST.max_connections)]
    wait_until(lambda: plain.server.open_connections == FAST.max_connections, what="connections counted")
    extra = connect(plain)
    assert answer_of(extra) == b""  # closed at accept
    # Idle keep-alive connections are closed after idle_timeout_s: the slots come back.
    started = time.monotonic()
    assert all(answer_of(sock) == b"" for sock in held)
    assert time.monotonic() - started < FAST.idle_timeout_s + 2
    wait_until(lambda: plain.server.open_connections == 0, what="connections released")
    assert post(plain.url, "filter", args_names(gpu_pod("after", 10, 512), [NODE]))[0] == 200


def test_a_stalled_tls_handshake_costs_one_connection(https: Extender, certs: Path) -> None:
    stalled = connect(https)  # TCP only: never sends a ClientHello
    code, _ = post(https.url, "filter", args_names(gpu_pod("p", 10, 512), [NODE]), tls=client(certs, certs))
    assert code == 200
    assert answer_of(stalled) == b""  # dropped after read_timeout_s
