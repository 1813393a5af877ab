"""moe_rows.cu's whole tiles, run on the host: staging, ring and mma as their source text stands.

test_moe_rows_host checks the lanes' dequantization; this checks what feeds them. rows_tile, gate_up_tile and
down_tile are cut from the source and built with g++ over shims of their PTX: 128 threads a block (std::thread),
__syncthreads a barrier of them, shared memory a byte array, each cp.async a copy done at once (the ring's
order is the barriers'), each mma.m16n8k16 an exchange of the warp's fragments, atomicAdd under a lock. A
format's addressing (quant chunks, records, Q6_K's d words and its X runs) that misplaces a byte fails here
against W x X, as it would on the GPU.
"""

import subprocess

import numpy as np
import pytest
from host_cpp import BYTE_PERM_SHIM, between, build
from kernel_data import assert_close_to_scale, dev, host, random_gguf_bytes, reference_dequant
from test_moe_rows_host import _FORMAT_SHIMS, _SHIMS

from strata.gpu.kernels import moe_rows, tensor_core
from strata.gpu.kernels.packing import pack

_NUM_TOKENS = 21  # 3 groups of 8, the last partial; X rows a thread copies past the first
_PTX_SHIMS = r"""
#include <condition_variable>
#include <mutex>
#include <thread>
struct uint2 { unsigned x, y; };
struct Barrier {
  std::mutex m;
  std::condition_variable cv;
  int count, waiting = 0;
  long generation = 0;
  explicit Barrier(int n) : count(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    const long g = generation;
    if (++waiting == count) { waiting = 0; ++generation; cv.notify_all(); }
    else cv.wait(lock, [&] { return generation != g; });
  }
};
static Barrier* block_barrier;
static Barrier* warp_barriers[4];
static struct { unsigned a[4], b[2]; } warp_fragments[4][32];
static std::mutex atomic_lock;
alignas(16) static unsigned char smem_bytes[48 * 1024];
static thread_local int thread_index;
struct ThreadIdx { int x; };
#define threadIdx (ThreadIdx{thread_index})
static inline void __syncthreads() { block_barrier->wait(); }
static inline unsigned shared_address(const void* p) { return (unsigned)((const unsigned char*)p - smem_bytes); }
template <int OFFSET> static inline void copy16(unsigned dst, const void* src) {
  memcpy(smem_bytes + dst + OFFSET, src, 16);
}
template <int OFFSET> static inline void copy16_or_zeros(unsigned dst, const void* src, bool valid) {
  if (valid) memcpy(smem_bytes + dst + OFFSET, src, 16); else memset(smem_bytes + dst + OFFSET, 0, 16);
}
static inline void copy4_part(unsigned dst, const void* src, int num_bytes) {
  memset(smem_bytes + dst, 0, 4);
  memcpy(smem_bytes + dst, src, num_bytes);
}
static inline void copy4_or_zeros(unsigned dst, const void* src, bool valid) { copy4_part(dst, src, valid ? 4 : 0); }
static inline void copy8_or_zeros(unsigned dst, const void* src, bool valid) {
  if (valid) memcpy(smem_bytes + dst, src, 8); else memset(smem_bytes + dst, 0, 8);
}
template <int OFFSET> static inline unsigned load_shared(unsigned addr) {
  unsigned v; memcpy(&v, smem_bytes + addr + OFFSET, 4); return v;
}
template <int OFFSET> static inline uint2 load_shared2(unsigned addr) {
  uint2 v; memcpy(&v, smem_bytes + addr + OFFSET, 8); return v;
}
static inline uint4 load_shared4(unsigned addr) { uint4 v; memcpy(&v, smem_bytes + addr, 16); return v; }
template <int N> static inline void wait_pending() {}
static inline void cp_async_commit() {}
static inline unsigned opaque_one024() { return 0x64006400u; }
static inline __half __float2half_rn(float v) { return to_half(v); }
static inline void atomicAdd(float* p, float v) { std::lock_guard<std::mutex> lock(atomic_lock); *p += v; }
static inline void atomicAdd(unsigned long long* p, unsigned long long v) {
  std::lock_guard<std::mutex> lock(atomic_lock); *p += v;
}
static inline long long __float2ll_rn(float v) { return llrintf(v); }
static inline float half_at(unsigned word, int i) { return __half2float((uint16_t)(word >> (16 * i))); }
// the warp's m16n8k16 (f16 A row-major 16 x 16, B 16 x 8, f32 C) from every lane's fragments, as the PTX ISA lays them
static inline void mma_16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  const int warp = thread_index >> 5, lane = thread_index & 31, g = lane >> 2, t = lane & 3;
  warp_fragments[warp][lane] = {{a0, a1, a2, a3}, {b0, b1}};
  warp_barriers[warp]->wait();
  for (int r = 0; r < 4; ++r) {
    const int row = g + 8 * (r >> 1), col = 2 * t + (r & 1);
    float sum = c[r];
    for (int k = 0; k < 16; ++k) {  // A (row, k): lane 4 (row % 8) + (k % 8) / 2, register 2 (k / 8) + row / 8
      const float a = half_at(warp_fragments[warp][4 * (row & 7) + ((k & 7) >> 1)].a[2 * (k >> 3) + (row >> 3)], k & 1);
      const float b = half_at(warp_fragments[warp][4 * col + ((k & 7) >> 1)].b[k >> 3], k & 1);  // B (k, col)
      sum += a * b;
    }
    c[r] = sum;
  }
  warp_barriers[warp]->wait();
}
"""

