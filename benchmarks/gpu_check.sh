#!/usr/bin/env bash
# The GPU check: mlx-loom on MLX's CUDA backend, in one run of under 10 minutes.
#
# On a Linux machine with an NVIDIA GPU (CUDA 12 driver) it
#   1. installs the core and every family into a fresh venv with MLX's CUDA
#      backend (MLX_LOOM_BACKEND=cuda: mlx-cuda-12, and never mlx-cpu) — or,
#      with --no-install, uses a Python where that is already done;
#   2. checks the install: exactly one MLX backend package, the one asked for,
#      the device MLX runs on, and `loom explain` of the bundled tiny model;
#   3. runs the parity tests of every family (bit-equal to mlx-lm on the same
#      device) and the engine's batch = solo and speculative = greedy tests;
#   4. prints prefill and decode speed beside mlx-lm (benchmarks/bench.py).
# It goes on past a failing step and ends with a summary; the exit status is
# the number of failed steps.
#
#   benchmarks/gpu_check.sh                  # on the GPU machine, from a clone
#   benchmarks/gpu_check.sh --no-install --python .venv/bin/python
#   benchmarks/gpu_check.sh --cpu            # the same steps on the CPU backend (a dry check)
#   benchmarks/gpu_check.sh --dry-run        # print the steps, check their files and what pip
#                                            # would install (needs the package index)
#
# Status: written and dry-checked on the CPU backend (--cpu, --dry-run); it
# has not yet run on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."

backend=cuda
install=1
dry=0
python=""
venv=.venv-gpu-check
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) backend=cpu ;;
        --no-install) install=0 ;;
        --dry-run) dry=1 ;;
        --python) python="$2"; shift ;;
        --venv) venv="$2"; shift ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# The families' parity tests, and the engine's equality tests.
PARITY=(
    plugins/minicpm5/tests/test_parity.py
    plugins/qwen3_next/tests/test_qwen3_next_parity.py
    plugins/gemma4/tests/test_parity.py
)
EQUALITY=(tests/engine/test_engine.py tests/generation/test_speculative.py)
if [ "$backend" = cuda ]; then
    want=mlx-cuda-12; unwanted=mlx-cpu
    ROWS=llama-130m-bf16,llama-130m-q4,qwen3_next-small-bf16,gemma4_text-small-bf16
    BENCH=(--prompt-tokens 512 --gen-tokens 128 --repeats 3)
else
    want=mlx-cpu; unwanted=mlx-cuda-12
    ROWS=llama-tiny-bf16
    BENCH=(--prompt-tokens 64 --gen-tokens 16 --repeats 1)
fi

failed=()
step() {  # step NAME COMMAND...: run it (or show it), note a failure, go on
    local name="$1"; shift
    echo
    echo "=== $name"
    echo "+ $*"
    [ "$dry" = 1 ] && return 0
    local start=$SECONDS
    if "$@"; then
        echo "--- $name: ok ($((SECONDS - start)) s)"
    else
        echo "--- $name: FAILED ($((SECONDS - start)) s)"
        failed+=("$name")
    fi
}

if [ "$dry" = 1 ]; then  # what can be checked without a GPU: the files, and what pip would install
    for f in "${PARITY[@]}" "${EQUALITY[@]}" benchmarks/bench.py core/setup.py; do
        [ -f "$f" ] || { echo "gpu_check: $f is missing" >&2; exit 1; }
    done
    report=$(mktemp)
    copy=$(mktemp -d)  # pip writes the build's egg-info beside the sources: not into this tree
    cp -r core "$copy/core"
    echo "=== what pip would install for the $backend backend (pip install --dry-run)"
    MLX_LOOM_BACKEND="$backend" "${python:-python3}" -m pip install -q --dry-run --ignore-installed \
        --report "$report" -e "$copy/core" >"$report.log" 2>&1 \
        || { cat "$report.log"; exit 1; }
    "${python:-python3}" - "$report" "$want" "$unwanted" <<'EOF' || exit 1
import json, sys
names = {i["metadata"]["name"] for i in json.load(open(sys.argv[1]))["install"]}
print("MLX packages:", ", ".join(sorted(n for n in names if n.startswith("mlx"))))
assert sys.argv[2] in names and sys.argv[3] not in names, "the wrong MLX backend would be installed"
EOF
    rm -rf "$report" "$report.log" "$copy"
fi

if [ "$install" = 1 ]; then
    python="$venv/bin/python"
    step "fresh venv" python3 -m venv --clear "$venv"
    step "install ($backend backend)" env MLX_LOOM_BACKEND="$backend" "$venv/bin/pip" install -q \
        -e "core[dev]" -e plugins/minicpm5 -e plugins/qwen3_next -e plugins/gemma4
fi
python="${python:-python3}"

step "one MLX backend: $want, not $unwanted" "$python" - "$want" "$unwanted" "$backend" <<'EOF'
import importlib.metadata as md, sys
import mlx.core as mx
want, unwanted, backend = sys.argv[1:]
def has(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print(f"{want}: {has(want)}   {unwanted}: {has(unwanted)}   mlx: {has('mlx')}")
print(f"default device: {mx.default_device()}   cuda: {mx.cuda.is_available()}")
print(f"device info: {mx.device_info()}")
assert has(want) and not has(unwanted), f"expected {want} installed and {unwanted} not"
assert mx.cuda.is_available() == (backend == "cuda"), "MLX does not run on the expected backend"
EOF
step "loom explain (backend, device, memory)" "$python" -m mlx_loom.cli.main explain tiny
step "parity of every family" "$python" -m pytest -q -p no:cacheprovider "${PARITY[@]}"
step "engine: batch = solo, speculative = greedy" \
    "$python" -m pytest -q -p no:cacheprovider "${EQUALITY[@]}"
step "prefill and decode beside mlx-lm" \
    "$python" benchmarks/bench.py --rows "$ROWS" "${BENCH[@]}"

echo
if [ "$dry" = 1 ]; then
    echo "gpu_check: dry run ($backend): every step above is ready to run"
    exit 0
fi
if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu_check: every step passed ($backend backend, $SECONDS s)"
else
    echo "gpu_check: ${#failed[@]} step(s) failed ($backend backend, $SECONDS s):"
    printf '  - %s\n' "${failed[@]}"
fi
exit ${#failed[@]}
