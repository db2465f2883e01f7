# minillm: `make book` builds the executed book, `make test` runs every check.
# Both set up .venv on first use (tools/setup_env.sh) and are quick when nothing changed.

VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STAMP   := $(VENV)/.installed
NBDIR   := _build/nbval
JOBS    ?= 2

.PHONY: help setup tangle check tiny book test test-unit test-notebooks serve clean

help:
	@echo "make book    set up, tangle, execute every chapter, build the HTML book"
	@echo "make test    set up, check the tangle, run unit/parity tests and every chapter (nbval)"
	@echo "make tangle  regenerate minillm/ from chapters/"
	@echo "make serve   serve the tiny model on an OpenAI-compatible API (ARGS='--port 8000 --model PATH')"

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt tools/setup_env.sh
	bash tools/setup_env.sh
	@touch $(STAMP)

tangle: $(STAMP)
	$(PYTHON) tools/tangle.py

check: $(STAMP)
	$(PYTHON) tools/tangle.py --check

# Train the course's tiny model once (cached in $${MINILLM_CACHE:-~/.cache/minillm}), before the
# parallel test runs, so they load it instead of racing to train it.
tiny: $(STAMP)
	$(PYTHON) -m minillm.tiny

book: $(STAMP) tangle tiny
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The book: file://$(CURDIR)/_build/html/index.html"

test: check tiny test-unit test-notebooks

# $(JOBS) workers share the cores: one thread each (more threads per worker only spin and wait).
test-unit: $(STAMP)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -n $(JOBS) tests

# nbval collects .ipynb only: convert the chapters into a scratch folder, one kernel
# per chapter (--dist loadfile keeps a notebook's cells on one worker).
test-notebooks: $(STAMP)
	rm -rf $(NBDIR) && mkdir -p $(NBDIR)
	for f in chapters/*.md; do $(BIN)/jupytext --quiet --to ipynb -o $(NBDIR)/$$(basename $$f .md).ipynb $$f; done
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 MPLBACKEND=Agg $(PYTHON) -m pytest -p no:cacheprovider -n $(JOBS) --dist loadfile \
		--nbval-lax --nbval-current-env --nbval-cell-timeout=900 -o testpaths= -o addopts= $(NBDIR)

serve: $(STAMP)
	$(PYTHON) -m minillm.server serve $(ARGS)

clean:
	rm -rf _build $(NBDIR)
