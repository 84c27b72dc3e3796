"""Authenticated /metrics (--metrics-auth kubernetes), over real HTTP: the metrics endpoint
asks the emulated API server (TokenReview, then SubjectAccessReview with RBAC from the
ClusterRole and binding deploy/ ships) whether a scrape's bearer token may get /metrics.
No token or a bad one is 401, a user RBAC does not allow is 403, the scraper's service
account reads the pods; decisions are cached per token; an API server that cannot answer is
a 503 (not cached), and the endpoint keeps serving."""

from __future__ import annotations

import json
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge

from agent.clock import VirtualClock
from agent.control.metricsauth import MetricsAuthorizer, bearer_token
from agent.emulators.apiserver import FakeApiServer
from agent.errors import ConfigError
from agent.platform.kube.client import api_client
from agent.platform.kube.reviews import AccessResult, ReviewClient, TokenResult, TokenUser
from agent.settings import MetricsAuth, MetricsSettings
from agent.surfaces.cli.main import build_parser
from agent.surfaces.cli.run import settings_from_args
from agent.surfaces.metrics.http import MetricsServer, tls_context
from tests.selfsigned import make_certificate

ROOT = Path(__file__).resolve().parents[2]
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
RBAC = "rbac.authorization.k8s.io"
METRICS = {"nonResourceAttributes": {"path": "/metrics", "verb": "get"}}


def deploy_rbac(api: FakeApiServer) -> None:
    """The ClusterRole vcuda-metrics-reader (deploy/base) and the monitoring overlay's binding
    of the scraper account, as written in deploy/ (test_deploy.py checks the rendered ones)."""
    for path in ("deploy/base/rbac.yaml", "deploy/overlays/monitoring/scraper.yaml"):
        for doc in yaml.safe_load_all((ROOT / path).read_text()):
            if doc and doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                api.create_object(doc["kind"].lower() + "s", doc)


@dataclass
class Rig:
    api: FakeApiServer
    clock: VirtualClock
    authorizer: MetricsAuthorizer
    url: str

    def get(self, path: str = "/metrics", token: str | None = None) -> tuple[int, str, Any]:
        request = urllib.request.Request(self.url + path)
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.read().decode(), answer.headers
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(), err.headers

    def reviews(self) -> int:
        return sum(1 for r in self.api.request_log if r.path == TOKEN_REVIEWS)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    api = FakeApiServer()
    api.start()
    deploy_rbac(api)
    client = api_client(api.write_kubeconfig(tmp_path / "kubeconfig"), in_cluster=False)
    clock = VirtualClock()
    authorizer = MetricsAuthorizer(ReviewClient(client, timeout_s=5), cache_s=30, clock=clock)
    registry = CollectorRegistry()
    gauge = Gauge("vcuda_container_cores", "cores", ["namespace", "pod"], registry=registry)
    gauge.labels("team-a", "trainer-0").set(50)
    server = MetricsServer("127.0.0.1", 0, registry, lambda: (True, "ready"), authorize=authorizer.decide)
    server.start()
    host, port = server.address
    try:
        yield Rig(api, clock, authorizer, f"http://{host}:{port}")
    finally:
        server.stop()
        client.close()  # type: ignore[no-untyped-call]
        api.stop()


def test_only_a_token_rbac_allows_reads_the_pods(rig: Rig) -> None:
    code, body, headers = rig.get()
    assert code == 401 and "bearer token" in body and "team-a" not in body
    assert headers["WWW-Authenticate"].startswith("Bearer")
    code, body, _ = rig.get(token="not-a-token")
    assert code == 401 and "invalid bearer token" in body and "team-a" not in body
    tenant = rig.api.auth.service_account_token("team-a", "default")  # any pod's own token
    code, body, _ = rig.get(token=tenant)
    assert code == 403 and "system:serviceaccount:team-a:default" in body and "trainer-0" not in body
    scraper = rig.api.auth.service_account_token("kube-system", "vcuda-metrics-scraper")
    code, body, _ = rig.get(token=scraper)
    assert code == 200
    assert 'vcuda_container_cores{namespace="team-a",pod="trainer-0"} 50.0' in body
    # The probes carry no token and get what they always did.
    assert rig.get("/healthz")[:2] == (200, "ok\n")
    assert rig.get("/readyz")[0] == 200
    # The SubjectAccessReview asked exactly for get /metrics as the reviewed user.
    [access] = [r for r in rig.api.request_log if r.path == ACCESS_REVIEWS][-1:]
    assert access.method == "POST" and access.status == 201


