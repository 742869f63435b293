# From a fresh clone:  make demo  (set up, train the offline demo, translate with it)
#                      make test  (set up, then ruff, mypy and pytest)
# Both set up .venv first, once: the CPU build of torch, then the project with its extras (dev, export, serve, docs).
# For another torch build (a GPU machine), install it into .venv before the first make, or name it:
#   make test TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126'

VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
# pytest-xdist processes for the tests, one a core (make test WORKERS=0: the tests in make's own process)
WORKERS ?= 2
BIN    := $(VENV)/bin
DEMO   := checkpoints/demo
DATA   := seq2seq/demo/data

.DEFAULT_GOAL := help
.PHONY: help setup demo train-demo translate-demo test lint typecheck pytest e2e docs

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install into it (again only when pyproject.toml changes)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev,export,serve,docs]'
	touch $@

demo: train-demo ## train the demo (~5 min on 2 cores), then translate its test set
	$(MAKE) translate-demo  # after training, even under make -j

train-demo: setup ## train on configs/demo.yaml: checkpoints/demo/best.ckpt
	$(BIN)/python -m seq2seq.fit --config configs/demo.yaml

translate-demo: setup ## translate the demo test set with checkpoints/demo/best.ckpt (beam 5): BLEU, 5 examples
	@test -f $(DEMO)/best.ckpt || { echo "no $(DEMO)/best.ckpt: run make demo first" >&2; exit 1; }
	gzip -dc $(DATA)/test.en.gz > $(DEMO)/test.en
	gzip -dc $(DATA)/test.de.gz > $(DEMO)/test.de
	$(BIN)/python -m seq2seq.translate --checkpoint $(DEMO)/best.ckpt --beam 5 \
	    --input $(DEMO)/test.en --ref $(DEMO)/test.de --output $(DEMO)/test.hyp --force  # a run again replaces it
	@paste $(DEMO)/test.en $(DEMO)/test.hyp | head -n 5 | awk -F '\t' '{print "\n  en: " $$1 "\n  de: " $$2}'

test: lint typecheck pytest ## all the checks CI runs (make -k test: all three even if one fails)

lint: setup ## ruff
	$(BIN)/ruff check .

typecheck: setup ## mypy (configured in pyproject.toml)
	$(BIN)/mypy

pytest: setup ## the default test run, in $(WORKERS) processes (slow tests: .venv/bin/python -m pytest -m slow)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup

e2e: setup ## the end-to-end runs and minute-long compiles make test leaves out (by hand: CI has no time for them)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup -m e2e

docs: setup ## the documentation site, built into site/ (--strict: a broken link, anchor or reference fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
