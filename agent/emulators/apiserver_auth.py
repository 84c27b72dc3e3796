"""The fake API server's TokenReview and SubjectAccessReview (an emulator, for tests and the
demo): bearer tokens from a table the test fills, RBAC decided from the ClusterRoles and
ClusterRoleBindings in the store (created through the API or ``create_object``, e.g. those
that deploy/ renders).

Wire format as kube-apiserver's: ``POST /apis/authentication.k8s.io/v1/tokenreviews`` answers
201 with the request and ``status.authenticated``, ``status.user{username, uid, groups}``,
``status.audiences`` (or ``status.error``); ``POST /apis/authorization.k8s.io/v1/
subjectaccessreviews`` answers 201 with ``status.allowed`` and ``status.reason``. An
authenticated user is in ``system:authenticated`` too; ``system:masters`` may do anything; a
service account's token names ``system:serviceaccount:<ns>:<name>`` in the groups
``system:serviceaccounts`` and ``system:serviceaccounts:<ns>``. A spec without a token, or a
SubjectAccessReview without a user or group or without exactly one of the attribute kinds, is
422 Invalid.

Not modelled: token expiry and audience checks (``audiences`` are echoed), x509 and other
authenticators, Roles and RoleBindings (namespaced RBAC), aggregated ClusterRoles, the Node
and webhook authorizers, ``denied`` (RBAC never denies, it only does not allow),
impersonation, ``selfsubject*reviews`` and ``localsubjectaccessreviews``.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.emulators.apiserver_query import ApiStatusError
from agent.emulators.apiserver_store import Store

AUTHENTICATED = "system:authenticated"
_DEFAULT_AUDIENCES = ["https://kubernetes.default.svc"]


@dataclass(frozen=True)
class TokenOwner:
    username: str
    uid: str
    groups: tuple[str, ...]


class AuthReviews:
    """The token table and the two reviews (``FakeApiServer.auth``)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._tokens: dict[str, TokenOwner] = {}

    def add_token(self, token: str, username: str, groups: Sequence[str] = (), uid: str = "") -> str:
        with self._lock:
            self._tokens[token] = TokenOwner(username, uid or secrets.token_hex(8), tuple(groups))
        return token

    def service_account_token(self, namespace: str, name: str) -> str:
        """A new token for the service account (as the TokenRequest API would issue one)."""
        groups = ("system:serviceaccounts", f"system:serviceaccounts:{namespace}")
        return self.add_token(secrets.token_urlsafe(32), f"system:serviceaccount:{namespace}:{name}", groups)

    def revoke(self, token: str) -> None:
        with self._lock:
            self._tokens.pop(token, None)

    def token_review(self, body: Any) -> dict[str, Any]:
        review = _review(body, "authentication.k8s.io/v1", "TokenReview")
        spec = review.get("spec") or {}
        token = spec.get("token") if isinstance(spec, dict) else None
        if not isinstance(token, str) or not token:
            raise _invalid("TokenReview.authentication.k8s.io", "spec.token: Required value")
        with self._lock:
            owner = self._tokens.get(token)
        if owner is None:
            status: dict[str, Any] = {"authenticated": False, "error": "invalid bearer token"}
        else:
            groups = [*owner.groups, AUTHENTICATED]
            status = {
                "authenticated": True,
                "user": {"username": owner.username, "uid": owner.uid, "groups": groups},
                "audiences": list(spec.get("audiences") or _DEFAULT_AUDIENCES),
            }
        return {**review, "status": status}

    def access_review(self, body: Any) -> dict[str, Any]:
        review = _review(body, "authorization.k8s.io/v1", "SubjectAccessReview")
        spec = review.get("spec")
        if not isinstance(spec, dict):
            raise _invalid("SubjectAccessReview.authorization.k8s.io", "spec: Required value")
        user, groups = str(spec.get("user") or ""), [str(g) for g in spec.get("groups") or []]
        if not user and not groups:
            raise _invalid(
                "SubjectAccessReview.authorization.k8s.io",
                "spec.user: Invalid value: at least one of user or group must be specified",
            )
        resource, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if (resource is None) == (non_resource is None):
            raise _invalid(
                "SubjectAccessReview.authorization.k8s.io",
                "spec.resourceAttributes: Invalid value: exactly one of nonResourceAttributes "
                "and resourceAttributes must be specified",
            )
        allowed, reason = self._authorize(user, groups, resource, non_resource)
        status: dict[str, Any] = {"allowed": allowed}
        if reason:
            status["reason"] = reason
        return {**review, "status": status}

    def _authorize(self, user: str, groups: list[str], resource: Any, non_resource: Any) -> tuple[bool, str]:
        if "system:masters" in groups:
            return True, ""
        roles = {r["metadata"]["name"]: r for r in self._store.all("clusterroles", None)}
        for binding in self._store.all("clusterrolebindings", None):
            ref = binding.get("roleRef") or {}
            role = roles.get(ref.get("name", "")) if ref.get("kind") == "ClusterRole" else None
            subject = _matching_subject(binding.get("subjects") or [], user, groups)
            if role is None or subject is None:
                continue
            if any(_rule_allows(rule, resource, non_resource) for rule in role.get("rules") or []):
                return True, (
                    f'RBAC: allowed by ClusterRoleBinding "{binding["metadata"]["name"]}" of ClusterRole '
                    f'"{role["metadata"]["name"]}" to {subject}'
                )
        return False, ""


def _review(body: Any, api_version: str, kind: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiStatusError(400, "BadRequest", "the request body must be a JSON object")
    return {"apiVersion": api_version, "kind": kind, **body, "metadata": {"creationTimestamp": None}}


def _invalid(kind: str, detail: str) -> ApiStatusError:
    return ApiStatusError(422, "Invalid", f"{kind} is invalid: {detail}")


def _matching_subject(subjects: Iterable[dict[str, Any]], user: str, groups: list[str]) -> str | None:
    for subject in subjects:
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "User" and name == user:
            return f'User "{name}"'
        if kind == "Group" and name in groups:
            return f'Group "{name}"'
        if kind == "ServiceAccount" and user == f"system:serviceaccount:{subject.get('namespace')}:{name}":
            return f'ServiceAccount "{subject.get("namespace")}/{name}"'
    return None


def _rule_allows(rule: dict[str, Any], resource: Any, non_resource: Any) -> bool:
    if non_resource is not None:
        path, verb = str(non_resource.get("path") or ""), str(non_resource.get("verb") or "")
        return _has(rule.get("verbs"), verb) and any(
            url in ("*", path) or (url.endswith("*") and path.startswith(url[:-1]))
            for url in rule.get("nonResourceURLs") or []
        )
    if rule.get("nonResourceURLs"):
        return False
    attrs = resource if isinstance(resource, dict) else {}
    name = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
    names = rule.get("resourceNames") or []
    return (
        _has(rule.get("verbs"), attrs.get("verb", ""))
        and _has(rule.get("apiGroups"), attrs.get("group", ""))
        and _has(rule.get("resources"), name)
        and (not names or attrs.get("name") in names)
    )


def _has(values: Any, wanted: str) -> bool:
    return isinstance(values, list) and ("*" in values or wanted in values)
