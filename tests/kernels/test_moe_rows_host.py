"""moe_rows.cu's dequantization and K order, run on the host against gguf-py and stage_x.

The simulator cannot run linked C++, so this test compiles the kernel's A-fragment dequantizers (dequant_block for
Q4_0, dequant_q8_block, dequant_q4_k_block, dequant_q5_k_block, dequant_q6_k_block, dequant_iq4_xs_block,
dequant_iq3_xxs_block and the pairs, levels, grid, signs and scales under them), the K-quants' step addressing
(step_words, x_step_column) and its hidden-column order, as their source text stands, for the CPU with g++ (CUDA's
half type and intrinsics replaced by float16 shims). It checks that each lane's registers, for both of its rows,
hold the f16 roundings of gguf-py's values of the physical elements the kernel's comments name (each format's quant
words and records as the kernel stages them a step), and that pairing them with X as stage_x lays it out (an 8-byte
load a lane, as the mma's B fragments) gives the same products as W x X^T. The tensor-core loop around them is
tested on the GPU (test_moe_rows).
"""

import shutil
import subprocess

import numpy as np
import pytest
from host_cpp import BYTE_PERM_SHIM, HALF_SHIMS, between, build
from kernel_data import dev, host, random_gguf_bytes, reference_dequant

from strata.gpu.kernels import moe_rows, tensor_core
from strata.gpu.kernels.packing import pack

_SHIMS = HALF_SHIMS + (r"""
static inline __half2 __low2half2(__half2 a) { return {a.x, a.x}; }
static inline __half2 __high2half2(__half2 a) { return {a.y, a.y}; }
// exact for the dequantizer's operands ((1024 + 16q) / 16 - 72 is an integer), so one rounding as on the GPU
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return {to_half(fmaf(__half2float(a.x), __half2float(b.x), __half2float(c.x))),
          to_half(fmaf(__half2float(a.y), __half2float(b.y), __half2float(c.y)))};
}
template <unsigned MASK> static inline unsigned mask_into(unsigned word, unsigned one024) """
r"""{ return (word & MASK) | one024; }
""")

_MAIN = r"""
// argv: rows cols tokens quant_pitch scale_pitch planes.bin x_staged.bin weights.out products.out columns.out
// Row r is a lane's row g, and row (r + 1) mod rows its row g + 8: weights.out holds both sets of registers'
// weights, [2][rows][cols] (from row g's, then from row g + 8's), products.out [2][rows][tokens] likewise.
int main(int argc, char** argv) {
  const int rows = atoi(argv[1]), cols = atoi(argv[2]), tokens = atoi(argv[3]);
  const int qp = atoi(argv[4]), sp = atoi(argv[5]);
  std::vector<unsigned> q((size_t)rows * qp);
  std::vector<uint16_t> s((size_t)rows * sp), x((size_t)tokens * cols), w((size_t)2 * rows * cols);
  std::vector<double> products((size_t)2 * rows * tokens, 0.0);
  FILE* f = fopen(argv[6], "rb");
  if (fread(q.data(), 4, q.size(), f) != q.size() || fread(s.data(), 2, s.size(), f) != s.size()) return 1;
  fclose(f);
  f = fopen(argv[7], "rb");
  if (fread(x.data(), 2, x.size(), f) != x.size()) return 1;
  fclose(f);
  for (int r = 0; r < rows; ++r)
    for (int kb = 0; kb < cols / 32; ++kb)
      for (int t = 0; t < 4; ++t) {  // lane t of the rows' warp
        const int r8 = (r + 1) % rows;
        unsigned scale0, scale8;  // the f16 scales of blocks 2 * (kb / 2) and 2 * (kb / 2) + 1: a step's scale word
        memcpy(&scale0, &s[(size_t)r * sp + 2 * (kb / 2)], 4);
        memcpy(&scale8, &s[(size_t)r8 * sp + 2 * (kb / 2)], 4);
        unsigned lo[4], hi[4];
        dequant_block(q[(size_t)r * qp + 4 * kb + t], q[(size_t)r8 * qp + 4 * kb + t], scale0, scale8, kb & 1,
                      0x64006400u, lo, hi);
        // the comments' K order: a0 (a1) holds elements 4t, 4t + 2; a2 (a3) holds 4t + 1, 4t + 3; hi from 16 on
        const int element[8] = {4 * t, 4 * t + 2, 4 * t + 1, 4 * t + 3, 16 + 4 * t, 18 + 4 * t, 17 + 4 * t, 19 + 4 * t};
        for (int half = 0; half < 2; ++half) {  // row g's registers (a0, a2), then row g + 8's (a1, a3)
          const int row = half ? r8 : r;
          const unsigned reg[4] = {lo[half], lo[2 + half], hi[half], hi[2 + half]};
          uint16_t* w_row = &w[((size_t)half * rows + row) * cols + 32 * kb];
          for (int i = 0; i < 8; ++i) w_row[element[i]] = (uint16_t)(reg[i / 2] >> (16 * (i % 2)));
          // the mma: b0 / b1 are the halves at stored positions 4t .. 4t + 3 (16 + 4t .. for hi) of X's row
          for (int n = 0; n < tokens; ++n) {
            const uint16_t* xs = &x[(size_t)n * cols + 32 * kb];
            double sum = 0.0;
            for (int i = 0; i < 8; ++i) {
              const int stored = (i < 4 ? 4 * t : 16 + 4 * t) + i % 4;
              sum += (double)__half2float((uint16_t)(reg[i / 2] >> (16 * (i % 2)))) * __half2float(xs[stored]);
            }
            products[((size_t)half * rows + row) * tokens + n] += sum;
          }
        }
      }
  std::vector<int> columns(64);
  for (int c = 0; c < 64; ++c) columns[c] = staged_column(c);
  f = fopen(argv[8], "wb"); fwrite(w.data(), 2, w.size(), f); fclose(f);
  f = fopen(argv[9], "wb"); fwrite(products.data(), 8, products.size(), f); fclose(f);
  f = fopen(argv[10], "wb"); fwrite(columns.data(), 4, columns.size(), f); fclose(f);
  return 0;
}
"""


