"""The Kubernetes API connection and the error boundary of every adapter in this package.

Adapters call the ``kubernetes`` client's API methods with ``_preload_content=False`` and
parse the JSON themselves (the client's model deserializer costs milliseconds per pod);
``call`` turns ``ApiException`` and urllib3 errors into ``KubeError`` / ``ConflictError``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import urllib3
import yaml
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import InClusterConfigLoader
from kubernetes.config.kube_config import load_kube_config
from urllib3.util import Retry

from agent.errors import ConflictError, KubeError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_T = TypeVar("_T")


def api_client(
    kubeconfig: Path | None,
    in_cluster: bool,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    pool_size: int = 16,
) -> ApiClient:
    """An ApiClient from the pod's service account (``in_cluster``) or from a kubeconfig file.

    ``pool_size`` bounds the pooled connections: two watches stay open all the time, and the
    Allocate path patches pods concurrently."""
    config = Configuration()
    config.connection_pool_maxsize = pool_size
    try:
        if in_cluster:
            loader = InClusterConfigLoader(  # type: ignore[no-untyped-call]
                token_filename=str(service_account_dir / "token"),
                cert_filename=str(service_account_dir / "ca.crt"),
            )
            loader.load_and_set(config)  # type: ignore[no-untyped-call]
        elif kubeconfig is not None:
            load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig), client_configuration=config, persist_config=False
            )
        else:
            raise KubeError(
                "no Kubernetes API configuration: give a kubeconfig path, or run in-cluster "
                "(a pod with a service account)"
            )
    except (ConfigException, OSError, yaml.YAMLError) as err:
        where = f"the service account in {service_account_dir}" if in_cluster else f"kubeconfig {kubeconfig}"
        raise KubeError(f"cannot load the Kubernetes API configuration from {where}: {err}") from err
    # No immediate re-dials of a refused or timed-out connection: every caller retries with
    # its own back-off (as client-go does), and urllib3's three quick retries only made each
    # failed request three more, with a WARNING apiece, all through an API server outage.
    config.retries = Retry(total=3, connect=0)
    return ApiClient(config)


def call(what: str, request: Callable[[], _T]) -> _T:
    """Run one API request; translate its failure into KubeError (ConflictError for 409)."""
    try:
        return request()
    except ApiException as err:
        raise api_error(what, err) from err
    except (urllib3.exceptions.HTTPError, OSError) as err:
        raise KubeError(f"{what} failed: the API server did not answer: {err}") from err


def api_error(what: str, err: ApiException) -> KubeError:
    """The server's Status message, when the body has one, else the HTTP reason."""
    status = int(err.status) if err.status else None
    message = str(err.reason or "")
    try:
        body = json.loads(err.body) if err.body else None
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        message = str(body["message"])
    error = ConflictError if status == 409 else KubeError
    return error(f"{what} failed (HTTP {status}): {message}", status=status)


def read_json(response: Any) -> Any:
    """The JSON body of a raw (``_preload_content=False``) urllib3 response, connection released."""
    try:
        data = response.data
    finally:
        response.release_conn()
    try:
        return json.loads(data)
    except ValueError as err:
        raise KubeError(f"the API server sent a body that is not JSON: {data[:200]!r}") from err


def json_call(what: str, request: Callable[[], Any]) -> Any:
    """``call`` for a request made with ``_preload_content=False``, returning the parsed JSON."""
    return call(what, lambda: read_json(request()))
