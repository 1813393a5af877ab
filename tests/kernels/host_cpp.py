"""Device C++ compiled for the CPU: the simulator cannot run linked C++, so tests of its pure helpers
(dequantizers, index maps) cut them from the source text and build them with g++, CUDA's half type and
intrinsics replaced by float16 shims."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

# The shims both host tests need. A product or difference of two halves is exact in float: rounding it
# to half is the GPU's one rounding.
HALF_SHIMS = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define __device__
#define __forceinline__ inline
typedef uint16_t __half;
struct __half2 { uint16_t x, y; };
static inline float __half2float(__half h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static inline uint16_t to_half(float v) { _Float16 f = (_Float16)v; uint16_t h; memcpy(&h, &f, 2); return h; }
static inline __half2 __float2half2_rn(float a) { return {to_half(a), to_half(a)}; }
static inline __half2 __hsub2(__half2 a, __half2 b) {
  return {to_half(__half2float(a.x) - __half2float(b.x)), to_half(__half2float(a.y) - __half2float(b.y))};
}
static inline __half2 __hmul2(__half2 a, __half2 b) {
  return {to_half(__half2float(a.x) * __half2float(b.x)), to_half(__half2float(a.y) * __half2float(b.y))};
}
"""

# CUDA's __byte_perm: byte n of the result is byte (s >> 4n) & 7 of y:x
BYTE_PERM_SHIM = r"""
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = x | (unsigned long long)y << 32;
  unsigned out = 0;
  for (int n = 0; n < 4; ++n) out |= (unsigned)(v >> (8 * ((s >> (4 * n)) & 7)) & 0xFF) << (8 * n);
  return out;
}
"""


# gemv_rows.cu's loads and intrinsics on the host
_GEMV_ROWS_SHIMS = HALF_SHIMS + BYTE_PERM_SHIM + r"""
typedef unsigned int u32;
typedef unsigned char u8;
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline float2 __half22float2(__half2 a) { return {__half2float(a.x), __half2float(a.y)}; }
static inline __half __ushort_as_half(unsigned short v) { return v; }
static inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline uint4 load_stream(const u32* p) { return {p[0], p[1], p[2], p[3]}; }
// the shared activations: a "shared address" is a byte offset from the staged rows' start
static const float* g_xs;
static inline u32 shared_address(const float* xs) { return (u32)(4 * (xs - g_xs)); }
static inline float4 load_x4(u32 xs, int index) {
  const float* p = g_xs + xs / 4 + index;
  return {p[0], p[1], p[2], p[3]};
}
static inline float load_x1(u32 xs, int index) { return g_xs[xs / 4 + index]; }
"""


def gemv_rows_items() -> list[str]:
    """cuda/gemv_rows.cu's format structs (Q40 .. IQ2S, F32, F16: their item loads and dot products, with the
    K-quants' scale decoding and run sums and the I-quants' lookups under them) as host C++, after the shims:
    the text the host tests build on (their own main after it)."""
    from strata.gpu.kernels import tensor_core

    source = tensor_core.source_text("gemv_rows.cu")
    return [_GEMV_ROWS_SHIMS,
            between(source, "constexpr int XSTRIDE", "__device__ __forceinline__ uint4 load_stream"),
            between(source, "__device__ __forceinline__ float byte_as_float", "__device__ __forceinline__ u32 "
                                                                             "shared_address"),
            between(source, "// IQ4_XS: byte i of the result", "}  // namespace"),  # iquants.cuh's lookups
            between(source, "__device__ __forceinline__ float half_at", "__device__ __forceinline__ float warp_sum"),
            between(source, "__device__ __forceinline__ u32 word_of", "// Q4_K for the gemv loop")]


def between(text: str, start: str, end: str) -> str:
    """The text from the first `start` up to the next `end` (a marker that moved fails loudly)."""
    first = text.index(start)
    return text[first:text.index(end, first)]


def build(folder: Path, name: str, source: str, extra_flags: tuple = ()) -> Path:
    """folder/name built from `source` by g++ (C++17, no FMA contraction); skips the test without g++ or
    without _Float16, fails it when the source no longer compiles for the host."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    (folder / "probe.cpp").write_text("int main() { _Float16 h = (_Float16)1.0f; return (int)(float)h - 1; }\n")
    if subprocess.run(["g++", "-std=c++17", "-o", str(folder / "probe"), str(folder / "probe.cpp")],
                      capture_output=True).returncode:
        pytest.skip("g++ without _Float16")
    (folder / f"{name}.cpp").write_text(source)
    done = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", *extra_flags, "-o", str(folder / name),
                           str(folder / f"{name}.cpp")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]  # the extracted C++ no longer compiles for the host
    return folder / name
