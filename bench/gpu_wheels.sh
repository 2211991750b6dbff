#!/usr/bin/env bash
# Fill bench/wheels/ (git-ignored) with the wheels bench/gpu_check.sh installs on a GPU
# machine that has no network: the packages jaxdd and its benchmarks need that a CUDA jax
# image usually lacks. Run it on a machine with network access, then copy or carry
# bench/wheels/ along with the checkout.
#
#   bench/gpu_wheels.sh [--python-version 3.12] [--dest bench/wheels]
#
# Only these packages are fetched, without their dependencies (jax, numpy, scipy,
# matplotlib, sympy, optax, flax, ... are taken to be there; gpu_check.sh says which import
# fails if one is not):
#   ase, jraph, e3nn-jax    jaxdd's own dependencies
#   jax-md, ml-collections  jax-md's LJ and NequIP beside jaxdd's in the table
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER=3.12
DEST="$ROOT/bench/wheels"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version) PYVER="$2"; shift 2 ;;
        --dest) DEST="$2"; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "gpu_wheels: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
PACKAGES=(ase jraph e3nn-jax jax-md ml-collections)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$tag"); done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d "$DEST" "${PACKAGES[@]}"
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1), in $DEST:"
ls -1 "$DEST"
