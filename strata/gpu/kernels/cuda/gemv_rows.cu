// Warp-level dot products of packed quantized rows with activations, for the decode GEMVs
// (gemv_native.py). One warp computes whole rows: its lanes take the row's 16-byte quant chunks
// (`items`) in turn, load every chunk of the call before any arithmetic (the loads are what the
// HBM has to keep in flight), multiply in registers with the block scale factored out, and meet
// in warp shuffles; every lane gets the totals.
//
// Activations come from shared memory as float32 (16-byte aligned), each group of 32 elements
// followed by 4 floats of padding (XSTRIDE = 36): lanes reading neighbouring 32-element groups with
// 16-byte loads then start on different banks (Q4_0, Q8_0, F32, F16; Q4_K's lanes read two
// 16-element halves of sub-block pairs and still meet 2-way conflicts).
//
// Items per format (a row of K elements):
//   Q4_0  one 18-byte block per item (16 quant bytes, d): byte j holds element j (low nibble)
//         and element j + 16 (high); K / 32 items
//   Q8_0  half a 34-byte block per item: 16 int8 elements, the block's d; K / 16 items
//   Q4_K  16 of a super-block's 128 quant bytes per item: bytes 32c + 16h .. +15 hold elements
//         16h .. 16h+15 of sub-blocks 2c (low nibbles) and 2c + 1 (high); K / 32 items
//   F32 / F16  4 / 8 values per item (the routers); K / 4 or K / 8 items
// Small integers become floats through the exponent trick (0x4B000000 | q is 2^23 + q), as in
// quant_device.py.
#include <cuda_fp16.h>
typedef unsigned int u32;  // NVRTC has no <stdint.h>
typedef unsigned char u8;

namespace {

constexpr int XSTRIDE = 36;
constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ uint4 load_stream(const u32* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float byte_as_float(u32 word, int k, float bias) {
  // byte k of `word` in the mantissa of 2^23, minus bias (2^23 + offset)
  return __int_as_float(__byte_perm(word, 0x4B000000u, 0x7540u | k)) - bias;
}

__device__ __forceinline__ float4 load_x4(const float* xs, int index) {
  return *reinterpret_cast<const float4*>(xs + index);
}

__device__ __forceinline__ float dot4_bytes(u32 word, float4 x, float bias) {
  float s = byte_as_float(word, 0, bias) * x.x;
  s = fmaf(byte_as_float(word, 1, bias), x.y, s);
  s = fmaf(byte_as_float(word, 2, bias), x.z, s);
  return fmaf(byte_as_float(word, 3, bias), x.w, s);
}

__device__ __forceinline__ float sum4(float4 x) { return (x.x + x.y) + (x.z + x.w); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
  return v;
}

// One item: its 16 quant bytes and the scales it needs (d: Q4_0 / Q8_0; Q4_K: dl, ml and dh, mh,
// d * scale and dmin * min of the sub-blocks in its low and high nibbles).
struct Item {
  uint4 q;
  float d;
  float dl, ml, dh, mh;
};

struct RowPlanes {
  const u32* quants;
  const __half* scales;
  const u8* extra;
};

// ---- Q4_0 ----
struct Q40 {
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 4 * i);
    it.d = __half2float(r.scales[i]);
    return it;
  }
  __device__ static float dot(const Item& it, const float* xs, int i) {
    const float* x = xs + i * XSTRIDE;
    const u32 w[4] = {it.q.x, it.q.y, it.q.z, it.q.w};
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s += dot4_bytes(w[j] & 0x0F0F0F0Fu, load_x4(x, 4 * j), 8388616.f);
      s += dot4_bytes((w[j] >> 4) & 0x0F0F0F0Fu, load_x4(x, 16 + 4 * j), 8388616.f);
    }
    return it.d * s;
  }
};

// ---- Q8_0 ----
struct Q80 {
  __device__ static int items(int num_cols) { return num_cols / 16; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 4 * i);
    it.d = __half2float(r.scales[i >> 1]);
    return it;
  }
  __device__ static float dot(const Item& it, const float* xs, int i) {
    const float* x = xs + (i >> 1) * XSTRIDE + (i & 1) * 16;
    const u32 w[4] = {it.q.x, it.q.y, it.q.z, it.q.w};
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) s += dot4_bytes(w[j] ^ 0x80808080u, load_x4(x, 4 * j), 8388736.f);
    return it.d * s;
  }
};

// ---- F32, F16: 4 or 8 values per item ----
struct F32 {
  __device__ static int items(int num_cols) { return num_cols / 4; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 4 * i);
    return it;
  }
  __device__ static float dot(const Item& it, const float* xs, int i) {
    const float4 x = load_x4(xs, (i >> 3) * XSTRIDE + (i & 7) * 4);
    return fmaf(__uint_as_float(it.q.w), x.w,
                fmaf(__uint_as_float(it.q.z), x.z, fmaf(__uint_as_float(it.q.y), x.y, __uint_as_float(it.q.x) * x.x)));
  }
};

