#!/usr/bin/env bash
# Build a wheelhouse for an air-gapped GPU node that already has Python 3.12, torch and transformers 5.x
# (manylinux x86_64), so that kvlab's sweeps (papermill) and the transformers 4.40.1 reference run there.
#
#   scripts/build_wheelhouse.sh [DEST]          DEST defaults to wheelhouse/ (git-ignored)
#
# DEST/*.whl         the papermill kernel stack ([kernel] of scripts/wheelhouse.lock) and kvlab itself
# DEST/legacy/*.whl  transformers 4.40.1, tokenizers 0.19.1, huggingface-hub 0.23.4 ([legacy]): these go
#                    to their own --target folder (the repo's .legacy-tf), never next to transformers 5
# DEST/install.sh    installs both on the node, offline (see docs/offline-gpu.md)
# DEST/notebooks/    the point notebook that `kvlab sweep` executes (the kvlab wheel has no notebooks)
# DEST/wheelhouse.lock, DEST/SHA256SUMS
#
# Needs network (PyPI) here, not on the node. Fails if a package is missing, present in two versions,
# not installable on cp312/manylinux x86_64, or if the folder grows past MAX_MIB (default 50).
# Environment: PYTHON (default .venv/bin/python, else python3), MAX_MIB.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DEST=${1:-wheelhouse}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
LOCK="$ROOT/scripts/wheelhouse.lock"
MAX_MIB=${MAX_MIB:-50}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