_FORMAT_SHIMS = r"""
#define __host__
struct float2 { float x, y; };
struct uint4 { unsigned x, y, z, w; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float __low2float(__half2 a) { return __half2float(a.x); }
static inline float __high2float(__half2 a) { return __half2float(a.y); }
static inline float2 __half22float2(__half2 a) { return {__half2float(a.x), __half2float(a.y)}; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline __half2 __floats2half2_rn(float a, float b) { return {to_half(a), to_half(b)}; }
"""

# The kernel's reads of one step for Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), IQ3_XXS (18) and IQ4_XS (23): words
# and records as rows_tile stages them.
_FORMATS_MAIN = r"""
// argv: format rows cols tokens quant_pitch scale_pitch extra_pitch planes.bin x_staged.bin weights.out products.out
// Row r is a lane's row g, and row (r + 2) mod rows its row g + 8 (rows even: as in the kernel, the two rows' d of a
// Q6_K super-block are both odd or both even halves of the plane).
int main(int argc, char** argv) {
  const int format = atoi(argv[1]), rows = atoi(argv[2]), cols = atoi(argv[3]), tokens = atoi(argv[4]);
  const int qp = atoi(argv[5]), sp = atoi(argv[6]), ep = atoi(argv[7]);
  std::vector<unsigned> q((size_t)rows * qp);
  std::vector<uint16_t> s((size_t)rows * sp), x((size_t)tokens * cols), w((size_t)2 * rows * cols);
  std::vector<unsigned char> e((size_t)rows * ep);
  std::vector<double> products((size_t)2 * rows * tokens, 0.0);
  FILE* f = fopen(argv[8], "rb");
  if (fread(q.data(), 4, q.size(), f) != q.size() || fread(s.data(), 2, s.size(), f) != s.size() ||
      fread(e.data(), 1, e.size(), f) != e.size()) return 1;
  fclose(f);
  f = fopen(argv[9], "rb");
  if (fread(x.data(), 2, x.size(), f) != x.size()) return 1;
  fclose(f);
  // a row's step as rows_tile stages it: Q5_K and Q6_K's 4 chunks (nibbles, then high bits) of 4 words each
  auto chunk_word = [&](int row, int step, int chunk, int t) {
    const int at = format == 13 ? step_words<kRowsQ5_K>(step, chunk >= 2) : step_words<kRowsQ6_K>(step, chunk >= 2);
    return q[(size_t)row * qp + at + 4 * (chunk & 1) + t];
  };
  // Q6_K's record: the 4-byte aligned word that holds the row's d of the step's super-block (an even half alone, an
  // odd one with the half before it), then the 8 scales of the step's half super-block
  auto q6_k_record = [&](int row, int step) {
    const size_t half = (size_t)row * sp + step / 4;
    uint4 record = {0, 0, 0, 0};
    memcpy(&record.x, &s[half & ~(size_t)1], half & 1 ? 4 : 2);
    memcpy(&record.y, &e[(size_t)row * ep + 16 * (step / 4) + 8 * ((step >> 1) & 1)], 8);
    return record;
  };
  // IQ4_XS's record: Q6_K's word of d, then the two aligned words that hold the super-block's 6 scale bytes (the
  // second read only up to them, the rest zeros)
  auto iq4_xs_record = [&](int row, int step) {
    const size_t half = (size_t)row * sp + step / 4, at = (size_t)row * ep + 6 * (step / 4), offset = at & 3;
    uint4 record = {0, 0, 0, 0};
    memcpy(&record.x, &s[half & ~(size_t)1], half & 1 ? 4 : 2);
    memcpy(&record.y, &e[at - offset], 4);
    memcpy(&record.z, &e[at - offset + 4], 2 + offset);
    return record;
  };
  // IQ3_XXS's scale word: Q6_K's word of d
  auto d_word = [&](int row, int step) {
    const size_t half = (size_t)row * sp + step / 4;
    unsigned word = 0;
    memcpy(&word, &s[half & ~(size_t)1], half & 1 ? 4 : 2);
    return word;
  };
  for (int r = 0; r < rows; ++r)
    for (int kb = 0; kb < cols / 32; ++kb)  // the 32-element group b = kb % 2 of step kb / 2
      for (int t = 0; t < 4; ++t) {
        const int r8 = (r + 2) % rows, step = kb / 2, b = kb & 1;
        int col0 = 32 * kb;  // the group's first column: Q6_K's as its X
        unsigned lo[4], hi[4];
        if (format == 8) {  // a step's 16 words: block b's lo in chunk 2b, hi in chunk 2b + 1
          unsigned scale0, scale8;
          memcpy(&scale0, &s[(size_t)r * sp + 2 * step], 4);
          memcpy(&scale8, &s[(size_t)r8 * sp + 2 * step], 4);
          const int lw = 16 * step + 8 * b + t;
          dequant_q8_block(q[(size_t)r * qp + lw], q[(size_t)r8 * qp + lw], q[(size_t)r * qp + lw + 4],
                           q[(size_t)r8 * qp + lw + 4], scale0, scale8, b, 0x64806480u, lo, hi);
        } else if (format == 14) {
          const unsigned d_parity = ((unsigned)r * sp) & 1;  // rows_tile's, of row g
          dequant_q6_k_block(chunk_word(r, step, 0, t), chunk_word(r8, step, 0, t), chunk_word(r, step, 1, t),
                             chunk_word(r8, step, 1, t), chunk_word(r, step, 2, t), chunk_word(r8, step, 2, t),
                             chunk_word(r, step, 3, t), chunk_word(r8, step, 3, t), q6_k_record(r, step),
                             q6_k_record(r8, step), 16 * (d_parity ^ ((step >> 2) & 1)), b, 2 * (step & 1) + 4 * b,
                             0x64006400u, lo, hi);
          col0 = x_step_column<kRowsQ6_K>(step) + 64 * b;
        } else if (format == 18) {  // a super-block's 24 words: qs (16), then its sign-and-scale words (8)
          const int super_block = step / 4, j = step % 4;
          const unsigned* row_q = &q[(size_t)r * qp + 24 * super_block];
          const unsigned* row_q8 = &q[(size_t)r8 * qp + 24 * super_block];
          const int d_shift = 16 * ((((unsigned)r * sp) & 1) ^ (super_block & 1));
          dequant_iq3_xxs_block(row_q[4 * j + 2 * b], row_q[4 * j + 2 * b + 1], row_q[16 + 2 * j + b],
                                lone_d(d_word(r, step), d_shift), row_q8[4 * j + 2 * b], row_q8[4 * j + 2 * b + 1],
                                row_q8[16 + 2 * j + b], lone_d(d_word(r8, step), d_shift), t, lo, hi);
        } else if (format == 23) {  // a step's 8 words, block b's in chunk b (Q4_0's); rows_tile's parities of row g
          const unsigned super_odd = (step / 4) & 1, d_parity = ((unsigned)r * sp) & 1;
          const unsigned e_parity = ((unsigned)r * ep) & 3;
          const int d_shift = 16 * (d_parity ^ super_odd), e_offset = (e_parity + 2 * super_odd) & 3;
          const int lw = 8 * step + 4 * b + t, sub_block = 2 * (step % 4) + b;
          dequant_iq4_xs_block(q[(size_t)r * qp + lw], q[(size_t)r8 * qp + lw],
                               iq4_xs_scale(iq4_xs_record(r, step), d_shift, e_offset, sub_block),
                               iq4_xs_scale(iq4_xs_record(r8, step), d_shift, e_offset, sub_block), lo, hi);
        } else {  // Q4_K, Q5_K: the row's record of its super-block (d, dmin, 12 scale bytes)
          const int super_block = step / 4, sub_block = 2 * (step % 4) + b, lw = 8 * step + t;
          uint4 record0, record8;
          memcpy(&record0.x, &s[(size_t)r * sp + 2 * super_block], 4);
          memcpy(&record8.x, &s[(size_t)r8 * sp + 2 * super_block], 4);
          memcpy(&record0.y, &e[(size_t)r * ep + 12 * super_block], 12);
          memcpy(&record8.y, &e[(size_t)r8 * ep + 12 * super_block], 12);
          if (format == 12)  // a step's 8 words, lo in chunk 0, hi in chunk 1
            dequant_q4_k_block(q[(size_t)r * qp + lw], q[(size_t)r8 * qp + lw], q[(size_t)r * qp + lw + 4],
                               q[(size_t)r8 * qp + lw + 4], q4_k_scale_min(record0, sub_block),
                               q4_k_scale_min(record8, sub_block), b, 0x64006400u, lo, hi);
          else
            dequant_q5_k_block(chunk_word(r, step, 0, t), chunk_word(r8, step, 0, t), chunk_word(r, step, 1, t),
                               chunk_word(r8, step, 1, t), chunk_word(r, step, 2, t), chunk_word(r8, step, 2, t),
                               chunk_word(r, step, 3, t), chunk_word(r8, step, 3, t),
                               q4_k_scale_min(record0, sub_block), q4_k_scale_min(record8, sub_block), b, sub_block,
                               0x64006400u, lo, hi);
        }
        const int element[8] = {4 * t, 4 * t + 2, 4 * t + 1, 4 * t + 3, 16 + 4 * t, 18 + 4 * t, 17 + 4 * t, 19 + 4 * t};
        for (int half = 0; half < 2; ++half) {
          const int row = half ? r8 : r;
          const unsigned reg[4] = {lo[half], lo[2 + half], hi[half], hi[2 + half]};
          uint16_t* w_row = &w[((size_t)half * rows + row) * cols + col0];
          for (int i = 0; i < 8; ++i) w_row[element[i]] = (uint16_t)(reg[i / 2] >> (16 * (i % 2)));
          for (int n = 0; n < tokens; ++n) {
            const uint16_t* xs = &x[(size_t)n * cols + col0];
            double sum = 0.0;
            for (int i = 0; i < 8; ++i) {
              const int stored = (i < 4 ? 4 * t : 16 + 4 * t) + i % 4;
              sum += (double)__half2float((uint16_t)(reg[i / 2] >> (16 * (i % 2)))) * __half2float(xs[stored]);
            }
            products[((size_t)half * rows + row) * tokens + n] += sum;
          }
        }
      }
  f = fopen(argv[10], "wb"); fwrite(w.data(), 2, w.size(), f); fclose(f);
  f = fopen(argv[11], "wb"); fwrite(products.data(), 8, products.size(), f); fclose(f);
  return 0;
}
"""


