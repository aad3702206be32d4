#!/usr/bin/env bash
# Build a wheelhouse for an air-gapped GPU node that already has Python 3.12, torch and transformers 5.x
# (manylinux x86_64), so that kvlab's sweeps (papermill) and the transformers 4.40.1 reference run there.
#
#   scripts/build_wheelhouse.sh [DEST]             DEST defaults to wheelhouse/ (git-ignored)
#   WITH_RAY=1 scripts/build_wheelhouse.sh [DEST]  also DEST/ray/: Ray for `kvlab sweep --engine ray` (docs/cluster.md)
#
# The pins are plain requirements files, one name==version a line:
#   scripts/wheelhouse-kernel.txt  → DEST/*.whl         the papermill kernel stack, with the kvlab wheel
#   scripts/wheelhouse-legacy.txt  → DEST/legacy/*.whl  transformers 4.40.1 & co: their own --target folder
#                                                       (the repo's .legacy-tf), never next to transformers 5
#   scripts/wheelhouse-ray.txt     → DEST/ray/*.whl     Ray and what it needs beyond torch and transformers
# DEST/install.sh    installs them on the node, offline (see docs/offline-gpu.md)
# DEST/notebooks/    the point notebook that `kvlab sweep` executes (the kvlab wheel carries it too)
# DEST/requirements/ the requirements files, DEST/SHA256SUMS
#
# Needs network (PyPI) here, not on the node. Fails if a package is missing, present in two versions,
# not installable on cp312/manylinux x86_64, or if DEST without ray/ grows past MAX_MIB (default 50: small
# enough to copy with the checkout; Ray's ~70 MiB wheel alone is larger, hence its own folder).
# Environment: PYTHON (default .venv/bin/python, else python3), MAX_MIB, WITH_RAY.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DEST=${1:-wheelhouse}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
MAX_MIB=${MAX_MIB:-50}
WITH_RAY=${WITH_RAY:-0}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# folder (relative to DEST) → its requirements file
declare -A GROUPS_=([.]=scripts/wheelhouse-kernel.txt [legacy]=scripts/wheelhouse-legacy.txt)
if [[ "$WITH_RAY" == 1 ]]; then GROUPS_[ray]=scripts/wheelhouse-ray.txt; fi

