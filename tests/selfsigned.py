"""A throwaway self-signed certificate for 127.0.0.1 (openssl), for tests of HTTPS endpoints."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files in ``directory``; skips the test without openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test's certificate")
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-days", "1", "-subj", "/CN=vcuda-agent", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