def test_a_group_binding_and_a_user_binding_are_honoured(rig: Rig) -> None:
    rig.api.create_object(
        "clusterrolebindings",
        {
            "metadata": {"name": "ops-reads-metrics"},
            "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": "vcuda-metrics-reader"},
            "subjects": [{"kind": "Group", "name": "ops", "apiGroup": RBAC}],
        },
    )
    assert rig.get(token=rig.api.auth.add_token("t-ops", "alice", ["ops"]))[0] == 200
    assert rig.get(token=rig.api.auth.add_token("t-dev", "bob", ["dev"]))[0] == 403
    assert rig.get(token=rig.api.auth.add_token("t-admin", "root", ["system:masters"]))[0] == 200


def test_decisions_are_cached_per_token_for_the_cache_period(rig: Rig) -> None:
    scraper = rig.api.auth.service_account_token("kube-system", "vcuda-metrics-scraper")
    for _ in range(5):  # Prometheus every 15 s, and a second replica: one review
        assert rig.get(token=scraper)[0] == 200
    assert rig.reviews() == 1
    for _ in range(3):
        assert rig.get(token="wrong")[0] == 401
    assert rig.reviews() == 2, "a refusal is cached too: a wrong token costs one review per period"
    rig.api.auth.revoke(scraper)
    rig.clock.advance(29)
    assert rig.get(token=scraper)[0] == 200, "within the period the cached decision stands"
    rig.clock.advance(2)
    assert rig.get(token=scraper)[0] == 401, "after it, the token is reviewed again"
    assert rig.reviews() == 3


def test_an_api_server_that_cannot_answer_is_a_503_never_cached(rig: Rig) -> None:
    scraper = rig.api.auth.service_account_token("kube-system", "vcuda-metrics-scraper")
    other = rig.api.auth.service_account_token("kube-system", "vcuda-metrics-scraper")
    assert rig.get(token=scraper)[0] == 200
    rig.api.refuse("POST", TOKEN_REVIEWS, 500)
    code, body, _ = rig.get(token=other)
    assert code == 503 and "did not answer" in body
    rig.api.allow()
    rig.api.refuse("POST", ACCESS_REVIEWS, 503)
    assert rig.get(token=other)[0] == 503
    rig.api.allow()
    rig.api.stop()  # connection refused
    assert rig.get(token=other)[0] == 503
    assert rig.get(token=scraper)[0] == 200, "a cached decision outlives a short outage"
    assert rig.get("/healthz")[0] == 200
    rig.api.start()
    assert rig.get(token=other)[0] == 200, "the outage was not cached"


