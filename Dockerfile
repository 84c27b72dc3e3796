# vcuda-agent node image: Debian's python3-bpfcc and the package in a venv; no build tools
# in the final stage. Runs privileged as a DaemonSet (deploy/, deploy/README.md).
#
#   docker build --build-arg VERSION=0.1.0 --build-arg REVISION=$(git rev-parse HEAD) \
#     --build-arg SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) -t REGISTRY/vcuda-agent:0.1.0 .
#
# Reproducibility: Python packages are pinned exactly (requirements.lock, the one lock the
# test venv installs too; the build backend included) and byte-compiled without timestamps; Debian packages come from the
# base image's suite. The base is pinned by tag; the reproducible form is a digest,
# `--build-arg BASE_IMAGE=debian:bookworm-slim@sha256:<digest>`, with apt pointed at
# snapshot.debian.org for the same date to pin the Debian packages too.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The dependencies first, in a layer of their own: a change to the package's code rebuilds
# only the layer after it (seconds), not the download of every wheel (a minute and more).
# PIP_CONSTRAINT (not -c) also reaches pip's isolated build environment (setuptools).
# Every dependency ships a wheel for CPython 3.11: this stage has no compiler either.
# Cut what the agent never imports (the final stage imports every agent module): pip and
# setuptools (the venv's bootstrap), and kubernetes' asyncio client, kubernetes.aio (68 MB
# with its bytecode; the agent uses the synchronous one), with aiohttp and the packages
# only aiohttp needs (13 MB).
COPY requirements.lock pyproject.toml ./
RUN python3 -m venv /opt/vcuda-agent \
 && python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
      > /tmp/dependencies.txt \
 && PIP_CONSTRAINT=/src/requirements.lock /opt/vcuda-agent/bin/pip install -q --no-compile -r /tmp/dependencies.txt \
 && /opt/vcuda-agent/bin/pip uninstall -y -q aiohttp-retry aiohttp aiosignal aiohappyeyeballs \
      frozenlist multidict yarl propcache attrs \
 && rm -r "$(/opt/vcuda-agent/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/kubernetes/aio"
COPY README.md ./
COPY agent ./agent
RUN PIP_CONSTRAINT=/src/requirements.lock /opt/vcuda-agent/bin/pip install -q --no-compile --no-deps . \
 && /opt/vcuda-agent/bin/pip uninstall -y -q setuptools pip \
 && /opt/vcuda-agent/bin/python -m compileall -q --invalidation-mode unchecked-hash /opt/vcuda-agent/lib

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="vcuda-agent" \
      org.opencontainers.image.description="Kubernetes node agent sharing NVIDIA GPUs with limits enforced from outside the workload" \
      org.opencontainers.image.source="https://github.com/vcuda-agent/vcuda-agent" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
# bcc compiles the BPF programs at run time with its own (library) LLVM, against the host's
# kernel headers mounted from /lib/modules and /usr/src: no compiler packages are needed.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-bpfcc \
 && rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log /var/cache/ldconfig/aux-cache
COPY --from=build /opt/vcuda-agent /opt/vcuda-agent
# The BPF C sources. The DaemonSet passes --bpf-dir /opt/vcuda-agent/bpf; the link below makes
# the package's own default (<site-packages>/bpf) resolve to the same directory.
COPY bpf/ /opt/vcuda-agent/bpf/
# Debian's bcc (not the unrelated PyPI package "bcc") made importable in the venv; every
# agent module is imported, so a failed import (bcc, or something cut above) fails the
# build rather than a node.
RUN site=$(/opt/vcuda-agent/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
 && ln -s /usr/lib/python3/dist-packages/bcc "$site/bcc" \
 && ln -s /opt/vcuda-agent/bpf "$site/bpf" \
 && PYTHONDONTWRITEBYTECODE=1 /opt/vcuda-agent/bin/python -c 'import bcc, importlib, pkgutil, agent; \
      [importlib.import_module(m.name) for m in pkgutil.walk_packages(agent.__path__, "agent.")]'
ENV PATH=/opt/vcuda-agent/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["vcuda-agent", "run"]