_MAIN = r"""
static void run_block(const std::function<void()>& body) {  // one block: 128 threads, each the body
  Barrier block(128), w0(32), w1(32), w2(32), w3(32);
  block_barrier = &block;
  Barrier* warps[4] = {&w0, &w1, &w2, &w3};
  for (int w = 0; w < 4; ++w) warp_barriers[w] = warps[w];
  std::vector<std::thread> threads;
  for (int i = 0; i < 128; ++i) threads.emplace_back([&, i] { thread_index = i; body(); });
  for (auto& thread : threads) thread.join();
}

struct Planes { std::vector<unsigned> q; std::vector<uint16_t> s; std::vector<unsigned char> e; int qp, sp, ep; };

static Planes read_planes(FILE* f, int rows) {
  Planes p;
  int pitches[3];
  if (fread(pitches, 4, 3, f) != 3) exit(2);
  p.qp = pitches[0], p.sp = pitches[1], p.ep = pitches[2];
  p.q.resize((size_t)rows * p.qp); p.s.resize((size_t)rows * p.sp); p.e.resize((size_t)rows * p.ep + 1);
  if (fread(p.q.data(), 4, p.q.size(), f) != p.q.size() || fread(p.s.data(), 2, p.s.size(), f) != p.s.size() ||
      fread(p.e.data(), 1, p.e.size() - 1, f) != p.e.size() - 1) exit(2);
  return p;
}

static RowsPlanes planes_of(Planes& p, int row) {
  return RowsPlanes{p.q.data() + (size_t)row * p.qp, (const __half*)p.s.data() + (size_t)row * p.sp,
                    p.e.data() + (size_t)row * p.ep};
}

// gate/up then down of one expert tile of TOKENS tokens (X rows 0 ..), every block of both launches
template <int F>
static void run(FILE* f, int dim, int ffn, const char* hidden_path, const char* out_path, const char* sums_path) {
  constexpr int G = (TOKENS + 7) / 8;
  Planes gate = read_planes(f, ffn), up = read_planes(f, ffn), down = read_planes(f, dim);
  std::vector<uint16_t> x((size_t)TOKENS * dim), hidden((size_t)TOKENS * ffn, 0);
  if (fread(x.data(), 2, x.size(), f) != x.size()) exit(2);
  std::vector<int> pair_token(TOKENS);
  std::vector<float> pair_weight(TOKENS, 1.f), out((size_t)TOKENS * dim, 0.f);
  std::vector<long long> sums((size_t)TOKENS * dim, 0);  // the same products as fixed-point sums (fixed_sums.py)
  for (int n = 0; n < TOKENS; ++n) pair_token[n] = n;
  for (int col0 = 0; col0 < ffn; col0 += 64)
    run_block([&] {
      gate_up_tile<F, G>((const __half*)x.data(), dim, dim / 32, pair_token.data(), 0, TOKENS, planes_of(gate, 0),
                         planes_of(up, 0), gate.qp, gate.sp, gate.ep, col0, ffn, (__half*)hidden.data(), ffn, col0,
                         smem_bytes);
    });
  for (int col0 = 0; col0 < dim; col0 += 128)  // as down<F>: the second half 64 rows on, rows past dim zeros
    run_block([&] {
      down_tile<F, G>((const __half*)hidden.data(), ffn, ffn / 32, pair_token.data(), pair_weight.data(), 0, TOKENS,
                      planes_of(down, 0), planes_of(down, dim - col0 > 64 ? 64 : 0), down.qp, down.sp, down.ep, col0,
                      dim, out.data(), dim, col0, smem_bytes);
    });
  for (int col0 = 0; col0 < dim; col0 += 128)
    run_block([&] {
      down_tile<F, G>((const __half*)hidden.data(), ffn, ffn / 32, pair_token.data(), pair_weight.data(), 0, TOKENS,
                      planes_of(down, 0), planes_of(down, dim - col0 > 64 ? 64 : 0), down.qp, down.sp, down.ep, col0,
                      dim, sums.data(), dim, col0, smem_bytes);
    });
  FILE* o = fopen(hidden_path, "wb"); fwrite(hidden.data(), 2, hidden.size(), o); fclose(o);
  o = fopen(out_path, "wb"); fwrite(out.data(), 4, out.size(), o); fclose(o);
  o = fopen(sums_path, "wb"); fwrite(sums.data(), 8, sums.size(), o); fclose(o);
}

// argv: format dim ffn inputs.bin hidden.out out.out sums.out
int main(int argc, char** argv) {
  const int format = atoi(argv[1]), dim = atoi(argv[2]), ffn = atoi(argv[3]);
  FILE* f = fopen(argv[4], "rb");
  switch (format) {
    case kRowsQ4_0: run<kRowsQ4_0>(f, dim, ffn, argv[5], argv[6], argv[7]); break;
    case kRowsQ8_0: run<kRowsQ8_0>(f, dim, ffn, argv[5], argv[6], argv[7]); break;
    case kRowsQ4_K: run<kRowsQ4_K>(f, dim, ffn, argv[5], argv[6], argv[7]); break;
    case kRowsQ5_K: run<kRowsQ5_K>(f, dim, ffn, argv[5], argv[6], argv[7]); break;
    case kRowsQ6_K: run<kRowsQ6_K>(f, dim, ffn, argv[5], argv[6], argv[7]); break;
    case kRowsIQ4_XS: run<kRowsIQ4_XS>(f, dim, ffn, argv[5], argv[6], argv[7]); break;
    case kRowsIQ3_XXS: run<kRowsIQ3_XXS>(f, dim, ffn, argv[5], argv[6], argv[7]); break;
    default: return 3;
  }
  fclose(f);
  return 0;
}
"""


