# roseray: two commands on a fresh machine.
#   make serve   — install and run the Ray Serve app (serve_config.yaml) on this machine (Ctrl-C stops it)
#   make serve-bg / make stop — the same in the background, and its stop
#   make test    — install and run the test suite
# Both create .venv first. torch is pinned so pip never resolves a newer (CUDA) build.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH  ?= torch==2.13.0
PIP     = $(BIN)/python -m pip
SERVE_CONFIG ?= serve_config.yaml
HAPROXY_DIR  ?=
HAPROXY_DIR_ARG = $(if $(HAPROXY_DIR),--dir $(HAPROXY_DIR))

.PHONY: install install-test serve serve-bg stop standalone generate test lint bench-step clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# pip runs again only when pyproject.toml or this Makefile (the torch pin) changed since the
# stamp was written: the install is editable, so code changes need none. torch goes first,
# pinned, so that resolving the rest never pulls a newer (CUDA) build.
$(VENV)/.installed-serve: pyproject.toml Makefile | $(BIN)/python
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q "$(TORCH)" -e ".[serve,client]"
	touch $@

$(VENV)/.installed-test: pyproject.toml Makefile | $(BIN)/python
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q "$(TORCH)" -e ".[serve,client,test,bench]"
	touch $@

install: $(VENV)/.installed-serve
install-test: $(VENV)/.installed-test

# `serve run` with haproxy_env's flags (HAProxy mode must be in Ray's environment when it starts),
# after a taken-port check (one line, exit 1, before Ray starts); Ctrl-C and SIGTERM both stop it
# gracefully (roseray.ray_serve.foreground).
serve: install
	$(BIN)/python -m roseray.ray_serve.foreground $(SERVE_CONFIG) $(HAPROXY_DIR_ARG)

# the same in the background (pid file and log in /tmp/roseray-serve-<uid>); `make stop` stops it
# and everything it started. SERVE_CONFIG: another Serve config; HAPROXY_DIR: haproxy_env's --dir
serve-bg: install
	$(BIN)/python -m roseray.ray_serve.background $(HAPROXY_DIR_ARG) start $(SERVE_CONFIG)

stop:
	$(BIN)/python -m roseray.ray_serve.background $(HAPROXY_DIR_ARG) stop

standalone: install
	$(BIN)/roseray serve --model random:tiny

generate: install
	$(BIN)/roseray generate --model random:tiny --prompt "Hello, roseray" --max-tokens 32

# pytest exits 5 when no test is collected: not a failure.
test: install-test
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

# ruff (pyproject.toml's [tool.ruff]): the whole tree, lint rules and import order
lint: install-test
	$(BIN)/ruff check .

bench-step: install
	$(BIN)/python -m roseray.bench step-overhead --num-seqs 64 256

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