# "section" -> the name==version lines of that [section] of the lock file
lock_section() {
    awk -v want="[$1]" '
        /^[[:space:]]*(#|$)/ { next }
        /^\[/ { section = $1; next }
        section == want { print $1 }' "$LOCK"
}
mapfile -t KERNEL < <(lock_section kernel)
mapfile -t LEGACY < <(lock_section legacy)
if (( ${#KERNEL[@]} == 0 || ${#LEGACY[@]} == 0 )); then
    echo "build_wheelhouse: $LOCK has no [kernel] or no [legacy] pins" >&2
    exit 1
fi

# Start clean: a wheel left from an older lock would be a second version.
rm -f "$DEST"/*.whl "$DEST"/legacy/*.whl
mkdir -p "$DEST/legacy"

# Earlier tags are preferred: the oldest glibc that has a wheel wins (debugpy 1.8.22 exists only as manylinux_2_34: the node needs glibc >= 2.34).
PLATFORMS=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 \
           manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
download() {  # download DIR SPEC...
    local dir=$1; shift
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$dir" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
echo "build_wheelhouse: downloading ${#KERNEL[@]} kernel wheels into $DEST"
download "$DEST" "${KERNEL[@]}"
echo "build_wheelhouse: downloading ${#LEGACY[@]} legacy wheels into $DEST/legacy"
download "$DEST/legacy" "${LEGACY[@]}"

echo "build_wheelhouse: building the kvlab wheel"
KVLAB_BUILD=$(mktemp -d)
trap 'rm -rf "$KVLAB_BUILD"' EXIT
# No build isolation when the interpreter already has setuptools (works offline); else let pip fetch it.
if "$PYTHON" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
    ISOLATION=--no-build-isolation
else
    ISOLATION=
fi
"$PYTHON" -m pip wheel --quiet --no-deps $ISOLATION . -w "$KVLAB_BUILD"
mv "$KVLAB_BUILD"/kvlab-*.whl "$DEST"/
rm -rf "$ROOT/build"

cp "$LOCK" "$DEST/wheelhouse.lock"
rm -rf "$DEST/notebooks" && mkdir -p "$DEST/notebooks"
if [[ -f notebooks/03_experiment_point.ipynb ]]; then
    cp notebooks/03_experiment_point.ipynb "$DEST/notebooks/"
else
    echo "build_wheelhouse: warning: notebooks/03_experiment_point.ipynb is missing; sweeps need a checkout" >&2
fi

# install.sh: what the node runs, offline. Usage: install.sh SITE LEGACY_TARGET
cat > "$DEST/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Offline install of this wheelhouse on the GPU node (Python 3.12 with torch and transformers 5.x).
#   bash install.sh [SITE] [LEGACY_TARGET]
# SITE defaults to /tmp/site. kvlab.reference looks for transformers 4.40.1 in .legacy-tf next to the kvlab
# package it runs from: run in a kvlab checkout, LEGACY_TARGET defaults to ./.legacy-tf; elsewhere (the
# kvlab wheel alone) to SITE/.legacy-tf.
# then: export PYTHONPATH=SITE:$PYTHONPATH PATH=SITE/bin:$PATH
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SITE=${1:-/tmp/site}
if [[ -f kvlab/__init__.py ]]; then DEFAULT_LEGACY=$PWD/.legacy-tf; else DEFAULT_LEGACY=$SITE/.legacy-tf; fi
LEGACY_TARGET=${2:-$DEFAULT_LEGACY}
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$HERE"/*.whl
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$LEGACY_TARGET" \
    "$HERE"/legacy/*.whl
echo "installed $(ls "$HERE"/*.whl | wc -l) wheels into $SITE and $(ls "$HERE"/legacy/*.whl | wc -l) into $LEGACY_TARGET"
echo "now: export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH"
INSTALL
chmod +x "$DEST/install.sh"

# Check: exactly one wheel per pin, at the pinned version, installable on cp312 manylinux x86_64,
# and nothing else but kvlab.
"$PYTHON" - "$DEST" "${KERNEL[@]}" -- "${LEGACY[@]}" <<'PY'
import re
import sys
from pathlib import Path

dest = Path(sys.argv[1])
args = sys.argv[2:]
split = args.index("--")
groups = {dest: args[:split], dest / "legacy": args[split + 1:]}


def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()


problems = []
for folder, pins in groups.items():
    wheels = sorted(folder.glob("*.whl"))
    by_name = {}
    for wheel in wheels:
        parts = wheel.name[:-4].split("-")
        name, version, python_tag, abi_tag, platform_tag = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
        by_name.setdefault(norm(name), []).append(version)
        pythons = python_tag.split(".")
        if not any(p in ("py3", "py2.py3", "cp312") or p.startswith("py3") for p in pythons) and abi_tag != "abi3":
            problems.append(f"{wheel.name}: not for CPython 3.12")
        platforms = platform_tag.split(".")
        if not any(p == "any" or (p.startswith("manylinux") and p.endswith("x86_64")) for p in platforms):
            problems.append(f"{wheel.name}: not a manylinux x86_64 or pure wheel")
    expected = {norm(pin.split("==")[0]): pin.split("==")[1] for pin in pins}
    if folder == dest:
        expected["kvlab"] = None
    for name, version in expected.items():
        found = by_name.get(name, [])
        if len(found) != 1:
            problems.append(f"{folder.name}/: {name} found {len(found)} times ({', '.join(found) or 'none'}), need exactly 1")
        elif version is not None and found[0] != version:
            problems.append(f"{folder.name}/: {name} is {found[0]}, lock says {version}")
    for name in set(by_name) - set(expected):
        problems.append(f"{folder.name}/: {name} {by_name[name]} is not in the lock")
    print(f"build_wheelhouse: {folder}: {len(wheels)} wheels for {len(expected)} pins")
if problems:
    print("build_wheelhouse: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)
PY

(cd "$DEST" && sha256sum ./*.whl legacy/*.whl > SHA256SUMS)
BYTES=$(du -sb "$DEST" | cut -f1)
MIB=$(awk -v b="$BYTES" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "build_wheelhouse: $DEST: $(ls "$DEST"/*.whl | wc -l) + $(ls "$DEST"/legacy/*.whl | wc -l) legacy wheels, $MIB MiB in all"
if (( BYTES > MAX_MIB * 1048576 )); then
    echo "build_wheelhouse: $MIB MiB is over the $MAX_MIB MiB that may travel with the working tree" >&2
    exit 1
fi