@pytest.fixture(scope="module")
def tiles(tmp_path_factory):
    common, iquants, rows = (tensor_core.source_text(name) for name in ("common.cuh", "iquants.cuh", "moe_rows.cu"))
    source = "\n".join([
        _SHIMS, _FORMAT_SHIMS, BYTE_PERM_SHIM, "#include <functional>", _PTX_SHIMS, f"#define TOKENS {_NUM_TOKENS}",
        between(iquants, "// IQ4_XS: byte i of the result", "}  // namespace"),
        between(common, "__device__ __forceinline__ unsigned pack_half2", "// c[0..3] += A"),
        between(common, "[[maybe_unused]] __device__ __forceinline__ unsigned scaled_half2", "// Q4_0 and Q8_0"),
        between(rows, "enum RowsFormat", "__device__ __forceinline__ unsigned shared_address"),
        between(rows, "__device__ __forceinline__ unsigned q4_low_pair", "// 0x64006400 in a register"),
        between(rows, "// A fragments of block b", "// The X copies of a thread"),
        between(rows, "// The X copies of a thread", "// Gate and up of one expert tile"),
        _MAIN]).replace("[[maybe_unused]] ", "")
    folder = tmp_path_factory.mktemp("moe_rows_tiles_host")
    build(folder, "tiles", source)
    return folder


