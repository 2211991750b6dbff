#!/usr/bin/env bash
# jaxdd on one GPU, in one go: install (offline), build the CUDA kernels, test them against
# the jnp paths and the CPU kernels, and print one table of dynamics figures
# (bench/gpu_table.py) and, for jaxdd's rows, where a step's time goes (bench/profile_table.py;
# the traces stay in the --out folder's profile/, for TensorBoard or Perfetto). Meant for a GPU machine with a CUDA jax already installed and no
# network (about 8 minutes on an H200); see docs/gpu.md.
#
#   bench/gpu_check.sh [--smoke] [--out DIR] [-- GPU_TABLE_ARGS...]
#
# Before: run bench/gpu_wheels.sh where there is network; it fills bench/wheels/ with the
# packages a CUDA jax image lacks (ase, jraph, e3nn-jax, jax-md, ml-collections), which this
# script installs with --no-index into a scratch folder.
#
# --smoke: the same stages on any machine at tiny sizes, nothing installed: the kernels are
# built into a scratch folder (the CUDA ones too when nvcc is found), the GPU tests are
# collected, and the table runs at tiny sizes. The test suite runs it.
#
# Arguments after -- go to bench/gpu_table.py (a second run that completes a table:
# -- --sections mlip,nequip-pair --lj-cells 126).
#
# Environment: PYTHON (default python3), JAXDD_CUDA_ARCH (default: the GPU's compute
# capability from nvidia-smi, else setup.py's default), DEADLINE_S (default 480: the
# table gets what the earlier stages leave of it), GPU_TESTS (the tests to run, pytest
# paths or node ids; default the kernel and neighbour test files).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE=0
OUT_DIR="${OUT:-/tmp/jaxdd-gpu-check}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --smoke) SMOKE=1; shift ;;
        --out) OUT_DIR="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
TABLE_ARGS=("$@")
PY="${PYTHON:-python3}"
DEADLINE_S="${DEADLINE_S:-480}"
START=$(date +%s)
mkdir -p "$OUT_DIR"
cd "$ROOT"
export PYTHONUNBUFFERED=1
failures=()

stage() { echo; echo "== [$(( $(date +%s) - START )) s] $*"; }
fail() { echo "gpu_check: FAILED: $*"; failures+=("$*"); }
left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }

