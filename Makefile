# The README's quickstart: `make demo` runs the main job on the embedded default, `make test` runs the suite.
# Both create .venv when missing. TORCH_SPEC picks the torch build: the default takes the CPU wheel that lies
# on these machines' disk; on a GPU cluster pass the build you want, e.g. `make TORCH_SPEC="torch==2.13.0" ...`
# with the CUDA index your cluster uses in PIP_EXTRA_INDEX_URL.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast clean prometheus

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) jobs/demo.py

# The unit tests on two pytest-xdist processes (they start no Ray cluster), then the integration tests one at a
# time (each starts its own Ray cluster, which takes both cores).
test: $(STAMP) prometheus
	$(PY) -m pytest -q -n 2 --durations=10 tests/unit
	$(PY) -m pytest -q --durations=40 tests/integration tests/gpu

# Debian's `prometheus` (2.42): the metrics tests start a real one. Installed as root when missing; otherwise a
# one-line error says how.
APT_PROMETHEUS := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
prometheus:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && { $(APT_PROMETHEUS) || { apt-get update -qq && \
		$(APT_PROMETHEUS); }; }; } || { echo "prometheus is not installed: run 'sudo apt-get install prometheus' \
		(Debian's package; the metrics tests start one)" >&2; exit 1; }

# The unit tests alone (no Ray cluster, no training job), on two pytest-xdist processes, without the few marked
# `slow` (several processes or a CLI subprocess each, about 8 s or more): for iteration. `make test` stays the full
# suite and is what CI runs.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow" --durations=10 tests/unit

clean:
	rm -rf $(VENV) outputs