struct F16 {
  __device__ static int items(int num_cols) { return num_cols / 8; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 4 * i);
    return it;
  }
  __device__ static float dot2(u32 word, float a, float b) {
    const float2 w = __half22float2(*reinterpret_cast<const __half2*>(&word));
    return fmaf(w.y, b, w.x * a);
  }
  __device__ static float dot(const Item& it, const float* xs, int i) {
    const float* x = xs + (i >> 2) * XSTRIDE + (i & 3) * 8;
    const float4 a = load_x4(x, 0), b = load_x4(x, 4);
    return (dot2(it.q.x, a.x, a.y) + dot2(it.q.y, a.z, a.w)) + (dot2(it.q.z, b.x, b.y) + dot2(it.q.w, b.z, b.w));
  }
};

// ---- Q4_K ----
__device__ __forceinline__ void q4_k_scale_min(const u8* q, int j, float& sc, float& mn) {
  if (j < 4) {
    sc = float(q[j] & 63);
    mn = float(q[j + 4] & 63);
  } else {
    sc = float((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    mn = float((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

struct Q4K {
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    const int sb = i >> 3, c = (i >> 1) & 3;
    it.q = load_stream(r.quants + 4 * i);
    const float d = __half2float(r.scales[2 * sb]), dmin = __half2float(r.scales[2 * sb + 1]);
    float sc, mn;
    q4_k_scale_min(r.extra + 12 * sb, 2 * c, sc, mn);
    it.dl = d * sc;
    it.ml = dmin * mn;
    q4_k_scale_min(r.extra + 12 * sb, 2 * c + 1, sc, mn);
    it.dh = d * sc;
    it.mh = dmin * mn;
    return it;
  }
  __device__ static float dot(const Item& it, const float* xs, int i) {
    // item i: super-block i / 8, chunk c = (i / 2) % 4, half h = i % 2; sub-block 2c is x group 8sb + 2c
    const int sb = i >> 3, c = (i >> 1) & 3, h = i & 1;
    const float* xl = xs + (8 * sb + 2 * c) * XSTRIDE + 16 * h;
    const float* xh = xl + XSTRIDE;
    const u32 w[4] = {it.q.x, it.q.y, it.q.z, it.q.w};
    float sl = 0.f, sh = 0.f, xsum_l = 0.f, xsum_h = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 a = load_x4(xl, 4 * j), b = load_x4(xh, 4 * j);
      sl += dot4_bytes(w[j] & 0x0F0F0F0Fu, a, 8388608.f);
      sh += dot4_bytes((w[j] >> 4) & 0x0F0F0F0Fu, b, 8388608.f);
      xsum_l += sum4(a);
      xsum_h += sum4(b);
    }
    return (it.dl * sl - it.ml * xsum_l) + (it.dh * sh - it.mh * xsum_h);
  }
};

// R rows of one or two matrices, all items of each, against the same activations xs.
template <class F, int R, int UNROLL>
__device__ __forceinline__ void rows_dot(float* out, const RowPlanes (&rows)[R], int num_rows, const float* xs,
                                         int num_cols) {
  const int lane = threadIdx.x & 31;
  const int num_items = F::items(num_cols);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int i0 = lane; i0 < num_items; i0 += 32 * UNROLL) {
    Item it[UNROLL][R];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r < num_rows && i0 + 32 * u < num_items) it[u][r] = F::load(rows[r], i0 + 32 * u);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r < num_rows && i0 + 32 * u < num_items) acc[r] += F::dot(it[u][r], xs, i0 + 32 * u);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[r] = warp_sum(acc[r]);
}

__device__ __forceinline__ RowPlanes row_planes(const u32* quants, const __half* scales, const u8* extra,
                                                long long row, int words_per_row, int halves_per_row,
                                                int extra_per_row) {
  return RowPlanes{quants + row * words_per_row, scales + row * halves_per_row, extra + row * extra_per_row};
}

// Output row n of the routed experts' down projection: sum_e weight[e] * W[slot[e] * dim + n] . x_e,
// the items of all experts dealt to the lanes in turn. x_e = xs + e * x_stride.
template <class F, int UNROLL>
__device__ __forceinline__ float down_row(const u32* quants, const __half* scales, const u8* extra,
                                          const int* slots, const float* weights, int top_k, int num_slots,
                                          long long n, int dim, int words_per_row, int halves_per_row,
                                          int extra_per_row, const float* xs, int x_stride, int num_cols) {
  const int lane = threadIdx.x & 31;
  const int per_row = F::items(num_cols), num_items = top_k * per_row;
  float acc = 0.f;
  int e = lane / per_row, i = lane % per_row;  // the item lane + 32 u of the flattened list
  for (int i0 = lane; i0 < num_items; i0 += 32 * UNROLL) {
    Item it[UNROLL];
    int ee[UNROLL], ii[UNROLL];
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      ee[u] = e;
      ii[u] = i;
      const int slot = e < top_k ? slots[e] : -1;
      ok[u] = i0 + 32 * u < num_items && slot >= 0 && slot < num_slots;
      if (ok[u])
        it[u] = F::load(row_planes(quants, scales, extra, (long long)slot * dim + n, words_per_row, halves_per_row,
                                   extra_per_row), i);
      for (i += 32; i >= per_row; i -= per_row) ++e;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (ok[u]) acc += weights[ee[u]] * F::dot(it[u], xs + ee[u] * x_stride, ii[u]);
  }
  return warp_sum(acc);
}

}  // namespace

#define STRATA_GEMV_ROWS(NAME, F, R, UNROLL)                                                                         \
  extern "C" __device__ void NAME(float* out, const u32* quants, const __half* scales, const u8* extra,              \
                                  long long row0, int num_rows, int words_per_row, int halves_per_row,               \
                                  int extra_per_row, const float* xs, int num_cols) {                                \
    RowPlanes rows[R];                                                                                               \
    for (int r = 0; r < R; ++r)                                                                                      \
      rows[r] = row_planes(quants, scales, extra, row0 + r, words_per_row, halves_per_row, extra_per_row);           \
    rows_dot<F, R, UNROLL>(out, rows, num_rows, xs, num_cols);                                                       \
  }

#define STRATA_GEMV_PAIR(NAME, F)                                                                                    \
  extern "C" __device__ void NAME(float* out, const u32* qa, const __half* sa, const u8* ea,                         \
                                  const u32* qb, const __half* sb, const u8* eb, long long row,                      \
                                  int words_per_row, int halves_per_row, int extra_per_row, const float* xs,         \
                                  int num_cols) {                                                                    \
    const RowPlanes rows[2] = {row_planes(qa, sa, ea, row, words_per_row, halves_per_row, extra_per_row),            \
                               row_planes(qb, sb, eb, row, words_per_row, halves_per_row, extra_per_row)};           \
    rows_dot<F, 2, 2>(out, rows, 2, xs, num_cols);                                                                   \
  }

#define STRATA_DOWN_ROW(NAME, F)                                                                                     \
  extern "C" __device__ void NAME(float* out, const u32* quants, const __half* scales, const u8* extra,              \
                                  const int* slots, const float* weights, int top_k, int num_slots, long long n,     \
                                  int dim, int words_per_row, int halves_per_row, int extra_per_row,                 \
                                  const float* xs, int x_stride, int num_cols) {                                     \
    out[0] = down_row<F, 4>(quants, scales, extra, slots, weights, top_k, num_slots, n, dim, words_per_row,          \
                            halves_per_row, extra_per_row, xs, x_stride, num_cols);                                  \
  }

STRATA_GEMV_ROWS(strata_gemv_rows_q4_0_r1, Q40, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q4_0_r2, Q40, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q4_0_r4, Q40, 4, 1)
STRATA_GEMV_ROWS(strata_gemv_rows_q8_0_r1, Q80, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q8_0_r2, Q80, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q8_0_r4, Q80, 4, 1)
STRATA_GEMV_ROWS(strata_gemv_rows_q4_k_r1, Q4K, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q4_k_r2, Q4K, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q4_k_r4, Q4K, 4, 1)
// float rows have 4-8x the items of a quantized row: more of them in flight per iteration
STRATA_GEMV_ROWS(strata_gemv_rows_f32_r1, F32, 1, 4)
STRATA_GEMV_ROWS(strata_gemv_rows_f32_r2, F32, 2, 4)
STRATA_GEMV_ROWS(strata_gemv_rows_f32_r4, F32, 4, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_f16_r1, F16, 1, 4)
STRATA_GEMV_ROWS(strata_gemv_rows_f16_r2, F16, 2, 4)
STRATA_GEMV_ROWS(strata_gemv_rows_f16_r4, F16, 4, 2)
STRATA_GEMV_PAIR(strata_gemv_pair_q4_0, Q40)
STRATA_GEMV_PAIR(strata_gemv_pair_q8_0, Q80)
STRATA_GEMV_PAIR(strata_gemv_pair_q4_k, Q4K)
STRATA_DOWN_ROW(strata_down_row_q4_0, Q40)
STRATA_DOWN_ROW(strata_down_row_q8_0, Q80)
STRATA_DOWN_ROW(strata_down_row_q4_k, Q4K)