def _host_build(tmp_path_factory, name: str, *pieces: str):
    """The shims, ``pieces`` cut from common.cuh, iquants.cuh and moe_rows.cu ((file, start, end) or plain text), built
    with g++ as ``name`` in a folder of its own."""
    sources = {file: tensor_core.source_text(file) for file in ("common.cuh", "iquants.cuh", "moe_rows.cu")}
    parts = [piece if isinstance(piece, str) else between(sources[piece[0]], *piece[1:]) for piece in pieces]
    folder = tmp_path_factory.mktemp(f"moe_rows_{name}_host")
    build(folder, name, "\n".join(parts).replace("[[maybe_unused]] ", ""))
    return folder


@pytest.fixture(scope="module")
def format_fragments(tmp_path_factory):
    return _host_build(
        tmp_path_factory, "formats", _SHIMS, _FORMAT_SHIMS, BYTE_PERM_SHIM,
        ("common.cuh", "__device__ __forceinline__ unsigned pack_half2", "// c[0..3] += A"),
        ("moe_rows.cu", "enum RowsFormat", "// A stage's regions"),
        ("common.cuh", "[[maybe_unused]] __device__ __forceinline__ unsigned scaled_half2", "// Q4_0 and Q8_0"),
        ("iquants.cuh", "// IQ4_XS: byte i of the result", "}  // namespace"),
        ("moe_rows.cu", "// Q8_0: two f16 halves", "// The X copies of a thread"),
        _FORMATS_MAIN)


