#!/usr/bin/env bash
# The H200 reproduction on an offline GPU node: install the wheelhouse, then one sweep (docs/offline-gpu.md).
#   OUT=/some/dir gpu/run.sh [sweep options, e.g. --engine ray --num-gpus 0.25]
# Environment: OUT (required), WHEELHOUSE (default wheelhouse/, from scripts/build_wheelhouse.sh),
# SITE (default /tmp/site), PYTHON (default python3). The same points on a CPU need no install:
#   python -m kvlab sweep h200 --grid preset=toy --grid device=cpu --grid dtype=float32 --out DIR
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ -n "${OUT:-}" ]] || { echo "run.sh: set OUT to the folder that receives the results" >&2; exit 2; }
WHEELHOUSE=${WHEELHOUSE:-wheelhouse} SITE=${SITE:-/tmp/site} PYTHON=${PYTHON:-python3}
# Before anything is installed: never replace this checkout's .legacy-tf on a machine without a GPU.
if ! nvidia-smi -L > /dev/null 2>&1; then
    echo "run.sh: no NVIDIA GPU here (nvidia-smi -L); on a CPU run the sweep directly (see above)" >&2
    exit 1
fi
mkdir -p "$OUT"
install() {  # exactly the pins of a requirements file, from the wheelhouse only
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --find-links "$1" --target "$2" -r "$3" >> "$OUT/install.log" 2>&1 \
        || { echo "run.sh: installing $3 from $1 failed; see $OUT/install.log" >&2; exit 1; }
}
install "$WHEELHOUSE" "$SITE" scripts/wheelhouse-kernel.txt           # papermill and its kernel
install "$WHEELHOUSE/legacy" .legacy-tf scripts/wheelhouse-legacy.txt  # transformers 4.40.1, for kind: reference
if [[ -d "$WHEELHOUSE/ray" ]]; then install "$WHEELHOUSE/ray" "$SITE" scripts/wheelhouse-ray.txt; fi  # --engine ray
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" MPLBACKEND=Agg
# Kernels' connection files in a writable place whatever HOME is; jupyter_core's own paths, without its warning.
export JUPYTER_RUNTIME_DIR="${TMPDIR:-/tmp}/kvlab-jupyter-runtime" JUPYTER_PLATFORM_DIRS=1
exec "$PYTHON" -m kvlab sweep h200 --out "$OUT" "$@"