# Start clean: a wheel left from an older pin would be a second version.
rm -f "$DEST"/*.whl "$DEST"/legacy/*.whl "$DEST"/ray/*.whl
rm -rf "$DEST/requirements" && mkdir -p "$DEST/requirements"

# Earlier tags are preferred: the oldest glibc that has a wheel wins (debugpy 1.8.22 exists only as manylinux_2_34: the node needs glibc >= 2.34).
PLATFORMS=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 \
           manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
CHECKS=()
for folder in "${!GROUPS_[@]}"; do
    pins=${GROUPS_[$folder]}
    mkdir -p "$DEST/$folder"
    echo "build_wheelhouse: downloading $pins into $DEST/$folder"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST/$folder" -r "$pins" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    cp "$pins" "$DEST/requirements/"
    CHECKS+=("$folder=$pins")
done

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

# The point notebook, wherever kvlab.lab.runner says it is.
POINT_NOTEBOOK=$("$PYTHON" -c "from kvlab.lab.runner import POINT_NOTEBOOK; print(POINT_NOTEBOOK)")
rm -rf "$DEST/notebooks" && mkdir -p "$DEST/notebooks"
cp "$POINT_NOTEBOOK" "$DEST/notebooks/"

# install.sh: what the node runs, offline. Usage: install.sh SITE LEGACY_TARGET
cat > "$DEST/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Offline install of this wheelhouse on the GPU node (Python 3.12 with torch and transformers 5.x).
#   bash install.sh [SITE] [LEGACY_TARGET]
# SITE defaults to /tmp/site; Ray too if ray/ is here. kvlab.releases looks for transformers 4.40.1 in
# .legacy-tf next to the kvlab package it runs from: run in a kvlab checkout, LEGACY_TARGET defaults to
# ./.legacy-tf; elsewhere (the kvlab wheel alone) to SITE/.legacy-tf.
# then: export PYTHONPATH=SITE:$PYTHONPATH PATH=SITE/bin:$PATH
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SITE=${1:-/tmp/site}
if [[ -f kvlab/__init__.py ]]; then DEFAULT_LEGACY=$PWD/.legacy-tf; else DEFAULT_LEGACY=$SITE/.legacy-tf; fi
LEGACY_TARGET=${2:-$DEFAULT_LEGACY}
PY=${PYTHON:-python3}
install() {  # install FOLDER TARGET: every wheel of the folder, nothing from the network
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
    echo "installed $(ls "$1"/*.whl | wc -l) wheels from $1 into $2"
}
install "$HERE" "$SITE"
install "$HERE/legacy" "$LEGACY_TARGET"
if compgen -G "$HERE/ray/*.whl" > /dev/null; then install "$HERE/ray" "$SITE"; fi
echo "now: export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH"
INSTALL
chmod +x "$DEST/install.sh"

# Check: exactly one wheel per pin, at the pinned version, installable on cp312 manylinux x86_64, and
# nothing else but kvlab (in DEST itself). The pins are read by pip's own parser (packaging).
"$PYTHON" - "$DEST" "${CHECKS[@]}" <<'PY'
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement


def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def pins(path):
    lines = (line.split("#")[0].strip() for line in Path(path).read_text().splitlines())
    return {norm(r.name): str(r.specifier).removeprefix("==") for r in map(Requirement, filter(None, lines))}


problems = []
dest = Path(sys.argv[1])
for check in sys.argv[2:]:
    relative, requirements = check.split("=", 1)
    folder = (dest / relative).resolve()
    expected = pins(requirements)
    if relative == ".":
        expected["kvlab"] = None
    by_name = {}
    wheels = sorted(folder.glob("*.whl"))
    for wheel in wheels:
        parts = wheel.name[:-4].split("-")
        name, version, python_tag, abi_tag, platform_tag = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
        by_name.setdefault(norm(name), []).append(version)
        if not any(p in ("py3", "cp312") or p.startswith("py3") for p in python_tag.split(".")) and abi_tag != "abi3":
            problems.append(f"{wheel.name}: not for CPython 3.12")
        if not any(p == "any" or (p.startswith("manylinux") and p.endswith("x86_64")) for p in platform_tag.split(".")):
            problems.append(f"{wheel.name}: not a manylinux x86_64 or pure wheel")
    for name, version in expected.items():
        found = by_name.get(name, [])
        if len(found) != 1:
            problems.append(f"{folder.name}/: {name} found {len(found)} times ({', '.join(found) or 'none'}), need exactly 1")
        elif version is not None and found[0] != version:
            problems.append(f"{folder.name}/: {name} is {found[0]}, {requirements} says {version}")
    for name in set(by_name) - set(expected):
        problems.append(f"{folder.name}/: {name} {by_name[name]} is not in {requirements}")
    print(f"build_wheelhouse: {folder}: {len(wheels)} wheels for {len(expected)} pins")
if problems:
    print("build_wheelhouse: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)
PY

(cd "$DEST" && sha256sum $(find . -name "*.whl" | sort) > SHA256SUMS)
BYTES=$(du -sb --exclude=ray "$DEST" | cut -f1)
MIB=$(awk -v b="$BYTES" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "build_wheelhouse: $DEST: $(ls "$DEST"/*.whl | wc -l) + $(ls "$DEST"/legacy/*.whl | wc -l) legacy wheels, $MIB MiB in all"
if [[ -d "$DEST/ray" ]] && compgen -G "$DEST/ray/*.whl" > /dev/null; then
    echo "build_wheelhouse: $DEST/ray: $(ls "$DEST"/ray/*.whl | wc -l) wheels, $(du -sh "$DEST/ray" | cut -f1) (not counted above)"
fi
if (( BYTES > MAX_MIB * 1048576 )); then
    echo "build_wheelhouse: $MIB MiB is over MAX_MIB=$MAX_MIB (the size meant to be copied with the checkout)" >&2
    exit 1
fi