@pytest.fixture(scope="module")
def fragments(tmp_path_factory):
    return _host_build(
        tmp_path_factory, "fragments", _SHIMS,
        ("common.cuh", "[[maybe_unused]] __device__ __forceinline__ unsigned scaled_half2", "// Q4_0 and Q8_0"),
        ("moe_rows.cu", "__device__ __forceinline__ unsigned q4_low_pair", "// 0x64006400 in a register"),
        ("moe_rows.cu", "// A fragments of block b", "// Q8_0: two f16 halves"),
        _MAIN)


def test_lanes_dequantize_like_gguf_and_pair_with_stage_x_as_w_times_x(fragments):
    num_rows, num_cols, num_tokens = 5, 128, 3  # 4 blocks: both of a step's scales, two steps
    rng = np.random.default_rng(30)
    raw = random_gguf_bytes("Q4_0", num_rows, num_cols, rng)
    packed = pack(raw, "Q4_0")
    x = rng.standard_normal((num_tokens, num_cols)).astype(np.float32)
    staged = host(moe_rows.stage_x(dev(x)))
    with open(fragments / "planes.bin", "wb") as f:
        f.write(np.ascontiguousarray(packed.quants, np.uint32).tobytes())
        f.write(np.ascontiguousarray(packed.scales, np.float16).tobytes())
    staged.tofile(fragments / "x.bin")
    subprocess.run([str(fragments / "fragments"), str(num_rows), str(num_cols), str(num_tokens),
                    str(packed.quants.shape[1]), str(packed.scales.shape[1]), str(fragments / "planes.bin"),
                    str(fragments / "x.bin"), *(str(fragments / name) for name in ("w.out", "p.out", "c.out"))],
                   check=True)
    weights = np.fromfile(fragments / "w.out", np.float16).reshape(2, num_rows, num_cols)  # rows g, rows g + 8
    expected = reference_dequant(raw, "Q4_0").astype(np.float16)
    for from_registers in weights:
        np.testing.assert_array_equal(from_registers.view(np.uint16), expected.view(np.uint16))  # bit for bit
    products = np.fromfile(fragments / "p.out", np.float64).reshape(2, num_rows, num_tokens)
    reference = expected.astype(np.float64) @ x.astype(np.float16).astype(np.float64).T  # [rows, tokens]
    for from_registers in products:
        np.testing.assert_allclose(from_registers, reference, rtol=1e-12, atol=1e-12)
    columns = np.fromfile(fragments / "c.out", np.int32)  # gate/up's hidden columns, as down reads them
    row = np.arange(64, dtype=np.float32)[None, :]
    np.testing.assert_array_equal(host(moe_rows.stage_x(dev(row)))[0, columns], row[0])


