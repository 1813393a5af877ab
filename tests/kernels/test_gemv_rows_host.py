"""gemv_rows.cu's items run on the host: each format's loads and dot products against gguf-py's values.

The simulator cannot run linked C++, so this test compiles the rows' format structs (Q40 .. Q6K, with the
K-quants' scale decoding and run sums under them), as their source text stands, for the CPU with g++ (the
16-byte and shared-memory loads replaced by plain reads, CUDA's half type by float16 shims). A host loop
deals a row's items to 32 lanes as rows_dot does and adds the lanes' sums in the warp's butterfly order. It
checks each row's product with x against gguf-py's dequantized row times x, and that the items of two rows
against two staged rows of x (dot<2, 2>) give each (row, x) the bits of dot<1, 1>. The warp loops around the
items are tested on the GPU (test_gemv_native, test_gemv_rows).
"""

import subprocess

import numpy as np
import pytest
from host_cpp import build, gemv_rows_items
from kernel_data import assert_dot_close, random_gguf_bytes, reference_dequant

from strata.gpu.kernels import gemv_native
from strata.gpu.kernels.packing import FORMATS, pack

_MAIN = r"""
// The sums of rows `rows` of R with NX rows of x (x_stride floats apart) as a warp's lanes take the row's items
// in turn and meet in the butterfly: out[t * R + r].
template <class F, int R, int NX>
void rows_dot(const RowPlanes (&rows)[R], const float* xs, int x_stride, int num_cols, float* out) {
  const int num_items = F::items(num_cols);
  std::vector<float> acc((size_t)32 * NX * R, 0.f);
  for (int lane = 0; lane < 32; ++lane)
    for (int i = lane; i < num_items; i += 32) {
      Item it[R];
      for (int r = 0; r < R; ++r) it[r] = F::load(rows[r], i);
      F::template dot<R, NX>(it, shared_address(xs), x_stride, i,
                             *reinterpret_cast<float(*)[NX][R]>(&acc[(size_t)lane * NX * R]));
    }
  for (int k = 0; k < NX * R; ++k) {
    float v[32], w[32];
    for (int lane = 0; lane < 32; ++lane) v[lane] = acc[(size_t)lane * NX * R + k];
    for (int offset = 16; offset > 0; offset >>= 1) {
      for (int lane = 0; lane < 32; ++lane) w[lane] = v[lane] + v[lane ^ offset];
      memcpy(v, w, sizeof(v));
    }
    out[k] = v[0];
  }
}

// ones [2][rows]: each (x row, row) by dot<1, 1>; pairs [2][rows]: rows 2p and 2p + 1 against both x rows at once
template <class F>
void products(int num_rows, int num_cols, int num_x, const u32* q, const uint16_t* s, const u8* e, int qp, int sp,
              int ep, const float* xs, float* ones, float* pairs) {
  auto planes = [&](int row) { return RowPlanes{q + (size_t)row * qp, s + (size_t)row * sp, e + (size_t)row * ep}; };
  for (int row = 0; row < num_rows; ++row)
    for (int t = 0; t < 2; ++t) {
      const RowPlanes one[1] = {planes(row)};
      rows_dot<F, 1, 1>(one, xs + t * num_x, 0, num_cols, &ones[t * num_rows + row]);
    }
  for (int row = 0; row < num_rows; row += 2) {
    const RowPlanes two[2] = {planes(row), planes(row + 1)};
    float out[4];
    rows_dot<F, 2, 2>(two, xs, num_x, num_cols, out);
    for (int t = 0; t < 2; ++t)
      for (int r = 0; r < 2; ++r) pairs[t * num_rows + row + r] = out[t * 2 + r];
  }
}

// argv: struct rows cols x_floats quant_pitch scale_pitch extra_pitch planes.bin xs.bin out.bin
int main(int argc, char** argv) {
  const std::string fmt = argv[1];
  const int rows = atoi(argv[2]), cols = atoi(argv[3]), num_x = atoi(argv[4]);
  const int qp = atoi(argv[5]), sp = atoi(argv[6]), ep = atoi(argv[7]);
  std::vector<u32> q((size_t)rows * qp);
  std::vector<uint16_t> s((size_t)rows * sp);
  std::vector<u8> e((size_t)rows * ep);
  std::vector<float> xs((size_t)2 * num_x), out((size_t)4 * rows);
  FILE* f = fopen(argv[8], "rb");
  if (fread(q.data(), 4, q.size(), f) != q.size() || fread(s.data(), 2, s.size(), f) != s.size() ||
      fread(e.data(), 1, e.size(), f) != e.size()) return 1;
  fclose(f);
  f = fopen(argv[9], "rb");
  if (fread(xs.data(), 4, xs.size(), f) != xs.size()) return 1;
  fclose(f);
  g_xs = xs.data();
  float* ones = out.data();
  float* pairs = out.data() + 2 * rows;
  if (fmt == "Q40") products<Q40>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "Q80") products<Q80>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "Q4K") products<Q4K>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "Q5K") products<Q5K>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "Q6K") products<Q6K>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "IQ4XS")
    products<IQ4XS>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "IQ3XXS")
    products<IQ3XXS>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "IQ3S")
    products<IQ3S>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "IQ2S")
    products<IQ2S>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "F32") products<F32>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else if (fmt == "F16") products<F16>(rows, cols, num_x, q.data(), s.data(), e.data(), qp, sp, ep, g_xs, ones, pairs);
  else return 2;
  f = fopen(argv[10], "wb");
  fwrite(out.data(), 4, out.size(), f);
  fclose(f);
  return 0;
}
"""


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    parts = ["#include <string>\n", *gemv_rows_items(), _MAIN]
    folder = tmp_path_factory.mktemp("gemv_rows_host")
    build(folder, "items", "\n".join(parts))
    return folder


