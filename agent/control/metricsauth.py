"""Who may read /metrics: a bearer token the API server authenticates (TokenReview) for a
user it authorizes to ``get`` the non-resource URL (SubjectAccessReview), as kube-rbac-proxy
and controller-runtime's authenticated metrics decide.

/metrics names every pod with a GPU share on the node (namespace, pod, container): on the
host network anyone who reaches the node's port would read them. Decisions are cached by the
token's SHA-256 for ``cache_s`` (Prometheus scrapes every 15 s: one pair of reviews per token
and cache period, not per scrape); an API server that does not answer is never cached, and
is a 503 with a log line, not a crash nor a 401 that would hide the outage. At most
``max_in_flight`` reviews run at once: a flood of random tokens costs the API server that
much and no more (the rest are answered 429).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from agent.clock import Clock, SystemClock
from agent.errors import KubeError
from agent.platform.kube.reviews import AccessResult, TokenResult, TokenUser

log = logging.getLogger(__name__)


class Reviews(Protocol):
    def review_token(self, token: str) -> TokenResult: ...

    def review_access(self, user: TokenUser, path: str, verb: str) -> AccessResult: ...


@dataclass(frozen=True)
class Decision:
    code: int  # the HTTP status: 200 serve, 401, 403, 429, 503
    reason: str  # for the response body and the log
    user: str = ""

    @property
    def allowed(self) -> bool:
        return self.code == 200


def bearer_token(header: str | None) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (the scheme is case-insensitive, as
    the API server's own bearer authenticator reads it); None when there is none."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


class MetricsAuthorizer:
    """The decision for one request's Authorization header (see the module docstring)."""

    def __init__(
        self,
        reviews: Reviews,
        *,
        path: str = "/metrics",
        verb: str = "get",
        cache_s: float = 30.0,
        max_entries: int = 1024,
        max_in_flight: int = 4,
        clock: Clock | None = None,
    ) -> None:
        self._reviews = reviews
        self.path, self.verb = path, verb
        self._cache_s = cache_s
        self._max_entries = max_entries
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, tuple[float, Decision]] = OrderedDict()
        self._slots = threading.BoundedSemaphore(max_in_flight)

    def decide(self, authorization: str | None) -> Decision:
        token = bearer_token(authorization)
        if token is None:
            return Decision(401, "no bearer token: send Authorization: Bearer <service account token>")
        key = hashlib.sha256(token.encode()).digest()
        now = self._clock.monotonic()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > now:
                return cached[1]
        if not self._slots.acquire(blocking=False):
            return Decision(429, "too many token reviews in flight; retry later")
        try:
            decision = self._review(token)
        finally:
            self._slots.release()
        if decision.code in (200, 401, 403):  # the API server's answer; an outage is not cached
            with self._lock:
                self._cache[key] = (self._clock.monotonic() + self._cache_s, decision)
                self._cache.move_to_end(key)
                while len(self._cache) > self._max_entries:
                    self._cache.popitem(last=False)
        return decision

    def _review(self, token: str) -> Decision:
        try:
            authn = self._reviews.review_token(token)
            if authn.user is None:
                log.info("metrics: refused a token the API server did not authenticate: %s", authn.error)
                return Decision(401, f"unauthorized: {authn.error}")
            user = authn.user
            authz = self._reviews.review_access(user, self.path, self.verb)
        except KubeError as err:
            log.error("metrics: cannot check a scrape's token, answering 503: %s", err)
            return Decision(503, "the Kubernetes API did not answer the token or access review")
        if not authz.allowed:
            log.info("metrics: %s may not %s %s: %s", user.username, self.verb, self.path, authz.reason)
            why = f": {authz.reason}" if authz.reason else ""
            return Decision(403, f"forbidden: user {user.username!r} may not {self.verb} {self.path}{why}")
        return Decision(200, "allowed", user.username)