def test_the_endpoint_serves_https_with_the_given_certificate(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    registry = CollectorRegistry()
    Gauge("vcuda_up", "up", registry=registry).set(1)
    server = MetricsServer("127.0.0.1", 0, registry, lambda: (True, "ready"), tls=tls_context(cert, key))
    server.start()
    host, port = server.address
    try:
        verified = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://{host}:{port}/metrics", context=verified, timeout=10) as answer:
            assert "vcuda_up 1.0" in answer.read().decode()
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP is not served
            urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=10)
        with urllib.request.urlopen(f"https://{host}:{port}/healthz", context=verified, timeout=10) as answer:
            assert answer.status == 200, "a failed handshake above did not stop the server"
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="--metrics-tls-cert"):
        tls_context(key, cert)  # swapped: not a certificate


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc.def", "abc.def"),
        ("bearer abc", "abc"),
        ("  Bearer   abc  ", "abc"),
        ("Basic dXNlcjpwYXNz", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Bearer a b", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


class _Stuck:
    """Reviews that wait until released: the flood test's API server under load."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def review_token(self, token: str) -> TokenResult:
        self.entered.release()
        self.release.wait(10)
        return TokenResult(None, "invalid bearer token")

    def review_access(self, user: TokenUser, path: str, verb: str) -> AccessResult:
        return AccessResult(False)


def test_a_flood_of_tokens_holds_at_most_max_in_flight_reviews() -> None:
    stuck = _Stuck()
    authorizer = MetricsAuthorizer(stuck, max_in_flight=2)
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda n=n: results.append(authorizer.decide(f"Bearer t{n}").code))
        for n in range(2)
    ]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert stuck.entered.acquire(timeout=10)
    assert authorizer.decide("Bearer t3").code == 429
    stuck.release.set()
    for thread in threads:
        thread.join(10)
    assert results == [401, 401]
    assert authorizer.decide("Bearer t4").code == 401, "slots are given back"


def _post(api: FakeApiServer, path: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        api.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_emulated_reviews_speak_the_wire_format() -> None:
    with FakeApiServer() as api:
        deploy_rbac(api)
        token = api.auth.service_account_token("kube-system", "vcuda-metrics-scraper")
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        code, review = _post(api, TOKEN_REVIEWS, request)
        assert code == 201 and review["kind"] == "TokenReview"
        status = review["status"]
        assert status["authenticated"] is True
        assert status["user"]["username"] == "system:serviceaccount:kube-system:vcuda-metrics-scraper"
        assert status["user"]["groups"] == [
            "system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"
        ]  # fmt: skip
        assert _post(api, TOKEN_REVIEWS, {"spec": {"token": "x"}})[1]["status"] == {
            "authenticated": False, "error": "invalid bearer token"
        }  # fmt: skip
        assert _post(api, TOKEN_REVIEWS, {"spec": {}})[0] == 422
        user = status["user"]
        spec = {"user": user["username"], "groups": user["groups"]}
        allowed = _post(api, ACCESS_REVIEWS, {"spec": {**spec, **METRICS}})
        assert allowed[0] == 201 and allowed[1]["status"]["allowed"] is True
        assert 'ClusterRole "vcuda-metrics-reader"' in allowed[1]["status"]["reason"]
        for attributes in (
            {"nonResourceAttributes": {"path": "/metrics", "verb": "post"}},
            {"nonResourceAttributes": {"path": "/healthz", "verb": "get"}},
            {"resourceAttributes": {"verb": "list", "resource": "pods"}},
        ):
            answer = _post(api, ACCESS_REVIEWS, {"spec": {**spec, **attributes}})
            assert answer[1]["status"] == {"allowed": False}
        assert _post(api, ACCESS_REVIEWS, {"spec": {"nonResourceAttributes": {"path": "/metrics"}}})[0] == 422
        assert _post(api, ACCESS_REVIEWS, {"spec": spec})[0] == 422
        assert _post(api, "/apis/authentication.k8s.io/v1/tokenreviews/x", {})[0] == 404


def _settings(*argv: str) -> MetricsSettings:
    return settings_from_args(build_parser().parse_args(["run", *argv])).metrics


def test_the_flags_and_what_they_refuse() -> None:
    default = _settings()
    assert default.auth is MetricsAuth.NONE and default.tls_cert is None, "the CLI's default: demo, dev"
    chosen = _settings("--metrics-auth", "kubernetes", "--metrics-tls-cert=/c", "--metrics-tls-key=/k")
    assert chosen.auth is MetricsAuth.KUBERNETES
    assert (chosen.tls_cert, chosen.tls_key) == (Path("/c"), Path("/k"))
    with pytest.raises(ConfigError) as info:
        _settings("--no-kube", "--metrics-auth=kubernetes", "--metrics-tls-cert=/c")
    assert len(info.value.problems) == 2
    assert any("--no-kube" in p for p in info.value.problems), "never open by mistake"
    assert any("--metrics-tls-key" in p for p in info.value.problems)
    assert _settings("--no-kube", "--no-metrics", "--metrics-auth=kubernetes").enabled is False
