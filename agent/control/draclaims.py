"""The claims the DRA kubelet plugin has prepared on this node, checkpointed so a restarted
agent answers kubelet the same and can still unprepare them.

The rest of the agent reads ``prepared()`` and subscribes to changes (the ledger and the
enforcement specs are fed from it, as from device-plugin allocations). The checkpoint is a
directory in the agent's state dir with one JSON file per claim (``<uid>.json``), written
atomically before kubelet hears the answer, so an answer kubelet acted on is always on disk;
one file per claim keeps a prepare as cheap with a thousand claims on the node as with one.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.domain.dra import ClaimRef, ClaimShare, PreparedClaim, PreparedDevice, PreparedMig
from agent.errors import PlatformError
from agent.platform.atomicfile import ensure_dir, read_text, remove, write_atomic

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
Listener = Callable[[list[PreparedClaim]], object]
# What reading the checkpoint raises for any bytes in it.
_UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError)
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a UID as a file name: no "/", no ".."


class PreparedClaims:
    """Prepared claims by UID; thread-safe. Listeners are called (outside the lock) with the
    full list after each change, in the order of the changes."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self.checkpoint_dir = checkpoint_dir
        self._lock = threading.Lock()
        self._notify_lock = threading.Lock()  # listeners see changes one at a time, in order
        self._claims: dict[str, PreparedClaim] = self._load()
        self._listeners: list[Listener] = []

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get(uid)

    def prepared(self) -> list[PreparedClaim]:
        with self._lock:
            return list(self._claims.values())

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(prepared())`` after every change; returns the unsubscribe function."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def add(self, claim: PreparedClaim) -> None:
        """Record (or replace) a prepared claim; PlatformError if the checkpoint cannot be
        written, and then nothing changed."""
        with self._notify_lock:
            with self._lock:
                self._save(claim)
                self._claims = {**self._claims, claim.ref.uid: claim}
            self._notify()

    def remove(self, uid: str) -> PreparedClaim | None:
        """Forget a claim (None if it was not prepared); PlatformError if the checkpoint
        cannot be written, and then nothing changed."""
        with self._notify_lock:
            with self._lock:
                if uid not in self._claims:
                    return None
                remove(self._path(uid))
                claims = dict(self._claims)
                gone = claims.pop(uid)
                self._claims = claims
            self._notify()
        return gone

    def _notify(self) -> None:
        with self._lock:
            listeners, claims = list(self._listeners), list(self._claims.values())
        for listener in listeners:
            try:
                listener(claims)
            except Exception:  # a broken subscriber must not fail kubelet's call
                log.exception("a prepared-claims listener failed")

    # Checkpoint ----------------------------------------------------------------------------
    def _path(self, uid: str) -> Path:
        if not _FILE_NAME.match(uid):
            raise PlatformError(f"claim UID {uid!r} cannot name a checkpoint file")
        return self.checkpoint_dir / f"{uid}.json"

    def _save(self, claim: PreparedClaim) -> None:
        path = self._path(claim.ref.uid)
        data = {"version": CHECKPOINT_VERSION, **_claim_json(claim)}
        ensure_dir(self.checkpoint_dir)
        write_atomic(path, json.dumps(data, sort_keys=True).encode(), mode=0o600)

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            paths = sorted(self.checkpoint_dir.glob("*.json"))
        except OSError as err:
            log.error("cannot read the DRA checkpoint %s: %s", self.checkpoint_dir, err)
            return {}
        claims: dict[str, PreparedClaim] = {}
        for path in paths:
            try:
                raw = json.loads(read_text(path) or "")
                if raw.get("version") != CHECKPOINT_VERSION:
                    raise ValueError(f"version {raw.get('version')!r}, expected {CHECKPOINT_VERSION}")
                claim = _claim_from(raw)
                if path.name != f"{claim.ref.uid}.json":
                    raise ValueError(f"it records claim UID {claim.ref.uid}")
            except (PlatformError, *_UNREADABLE) as err:
                # Skipping it is what a node without the file does: kubelet prepares again what
                # it still needs, and unpreparing an unknown claim still removes its CDI spec.
                log.error("ignoring the unreadable DRA checkpoint file %s: %s", path, err)
                continue
            claims[claim.ref.uid] = claim
        if claims:
            log.info("DRA checkpoint %s: %d prepared claims", self.checkpoint_dir, len(claims))
        return claims


def _claim_json(claim: PreparedClaim) -> dict[str, Any]:
    return {
        "namespace": claim.ref.namespace,
        "name": claim.ref.name,
        "uid": claim.ref.uid,
        "shares": [
            {
                "request": s.request,
                "pool": s.pool,
                "device": s.device,
                "gpu_index": s.gpu_index,
                "cores": s.cores,
                "memory_mib": s.memory_mib,
                "share_id": s.share_id,
                "policy": s.policy,
                "limit": s.limit,
                "isolation": s.isolation,
            }
            for s in claim.shares
        ],
        "mig": [
            {
                "request": m.request,
                "device": m.device,
                "gpu_index": m.gpu_index,
                "gpu_minor": m.gpu_minor,
                "gi": m.gi,
                "ci": m.ci,
                "uuid": m.uuid,
                "profile": m.profile,
                "start": m.start,
                "size": m.size,
                "cap_minors": list(m.cap_minors),
            }
            for m in claim.mig
        ],
        "devices": [
            {"requests": list(d.requests), "pool": d.pool, "device": d.device, "cdi_ids": list(d.cdi_ids)}
            for d in claim.devices
        ],
    }


def _claim_from(raw: Any) -> PreparedClaim:
    ref = ClaimRef(_str(raw["namespace"]), _str(raw["name"]), _str(raw["uid"]))
    shares = tuple(
        ClaimShare(
            request=_str(s["request"]),
            pool=_str(s["pool"]),
            device=_str(s["device"]),
            gpu_index=_int(s["gpu_index"]),
            cores=_int(s["cores"]),
            memory_mib=_int(s["memory_mib"]),
            share_id=_str(s["share_id"]),
            policy=None if s["policy"] is None else _str(s["policy"]),
            limit=None if s["limit"] is None else _int(s["limit"]),
            isolation=None if s.get("isolation") is None else _str(s["isolation"]),
        )
        for s in raw["shares"]
    )
    migs = tuple(
        PreparedMig(
            request=_str(m["request"]),
            device=_str(m["device"]),
            gpu_index=_int(m["gpu_index"]),
            gpu_minor=_int(m["gpu_minor"]),
            gi=_int(m["gi"]),
            ci=_int(m["ci"]),
            uuid=_str(m["uuid"]),
            profile=_str(m["profile"]),
            start=_int(m["start"]),
            size=_int(m["size"]),
            cap_minors=tuple(_int(c) for c in m["cap_minors"]),
        )
        for m in raw.get("mig") or ()
    )
    devices = tuple(
        PreparedDevice(
            tuple(_str(r) for r in d["requests"]),
            _str(d["pool"]),
            _str(d["device"]),
            tuple(_str(i) for i in d["cdi_ids"]),
        )
        for d in raw["devices"]
    )
    if len(devices) != len(shares):
        raise ValueError(f"claim {ref.key}: {len(shares)} shares but {len(devices)} devices")
    return PreparedClaim(ref, shares, devices, migs)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an integer")
    return value
