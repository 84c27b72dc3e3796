"""What --metrics-auth kubernetes adds to a scrape: the decision for a token already cached
(SHA-256 of the token and a dict lookup), and for a new token (a TokenReview and a
SubjectAccessReview over HTTP to the emulated API server on loopback, through the agent's
kubernetes client); then whole scrapes of a small registry over HTTP with and without auth.

    .venv/bin/python bench/metrics_auth.py [--rounds 300]

Last line: RESULT cached_us=<median> review_ms=<median> scrape_open_ms=<median>
scrape_auth_ms=<median>.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from agent.control.metricsauth import MetricsAuthorizer
from agent.emulators.apiserver import FakeApiServer
from agent.platform.kube.client import api_client
from agent.platform.kube.reviews import ReviewClient
from agent.surfaces.metrics.http import MetricsServer

READER = {"metadata": {"name": "reader"}, "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]}
BINDING = {
    "metadata": {"name": "scraper"},
    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "reader"},
    "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": "kube-system"}],
}


def median_of(rounds: int, action: Callable[[], object]) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scrape(url: str, token: str | None) -> bytes:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return bytes(answer.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    rounds = parser.parse_args().rounds
    registry = CollectorRegistry()
    gauge = Gauge("vcuda_container_cores", "cores", ["namespace", "pod"], registry=registry)
    for n in range(128):
        gauge.labels("team", f"pod-{n}").set(n)
    with FakeApiServer() as api, tempfile.TemporaryDirectory() as tmp:
        api.create_object("clusterroles", READER)
        api.create_object("clusterrolebindings", BINDING)
        client = api_client(api.write_kubeconfig(Path(tmp) / "kc"), in_cluster=False)
        authorizer = MetricsAuthorizer(ReviewClient(client), cache_s=3600)
        token = api.auth.service_account_token("kube-system", "scraper")
        header = f"Bearer {token}"
        assert authorizer.decide(header).allowed
        cached = median_of(rounds * 10, lambda: authorizer.decide(header))
        fresh = [api.auth.service_account_token("kube-system", "scraper") for _ in range(rounds)]
        tokens = iter(fresh)
        review = median_of(rounds, lambda: authorizer.decide(f"Bearer {next(tokens)}"))
        open_server = MetricsServer("127.0.0.1", 0, registry, lambda: (True, "ready"))
        auth_server = MetricsServer(
            "127.0.0.1", 0, registry, lambda: (True, "ready"), authorize=authorizer.decide
        )
        for server in (open_server, auth_server):
            server.start()
        try:
            open_url = "http://{}:{}/metrics".format(*open_server.address)
            auth_url = "http://{}:{}/metrics".format(*auth_server.address)
            assert scrape(auth_url, token) == scrape(open_url, None)
            open_ms = median_of(rounds, lambda: scrape(open_url, None)) * 1e3
            auth_ms = median_of(rounds, lambda: scrape(auth_url, token)) * 1e3
        finally:
            for server in (open_server, auth_server):
                server.stop()
            client.close()  # type: ignore[no-untyped-call]
    print(
        f"cached decision: {cached * 1e6:.1f} us; new token (TokenReview + SubjectAccessReview): "
        f"{review * 1e3:.2f} ms; scrape (128 series) open {open_ms:.2f} ms, "
        f"authenticated {auth_ms:.2f} ms"
    )
    print(
        f"RESULT cached_us={cached * 1e6:.1f} review_ms={review * 1e3:.2f} "
        f"scrape_open_ms={open_ms:.2f} scrape_auth_ms={auth_ms:.2f}"
    )


if __name__ == "__main__":
    main()
