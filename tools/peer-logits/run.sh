#!/usr/bin/env bash
# Strata against llama.cpp on the same GGUF files, on the CPU: prompt ids, the first step's logits and
# 32 greedy tokens of each model and prompt (prompts/), as a Markdown table (docs/ARCHITECTURE.md, "Tests").
#
#   tools/peer-logits/run.sh LLAMA_CPP_SOURCE OUT_DIR MODEL.gguf [MODEL.gguf ...]
#
# LLAMA_CPP_SOURCE: a llama.cpp source tree (e.g. the one vendored in the llama-cpp-python sdist); its
# libllama is built once into OUT_DIR/build (CPU only, ~15 min on 2 cores). PYTHON (default python3) must
# import strata. A synthetic model must be written without --mtp for llama.cpp to load it. DUMP_ARGS: more
# options of dump.cpp, e.g. DUMP_ARGS=--no-repack where llama.cpp's repacked CPU kernels (AMX) crash on a
# small synthetic shape.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 LLAMA_CPP_SOURCE OUT_DIR MODEL.gguf [MODEL.gguf ...]" >&2; exit 2
fi
[ -f "$1/include/llama.h" ] || { echo "$1 is not a llama.cpp source tree (no include/llama.h)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); shift 2
python=${PYTHON:-python3}
steps=32
if [ ! -f "$out/build/bin/libllama.so" ]; then
  cmake -S "$src" -B "$out/build" -DGGML_CUDA=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_COMMON=OFF > "$out/cmake.log"
  cmake --build "$out/build" -j "$(nproc)" --target llama > "$out/build.log"
fi
g++ -std=c++17 -O2 -I "$src/include" -I "$src/ggml/include" "$here/dump.cpp" -o "$out/dump" \
  -L "$out/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$out/build/bin"
for model in "$@"; do
  name=$(basename "$model" .gguf)
  for prompt in "$here"/prompts/*.txt; do
    base="$out/$name.$(basename "$prompt" .txt)"
    "$out/dump" "$model" "$prompt" $steps "$base.llama.logits.f32" --prompt-file ${DUMP_ARGS:-} > "$base.llama.json"
    "$python" "$here/strata_dump.py" "$model" "$prompt" $steps "$base.strata"
  done
done
"$python" "$here/compare.py" "$out"
