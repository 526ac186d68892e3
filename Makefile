# `make demo` and `make test` each set everything up (a virtualenv in .venv with qdeploy and its
# dependencies from the package registry) and then run. .ci/run first smoke-tests a plain `pip install .`,
# then calls `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test smoke setup clean

demo: $(STAMP)
	$(VENV)/bin/qdeploy demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra

# INT8 with all four methods on a tiny model, from the installed package (what .ci/run does after a plain install)
smoke: $(STAMP)
	cd /tmp && $(CURDIR)/$(VENV)/bin/python $(CURDIR)/bench/smoke_plain_install.py

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs
