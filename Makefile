# make demo  - install into .venv if needed, then run the main job
# make test  - install into .venv (torch 2.14.1) and .venv-torch2.13 (torch 2.13.0) if needed, then
#              run the whole suite on 2.14.1 and the backend and MoE packages again on 2.13.0
PYTHON ?= python3
VENV ?= .venv
VENV_213 ?= .venv-torch2.13
PY := $(VENV)/bin/python
PY_213 := $(VENV_213)/bin/python
STAMP := $(VENV)/.hetcomm-installed
STAMP_213 := $(VENV_213)/.hetcomm-installed
# The supported torch releases (pyproject.toml: torch>=2.13,<2.15). Pinned here because an
# unpinned torch pulls the newest CUDA build; on this kind of machine both lie on disk (2.14.1 is
# the registry's CUDA build, 5.4 GB, and runs on the CPU; 2.13.0 a CPU wheel).
TORCH ?= 2.14.1
TORCH_213 ?= 2.13.0

.PHONY: demo test install clean bench

demo: $(STAMP)
	$(VENV)/bin/hetcomm train

# Two pytest-xdist workers: the suite's multi-process tests leave a core idle about a third of the
# time (waiting on peers, timeouts, rendezvous), so two at once fill it. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: $(STAMP) $(STAMP_213)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal
	$(PY_213) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests/backends tests/moe

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==$(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

$(STAMP_213): pyproject.toml
	test -x $(PY_213) || $(PYTHON) -m venv $(VENV_213)
	$(PY_213) -m pip install -q --disable-pip-version-check torch==$(TORCH_213)
	$(PY_213) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP_213)

clean:
	rm -rf $(VENV) $(VENV_213) build *.egg-info .pytest_cache .hypothesis
