"""How the extender is reached: HTTPS with client certificates, or plain HTTP where that is safe.

kube-scheduler's extender client (its ``tlsConfig``: certFile, keyFile, caFile) presents a
client certificate; the verbs (filter, prioritize, bind) are answered only on a connection
whose certificate ``client_ca`` signed. GET /healthz, /readyz and /metrics need none:
kubelet's probes and Prometheus present none, and they reveal nothing a tenant could use.
Plain HTTP is served on loopback (a scheduler in the same network namespace, tests) or on
any address when the admin asks for it explicitly (``--allow-plain-http``).
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Callable
from pathlib import Path

from agent.errors import ConfigError
from agent.settings import ExtenderSettings


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: only this network namespace can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_context(settings: ExtenderSettings) -> ssl.SSLContext | None:
    """The TLS context to serve with, or None for plain HTTP; ConfigError naming the flag when
    the combination is unsafe or a file cannot be used."""
    tls = (settings.tls_cert, settings.tls_key, settings.client_ca)
    if not any(tls):
        if is_loopback(settings.host) or settings.allow_plain_http:
            return None
        raise ConfigError(
            [
                f"the extender would serve plain HTTP on {settings.host}: anyone who reaches the "
                "port could bind pods. Give --tls-cert, --tls-key and --client-ca, listen on "
                "loopback, or pass --allow-plain-http"
            ]
        )
    missing = [
        flag for flag, path in zip(("--tls-cert", "--tls-key", "--client-ca"), tls, strict=True) if not path
    ]
    if missing:
        raise ConfigError(
            [f"HTTPS needs {', '.join(missing)} as well (the client CA: without it anyone could bind pods)"]
        )
    assert settings.tls_cert and settings.tls_key and settings.client_ca
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # OPTIONAL, not REQUIRED: a certificate that is presented must verify, and the verbs
    # demand one (server.py); the probes and /metrics connect without one.
    context.verify_mode = ssl.CERT_OPTIONAL
    _load(context.load_cert_chain, "--tls-cert/--tls-key", settings.tls_cert, settings.tls_key)
    _load(context.load_verify_locations, "--client-ca", settings.client_ca)
    return context


def _load(load: Callable[..., object], flags: str, *paths: Path) -> None:
    try:
        load(*(str(p) for p in paths))
    except (OSError, ssl.SSLError) as err:
        shown = ", ".join(str(p) for p in paths)
        raise ConfigError([f"{flags}: cannot use {shown}: {getattr(err, 'strerror', None) or err}"]) from err