stage "machine"
"$PY" -c 'import sys, jax; print("python", sys.version.split()[0], "| jax", jax.__version__, "|", jax.devices())' \
    || { echo "gpu_check: $PY cannot import jax; set PYTHON to the interpreter that has it"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv

stage "packages"
if [[ $SMOKE == 1 ]]; then
    echo "smoke: nothing installed"
else
    shopt -s nullglob
    wheels=("$ROOT"/bench/wheels/*.whl)
    if [[ ${#wheels[@]} -eq 0 ]]; then
        echo "gpu_check: bench/wheels/ has no wheels: run bench/gpu_wheels.sh on a machine with network, then bring"
        echo "bench/wheels/ along (it is git-ignored)"
        exit 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jaxdd-site \
        "${wheels[@]}" || { echo "gpu_check: installing bench/wheels failed"; exit 1; }
    export PYTHONPATH="/tmp/jaxdd-site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import ase, jraph, e3nn_jax, jax_md, flax, equinox, orbax.checkpoint; print("imports ok")' \
    || fail "a package jaxdd or the table needs is missing (see the ImportError above)"

stage "build"
if [[ -z "${JAXDD_CUDA_ARCH:-}" ]] && command -v nvidia-smi >/dev/null; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    [[ "$cap" =~ ^[0-9]+$ ]] && export JAXDD_CUDA_ARCH="$cap"
fi
if [[ $SMOKE == 1 ]]; then
    # Built into a scratch folder: the installed jaxdd stays as it is. Compiling the CUDA sources
    # checks them and setup.py's CUDA path; running them needs a GPU.
    build=$(mktemp -d)
    if command -v nvcc >/dev/null; then cuda=1; else cuda=0; echo "smoke: no nvcc on PATH: CUDA sources not compiled"; fi
    JAXDD_CUDA=$cuda JAXDD_CUDA_ARCH="${JAXDD_CUDA_ARCH:-90}" "$PY" setup.py -q build_ext --build-lib "$build/lib" \
        --build-temp "$build/tmp" >"$OUT_DIR/build.log" 2>&1 || fail "building the kernels (see $OUT_DIR/build.log)"
    ls "$build"/lib/jaxdd/ffi/
    [[ $cuda == 0 || -f "$build/lib/jaxdd/ffi/_kernels_cuda.so" ]] || fail "the CUDA library was not built"
    rm -rf "$build"
else
    JAXDD_CUDA=1 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT" \
        >"$OUT_DIR/build.log" 2>&1 || { tail -30 "$OUT_DIR/build.log"; fail "pip install -e . with JAXDD_CUDA=1"; }
    "$PY" -c 'import jaxdd.ffi as f; print("cpu kernels:", f.available(), "| cuda kernels:", f.cuda_available())'
    "$PY" -c 'import sys, jaxdd.ffi as f; sys.exit(not f.cuda_available())' \
        || fail "the CUDA kernels are not available to jax (see $OUT_DIR/build.log)"
fi

stage "kernel and neighbour tests on the default device, against the jnp paths and the CPU kernels"
# The suite's conftest defaults to CPU devices; here the GPU comes first and the CPU stays
# available for the CPU-against-CUDA comparisons.
DEFAULT_TESTS="tests/ffi/test_ffi_kernels.py tests/ffi/test_ffi_neighbors.py tests/ffi/test_ffi_models.py tests/neighbors/test_neighbors.py"
read -ra TESTS <<<"${GPU_TESTS:-$DEFAULT_TESTS}"
if [[ $SMOKE == 1 ]]; then
    "$PY" -m pytest -q -p no:cacheprovider --co "${TESTS[@]}" | tail -1 || fail "collecting the GPU tests"
else
    JAX_PLATFORMS=cuda,cpu timeout 240 "$PY" -m pytest -q -p no:cacheprovider -n 0 -rs "${TESTS[@]}" \
        2>&1 | tee "$OUT_DIR/tests.log" | tail -25
    [[ ${PIPESTATUS[0]} == 0 ]] || fail "GPU tests (see $OUT_DIR/tests.log)"
fi

stage "dynamics table"
budget=$(( $(left) - 45 ))
(( budget > 30 )) || budget=30
# Each jaxdd LJ and MLIP row also traces a few steps: the table ends with where their time goes.
rm -rf "$OUT_DIR/profile"
args=(--budget "$budget" --json "$OUT_DIR/gpu_table.json" --profile "$OUT_DIR/profile" "${TABLE_ARGS[@]}")
[[ $SMOKE == 1 ]] && args+=(--smoke)
rm -f "$OUT_DIR/gpu_table.json"  # written after every row: none left from an earlier run
timeout $(( budget + 40 )) "$PY" bench/gpu_table.py "${args[@]}" 2>"$OUT_DIR/table.err" | tee "$OUT_DIR/gpu_table.txt"
if [[ ${PIPESTATUS[0]} != 0 ]]; then
    tail -20 "$OUT_DIR/table.err"
    fail "bench/gpu_table.py (see $OUT_DIR/table.err; a row that outran the budget was stopped)"
    # The rows before the one that failed or was stopped, from the JSON written after each row.
    [[ -f "$OUT_DIR/gpu_table.json" ]] && "$PY" bench/gpu_table.py --show "$OUT_DIR/gpu_table.json" \
        | tee "$OUT_DIR/gpu_table.txt"
fi

stage "done in $(( $(date +%s) - START )) s"
if [[ ${#failures[@]} -gt 0 ]]; then
    printf 'gpu_check: failed stage: %s\n' "${failures[@]}"
    exit 1
fi
echo "gpu_check: all stages passed"
