# Two commands do everything on a fresh machine with Python >= 3.10:
#   make compare   the main job: legacy vs in-place KV caches on the default device
#   make test      the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready
LEGACY := .legacy-tf/transformers-4.40.1.dist-info

.PHONY: compare test lab legacy wheelhouse clean

$(READY): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kvlab)" >/dev/null
	touch $@

# transformers 4.40.1, the last tuple-cache release, in its own folder: the reference the emulation must match.
$(LEGACY): $(READY)
	$(BIN)/python -c "from kvlab.reference import install_legacy_transformers as i; i()"

legacy: $(LEGACY)

compare: $(READY)
	$(BIN)/python -m kvlab compare

test: $(READY) $(LEGACY)
	$(BIN)/python -m pytest -q

lab: $(READY)
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf $(VENV) .legacy-tf results

# A folder of wheels for an air-gapped GPU node (papermill stack, kvlab, transformers 4.40.1): docs/offline-gpu.md
wheelhouse: $(READY)
	PYTHON=$(BIN)/python scripts/build_wheelhouse.sh wheelhouse
