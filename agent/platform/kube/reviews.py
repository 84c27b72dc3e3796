"""TokenReview and SubjectAccessReview: who presents a bearer token, and may they do something.

What kube-rbac-proxy and controller-runtime's ``WithAuthenticationAndAuthorization`` filter
ask the API server for each request to a protected endpoint: an
``authentication.k8s.io/v1`` TokenReview of the token, then an ``authorization.k8s.io/v1``
SubjectAccessReview of the user it names. The agent's service account needs ``create`` on
both (deploy/base/rbac.yaml; the built-in ClusterRole ``system:auth-delegator`` grants the
same). A request that fails raises KubeError (the caller answers 503 and logs it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes.client import (
    ApiClient,
    AuthenticationV1Api,
    AuthorizationV1Api,
    V1SubjectAccessReview,
    V1TokenReview,
)

from agent.errors import KubeError
from agent.platform.kube.client import json_call


@dataclass(frozen=True)
class TokenUser:
    """status.user of an authenticated TokenReview."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()  # sorted, so the user is hashable


@dataclass(frozen=True)
class TokenResult:
    user: TokenUser | None  # None: the API server did not authenticate the token
    error: str = ""  # status.error, why not (the API server's words)


@dataclass(frozen=True)
class AccessResult:
    allowed: bool
    reason: str = ""  # status.reason, or status.evaluationError


class ReviewClient:
    """Posts the two reviews with the agent's own API client (its service account)."""

    def __init__(self, api: ApiClient, timeout_s: float = 5.0, audiences: tuple[str, ...] = ()) -> None:
        self._authn = AuthenticationV1Api(api)
        self._authz = AuthorizationV1Api(api)
        self._timeout = timeout_s
        self._audiences = audiences

    def review_token(self, token: str) -> TokenResult:
        spec: dict[str, object] = {"token": token}
        if self._audiences:
            spec["audiences"] = list(self._audiences)
        body = V1TokenReview.model_validate(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        )
        answer = json_call(
            "TokenReview",
            lambda: self._authn.create_token_review(
                body, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        return token_result(answer)

    def review_access(self, user: TokenUser, path: str, verb: str) -> AccessResult:
        spec: dict[str, object] = {
            "user": user.username,
            "groups": list(user.groups),
            "nonResourceAttributes": {"path": path, "verb": verb},
        }
        if user.uid:
            spec["uid"] = user.uid
        if user.extra:
            spec["extra"] = {key: list(values) for key, values in user.extra}
        body = V1SubjectAccessReview.model_validate(
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
        )
        answer = json_call(
            "SubjectAccessReview",
            lambda: self._authz.create_subject_access_review(
                body, _preload_content=False, _request_timeout=self._timeout
            ),
        )
        return access_result(answer)


def token_result(answer: object) -> TokenResult:
    """A TokenReview's status; KubeError for an answer that is not one."""
    status = _status(answer, "TokenReview")
    if status.get("authenticated") is not True:
        return TokenResult(None, str(status.get("error") or "the token was not authenticated"))
    user = status.get("user")
    if not isinstance(user, dict) or not isinstance(user.get("username"), str) or not user["username"]:
        raise KubeError("TokenReview: authenticated, but status.user.username is missing")
    groups = user.get("groups") or []
    extra = user.get("extra") or {}
    if not isinstance(groups, list) or not isinstance(extra, dict):
        raise KubeError("TokenReview: status.user.groups or extra has the wrong type")
    return TokenResult(
        TokenUser(
            username=user["username"],
            uid=str(user.get("uid") or ""),
            groups=tuple(str(g) for g in groups),
            extra=tuple(sorted((str(k), tuple(str(v) for v in vs or ())) for k, vs in extra.items())),
        )
    )


def access_result(answer: object) -> AccessResult:
    """A SubjectAccessReview's status; ``denied`` without ``allowed`` is a refusal too."""
    status = _status(answer, "SubjectAccessReview")
    reason = str(status.get("reason") or status.get("evaluationError") or "")
    return AccessResult(status.get("allowed") is True and status.get("denied") is not True, reason)


def _status(answer: object, kind: str) -> dict[str, object]:
    status = answer.get("status") if isinstance(answer, dict) else None
    if not isinstance(status, dict):
        raise KubeError(f"{kind}: the API server's answer has no status: {str(answer)[:200]}")
    return status