# per format (dim, ffn): Q4_0 and Q8_0 a down block whose second half is past dim; the K-quants' and I-quants'
# gate/up rows 2 super-blocks, down's 1. Every plane a pitch wider than its rows: the one-d-a-super-block formats'
# scales by one half, so a row's d of a super-block is at an odd or an even half of the plane by its row (gate/up, 3 a
# row) or by its super-block (down); IQ4_XS's extra by 2 bytes, so a row's 6 scale bytes start at byte 0 or 2 of a word
_LONE_D = ("Q6_K", "IQ4_XS", "IQ3_XXS")
_SHAPES = {"Q4_0": (192, 128), "Q8_0": (192, 128),
           **{fmt: (512, 256) for fmt in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS")}}
_MAGNITUDES = {"Q8_0": 1.0 / 128, "Q4_K": 1.0 / 256, "Q5_K": 1.0 / 512, "Q6_K": 1.0 / 1024, "IQ4_XS": 1.0 / 1024,
               "IQ3_XXS": 1.0 / 128}
# cuda/moe_rows.cu's RowsFormat
_FORMAT_CODES = {"Q4_0": 0, "Q8_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "IQ4_XS": 5, "IQ3_XXS": 6}


def _write_planes(f, raw: np.ndarray, fmt: str):
    packed = pack(raw, fmt)
    planes = [np.pad(np.ascontiguousarray(getattr(packed, p)), ((0, 0), (0, wider)))
              for p, wider in (("quants", 4), ("scales", 1 if fmt in _LONE_D else 2),
                               ("extra", 2 if fmt == "IQ4_XS" else 4))]
    if fmt not in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
        planes[2] = np.zeros((raw.shape[0], 0), np.uint8)
    f.write(np.array([plane.shape[1] for plane in planes], np.int32).tobytes())  # the pitches
    for plane in planes:
        f.write(plane.tobytes())


@pytest.mark.parametrize("fmt", moe_rows.BUILT_FORMATS)
def test_a_tile_of_gate_up_and_down_matches_w_times_x(tiles, fmt):
    dim, ffn = _SHAPES[fmt]
    rng = np.random.default_rng(32)
    raws = [random_gguf_bytes(fmt, rows, cols, rng, _MAGNITUDES.get(fmt)) for rows, cols in
            ((ffn, dim), (ffn, dim), (dim, ffn))]
    x = rng.standard_normal((_NUM_TOKENS, dim)).astype(np.float32)
    with open(tiles / "inputs.bin", "wb") as f:
        for raw in raws:
            _write_planes(f, raw, fmt)
        f.write(host(moe_rows.stage_x(dev(x))).tobytes())
    outputs = [str(tiles / name) for name in ("hidden.out", "out.out", "sums.out")]
    subprocess.run([str(tiles / "tiles"), str(_FORMAT_CODES[fmt]), str(dim), str(ffn), str(tiles / "inputs.bin"),
                    *outputs], check=True, timeout=120)
    gate, up, down = (reference_dequant(raw, fmt).astype(np.float16).astype(np.float64) for raw in raws)
    x16 = x.astype(np.float16).astype(np.float64)
    g, u = x16 @ gate.T, x16 @ up.T  # [T, F]
    stored = np.fromfile(tiles / "hidden.out", np.float16).reshape(_NUM_TOKENS, ffn)
    hidden = stored.reshape(_NUM_TOKENS, -1, 4)[:, :, [0, 2, 1, 3]].reshape(_NUM_TOKENS, ffn)  # stage_x's order undone
    assert_close_to_scale(hidden, g / (1 + np.exp(-g)) * u, 2e-3)
    out = np.fromfile(tiles / "out.out", np.float32).reshape(_NUM_TOKENS, dim)
    assert_close_to_scale(out, hidden.astype(np.float64) @ down.T, 1e-4)  # from the tile's own f16 hidden
    sums = np.fromfile(tiles / "sums.out", np.int64).reshape(_NUM_TOKENS, dim)  # the fixed-point epilogue's
    np.testing.assert_allclose(sums / 2.0**32, out, rtol=1e-6, atol=2e-9)
