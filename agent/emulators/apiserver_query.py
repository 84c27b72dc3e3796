"""Request-level pieces of the fake API server: Status errors and field/label selectors."""

from __future__ import annotations

from typing import Any


class ApiStatusError(Exception):
    """A request the API server refuses; rendered as a v1 Status object."""

    def __init__(self, code: int, reason: str, message: str, name: str = "", kind: str = "") -> None:
        self.code, self.reason, self.name, self.kind = code, reason, name, kind
        super().__init__(message)

    def status(self) -> dict[str, Any]:
        return status_object(self.code, self.reason, str(self), self.name, self.kind)


def status_object(code: int, reason: str, message: str, name: str = "", kind: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if name or kind:
        body["details"] = {"name": name, "kind": kind}
    return body


def not_found(resource: str, name: str) -> ApiStatusError:
    return ApiStatusError(404, "NotFound", f'{resource} "{name}" not found', name, resource)


def conflict(resource: str, name: str) -> ApiStatusError:
    return ApiStatusError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        name,
        resource,
    )


def expired(rv: int, oldest: int) -> ApiStatusError:
    return ApiStatusError(410, "Expired", f"too old resource version: {rv} ({oldest})")


class Selector:
    """Field and label selectors: ``a=b``, ``a==b``, ``a!=b`` (fields are dotted paths, a missing
    field reads as ""); labels also ``key`` and ``!key``. Set-based label syntax is refused."""

    def __init__(self, fields: str = "", labels: str = "") -> None:
        self._fields = [_term(t, "field") for t in _terms(fields)]
        self._labels = [_term(t, "label") for t in _terms(labels)]

    def matches(self, obj: dict[str, Any]) -> bool:
        for path, op, want in self._fields:
            if (_field(obj, path) == want) != (op == "="):
                return False
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for key, op, want in self._labels:
            if op == "exists" and key not in labels:
                return False
            if op == "!exists" and key in labels:
                return False
            if op in ("=", "!=") and (labels.get(key) == want) != (op == "="):
                return False
        return True


def _terms(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _term(text: str, what: str) -> tuple[str, str, str]:
    if "(" in text or " in " in text or " notin " in text:
        raise ApiStatusError(400, "BadRequest", f"unsupported {what} selector {text!r}")
    for op, name in (("!=", "!="), ("==", "="), ("=", "=")):
        if op in text:
            key, _, value = text.partition(op)
            return key.strip(), name, value.strip()
    if what == "label":
        return (text[1:], "!exists", "") if text.startswith("!") else (text, "exists", "")
    raise ApiStatusError(400, "BadRequest", f"invalid field selector {text!r}")


def _field(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)
