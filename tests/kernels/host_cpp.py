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


def between(text: str, start: str, end: str) -> str:
    """The text from the first `start` up to the next `end` (a marker that moved fails loudly)."""
    first = text.index(start)
    return text[first:text.index(end, first)]


def build(folder: Path, name: str, source: str) -> Path:
    """folder/name built from `source` by g++ (C++17, no FMA contraction); skips the test without g++ or
    without _Float16, fails it when the source no longer compiles for the host."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    (folder / "probe.cpp").write_text("int main() { _Float16 h = (_Float16)1.0f; return (int)(float)h - 1; }\n")
    if subprocess.run(["g++", "-std=c++17", "-o", str(folder / "probe"), str(folder / "probe.cpp")],
                      capture_output=True).returncode:
        pytest.skip("g++ without _Float16")
    (folder / f"{name}.cpp").write_text(source)
    done = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-o", str(folder / name),
                           str(folder / f"{name}.cpp")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]  # the extracted C++ no longer compiles for the host
    return folder / name
