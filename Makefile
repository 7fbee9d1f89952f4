# The book's commands. Each target creates or reuses the environment in .venv first (idempotent).
#   make demo   - the main job: generate learner versions, autograde the bundled submissions, print scores
#   make test   - the test suite
#   make lab    - self-study: generate the learner versions into learner/ and open JupyterLab there
#                 (LAB_ARGS="..." passes options to jupyter lab)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# torch is installed first and alone: a plain `torch` requirement pulls a multi-GB CUDA build.
# Elsewhere, the CPU build: make test TORCH_PIP="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lab learner notebooks figures env

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIP)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e . --config-settings editable_mode=compat
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m graders.course demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

learner: $(STAMP)
	$(PY) -m graders.course learner --out learner

# LAB_ARGS passes options to jupyter lab (make lab LAB_ARGS="--no-browser --port 8899"); as root (a
# container's usual user) Jupyter refuses to start without --allow-root, so it is added there
LAB_ARGS ?=
lab: learner
	$(VENV)/bin/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS) learner

notebooks: $(STAMP)
	$(PY) tools/build_notebooks.py

figures: $(STAMP)
	for f in figures/src/*.py; do $(PY) $$f || exit 1; done
