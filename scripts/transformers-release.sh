#!/usr/bin/env bash
# The oldest transformers kvlab supports (pyproject: transformers>=5.17), in its own folder that shadows
# the pinned one (requirements.lock) on PYTHONPATH, for the tests that are quick and touch the cache API (decoder, graph and encoder-decoder caches).
#
#   scripts/oldest-transformers.sh install          install it once into .tf-oldest/ (make does this)
#   scripts/oldest-transformers.sh test [ARGS...]   run the subset against it (ARGS go to pytest)
#
# PYTHON (default .venv/bin/python) is the interpreter of the kvlab environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

VERSION=5.17.0
TARGET=.tf-oldest
# Installed --no-deps: everything else comes from the environment. Of requirements.lock, 5.17 refuses only
# huggingface-hub 2.x (it declares huggingface-hub<2.0 and checks it at import); hub 1.33.0, the last 1.x,
# needs httpx<1 (the lock has httpx 0.28.1). tokenizers 0.23, safetensors 0.8, regex, numpy, ... satisfy it.
PINS=("transformers==$VERSION" "huggingface-hub==1.33.0")
TESTS=(tests/test_tokens.py tests/test_memory.py tests/test_compat.py tests/test_graphs.py tests/test_encdec.py)

install() {
    if [ -e "$TARGET/.ready" ] && [ "$(cat "$TARGET/.ready")" = "${PINS[*]}" ]; then
        touch "$TARGET/.ready"  # up to date for make, whose target this stamp is
        return 0
    fi
    # Into a fresh folder, renamed when complete: an interrupted install leaves no half folder behind.
    rm -rf "$TARGET" "$TARGET.tmp"
    "$PYTHON" -m pip install --quiet --no-deps --target "$TARGET.tmp" "${PINS[@]}"
    echo "${PINS[*]}" > "$TARGET.tmp/.ready"
    mv "$TARGET.tmp" "$TARGET"
}

case "${1:-}" in
    install)
        install ;;
    test)
        shift
        install
        # kvlab comes from this checkout either way; the folder goes first so its transformers wins.
        export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" KVLAB_EXPECT_TRANSFORMERS=$VERSION
        # One OpenMP thread, as kvlab's CPU sweeps use: the toy model's kernels are too small to share, and on
        # a busy 2-core runner two threads made this subset 10-20x slower (spinning, not computing).
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
        "$PYTHON" -c "import transformers as t, huggingface_hub as h; print('transformers', t.__version__, \
'from', t.__file__, '/ huggingface_hub', h.__version__); assert t.__version__ == '$VERSION', t.__version__"
        exec "$PYTHON" -m pytest "${TESTS[@]}" "$@" ;;
    *)
        echo "usage: $0 install | test [pytest args]" >&2; exit 2 ;;
esac
