#!/usr/bin/env bash
# The H200 run in one device call: install the wheelhouse offline, then run the plan kvlab/plans/h200.yaml.
# What runs (jobs, lanes, phases, the budget, the summary) lives in that plan file and in kvlab/plan.py;
# see docs/offline-gpu.md. Results land flat in $OUT: run.log, env.txt, results.csv, provenance.json,
# summary.md, sweep.tar.gz (and install.log on the GPU).
#
#   OUT=/some/dir gpu/h200_run.sh                the GPU node (wheelhouse/ from scripts/build_wheelhouse.sh)
#   OUT=/tmp/gpu-dry gpu/h200_run.sh --dry-run   the same plan on a CPU: toy stand-ins, tiny sizes, no install
#   OUT=/tmp/plan gpu/h200_run.sh --list         the jobs, their estimates and deadlines; runs nothing
# Other arguments go to `python -m kvlab plan` (e.g. --only a-,d-). Environment: OUT (required), BUDGET_S
# (seconds for the whole call, install included; default 450 on the GPU, the plan's dry_run value on a CPU),
# WHEELHOUSE (default wheelhouse), SITE (default /tmp/site), PLAN (default h200), PYTHON (default python3;
# .venv/bin/python when there is one and the run is --dry-run or --list).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [[ -z "${OUT:-}" ]]; then
    echo "h200_run: set OUT to the folder that receives the results" >&2
    exit 2
fi
mkdir -p "$OUT"
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
SITE=${SITE:-/tmp/site}
HERE_ONLY=0  # --dry-run or --list: nothing to install, no GPU needed
for arg in "$@"; do [[ "$arg" == --dry-run || "$arg" == --list ]] && HERE_ONLY=1; done
if (( HERE_ONLY )) && [[ -z "${PYTHON:-}" && -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; fi
PYTHON=${PYTHON:-python3}
BUDGET=()
[[ -n "${BUDGET_S:-}" ]] && BUDGET=(--budget "$BUDGET_S")

if (( ! HERE_ONLY )); then
    # Before anything is installed: never overwrite this checkout's .legacy-tf on a machine without a GPU.
    if ! nvidia-smi -L > /dev/null 2>&1; then
        echo "h200_run: no NVIDIA GPU here (nvidia-smi -L); on a CPU add --dry-run" >&2
        exit 1
    fi
    # Exactly the lock's pins: pip stops if the wheelhouse lacks one.
    install() {
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --find-links "$1" --target "$2" -r "$3" >> "$OUT/install.log" 2>&1
    }
    if ! install "$WHEELHOUSE" "$SITE" scripts/wheelhouse-kernel.txt \
        || ! install "$WHEELHOUSE/legacy" .legacy-tf scripts/wheelhouse-legacy.txt; then
        echo "h200_run: install from $WHEELHOUSE failed, see $OUT/install.log (scripts/build_wheelhouse.sh)" >&2
        exit 1
    fi
    export PATH="$SITE/bin:$PATH"
    BUDGET=(--budget $(( ${BUDGET_S:-450} - SECONDS )))  # the plan gets what the install left
fi
# This checkout's kvlab first, then the carried wheels.
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export JUPYTER_PLATFORM_DIRS=1 JUPYTER_RUNTIME_DIR="${TMPDIR:-/tmp}/kvlab-jupyter-runtime" MPLBACKEND=Agg
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec "$PYTHON" -m kvlab plan "${PLAN:-h200}" --out "$OUT" "${BUDGET[@]}" "$@"
