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

.PHONY: dev demo test test-python test-lab lint docs docs-table clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	sh scripts/install-torch.sh $(PY) "$(TORCH)" "$(TORCH_INDEX)"
	$(PY) -m pip install -q -e ".[test]"
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
	$(PY) -m nbtrain.sft.config_doc --check
	$(PY) -m mkdocs build -q

# regenerate the SFTConfig table in docs/fine-tuning.md from the dataclass
docs-table: $(STAMP)
	$(PY) -m nbtrain.sft.config_doc

# the JupyterLab extension: build, prettier + eslint, vitest, REST handlers, UI tests in Chromium
test-lab: $(STAMP)
	PYTHON=$(abspath $(PY)) bash labextension/run-tests.sh

# the Python suite: real engines, real gloo groups, simulated nodes (needs root for namespaces)
test-python: $(STAMP)
	sh scripts/testbed-deps.sh
	$(PY) -m pytest -q -p no:cacheprovider --durations=40 -rfE --ignore=tests/test_server.py tests

test: lint docs test-lab test-python

clean:
	rm -rf $(VENV) nbtrain-demo labextension/node_modules labextension/prebuilt labextension/lib
