# Every target installs what it needs into .venv first, so each works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROTOS := protos/pergrad/v1/tensor.proto protos/pergrad/v1/gradient_service.proto
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install system-deps test soak demo bench protos lint wheel image image-test clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,dev]'
	touch $@

install: $(STAMP)

# prometheus and promtool (Debian package prometheus) for the metrics and deploy tests;
# nothing to do when both are on PATH. kubectl, if present, renders the Kustomize overlays.
system-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
		$(SUDO) apt-get update -q && \
		$(SUDO) apt-get install -y -q --no-install-recommends prometheus; }

lint: install
	$(PY) -m ruff check .

test: install system-deps lint
	$(PY) -m pytest -q

# The long fuzz run: thousands of random requests of each kind against a live server.
soak: install
	PERGRAD_FUZZ_EXAMPLES=3000 $(PY) -m pytest -q tests/server/test_fuzz.py

# The one wheel users, the container images and the installed-package test all install.
wheel: install
	rm -rf build dist
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .

# The CPU image, built with podman (no Docker engine needed), and the installed-package
# smoke test run against a container of it. Needs root.
IMAGE ?= pergrad:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)-cpu

image: install
	deploy/docker/build-image.sh $(IMAGE)

image-test: image
	PERGRAD_IMAGE=$(IMAGE) $(PY) -m pytest -q tests/release/test_installed_package.py

demo: install
	$(PY) examples/demo.py

bench: install
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/reductions.py
	$(PY) benchmarks/transport.py
	$(PY) benchmarks/load.py

# The generated code, and the descriptors with their comments that reflection serves.
protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --grpc_python_out=protos \
		--pyi_out=protos $(PROTOS)
	$(PY) -m grpc_tools.protoc -Iprotos --include_source_info \
		--descriptor_set_out=protos/pergrad/v1/descriptors.binpb $(PROTOS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
