# vcuda-agent node image: Debian's python3-bpfcc, the package in a venv, no build tools
# in the final stage. Runs privileged as a DaemonSet (see deploy/).
FROM debian:bookworm-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
RUN python3 -m venv /opt/vcuda-agent \
 && /opt/vcuda-agent/bin/pip install --no-cache-dir --no-compile . \
 && /opt/vcuda-agent/bin/pip uninstall -y pip

FROM debian:bookworm-slim
LABEL org.opencontainers.image.title="vcuda-agent" \
      org.opencontainers.image.description="Kubernetes node agent sharing NVIDIA GPUs with enforced limits" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-bpfcc \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/vcuda-agent /opt/vcuda-agent
# Debian's bcc (not the unrelated PyPI package "bcc") made importable in the venv.
RUN ln -s /usr/lib/python3/dist-packages/bcc /opt/vcuda-agent/lib/python3.11/site-packages/bcc
ENV PATH=/opt/vcuda-agent/bin:$PATH PYTHONUNBUFFERED=1
ENTRYPOINT ["vcuda-agent", "run"]
