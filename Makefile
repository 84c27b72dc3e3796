# vcuda-agent: `make demo` and `make test` do all set-up themselves (Debian/Ubuntu, as root).
SHELL := /bin/bash
PYTHON ?= /usr/bin/python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The one lock (deploy/image/freeze_constraints.py): the venv and the image install these versions.
LOCK := requirements.lock
PROTOS := $(wildcard agent/platform/kubelet/pb/*.proto)
# helm and kubectl (deploy/host/get-helm.sh) for the Helm chart: its tests and `make chart`.
TOOLS := .tools
HELM := $(TOOLS)/helm
CHART := deploy/helm/vcuda-agent

.PHONY: all setup host demo test test-repeat lint format bench gpu-check image chart lock proto clean

all: test

host:
	@bash deploy/host/setup.sh

# The venv: the package editable with its dev tools, and Debian's bcc linked in.
$(STAMP): pyproject.toml $(LOCK) | host
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	PIP_CONSTRAINT=$(CURDIR)/$(LOCK) $(VPY) -m pip install -q -e '.[dev]'
	@site=$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  ln -sfn /usr/lib/python3/dist-packages/bcc "$$site/bcc"; \
	  $(VPY) -c 'import bcc, os; print("setup: bcc", bcc.__version__ if hasattr(bcc, "__version__") else "", "from", os.path.realpath(bcc.__file__))'
	@touch $(STAMP)

# The binary is its own stamp: the script runs again (and re-downloads only for another pinned
# version) when it is newer than the binary.
$(HELM): deploy/host/get-helm.sh
	@bash deploy/host/get-helm.sh $(TOOLS)

setup: host $(STAMP) $(HELM)
	@echo "setup: $(VENV)/bin/vcuda-agent ready"

demo: setup
	@$(COMPILE)
	$(VENV)/bin/vcuda-agent demo

# Two workers, a test file each at a time: most tests wait on real time (agents, GPU servers,
# containers), so two files share this 2-core machine well; a file's tests stay in order. The
# files that measure caps form one group (tests/conftest.py): never two of them at once.
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=20

# The suite starts hundreds of Python processes (agents, GPU servers, workloads): each would
# compile the package again where PYTHONDONTWRITEBYTECODE is set (0.7 s of a core apiece), so
# the bytecode is written once, here. Python still reads it with that variable set.
COMPILE := $(VPY) -m compileall -q -j 0 agent tests bench

# $(TOOLS) goes last on PATH: its kubectl (for `kubectl kustomize`) only where none is installed.
test: setup
	@$(COMPILE)
	PATH="$$PATH:$(CURDIR)/$(TOOLS)" $(VPY) -m pytest $(PYTEST_ARGS)

# The real-process tier N times (default 3), every run to its end: a test that fails in one of
# them is a flake to find the cause of. `make test-repeat N=5`.
N ?= 3
test-repeat: setup
	@$(COMPILE)
	@fails=0; for i in $$(seq $(N)); do echo "test-repeat: run $$i of $(N)"; \
	  PATH="$$PATH:$(CURDIR)/$(TOOLS)" $(VPY) -m pytest $(PYTEST_ARGS) -q tests/integration tests/runtime \
	    || fails=$$((fails + 1)); done; \
	  echo "test-repeat: $$fails of $(N) runs failed"; test $$fails -eq 0

lint: setup
	$(VENV)/bin/ruff check agent tests bench
	$(VENV)/bin/ruff format --check agent tests bench
	$(VENV)/bin/mypy
	$(HELM) lint --strict --quiet $(CHART)

format: setup
	$(VENV)/bin/ruff check --fix agent tests bench
	$(VENV)/bin/ruff format agent tests bench

bench: setup
	$(VPY) bench/allocate.py
	$(VPY) bench/restarts.py
	$(VPY) bench/enforcement.py
	$(VPY) bench/controller_cost.py

# The GPU script (bench/gpu_suite.py) on a GPU machine: no venv there, its own python3 with
# PyTorch and pynvml; results under $OUT (else ./gpu-suite-out). GPU_CHECK_ARGS adds options,
# e.g. GPU_CHECK_ARGS="--budget-s 300 --patterns train,graph".
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) bench/gpu_suite.py $(GPU_CHECK_ARGS)

# The image, built with podman on a cached debootstrap base (deploy/image/build.sh; root).
image: host
	@bash deploy/image/build.sh

# The Helm chart, linted and packaged: dist/vcuda-agent-<chart version>.tgz.
chart: $(HELM)
	$(HELM) lint --strict $(CHART)
	$(HELM) package $(CHART) --destination dist

# Refresh the lock: a throw-away venv with the newest versions pyproject.toml allows, frozen.
# Then `make test` (the venv follows the lock) before committing it.
lock: host
	@rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --upgrade pip
	.lock-venv/bin/python -m pip install -q -e '.[dev]'
	.lock-venv/bin/python deploy/image/freeze_constraints.py > $(LOCK).new && mv $(LOCK).new $(LOCK)
	@rm -rf .lock-venv && echo "lock: $(LOCK) refreshed"

# Regenerate the gRPC stubs (committed) from the .proto files.
proto: setup
	$(VPY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
	  --plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy --plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc \
	  --mypy_out=. --mypy_grpc_out=. $(PROTOS)

clean:
	rm -rf $(VENV) $(TOOLS) .mypy_cache .ruff_cache .pytest_cache
