# Set-up and everyday commands. `make run` and `make test` install what they need first.
#
#   make run                      # .venv, torch (CPU build) + rlhf[dev], then the default job
#   make run ARGS="algo=ppo --plan"
#   make test                     # the test suite (what CI runs: bash .ci/run)
#   make plan ARGS="model=llama3-8b hardware=8xh100"

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.rlhf-installed
ARGS   ?=
# Two pytest workers (pytest-xdist), whole files each (module fixtures share one run; tests/conftest.py
# splits a few files and sends the longest first, by tests/durations.json): an
# end-to-end run keeps about one core busy, so on 2 cores two of them nearly halve the suite.
TEST_WORKERS ?= 2
PYTEST_ARGS ?= -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: install run plan test test-slow clean

# torch first and pinned: left to the resolver, plain `torch` pulls a multi-GB CUDA build.
# constraints.txt holds the versions measured together, so every fresh .venv gets the same set.
$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c constraints.txt $(TORCH)
	$(PY) -m pip install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/rlhf-run $(ARGS)

plan: install
	$(VENV)/bin/rlhf-run $(ARGS) --plan

# pytest exits 5 when it collects no test: not a failure here.
test: install
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

test-slow: install
	$(PY) -m pytest -m slow $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

clean:
	rm -rf build dist *.egg-info outputs multirun
