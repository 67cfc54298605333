# roseray: two commands on a fresh machine.
#   make serve   — install and run the Ray Serve app (serve_config.yaml) on this machine
#   make test    — install and run the test suite
# Both create .venv first. torch is pinned so pip never resolves a newer (CUDA) build.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH  ?= torch==2.13.0
PIP     = $(BIN)/python -m pip

.PHONY: install install-test serve standalone generate test bench-step clean

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

# HAProxy-mode flags must be in Ray's environment when it starts (roseray.ray_serve.haproxy_env).
serve: install
	eval "$$($(BIN)/python -m roseray.ray_serve.haproxy_env)" && $(BIN)/serve run serve_config.yaml

standalone: install
	$(BIN)/roseray serve --model random:tiny

generate: install
	$(BIN)/roseray generate --model random:tiny --prompt "Hello, roseray" --max-tokens 32

# pytest exits 5 when no test is collected: not a failure.
test: install-test
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

bench-step: install
	$(BIN)/python -m roseray.bench step-overhead --num-seqs 64 256

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
