# make demo  - install into .venv if needed, then run the main job
# make test  - install into .venv if needed, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hetcomm-installed

.PHONY: demo test install clean bench

demo: $(STAMP)
	$(VENV)/bin/hetcomm train

# Two pytest-xdist workers: the suite's multi-process tests leave a core idle about a third of the
# time (waiting on peers, timeouts, rendezvous), so two at once fill it. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

install: $(STAMP)

# torch==2.13.0 first: on this kind of machine it resolves to a local CPU wheel in seconds,
# while an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
