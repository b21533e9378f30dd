#!/usr/bin/env bash
# Installs llama.cpp (llama-cpp-python, built from source for this CPU) and
# what its GGUF converter needs into a separate benchmark venv, so that
# benchmarks/cpu_bench.py can run llama.cpp on the same weights as mlx-loom
# and mlx-lm. Nothing from llama.cpp is part of the project; this venv is
# ignored by git. Takes ~16 minutes on a 2-core machine (the C++ build).
#
#   bash benchmarks/setup_llama_cpp.sh            # -> benchmarks/.llama-venv
#   LLAMA_VENV=/some/where bash benchmarks/setup_llama_cpp.sh
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${LLAMA_VENV:-$HERE/.llama-venv}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3.11}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip

# The converter (convert_hf_to_gguf.py) and its gguf package ship inside the
# sdist's vendored llama.cpp, so keep the unpacked source next to the venv.
SRC="$VENV/src"
mkdir -p "$SRC"
"$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$VERSION"
tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
LLAMA_SRC="$SRC/llama_cpp_python-$VERSION"

# -DGGML_NATIVE=ON: build for this CPU's instruction sets, as a user would.
# Except AMX: on a CPU with AMX, -march=native also builds ggml's AMX
# kernels, and in this version they crash on the benchmark's 4-bit rows
# (SIGSEGV in ggml_backend_amx_mul_mat, at one thread and at two, on an
# Intel Xeon with AMX-INT8). There every other set the CPU has is named
# one by one and AMX left out; GGML_AMX=0 in the environment keeps this
# rule on any CPU.
FLAGS="-DGGML_NATIVE=ON"
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null || [ "${GGML_AMX:-}" = 0 ]; then
    FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    for pair in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
        avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        if grep -qw "${pair%%:*}" /proc/cpuinfo; then
            FLAGS="$FLAGS -DGGML_${pair##*:}=ON"
        fi
    done
fi
echo "llama.cpp build flags: $FLAGS"
CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-2}" \
    "$VENV/bin/pip" install -q "$LLAMA_SRC"

# The converter imports torch (the CPU wheel), numpy, safetensors and
# transformers (for the tokenizer), and the vendored gguf package.
"$VENV/bin/pip" install -q "torch==2.13.0" numpy safetensors transformers sentencepiece
"$VENV/bin/pip" install -q "$LLAMA_SRC/vendor/llama.cpp/gguf-py"
echo "$LLAMA_SRC/vendor/llama.cpp" > "$VENV/llama_cpp_source"
echo "llama.cpp benchmark venv ready: $VENV"
