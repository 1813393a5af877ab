#!/usr/bin/env bash
# Strata's tokenizer against llama.cpp's on one real byte-level BPE vocabulary under every pre-tokenizer name
# Strata knows (or the names given), on llama.cpp's tokenizer test inputs and inputs.inp (docs/ARCHITECTURE.md,
# "Tests"). Prints a Markdown table.
#
#   tools/peer-tokens/run.sh LLAMA_CPP_SOURCE VOCAB.gguf INPUTS_DIR OUT_DIR [PRE_NAME ...]
#
# LLAMA_CPP_SOURCE: a llama.cpp source tree (e.g. the one vendored in the llama-cpp-python sdist); its libllama is
# built once into OUT_DIR/build (CPU only). VOCAB.gguf: e.g. that tree's models/ggml-vocab-llama-bpe.gguf.
# INPUTS_DIR: its models/*.inp files, or any folder of .inp / .txt files; inputs.inp beside this script is
# added. PYTHON (default python3) must import strata.
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 LLAMA_CPP_SOURCE VOCAB.gguf INPUTS_DIR OUT_DIR [PRE_NAME ...]" >&2; exit 2
fi
[ -f "$1/include/llama.h" ] || { echo "$1 is not a llama.cpp source tree (no include/llama.h)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$1" && pwd); vocab=$2; out=$(mkdir -p "$4" && cd "$4" && pwd); inputs=$out/inputs
python=${PYTHON:-python3}
if [ ! -f "$out/build/bin/libllama.so" ]; then
  cmake -S "$src" -B "$out/build" -DGGML_CUDA=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_COMMON=OFF > "$out/cmake.log" 2>&1
  cmake --build "$out/build" -j "$(nproc)" --target llama > "$out/build.log" 2>&1
fi
g++ -std=c++17 -O2 -I "$src/include" -I "$src/ggml/include" "$here/tokenize.cpp" -o "$out/tokenize" \
  -L "$out/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$out/build/bin"
[ -d "$3" ] || { echo "$3 is not a folder of .inp / .txt inputs" >&2; exit 2; }
rm -rf "$inputs" && mkdir -p "$inputs"
for file in "$3"/*.inp "$3"/*.txt; do [ -f "$file" ] && cp "$file" "$inputs"/; done
cp "$here/inputs.inp" "$inputs"/
shift 4
"$python" "$here/compare.py" "$out/tokenize" "$vocab" "$inputs" "$out" "$@"
