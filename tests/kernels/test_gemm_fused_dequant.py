"""The fused GEMM loop's weight dequantization (cuda/gemm_mma.cu), run on the host against gguf-py.

The simulator cannot run linked C++, so this test compiles the loop's octet loads and dequantizers,
as their source text stands, for the CPU with g++ (CUDA's half type and intrinsics replaced by
float16 shims) and compares every element with gguf-py's values rounded to float16, which is what
the Numba dequantizers stage. The tensor-core loop around them is tested on the GPU.
"""

import subprocess

import numpy as np
import pytest
from host_cpp import BYTE_PERM_SHIM, HALF_SHIMS, between, build
from kernel_data import random_gguf_bytes, reference_dequant

from strata.gpu.kernels import tensor_core
from strata.gpu.kernels.gemm_config import FUSED_FORMATS
from strata.gpu.kernels.packing import pack

_SHIMS = HALF_SHIMS + BYTE_PERM_SHIM + r"""
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static inline __half2 __floats2half2_rn(float a, float b) { return {to_half(a), to_half(b)}; }
static inline float __int_as_float(unsigned b) { float f; memcpy(&f, &b, 4); return f; }
"""

_MAIN = r"""
template <OctetFormat F> void dequant_all(const WeightPlanes& p, int rows, int cols, uint16_t* out) {
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < cols / 8; ++o) {
      const uint4 v = dequant_weights<F>(load_weights<F>(p, r, o), o);
      memcpy(out + (size_t)r * cols + o * 8, &v, 16);
    }
}
int main(int argc, char** argv) {  // format rows cols quant_pitch scale_pitch extra_pitch planes.bin out.bin
  const int fmt = atoi(argv[1]), rows = atoi(argv[2]), cols = atoi(argv[3]);
  const int qp = atoi(argv[4]), sp = atoi(argv[5]), ep = atoi(argv[6]);
  std::vector<unsigned> q((size_t)rows * qp);
  std::vector<uint16_t> s((size_t)rows * sp), out((size_t)rows * cols);
  std::vector<unsigned char> e((size_t)rows * ep);
  FILE* f = fopen(argv[7], "rb");
  if (fread(q.data(), 4, q.size(), f) != q.size() || fread(s.data(), 2, s.size(), f) != s.size() ||
      fread(e.data(), 1, e.size(), f) != e.size()) return 1;
  fclose(f);
  const WeightPlanes p{q.data(), s.data(), e.data(), qp, sp, ep};
  switch (fmt) {
    case 0: dequant_all<kQ4_0>(p, rows, cols, out.data()); break;
    case 1: dequant_all<kQ4_1>(p, rows, cols, out.data()); break;
    case 2: dequant_all<kQ8_0>(p, rows, cols, out.data()); break;
    case 3: dequant_all<kQ4_K>(p, rows, cols, out.data()); break;
    case 4: dequant_all<kQ6_K>(p, rows, cols, out.data()); break;
    case 5: dequant_all<kF16>(p, rows, cols, out.data()); break;
    default: return 2;
  }
  f = fopen(argv[8], "wb");
  fwrite(out.data(), 2, out.size(), f);
  fclose(f);
  return 0;
}
"""


@pytest.fixture(scope="module")
def dequantizer(tmp_path_factory):
    common = tensor_core.source_text("common.cuh")
    gemm = tensor_core.source_text("gemm_mma.cu")
    source = "\n".join([
        _SHIMS,
        between(common, "__device__ __forceinline__ unsigned pack_half2", "// c[0..3] +="),
        between(common, "enum OctetFormat", "[[maybe_unused]] __device__ __forceinline__ void cp_async_16"),
        between(common, "// 2^23 + b", "}  // namespace"),
        between(gemm, "// A packed weight matrix's planes", "// acc_a (and acc_b"),
        _MAIN,
    ])
    folder = tmp_path_factory.mktemp("fused_dequant")
    build(folder, "dequant", source)
    return folder


@pytest.mark.parametrize("fmt", FUSED_FORMATS)
def test_fused_loop_dequantizes_like_gguf(dequantizer, fmt):
    num_rows, num_cols = 7, 768  # three K-quant super-blocks, 24 legacy blocks
    raw = random_gguf_bytes(fmt, num_rows, num_cols, np.random.default_rng(20))
    packed = pack(raw, fmt)
    planes = dequantizer / f"{fmt}.bin"
    out = dequantizer / f"{fmt}.out"
    quants = np.ascontiguousarray(packed.quants).view(np.uint32)  # an F16 matrix's values, two a word
    with open(planes, "wb") as f:  # a plane the format lacks is a (1, 1) placeholder: one row of it per row
        for plane, dtype in ((quants, np.uint32), (packed.scales, np.float16), (packed.extra, np.uint8)):
            f.write(np.ascontiguousarray(np.broadcast_to(plane, (num_rows, plane.shape[1])), dtype).tobytes())
    pitches = (quants.shape[1], packed.scales.shape[1], packed.extra.shape[1])
    subprocess.run([str(dequantizer / "dequant"), str(FUSED_FORMATS.index(fmt)), str(num_rows), str(num_cols),
                    *map(str, pitches), str(planes), str(out)], check=True)
    got = np.fromfile(out, np.float16).reshape(num_rows, num_cols)
    expected = reference_dequant(raw, fmt).astype(np.float16)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))  # bit for bit: signed zeros too