_FORMAT_CODES = {"Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ3_XXS": 18, "IQ4_XS": 23}


@pytest.mark.parametrize("fmt", list(_FORMAT_CODES))
def test_lanes_of_the_other_formats_dequantize_like_gguf_and_pair_with_stage_x(format_fragments, fmt):
    # K-quants, IQ4_XS: 3 super-blocks, 12 steps (every sub-block of each; Q6_K's and IQ4_XS's d at odd and even halves
    # of its plane; IQ4_XS's 6 scale bytes at byte 0 and 2 of an aligned word: 18 bytes a row)
    num_rows, num_cols, num_tokens = 6, (512 if fmt == "Q8_0" else 768), 3
    rng = np.random.default_rng(31)
    raw = random_gguf_bytes(fmt, num_rows, num_cols, rng)
    packed = pack(raw, fmt)
    x = rng.standard_normal((num_tokens, num_cols)).astype(np.float32)
    staged = host(moe_rows.stage_x(dev(x)))
    is_extra = fmt not in ("Q8_0", "IQ3_XXS")
    extra = np.ascontiguousarray(packed.extra, np.uint8) if is_extra else np.zeros((num_rows, 0), np.uint8)
    with open(format_fragments / "planes.bin", "wb") as f:
        f.write(np.ascontiguousarray(packed.quants, np.uint32).tobytes())
        f.write(np.ascontiguousarray(packed.scales, np.float16).tobytes())
        f.write(extra.tobytes())
    staged.tofile(format_fragments / "x.bin")
    subprocess.run([str(format_fragments / "formats"), str(_FORMAT_CODES[fmt]), str(num_rows), str(num_cols),
                    str(num_tokens), str(packed.quants.shape[1]), str(packed.scales.shape[1]), str(extra.shape[1]),
                    str(format_fragments / "planes.bin"), str(format_fragments / "x.bin"),
                    str(format_fragments / "w.out"), str(format_fragments / "p.out")], check=True)
    weights = np.fromfile(format_fragments / "w.out", np.float16).reshape(2, num_rows, num_cols)
    expected = reference_dequant(raw, fmt).astype(np.float16)  # gguf-py's float32 values, rounded once to f16
    for from_registers in weights:
        np.testing.assert_array_equal(from_registers.view(np.uint16), expected.view(np.uint16))  # bit for bit
    products = np.fromfile(format_fragments / "p.out", np.float64).reshape(2, num_rows, num_tokens)
    reference = expected.astype(np.float64) @ x.astype(np.float16).astype(np.float64).T  # [rows, tokens]
    for from_registers in products:
        np.testing.assert_allclose(from_registers, reference, rtol=1e-12, atol=1e-12)


