#!/usr/bin/env bash
# The two ends of the transformers range kvlab supports, each in its own folder that shadows the pinned release
# (requirements.lock) on PYTHONPATH, for the tests that are quick and touch the cache API (decoder, graph and
# encoder-decoder caches):
#   oldest  transformers 5.17 (pyproject: transformers>=5.17) in .tf-oldest/
#   newest  transformers 5.25, the newest 5.x release, in .tf-newest/
#
#   scripts/transformers-release.sh oldest|newest install          install it once (make does this)
#   scripts/transformers-release.sh oldest|newest test [ARGS...]   run the subset against it (ARGS go to pytest)
#
# PYTHON (default .venv/bin/python) is the interpreter of the kvlab environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

# Each release is installed --no-deps: everything else comes from the environment, and `install` checks that the
# environment satisfies what the release declares (Requires-Dist), but for the packages named in UNMET.
case "${1:-}" in
    oldest)
        VERSION=5.17.0
        TARGET=.tf-oldest
        # Of requirements.lock, 5.17 refuses only huggingface-hub 2.x (it declares huggingface-hub<2.0 and checks it
        # at import); hub 1.33.0, the last 1.x, needs httpx<1 (the lock has httpx 0.28.1). tokenizers 0.23,
        # safetensors 0.8, regex, numpy, ... satisfy it.
        PINS=("transformers==$VERSION" "huggingface-hub==1.33.0")
        UNMET=() ;;
    newest)
        VERSION=5.25.0
        TARGET=.tf-newest
        # requirements.lock satisfies all 5.25 declares (huggingface-hub>=2.4.0, tokenizers>=0.23.1,<0.24,
        # safetensors>=0.8.0, regex>=2025.10.22, ...) but `kernels` (>=0.19.1,<0.20; not on PyPI when this was
        # written). Without it 5.25 runs, but from_pretrained turns hub kernels on unless told not to and then
        # refuses: kvlab passes use_kernels=False (kvlab.models.build_model), and this run leaves USE_HUB_KERNELS
        # unset so that tests/test_compat.py checks it.
        PINS=("transformers==$VERSION")
        UNMET=(kernels) ;;
    *)
        echo "usage: $0 oldest|newest install | test [pytest args]" >&2; exit 2 ;;
esac
shift
TESTS=(tests/test_tokens.py tests/test_memory.py tests/test_compat.py tests/test_graphs.py tests/test_encdec.py)

install() {
    if [ -e "$TARGET/.ready" ] && [ "$(cat "$TARGET/.ready")" = "${PINS[*]}" ]; then
        touch "$TARGET/.ready"  # up to date for make, whose target this stamp is
        return 0
    fi
    # Into a fresh folder, renamed when complete: an interrupted install leaves no half folder behind.
    rm -rf "$TARGET" "$TARGET.tmp"
    "$PYTHON" -m pip install --quiet --no-deps --target "$TARGET.tmp" "${PINS[@]}"
    PYTHONPATH="$TARGET.tmp" "$PYTHON" - "${UNMET[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

unmet = []
for line in requires("transformers") or []:
    requirement = Requirement(line)
    if requirement.marker and not requirement.marker.evaluate({"extra": ""}) or requirement.name in sys.argv[1:]:
        continue  # an extra's, or one the release is known to run without
    try:
        installed = version(requirement.name)
    except PackageNotFoundError:
        installed = None
    if installed is None or not requirement.specifier.contains(installed, prereleases=True):
        unmet.append(f"{requirement} (installed: {installed})")
if unmet:
    sys.exit("transformers " + version("transformers") + " needs what the environment lacks: " + "; ".join(unmet))
PY
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
        echo "usage: $0 oldest|newest install | test [pytest args]" >&2; exit 2 ;;
esac