def _staged(x: np.ndarray) -> np.ndarray:
    """x [T, K] as the kernels stage it: each 32-element group X_STRIDE floats on, its padding NaN (never read)."""
    groups = x.reshape(x.shape[0], -1, gemv_native.X_GROUP)
    padded = np.full((x.shape[0], groups.shape[1], gemv_native.X_STRIDE), np.nan, np.float32)
    padded[:, :, :gemv_native.X_GROUP] = groups
    return padded.reshape(x.shape[0], -1)


@pytest.mark.parametrize("fmt", gemv_native.BUILT_FORMATS)
def test_each_formats_items_give_gguf_rows_times_x_and_two_rows_the_bits_of_one(items, fmt):
    struct, _ = gemv_native._ROWS_SHAPES[fmt]
    block_elems = FORMATS[fmt].block_elems if fmt in gemv_native._K_QUANTS else 32
    rng = np.random.default_rng(700)
    # K-quants: rows of 1, 2, 3 super-blocks (a lane an item at most) and of 9 (lanes' second and third items)
    for num_blocks in (1, 2, 3, 9) if block_elems == 256 else (1, 3, 33, 70):
        num_rows, num_cols = 4, block_elems * num_blocks
        raw = random_gguf_bytes(fmt, num_rows, num_cols, rng)
        packed = pack(raw, fmt)
        values = reference_dequant(raw, fmt)  # gguf-py's float32 weights
        x = rng.standard_normal((2, num_cols)).astype(np.float32)
        planes = [np.ascontiguousarray(packed.quants).view(np.uint8).reshape(num_rows, -1)]
        planes += [np.ascontiguousarray(p).view(np.uint8).reshape(num_rows, -1) if p.shape[0] == num_rows
                   else np.zeros((num_rows, 0), np.uint8) for p in (packed.scales, packed.extra)]
        with open(items / "planes.bin", "wb") as f:
            f.writelines(plane.tobytes() for plane in planes)
        staged = _staged(x)
        staged.tofile(items / "xs.bin")
        pitches = (planes[0].shape[1] // 4, planes[1].shape[1] // 2, planes[2].shape[1])
        subprocess.run([str(items / "items"), struct, str(num_rows), str(num_cols), str(staged.shape[1]),
                        *map(str, pitches), str(items / "planes.bin"), str(items / "xs.bin"), str(items / "out.bin")],
                       check=True)
        ones, pairs = np.fromfile(items / "out.bin", np.float32).reshape(2, 2, num_rows)
        assert_dot_close(ones, x.astype(np.float64) @ values.T.astype(np.float64), np.abs(x) @ np.abs(values).T)
        np.testing.assert_array_equal(pairs, ones)  # each (x row, row) the same chain of operations