def test_every_format_compiles_for_the_gpu(tmp_path):
    # the simulator cannot link C++: without a GPU, nvcc checks the source where it is installed, with every
    # instantiation a kernel may append to it (each kernel links its own one)
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    launches = ("gate_up", "down")
    source = tmp_path / "moe_rows.cu"
    instances = (moe_rows.instance(launch, fmt) for fmt in moe_rows.BUILT_FORMATS for launch in launches)
    source.write_text(tensor_core.source_text("moe_rows.cu") + "".join(instances))
    done = subprocess.run(["nvcc", "-arch=sm_90", "-rdc=true", "-ptx", str(source), "-o", str(tmp_path / "rows.ptx")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = (tmp_path / "rows.ptx").read_text()
    for fmt in moe_rows.BUILT_FORMATS:
        for launch in launches:
            assert f".func strata_moe_rows_{launch}_{fmt.lower()}(" in ptx
    alone = tmp_path / "alone.cu"  # the source alone exports nothing: a link compiles only what it appends
    alone.write_text(tensor_core.source_text("moe_rows.cu"))
    done = subprocess.run(["nvcc", "-arch=sm_90", "-rdc=true", "-ptx", str(alone), "-o", str(tmp_path / "alone.ptx")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "strata_moe_rows_" not in (tmp_path / "alone.ptx").read_text()

