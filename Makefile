# The README's commands. `make run` and `make test` do all the set-up they need first.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.stamp-setup
PREFIX ?= /usr
DESTDIR ?=

.PHONY: setup run test clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml tools/apt-deps.sh
	tools/apt-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

run: setup
	tools/demo.sh

test: setup
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
