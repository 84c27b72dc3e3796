"""The isolated shares' checkpoint: which MIG instance serves which pod's container.

One JSON file in ``--state-dir`` (``mig-shares.json``), replaced atomically after every
change, readable by its owner only::

    {"version": 1,
     "shares": [{"podUID": "...", "namespace": "default", "pod": "train", "container": "cuda",
                 "gpu": 0, "gi": 5, "ci": 0, "uuid": "MIG-...", "profile": "2g.20gb",
                 "cores": 30, "memoryMiB": 20000, "giCapMinor": 48, "ciCapMinor": 49}]}

A missing file is no share; an unreadable one (bad JSON, another version, a bad entry) is
logged and read as no share, and said so (``load_shares``' second value), so that the
caller destroys nothing on its word.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import PlatformError
from agent.platform.atomicfile import read_text, write_atomic
from agent.platform.gpu.migstate import MigDevice

log = logging.getLogger(__name__)

VERSION = 1


@dataclass(frozen=True)
class ShareKey:
    """The container a share belongs to."""

    pod_uid: str
    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class IsolatedShare:
    """One isolated share and the MIG instance made for it."""

    pod_uid: str
    namespace: str
    pod: str
    container: str
    gpu: int
    gi: int
    ci: int
    uuid: str
    profile: str
    cores: int
    memory_mib: int
    gi_cap_minor: int | None = None
    ci_cap_minor: int | None = None

    @classmethod
    def of(cls, key: ShareKey, device: MigDevice, cores: int, memory_mib: int) -> IsolatedShare:
        return cls(
            key.pod_uid, key.namespace, key.pod, key.container, device.gpu_index, device.gi, device.ci,
            device.uuid, device.profile, cores, memory_mib, device.gi_cap_minor, device.ci_cap_minor,
        )  # fmt: skip

    @property
    def key(self) -> ShareKey:
        return ShareKey(self.pod_uid, self.namespace, self.pod, self.container)

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


_FIELDS: tuple[tuple[str, str, type], ...] = (
    ("pod_uid", "podUID", str),
    ("namespace", "namespace", str),
    ("pod", "pod", str),
    ("container", "container", str),
    ("gpu", "gpu", int),
    ("gi", "gi", int),
    ("ci", "ci", int),
    ("uuid", "uuid", str),
    ("profile", "profile", str),
    ("cores", "cores", int),
    ("memory_mib", "memoryMiB", int),
)
_OPTIONAL = (("gi_cap_minor", "giCapMinor"), ("ci_cap_minor", "ciCapMinor"))


def save_shares(path: Path, shares: list[IsolatedShare]) -> None:
    """PlatformError when it cannot be written."""
    body = {"version": VERSION, "shares": [_encode(s) for s in sorted(shares, key=lambda s: (s.gpu, s.gi))]}
    write_atomic(path, (json.dumps(body, indent=1) + "\n").encode(), mode=0o600, make_parents=True)


def load_shares(path: Path) -> tuple[list[IsolatedShare], bool]:
    """(the shares, whether the file could be read: a missing file can)."""
    try:
        text = read_text(path)
    except PlatformError as err:
        log.error("the isolated shares' checkpoint: %s", err)
        return [], False
    if text is None:
        return [], True
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} checkpoint")
        entries = raw.get("shares")
        if not isinstance(entries, list):
            raise ValueError("shares must be a list")
        return [_decode(e, i) for i, e in enumerate(entries)], True
    except (ValueError, RecursionError) as err:
        log.error("the isolated shares' checkpoint %s cannot be read (%s): no share adopted, none destroyed",
                  path, err)  # fmt: skip
        return [], False


def _encode(share: IsolatedShare) -> dict[str, Any]:
    body: dict[str, Any] = {wire: getattr(share, name) for name, wire, _ in _FIELDS}
    for name, wire in _OPTIONAL:
        body[wire] = getattr(share, name)
    return body


def _decode(raw: object, i: int) -> IsolatedShare:
    if not isinstance(raw, dict):
        raise ValueError(f"shares[{i}] must be an object")
    values: dict[str, Any] = {}
    for name, wire, kind in _FIELDS:
        value = raw.get(wire)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"shares[{i}].{wire} must be {'an integer' if kind is int else 'a string'}")
        values[name] = value
    for name, wire in _OPTIONAL:
        value = raw.get(wire)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"shares[{i}].{wire} must be an integer or null")
        values[name] = value
    return IsolatedShare(**values)
