# `make demo` and `make test` each set everything up (a virtualenv in .venv with qdeploy and its
# dependencies from the package registry) and then run. .ci/run first smoke-tests a plain `pip install .`,
# then calls `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

demo: $(STAMP)
	$(VENV)/bin/qdeploy demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra --durations=15

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test,keras]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs
