// Warp-level dot products of packed quantized rows with activations, for the decode GEMVs
// (gemv_native.py). One warp computes whole rows: its lanes take the row's 16-byte quant chunks
// (`items`) in turn, load every chunk of the call before any arithmetic (the loads are what the
// HBM has to keep in flight), multiply in registers with the block scale factored out, and meet
// in warp shuffles; every lane gets the totals. A warp of R rows loads each activation vector once
// for all R (the same item of every row meets the same activations), so that shared memory, not
// the HBM, stops being the limit: a 4-bit item is 16 bytes of weights against 128 of activations.
//
// Activations come from shared memory as float32 (16-byte aligned), each group of 32 elements
// followed by 4 floats of padding (XSTRIDE = 36): lanes reading neighbouring 32-element groups with
// 16-byte loads then start on different banks (Q4_0, Q8_0, F32, F16; Q4_K's lanes read two
// 16-element halves of sub-block pairs and still meet 2-way conflicts). They are read with
// ld.shared from the 32-bit shared address: through the generic pointer the kernels pass, every
// load would first test which memory it points to.
//
// Items per format (a row of K elements):
//   Q4_0  one 18-byte block per item (16 quant bytes, d): byte j holds element j (low nibble)
//         and element j + 16 (high); K / 32 items
//   Q8_0  half a 34-byte block per item: 16 int8 elements, the block's d; K / 16 items
//   Q4_K  16 of a super-block's 128 quant bytes per item: bytes 32c + 16h .. +15 hold elements
//         16h .. 16h+15 of sub-blocks 2c (low nibbles) and 2c + 1 (high); K / 32 items. The
//         super-block's d and dmin are read as one word and its 12 scale bytes as three. gemv's
//         loop takes 32 bytes an item (Q4KWide: both halves, K / 64 items) from its own layout.
//   Q5_K  Q4_K's items, each with the 16 bytes of qh that hold its quants' fifth bits; K / 32 items
//   Q6_K  16 of a super-block's 128 ql bytes per item (two 16-element runs of two groups), with the 16 bytes
//         of qh that hold their top two bits, d and the runs' two int8 scales; K / 32 items
//   IQ4_XS  a 32-element sub-block per item, its 16 quant bytes laid out as Q4_0's block; each nibble picks an int8
//         level (iquants.cuh), its scale d * (ls - 32) from the super-block's d and 6 scale bytes; K / 32 items
//   IQ3_XXS  a 32-element sub-block per item: its 8 grid indices (8 bytes, each 4 elements' magnitudes) and its
//         sign-and-scale word, its scale d * (0.5 + ls) * 0.5; K / 32 items
//   IQ3_S  a 32-element sub-block per item: its 8 grid indices' low bytes, their ninth bits, its 32 sign bits, its
//         scale d * (1 + 2 ls); K / 32 items
//   IQ2_S  a 32-element sub-block per item: its 4 octets' grid indices (8 + 2 bits), 32 sign bits and two scales
//         d * (0.5 + ls) * 0.25, one a 16 elements; K / 32 items
//   F32 / F16  4 / 8 values per item (the routers); K / 4 or K / 8 items
// Small integers become floats through the exponent trick (0x4B000000 | q is 2^23 + q), as in
// quant_device.py.
#include <cuda_fp16.h>

#include "iquants.cuh"
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

__device__ __forceinline__ u32 shared_address(const float* xs) {
  return static_cast<u32>(__cvta_generic_to_shared(xs));
}

// 4 floats at float index `index` of the shared activations at shared address xs. volatile: a load the
// compiler deems free of effects may be speculated out of its branch, past the end of the activations.
__device__ __forceinline__ float4 load_x4(u32 xs, int index) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(xs + 4 * index));
  return v;
}

__device__ __forceinline__ float load_x1(u32 xs, int index) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(xs + 4 * index));
  return v;
}

__device__ __forceinline__ float half_at(const __half* p) {
  return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p))));
}

__device__ __forceinline__ float sum4(float4 x) { return (x.x + x.y) + (x.z + x.w); }

// The 4 small integers of `word`'s bytes as floats (byte_as_float), converted once for every activation row.
__device__ __forceinline__ float4 bytes_as_float4(u32 word, float bias) {
  return make_float4(byte_as_float(word, 0, bias), byte_as_float(word, 1, bias), byte_as_float(word, 2, bias),
                     byte_as_float(word, 3, bias));
}

// s plus the weights' 4 products with x, added to it in this order (the quantized formats' rows share it).
__device__ __forceinline__ float dot4(float4 w, float4 x, float s) {
  s = fmaf(w.x, x.x, s);
  s = fmaf(w.y, x.y, s);
  s = fmaf(w.z, x.z, s);
  return fmaf(w.w, x.w, s);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
  return v;
}

__device__ __forceinline__ u32 word_of(const uint4& q, int j) {
  return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;
}

// One item: its 16 quant bytes and the scales it needs (d: Q4_0 / Q8_0; the K-quants: dl, ml and dh, mh,
// d * scale and dmin * min of the runs in its low and high nibbles, Q6_K without mins).
struct Item {
  uint4 q, q2;  // q2: the second 16 bytes of a wide Q4_K item, the qh bytes of a Q5_K or Q6_K item
  float d;
  float dl, ml, dh, mh;
};

struct RowPlanes {
  const u32* quants;
  const __half* scales;
  const u8* extra;
};

// Each format: items(K); load(row, i), the item i of a row; dot<R, NX>(it, xs, x_stride, i, acc),
// acc[t][r] += the product of it[r] (item i of R rows) with activation row t (xs + t * x_stride floats),
// each activation read once for all R and each weight converted to float once for all NX. The sum of
// (t, r) is the same chain of operations whatever R and NX are.

// ---- Q4_0 ----
// Items of 32 elements laid out as Q4_0's block (Q4_0, IQ4_XS): byte k of quant word j holds element 4j + k in its
// low nibble and 16 + 4j + k in its high; F::weights(nibbles) converts 4 nibbles (a byte each) to their weights,
// and the item adds d * (its weights . x).
template <class F, int R, int NX>
__device__ __forceinline__ void nibble_items_dot(const Item (&it)[R], u32 xs, int x_stride, int i,
                                                 float (&acc)[NX][R]) {
  float s[NX][R];
#pragma unroll
  for (int t = 0; t < NX; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) s[t][r] = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float4 wl[R], wh[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const u32 w = word_of(it[r].q, j);
      wl[r] = F::weights(w & 0x0F0F0F0Fu);
      wh[r] = F::weights((w >> 4) & 0x0F0F0F0Fu);
    }
#pragma unroll
    for (int t = 0; t < NX; ++t) {
      const u32 x = xs + 4 * (t * x_stride + i * XSTRIDE);
      const float4 lo = load_x4(x, 4 * j), hi = load_x4(x, 16 + 4 * j);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        s[t][r] = dot4(wl[r], lo, s[t][r]);
        s[t][r] = dot4(wh[r], hi, s[t][r]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NX; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] += it[r].d * s[t][r];
}

struct Q40 {
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 4 * i);
    it.d = half_at(r.scales + i);
    return it;
  }
  // a nibble's weight q - 8 (2^23 + 8 is the bias)
  __device__ static float4 weights(u32 nibbles) { return bytes_as_float4(nibbles, 8388616.f); }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    nibble_items_dot<Q40, R, NX>(it, xs, x_stride, i, acc);
  }
};

// ---- Q8_0 ----
struct Q80 {
  __device__ static int items(int num_cols) { return num_cols / 16; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 4 * i);
    it.d = half_at(r.scales + (i >> 1));
    return it;
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    float s[NX][R];
#pragma unroll
    for (int t = 0; t < NX; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) s[t][r] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float4 w[R];
#pragma unroll
      for (int r = 0; r < R; ++r) w[r] = bytes_as_float4(word_of(it[r].q, j) ^ 0x80808080u, 8388736.f);
#pragma unroll
      for (int t = 0; t < NX; ++t) {
        const float4 v = load_x4(xs + 4 * (t * x_stride + (i >> 1) * XSTRIDE + (i & 1) * 16), 4 * j);
#pragma unroll
        for (int r = 0; r < R; ++r) s[t][r] = dot4(w[r], v, s[t][r]);
      }
    }
#pragma unroll
    for (int t = 0; t < NX; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[t][r] += it[r].d * s[t][r];
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
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
#pragma unroll
    for (int t = 0; t < NX; ++t) {
      const float4 x = load_x4(xs, t * x_stride + (i >> 3) * XSTRIDE + (i & 7) * 4);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint4& q = it[r].q;
        acc[t][r] += fmaf(__uint_as_float(q.w), x.w, fmaf(__uint_as_float(q.z), x.z,
                                                          fmaf(__uint_as_float(q.y), x.y, __uint_as_float(q.x) * x.x)));
      }
    }
  }
};

struct F16 {
  __device__ static int items(int num_cols) { return num_cols / 8; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 4 * i);
    return it;
  }
  __device__ static float2 halves(u32 word) { return __half22float2(*reinterpret_cast<const __half2*>(&word)); }
  __device__ static float dot2(float2 w, float a, float b) { return fmaf(w.y, b, w.x * a); }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    float2 w[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      w[r][0] = halves(it[r].q.x);
      w[r][1] = halves(it[r].q.y);
      w[r][2] = halves(it[r].q.z);
      w[r][3] = halves(it[r].q.w);
    }
#pragma unroll
    for (int t = 0; t < NX; ++t) {
      const int x = t * x_stride + (i >> 2) * XSTRIDE + (i & 3) * 8;
      const float4 a = load_x4(xs, x), b = load_x4(xs, x + 4);
#pragma unroll
      for (int r = 0; r < R; ++r)
        acc[t][r] += (dot2(w[r][0], a.x, a.y) + dot2(w[r][1], a.z, a.w)) +
                     (dot2(w[r][2], b.x, b.y) + dot2(w[r][3], b.z, b.w));
    }
  }
};

// ---- Q4_K ----
// The 6-bit scales and mins of sub-blocks 2c and 2c + 1 from the super-block's 12 scale bytes, held as
// words e0 (bytes 0-3), e1 (4-7), e2 (8-11). Sub-block j < 4: scale byte j & 63, min byte j + 4 & 63;
// j >= 4: scale (byte j + 4 & 15) | (byte j - 4 >> 6) << 4, min (byte j + 4 >> 4) | (byte j >> 6) << 4.
__device__ __forceinline__ void q4_k_scales_mins(u32 e0, u32 e1, u32 e2, int c, float (&sc)[2], float (&mn)[2]) {
  // both sub-blocks at once, a byte each: bytes 2c % 4 and the next of each word, moved to bytes 0 and 1
  const bool is_low = c < 2;
  const int shift = 16 * (c & 1);
  const u32 mask = is_low ? 0x3F3Fu : 0x0F0Fu;
  const u32 top = is_low ? 0u : 0x3030u;  // j >= 4: bits 6-7 of bytes j - 4 (scale) and j (min), as bits 4-5
  const u32 sc2 = (((is_low ? e0 : e2) >> shift) & mask) | (((e0 >> shift) >> 2) & top);
  const u32 mn2 = (((is_low ? e1 : e2 >> 4) >> shift) & mask) | (((e1 >> shift) >> 2) & top);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    sc[k] = byte_as_float(sc2, k, 8388608.f);
    mn[k] = byte_as_float(mn2, k, 8388608.f);
  }
}

// The scales of an item's sub-blocks 2c and 2c + 1 of super-block sb: d * scale and dmin * min of each.
__device__ __forceinline__ void q4_k_item_scales(const RowPlanes& r, int sb, int c, Item& it) {
  // d and dmin: halves 2sb and 2sb + 1, one word (a row has 2 halves a super-block); 12 scale bytes a super-block
  const u32 dm_word = __ldg(reinterpret_cast<const u32*>(r.scales) + sb);
  const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(&dm_word));
  const u32* e = reinterpret_cast<const u32*>(r.extra) + 3 * sb;
  float sc[2], mn[2];
  q4_k_scales_mins(__ldg(e), __ldg(e + 1), __ldg(e + 2), c, sc, mn);
  it.dl = dm.x * sc[0];
  it.ml = dm.y * mn[0];
  it.dh = dm.x * sc[1];
  it.mh = dm.y * mn[1];
}

// ---- K-quant items: two 16-element runs of a super-block, each with its scale (Q4_K, Q5_K: and min) ----
// The sums of an item's two runs with the activations from floats xl and xh (activation row t's t * x_stride
// further on): sl, sh of the quants less the bias's offset (lo[r][j], hi[r][j]: word j's 4 quants of each run of
// row r, a byte each) times x; xsum_l, xsum_h of x, for the mins (unread by Q6_K, which has none).
template <int R, int NX>
__device__ __forceinline__ void k_runs_dot(const u32 (&lo)[R][4], const u32 (&hi)[R][4], float bias, u32 xs,
                                           int x_stride, int xl, int xh, float (&sl)[NX][R], float (&sh)[NX][R],
                                           float (&xsum_l)[NX], float (&xsum_h)[NX]) {
#pragma unroll
  for (int t = 0; t < NX; ++t) {
    xsum_l[t] = xsum_h[t] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) sl[t][r] = sh[t][r] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float4 wl[R], wh[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      wl[r] = bytes_as_float4(lo[r][j], bias);
      wh[r] = bytes_as_float4(hi[r][j], bias);
    }
#pragma unroll
    for (int t = 0; t < NX; ++t) {
      const float4 a = load_x4(xs, t * x_stride + xl + 4 * j), b = load_x4(xs, t * x_stride + xh + 4 * j);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        sl[t][r] = dot4(wl[r], a, sl[t][r]);
        sh[t][r] = dot4(wh[r], b, sh[t][r]);
      }
      xsum_l[t] += sum4(a);
      xsum_h[t] += sum4(b);
    }
  }
}

// Q4_K and Q5_K item i (super-block i / 8, chunk c = (i / 2) % 4, half h = i % 2: elements 16h .. 16h + 15 of
// sub-blocks 2c and 2c + 1, x groups 8sb + 2c and the next) of quants lo, hi: d * scale * q - dmin * min of each run.
template <int R, int NX>
__device__ __forceinline__ void k_min_runs_dot(const Item (&it)[R], const u32 (&lo)[R][4], const u32 (&hi)[R][4],
                                               u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
  const int xl = (8 * (i >> 3) + 2 * ((i >> 1) & 3)) * XSTRIDE + 16 * (i & 1);
  float sl[NX][R], sh[NX][R], xsum_l[NX], xsum_h[NX];
  k_runs_dot<R, NX>(lo, hi, 8388608.f, xs, x_stride, xl, xl + XSTRIDE, sl, sh, xsum_l, xsum_h);
#pragma unroll
  for (int t = 0; t < NX; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r)
      acc[t][r] += (it[r].dl * sl[t][r] - it[r].ml * xsum_l[t]) + (it[r].dh * sh[t][r] - it[r].mh * xsum_h[t]);
}

struct Q4K {
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 4 * i);
    q4_k_item_scales(r, i >> 3, (i >> 1) & 3, it);
    return it;
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    u32 lo[R][4], hi[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 w = word_of(it[r].q, j);
        lo[r][j] = w & 0x0F0F0F0Fu;
        hi[r][j] = (w >> 4) & 0x0F0F0F0Fu;
      }
    k_min_runs_dot<R, NX>(it, lo, hi, xs, x_stride, i, acc);
  }
};

// ---- Q5_K: Q4_K's items, scales and x, each quant's fifth bit from the super-block's qh ----
// A super-block's quants are qh[32] then qs[128] (40 words): item i's nibbles are qs bytes 32c + 16h .. (q), their
// fifth bits bits 2c and 2c + 1 of qh bytes 16h .. 16h + 15 (q2, the same 16 bytes for the 4 items of a half).
struct Q5K {
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    const u32* block = r.quants + 40 * (i >> 3);
    it.q = load_stream(block + 8 + 4 * (i & 7));
    it.q2 = load_stream(block + 4 * (i & 1));
    q4_k_item_scales(r, i >> 3, (i >> 1) & 3, it);
    return it;
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    const int c2 = 2 * ((i >> 1) & 3);  // the bit of sub-block 2c (2c + 1: the next) in each qh byte
    u32 lo[R][4], hi[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 w = word_of(it[r].q, j), b = word_of(it[r].q2, j) >> c2;
        lo[r][j] = (w & 0x0F0F0F0Fu) | (b & 0x01010101u) << 4;
        hi[r][j] = ((w >> 4) & 0x0F0F0F0Fu) | (b & 0x02020202u) << 3;
      }
    k_min_runs_dot<R, NX>(it, lo, hi, xs, x_stride, i, acc);
  }
};

// ---- Q6_K: d * scale * (q - 32), a scale per 16 elements ----
// A super-block's quants are ql[128] then qh[64] (48 words). Item i is ql bytes 16k .. 16k + 15 (k = i % 8; q):
// with half h = k / 4 and s = k / 2 % 2, their low nibbles are elements 16 (k % 2) .. of group 4h + s, the high
// nibbles those of group 4h + 2 + s; each quant's top two bits are bits 2s (low) and 2s + 4 (high) of qh bytes
// 32h + 16 (k % 2) .. (q2, shared by 4 items). The runs' scales are the int8 scales 8h + k % 4 and 8h + 4 + k % 4.
struct Q6K {
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    const int sb = i >> 3, k = i & 7;
    const u32* block = r.quants + 48 * sb;
    it.q = load_stream(block + 4 * k);
    it.q2 = load_stream(block + 32 + 8 * (k >> 2) + 4 * (k & 1));
    const float d = half_at(r.scales + sb);
    const signed char* sc = reinterpret_cast<const signed char*>(r.extra) + 16 * sb + 8 * (k >> 2) + (k & 3);
    it.dl = d * static_cast<float>(__ldg(sc));
    it.dh = d * static_cast<float>(__ldg(sc + 4));
    return it;
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    const int sb = i >> 3, k = i & 7, s = (k >> 1) & 1;
    const int xl = (8 * sb + 4 * (k >> 2) + s) * XSTRIDE + 16 * (k & 1);
    u32 lo[R][4], hi[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 w = word_of(it[r].q, j), b = word_of(it[r].q2, j) >> (2 * s);
        lo[r][j] = (w & 0x0F0F0F0Fu) | (b & 0x03030303u) << 4;
        hi[r][j] = ((w >> 4) & 0x0F0F0F0Fu) | (b & 0x30303030u);
      }
    float sl[NX][R], sh[NX][R], xsum_l[NX], xsum_h[NX];
    k_runs_dot<R, NX>(lo, hi, 8388640.f, xs, x_stride, xl, xl + 2 * XSTRIDE, sl, sh, xsum_l, xsum_h);  // q - 32
#pragma unroll
    for (int t = 0; t < NX; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[t][r] += it[r].dl * sl[t][r] + it[r].dh * sh[t][r];
  }
};

// ---- IQ4_XS: d * (ls - 32) * level, a scale per 32-element sub-block ----
// A super-block's quants are qs[128] (32 words): item i is words 4i .. (sub-block j = i % 8 of super-block i / 8);
// its d is half i / 8 of the scale plane, its scale bytes (scales_h[2], then scales_l[4]) bytes 6 (i / 8) .. of the
// extra plane: ls is nibble j % 2 of scales_l byte j / 2, above it bits 2 (j % 4) of scales_h byte j / 4.
struct IQ4XS {
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    const int sb = i >> 3, j = i & 7;
    it.q = load_stream(r.quants + 4 * i);
    const u8* e = r.extra + 6 * sb;
    const u32 low = (__ldg(e + 2 + (j >> 1)) >> (4 * (j & 1))) & 0xFu;
    const u32 high = (__ldg(e + (j >> 2)) >> (2 * (j & 3))) & 3u;
    const u32 ls = low | high << 4;
    it.d = half_at(r.scales + sb) * static_cast<float>(static_cast<int>(ls) - 32);
    return it;
  }
  // a nibble's int8 level, offset to an unsigned byte as Q8_0's quants
  __device__ static float4 weights(u32 nibbles) {
    return bytes_as_float4(iq4_levels(nibbles) ^ 0x80808080u, 8388736.f);
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    nibble_items_dot<IQ4XS, R, NX>(it, xs, x_stride, i, acc);
  }
};

// ---- The grid I-quants (IQ3_XXS, IQ3_S, IQ2_S): an item is a 32-element sub-block of 8 quads, each 4 magnitudes a
// grid entry gives and 4 sign bits. F::quad(it, l): quad l's weights (elements 4l .. 4l + 3) before the scale;
// F::kTwoScales: quads 0 .. 3 take it.dl and 4 .. 7 it.dh (IQ2_S), else all take it.d. ----

// 4 magnitudes (a byte each, first element lowest) as floats, negated where bit i of `signs` is set
__device__ __forceinline__ float4 signed_bytes(u32 magnitudes, u32 signs) {
  const float4 m = bytes_as_float4(magnitudes, 8388608.f);
  return make_float4(signs & 1u ? -m.x : m.x, signs & 2u ? -m.y : m.y, signs & 4u ? -m.z : m.z,
                     signs & 8u ? -m.w : m.w);
}

template <class F, int R, int NX>
__device__ __forceinline__ void grid_quads_dot(const Item (&it)[R], u32 xs, int x_stride, int i,
                                               float (&acc)[NX][R]) {
  float s[2][NX][R];  // the quads' sums under each scale (one only without kTwoScales)
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int t = 0; t < NX; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) s[h][t][r] = 0.f;
#pragma unroll
  for (int l = 0; l < 8; ++l) {
    const int h = F::kTwoScales ? l >> 2 : 0;
    float4 w[R];
#pragma unroll
    for (int r = 0; r < R; ++r) w[r] = F::quad(it[r], l);
#pragma unroll
    for (int t = 0; t < NX; ++t) {
      const float4 v = load_x4(xs + 4 * (t * x_stride + i * XSTRIDE), 4 * l);
#pragma unroll
      for (int r = 0; r < R; ++r) s[h][t][r] = dot4(w[r], v, s[h][t][r]);
    }
  }
#pragma unroll
  for (int t = 0; t < NX; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r)
      acc[t][r] += F::kTwoScales ? it[r].dl * s[0][t][r] + it[r].dh * s[1][t][r] : it[r].d * s[0][t][r];
}

// IQ3_XXS: d * (0.5 + ls) * 0.5 * magnitude, a scale per 32-element sub-block. A super-block's quants are qs[64]
// then its 8 sign-and-scale words (24 words): item i (sub-block j = i % 8 of super-block i / 8) is qs words 2j,
// 2j + 1 (q.x, q.y: grid entries 0 .. 3 and 4 .. 7, a byte each) and word 16 + j (q.z: four 7-bit sign groups, ls
// in its top 4 bits).
struct IQ3XXS {
  static constexpr bool kTwoScales = false;
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    const int sb = i >> 3, j = i & 7;
    const u32* block = r.quants + 24 * sb;
    const uint2 qs = __ldg(reinterpret_cast<const uint2*>(block + 2 * j));
    it.q.x = qs.x;
    it.q.y = qs.y;
    it.q.z = __ldg(block + 16 + j);
    it.d = half_at(r.scales + sb) * (0.5f + static_cast<float>(it.q.z >> 28)) * 0.5f;  // as gguf-py's, exact
    return it;
  }
  __device__ static float4 quad(const Item& it, int l) {
    const u32 index = ((l < 4 ? it.q.x : it.q.y) >> (8 * (l & 3))) & 0xFFu;
    return signed_bytes(kIq3XxsGrid[index], iq3_signs(it.q.z, l));
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    grid_quads_dot<IQ3XXS, R, NX>(it, xs, x_stride, i, acc);
  }
};

// IQ3_S: d * (1 + 2 ls) * magnitude, a scale per 32-element sub-block. A super-block's quants are qs[64], qh[8],
// signs[32] (26 words); its 4 scale bytes are in the extra plane. Item i (sub-block j = i % 8 of super-block i / 8)
// is qs words 2j, 2j + 1 (q.x, q.y: the low 8 bits of grid entries 0 .. 3 and 4 .. 7, a byte each), signs word
// 18 + j (q.z: bit 4l + e for element e of entry l) and qh byte j (q.w: bit l, entry l's ninth index bit); ls is
// nibble j % 2 of scale byte j / 2.
struct IQ3S {
  static constexpr bool kTwoScales = false;
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    const int sb = i >> 3, j = i & 7;
    const u32* block = r.quants + 26 * sb;
    const uint2 qs = __ldg(reinterpret_cast<const uint2*>(block + 2 * j));
    it.q.x = qs.x;
    it.q.y = qs.y;
    it.q.z = __ldg(block + 18 + j);
    it.q.w = (__ldg(block + 16 + (j >> 2)) >> (8 * (j & 3))) & 0xFFu;
    const u32 ls = (__ldg(r.extra + 4 * sb + (j >> 1)) >> (4 * (j & 1))) & 0xFu;
    it.d = half_at(r.scales + sb) * static_cast<float>(1 + 2 * ls);  // as gguf-py's, exact
    return it;
  }
  __device__ static float4 quad(const Item& it, int l) {
    const u32 index = (((l < 4 ? it.q.x : it.q.y) >> (8 * (l & 3))) & 0xFFu) | (((it.q.w >> l) & 1u) << 8);
    return signed_bytes(kIq3SGrid[index], (it.q.z >> (4 * l)) & 0xFu);
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    grid_quads_dot<IQ3S, R, NX>(it, xs, x_stride, i, acc);
  }
};

// IQ2_S: d * (0.5 + ls) * 0.25 * magnitude, a scale per 16 elements. A super-block's quants are qs[32], signs[32],
// qh[8] (18 words); its 8 scale bytes are in the extra plane. Item i (sub-block j = i % 8 of super-block i / 8) is
// qs word j (q.x: the low 8 bits of the grid indices of its octets k = 0 .. 3, a byte each), signs word 8 + j (q.y:
// byte k for octet k, bit e for its element e) and qh byte j (q.z: bits 2k, 2k + 1, octet k's top index bits);
// octets 0 and 1 take the low nibble of scale byte j (dl), 2 and 3 the high one (dh). Octet k is quads 2k, 2k + 1:
// its grid entry is 8 magnitudes, two words.
struct IQ2S {
  static constexpr bool kTwoScales = true;
  __device__ static int items(int num_cols) { return num_cols / 32; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    const int sb = i >> 3, j = i & 7;
    const u32* block = r.quants + 18 * sb;
    it.q.x = __ldg(block + j);
    it.q.y = __ldg(block + 8 + j);
    it.q.z = (__ldg(block + 16 + (j >> 2)) >> (8 * (j & 3))) & 0xFFu;
    const u32 ls = __ldg(r.extra + 8 * sb + j);
    const float d = half_at(r.scales + sb);
    it.dl = d * (0.5f + static_cast<float>(ls & 0xFu)) * 0.25f;  // as gguf-py's, exact
    it.dh = d * (0.5f + static_cast<float>(ls >> 4)) * 0.25f;
    return it;
  }
  __device__ static float4 quad(const Item& it, int l) {
    const int k = l >> 1;
    const u32 index = ((it.q.x >> (8 * k)) & 0xFFu) | (((it.q.z >> (2 * k)) & 3u) << 8);
    return signed_bytes(kIq2SGrid[2 * index + (l & 1)], (it.q.y >> (4 * l)) & 0xFu);
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    grid_quads_dot<IQ2S, R, NX>(it, xs, x_stride, i, acc);
  }
};

// Q4_K for the gemv loop: 32 quant bytes an item, whole sub-blocks 2c and 2c + 1 (low and high nibbles of bytes
// 32c .. 32c + 31), so that the item's scales are read and decoded once for 64 elements; K / 64 items. Its
// activations come in gemv_native's Q4_K layout: each super-block's 8 groups Q4K_SB_STRIDE floats after the
// last's (4 more than 8 groups), so that lanes of two super-blocks start on other banks, and each group's two
// 16-element half sums staged in its padding (floats 32 and 33).
constexpr int Q4K_SB_STRIDE = 8 * XSTRIDE + 4;

struct Q4KWide {
  __device__ static int items(int num_cols) { return num_cols / 64; }
  __device__ static Item load(const RowPlanes& r, int i) {
    Item it;
    it.q = load_stream(r.quants + 8 * i);
    it.q2 = load_stream(r.quants + 8 * i + 4);
    q4_k_item_scales(r, i >> 2, i & 3, it);
    return it;
  }
  template <int R, int NX>
  __device__ static void dot(const Item (&it)[R], u32 xs, int x_stride, int i, float (&acc)[NX][R]) {
    // item i: super-block i / 4, chunk c = i % 4: sub-blocks 2c and 2c + 1 are groups 2c and 2c + 1 of the super-block
    const int xl = (i >> 2) * Q4K_SB_STRIDE + 2 * (i & 3) * XSTRIDE, xh = xl + XSTRIDE;
    float sl[NX][R], sh[NX][R];
#pragma unroll
    for (int t = 0; t < NX; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) sl[t][r] = sh[t][r] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float4 wl[R], wh[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const u32 w = word_of(h ? it[r].q2 : it[r].q, j);
          wl[r] = bytes_as_float4(w & 0x0F0F0F0Fu, 8388608.f);
          wh[r] = bytes_as_float4((w >> 4) & 0x0F0F0F0Fu, 8388608.f);
        }
#pragma unroll
        for (int t = 0; t < NX; ++t) {
          const int xt = t * x_stride + 16 * h + 4 * j;
          const float4 a = load_x4(xs, xl + xt), b = load_x4(xs, xh + xt);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            sl[t][r] = dot4(wl[r], a, sl[t][r]);
            sh[t][r] = dot4(wh[r], b, sh[t][r]);
          }
        }
      }
#pragma unroll
    for (int t = 0; t < NX; ++t) {
      const float xsum_l = load_x1(xs, t * x_stride + xl + 32) + load_x1(xs, t * x_stride + xl + 33);
      const float xsum_h = load_x1(xs, t * x_stride + xh + 32) + load_x1(xs, t * x_stride + xh + 33);
#pragma unroll
      for (int r = 0; r < R; ++r)
        acc[t][r] += (it[r].dl * sl[t][r] - it[r].ml * xsum_l) + (it[r].dh * sh[t][r] - it[r].mh * xsum_h);
    }
  }
};

__device__ __forceinline__ RowPlanes row_planes(const u32* quants, const __half* scales, const u8* extra,
                                                long long row, int words_per_row, int halves_per_row,
                                                int extra_per_row) {
  return RowPlanes{quants + row * words_per_row, scales + row * halves_per_row, extra + row * extra_per_row};
}

// R rows of one or two matrices, all items of each, against NX activation rows (xs + t * x_stride floats,
// t < NX), each row's item read once for all NX: out[t * R + r] is row r's product with activation row t.
// Every row is read: a caller with fewer rows repeats its last one and drops the repeats' totals. Each
// (t, r) sum is the same chain of operations whatever NX is: F::dot<R, NX>'s.
template <class F, int R, int UNROLL, int NX>
__device__ __forceinline__ void rows_dot(float* out, const RowPlanes (&rows)[R], const float* xs, int x_stride,
                                         int num_cols) {
  const int lane = threadIdx.x & 31;
  const int num_items = F::items(num_cols);
  const u32 xs_shared = shared_address(xs);
  float acc[NX][R];
#pragma unroll
  for (int t = 0; t < NX; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
  for (int i0 = lane; i0 < num_items; i0 += 32 * UNROLL) {
    Item it[UNROLL][R];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (i0 + 32 * u < num_items) it[u][r] = F::load(rows[r], i0 + 32 * u);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (i0 + 32 * u < num_items)
        F::template dot<R, NX>(it[u], xs_shared, x_stride, i0 + 32 * u, acc);
  }
#pragma unroll
  for (int t = 0; t < NX; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) out[t * R + r] = warp_sum(acc[t][r]);
}

// Rows row_begin, row_begin + row_step, ... of a num_rows-row matrix, R at a time, into y (added to it when
// accumulate): the call's whole share of a GEMV. Each step (a group of R rows, 32 * UNROLL of their items)
// loads the next step's items before it multiplies its own, so that a warp keeps its loads in flight while it
// computes; a group at a time, each group's arithmetic left the warp's share of the HBM idle. NX activation
// rows (xs + t * x_stride floats) meet each loaded item, into y + t * y_stride: row t's sums are those of
// NX = 1 with activation row t.
template <class F, int R, int UNROLL, int NX>
__device__ __forceinline__ void rows_loop(float* y, long long y_stride, const u32* quants, const __half* scales,
                                          const u8* extra, long long row_begin, long long row_step,
                                          long long num_rows, int words_per_row, int halves_per_row,
                                          int extra_per_row, const float* xs, int x_stride, int num_cols,
                                          bool accumulate) {
  constexpr int CHUNK = 32 * UNROLL;
  const int lane = threadIdx.x & 31;
  const int num_items = F::items(num_cols);
  const u32 xs_shared = shared_address(xs);
  // the items lane + 32 u from i0 of rows row0 .. row0 + R - 1 (the last row repeated past num_rows)
  auto load_step = [&](Item (&it)[UNROLL][R], long long row0, int i0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const long long row = row0 + r < num_rows ? row0 + r : num_rows - 1;
      const RowPlanes planes = row_planes(quants, scales, extra, row, words_per_row, halves_per_row, extra_per_row);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (i0 + lane + 32 * u < num_items) it[u][r] = F::load(planes, i0 + lane + 32 * u);
    }
  };
  long long row0 = row_begin;
  int i0 = 0;
  if (row0 >= num_rows) return;
  Item cur[UNROLL][R];
  load_step(cur, row0, 0);
  float acc[NX][R];
#pragma unroll
  for (int t = 0; t < NX; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
  for (;;) {
    long long next_row0 = row0;
    int next_i0 = i0 + CHUNK;
    if (next_i0 >= num_items) {
      next_i0 = 0;
      next_row0 += row_step;
    }
    const bool has_next = next_row0 < num_rows;
    Item next[UNROLL][R];
    if (has_next) load_step(next, next_row0, next_i0);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (i0 + lane + 32 * u < num_items)
        F::template dot<R, NX>(cur[u], xs_shared, x_stride, i0 + lane + 32 * u, acc);
    if (next_i0 == 0) {  // the group's last step
#pragma unroll
      for (int t = 0; t < NX; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float total = warp_sum(acc[t][r]);
          float* yt = y + t * y_stride;
          if (lane == r && row0 + r < num_rows) yt[row0 + r] = accumulate ? yt[row0 + r] + total : total;
          acc[t][r] = 0.f;
        }
    }
    if (!has_next) break;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) cur[u][r] = next[u][r];
    row0 = next_row0;
    i0 = next_i0;
  }
}

// Where a routed expert's rows lie. SlotPlanes: stacked planes, expert (slot) s at row s * num_rows_each.
// AddressPlanes: each expert's planes anywhere (a cache slot, or pinned host memory the kernel reads over
// PCIe), as device addresses in a table of `stride` per expert, this matrix's three from `first`.
struct SlotPlanes {
  const u32* quants;
  const __half* scales;
  const u8* extra;
  int num_experts;
  long long num_rows_each;
  int words_per_row, halves_per_row, extra_per_row;
  __device__ __forceinline__ RowPlanes row(int e, long long n) const {
    return row_planes(quants, scales, extra, (long long)e * num_rows_each + n, words_per_row, halves_per_row,
                      extra_per_row);
  }
};

struct AddressPlanes {
  const unsigned long long* table;
  int num_experts, stride, first;
  int words_per_row, halves_per_row, extra_per_row;
  __device__ __forceinline__ RowPlanes row(int e, long long n) const {
    const unsigned long long* at = table + (long long)e * stride + first;
    return row_planes(reinterpret_cast<const u32*>(at[0]), reinterpret_cast<const __half*>(at[1]),
                      reinterpret_cast<const u8*>(at[2]), n, words_per_row, halves_per_row, extra_per_row);
  }
};

// silu(g) * u in float32, the operations of activation.device_silu_mul (exp of -|g| never overflows)
__device__ __forceinline__ float silu_mul(float g, float u) {
  const float e = expf(-fabsf(g));
  const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return g * sigmoid * u;
}

// The step after (row, i0) of a warp's loop over rows row_step apart, chunk items of a row at a time
struct LoopStep {
  int row, i0;
};
__device__ __forceinline__ LoopStep next_step(int row, int i0, int chunk, int num_items, int row_step) {
  return i0 + chunk < num_items ? LoopStep{row, i0 + chunk} : LoopStep{row + row_step, 0};
}

// A token's routed experts' gate and up rows, and silu(gate . x) * (up . x) of each into hidden: rows j = j_begin,
// j_begin + j_step, ... of the token's top_k * ffn (expert e = j / ffn, its row n = j % ffn; hidden[j]), x at xs.
// Each step (a row pair, 32 * UNROLL of its items) loads the next step's items before it multiplies its own, as
// rows_loop does, so that a warp that owns several rows keeps its loads in flight across them (a verify step's five
// tokens' experts: 13-19% faster than a warp a row on the H200; one token's: level). A pair's sums are
// rows_dot<F, 2, UNROLL, 1>'s (each lane adds its items in increasing order). An id outside [0, num_experts) gives
// 0 (and reads nothing).
template <class F, int UNROLL, class Planes>
__device__ __forceinline__ void pair_loop(float* hidden, const Planes& gate, const Planes& up, const int* ids,
                                          int top_k, int ffn, int j_begin, int j_step, const float* xs,
                                          int num_cols) {
  constexpr int CHUNK = 32 * UNROLL;
  const int lane = threadIdx.x & 31;
  const int num_items = F::items(num_cols), num_rows = top_k * ffn;
  const u32 xs_shared = shared_address(xs);
  auto expert_of = [&](int j) {
    const int id = ids[j / ffn];
    return id >= 0 && id < gate.num_experts ? id : -1;
  };
  auto load_step = [&](Item (&it)[UNROLL][2], int j, int i0) {
    const int e = j / ffn, id = expert_of(j);
    if (id < 0) {  // nothing to read (an addressed expert's planes may not exist): zeros, and the row writes 0
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) it[u][0] = it[u][1] = Item{};
      return;
    }
    const RowPlanes rows[2] = {gate.row(id, j - e * ffn), up.row(id, j - e * ffn)};
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (i0 + lane + 32 * u < num_items) it[u][r] = F::load(rows[r], i0 + lane + 32 * u);
  };
  int j = j_begin, i0 = 0;
  if (j >= num_rows) return;
  Item cur[UNROLL][2];
  load_step(cur, j, 0);
  float acc[1][2] = {{0.f, 0.f}};
  for (;;) {
    const LoopStep next_at = next_step(j, i0, CHUNK, num_items, j_step);
    const bool has_next = next_at.row < num_rows;
    Item next[UNROLL][2];
    if (has_next) load_step(next, next_at.row, next_at.i0);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (i0 + lane + 32 * u < num_items) F::template dot<2, 1>(cur[u], xs_shared, 0, i0 + lane + 32 * u, acc);
    if (next_at.i0 == 0) {  // the pair's last step
      const float g = warp_sum(acc[0][0]), u = warp_sum(acc[0][1]);
      if (lane == 0) hidden[j] = expert_of(j) < 0 ? 0.f : silu_mul(g, u);
      acc[0][0] = acc[0][1] = 0.f;
    }
    if (!has_next) break;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < 2; ++r) cur[u][r] = next[u][r];
    j = next_at.row;
    i0 = next_at.i0;
  }
}

// Output rows n = n_begin, n_begin + n_step, ... < num_rows of a token's routed experts' down projection, added to
// out[n]: sum_e weight[e] * W_{ids[e]}[n] . x_e (x_e = xs + e * x_stride floats), a row's items of all experts dealt
// to the lanes in turn as down_row deals them, each step loading the next step's items (the next row's, at a row's
// end) before it multiplies its own. An id outside [0, num_experts) adds nothing.
template <class F, int UNROLL, class Planes>
__device__ __forceinline__ void down_loop(float* out, const Planes& planes, const int* ids, const float* weights,
                                          int top_k, int n_begin, int n_step, int num_rows, const float* xs,
                                          int x_stride, int num_cols) {
  constexpr int CHUNK = 32 * UNROLL;
  const int lane = threadIdx.x & 31;
  const int per_row = F::items(num_cols), num_items = top_k * per_row;
  const u32 xs_shared = shared_address(xs);
  // step (n, i0): lane's items i0 + lane + 32 u of row n's flattened list, expert e = item / per_row
  auto load_step = [&](Item (&it)[UNROLL][1], bool (&ok)[UNROLL], int n, int i0) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int item = i0 + lane + 32 * u, e = item / per_row;
      const int id = item < num_items ? ids[e] : -1;
      ok[u] = id >= 0 && id < planes.num_experts;
      if (ok[u]) it[u][0] = F::load(planes.row(id, n), item - e * per_row);
    }
  };
  int n = n_begin, i0 = 0;
  if (n >= num_rows) return;
  Item cur[UNROLL][1];
  bool cur_ok[UNROLL];
  load_step(cur, cur_ok, n, 0);
  float acc = 0.f;
  for (;;) {
    const LoopStep next_at = next_step(n, i0, CHUNK, num_items, n_step);
    const bool has_next = next_at.row < num_rows;
    Item next[UNROLL][1];
    bool next_ok[UNROLL];
    if (has_next) load_step(next, next_ok, next_at.row, next_at.i0);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (cur_ok[u]) {
        const int item = i0 + lane + 32 * u, e = item / per_row;
        float product[1][1] = {{0.f}};
        F::template dot<1, 1>(cur[u], xs_shared + 4 * e * x_stride, 0, item - e * per_row, product);
        acc += weights[e] * product[0][0];
      }
    if (next_at.i0 == 0) {  // the row's last step
      const float total = warp_sum(acc);
      if (lane == 0) out[n] += total;
      acc = 0.f;
    }
    if (!has_next) break;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      cur[u][0] = next[u][0];
      cur_ok[u] = next_ok[u];
    }
    n = next_at.row;
    i0 = next_at.i0;
  }
}

}  // namespace

#define STRATA_GEMV_ROWS(NAME, F, R, UNROLL)                                                                         \
  extern "C" __device__ void NAME(float* out, const u32* quants, const __half* scales, const u8* extra,              \
                                  long long row0, int num_rows, int words_per_row, int halves_per_row,               \
                                  int extra_per_row, const float* xs, int num_cols) {                                \
    RowPlanes rows[R];                                                                                               \
    for (int r = 0; r < R; ++r)                                                                                      \
      rows[r] = row_planes(quants, scales, extra, row0 + (r < num_rows ? r : num_rows - 1), words_per_row,            \
                           halves_per_row, extra_per_row);                                                           \
    rows_dot<F, R, UNROLL, 1>(out, rows, xs, 0, num_cols);                                                          \
  }

#define STRATA_GEMV_LOOP(NAME, F, R, UNROLL)                                                                         \
  extern "C" __device__ void NAME(float* y, const u32* quants, const __half* scales, const u8* extra,                \
                                  long long row_begin, long long row_step, long long num_rows, int words_per_row,    \
                                  int halves_per_row, int extra_per_row, const float* xs, int num_cols,              \
                                  int accumulate) {                                                                  \
    rows_loop<F, R, UNROLL, 1>(y, 0, quants, scales, extra, row_begin, row_step, num_rows, words_per_row,           \
                               halves_per_row, extra_per_row, xs, 0, num_cols, accumulate != 0);                     \
  }

// NX activation rows: gemv_native appends these for the (format, R, NX) a launch needs (tensor_core.cu_source's
// suffix), so that only the instantiations in use are compiled.
#define STRATA_GEMV_ROWS_X(NAME, F, R, UNROLL, NX)                                                                   \
  extern "C" __device__ void NAME(float* out, const u32* quants, const __half* scales, const u8* extra,              \
                                  long long row0, int num_rows, int words_per_row, int halves_per_row,               \
                                  int extra_per_row, const float* xs, int x_stride, int num_cols) {                  \
    RowPlanes rows[R];                                                                                               \
    for (int r = 0; r < R; ++r)                                                                                      \
      rows[r] = row_planes(quants, scales, extra, row0 + (r < num_rows ? r : num_rows - 1), words_per_row,            \
                           halves_per_row, extra_per_row);                                                           \
    rows_dot<F, R, UNROLL, NX>(out, rows, xs, x_stride, num_cols);                                                  \
  }

#define STRATA_GEMV_LOOP_X(NAME, F, R, UNROLL, NX)                                                                   \
  extern "C" __device__ void NAME(float* y, long long y_stride, const u32* quants, const __half* scales,             \
                                  const u8* extra, long long row_begin, long long row_step, long long num_rows,      \
                                  int words_per_row, int halves_per_row, int extra_per_row, const float* xs,         \
                                  int x_stride, int num_cols, int accumulate) {                                      \
    rows_loop<F, R, UNROLL, NX>(y, y_stride, quants, scales, extra, row_begin, row_step, num_rows, words_per_row,    \
                                halves_per_row, extra_per_row, xs, x_stride, num_cols, accumulate != 0);             \
  }

// A token's experts as loops over rows (pair_loop, down_loop): stacked slots (SlotPlanes) or an address table
// (AddressPlanes: the gate planes of an expert from column 0, up from 3, down from 6 of `stride`).
#define STRATA_PAIR_LOOP(NAME, F)                                                                                    \
  extern "C" __device__ void NAME(float* hidden, const u32* gq, const __half* gs, const u8* ge, const u32* uq,      \
                                  const __half* us, const u8* ue, int num_slots, int words_per_row,                  \
                                  int halves_per_row, int extra_per_row, const int* ids, int top_k, int ffn,         \
                                  int j_begin, int j_step, const float* xs, int num_cols) {                          \
    const SlotPlanes gate{gq, gs, ge, num_slots, ffn, words_per_row, halves_per_row, extra_per_row};                 \
    const SlotPlanes up{uq, us, ue, num_slots, ffn, words_per_row, halves_per_row, extra_per_row};                   \
    pair_loop<F, 2>(hidden, gate, up, ids, top_k, ffn, j_begin, j_step, xs, num_cols);                               \
  }

#define STRATA_DOWN_LOOP(NAME, F)                                                                                    \
  extern "C" __device__ void NAME(float* out, const u32* quants, const __half* scales, const u8* extra,              \
                                  int num_slots, int words_per_row, int halves_per_row, int extra_per_row,           \
                                  const int* ids, const float* weights, int top_k, int n_begin, int n_step, int dim, \
                                  const float* xs, int x_stride, int num_cols) {                                     \
    const SlotPlanes planes{quants, scales, extra, num_slots, dim, words_per_row, halves_per_row, extra_per_row};   \
    down_loop<F, 4>(out, planes, ids, weights, top_k, n_begin, n_step, dim, xs, x_stride, num_cols);                 \
  }

#define STRATA_PAIR_LOOP_AT(NAME, F)                                                                                 \
  extern "C" __device__ void NAME(float* hidden, const unsigned long long* table, int stride, int num_experts,      \
                                  int words_per_row, int halves_per_row, int extra_per_row, const int* ids,          \
                                  int top_k, int ffn, int j_begin, int j_step, const float* xs, int num_cols) {      \
    const AddressPlanes gate{table, num_experts, stride, 0, words_per_row, halves_per_row, extra_per_row};           \
    const AddressPlanes up{table, num_experts, stride, 3, words_per_row, halves_per_row, extra_per_row};             \
    pair_loop<F, 2>(hidden, gate, up, ids, top_k, ffn, j_begin, j_step, xs, num_cols);                               \
  }

#define STRATA_DOWN_LOOP_AT(NAME, F)                                                                                 \
  extern "C" __device__ void NAME(float* out, const unsigned long long* table, int stride, int num_experts,         \
                                  int words_per_row, int halves_per_row, int extra_per_row, const int* ids,          \
                                  const float* weights, int top_k, int n_begin, int n_step, int dim,                 \
                                  const float* xs, int x_stride, int num_cols) {                                     \
    const AddressPlanes planes{table, num_experts, stride, 6, words_per_row, halves_per_row, extra_per_row};         \
    down_loop<F, 4>(out, planes, ids, weights, top_k, n_begin, n_step, dim, xs, x_stride, num_cols);                 \
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
STRATA_GEMV_ROWS(strata_gemv_rows_q5_k_r1, Q5K, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q5_k_r2, Q5K, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q5_k_r4, Q5K, 4, 1)
STRATA_GEMV_ROWS(strata_gemv_rows_q6_k_r1, Q6K, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q6_k_r2, Q6K, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_q6_k_r4, Q6K, 4, 1)
STRATA_GEMV_ROWS(strata_gemv_rows_iq4_xs_r1, IQ4XS, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_iq4_xs_r2, IQ4XS, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_iq4_xs_r4, IQ4XS, 4, 1)
STRATA_GEMV_ROWS(strata_gemv_rows_iq3_xxs_r1, IQ3XXS, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_iq3_xxs_r2, IQ3XXS, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_iq3_xxs_r4, IQ3XXS, 4, 1)
STRATA_GEMV_ROWS(strata_gemv_rows_iq3_s_r1, IQ3S, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_iq3_s_r2, IQ3S, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_iq3_s_r4, IQ3S, 4, 1)
STRATA_GEMV_ROWS(strata_gemv_rows_iq2_s_r1, IQ2S, 1, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_iq2_s_r2, IQ2S, 2, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_iq2_s_r4, IQ2S, 4, 1)
// float rows have 4-8x the items of a quantized row: more of them in flight per iteration
STRATA_GEMV_ROWS(strata_gemv_rows_f32_r1, F32, 1, 4)
STRATA_GEMV_ROWS(strata_gemv_rows_f32_r2, F32, 2, 4)
STRATA_GEMV_ROWS(strata_gemv_rows_f32_r4, F32, 4, 2)
STRATA_GEMV_ROWS(strata_gemv_rows_f16_r1, F16, 1, 4)
STRATA_GEMV_ROWS(strata_gemv_rows_f16_r2, F16, 2, 4)
STRATA_GEMV_ROWS(strata_gemv_rows_f16_r4, F16, 4, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q4_0_r1, Q40, 1, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q4_0_r2, Q40, 2, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q4_0_r4, Q40, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_q8_0_r1, Q80, 1, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q8_0_r2, Q80, 2, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q8_0_r4, Q80, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_q4_k_r1, Q4KWide, 1, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_q4_k_r2, Q4KWide, 2, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_q4_k_r4, Q4KWide, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_q5_k_r1, Q5K, 1, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q5_k_r2, Q5K, 2, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q5_k_r4, Q5K, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_q6_k_r1, Q6K, 1, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q6_k_r2, Q6K, 2, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_q6_k_r4, Q6K, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_iq4_xs_r1, IQ4XS, 1, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_iq4_xs_r2, IQ4XS, 2, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_iq4_xs_r4, IQ4XS, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_iq3_xxs_r1, IQ3XXS, 1, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_iq3_xxs_r2, IQ3XXS, 2, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_iq3_xxs_r4, IQ3XXS, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_iq3_s_r1, IQ3S, 1, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_iq3_s_r2, IQ3S, 2, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_iq3_s_r4, IQ3S, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_iq2_s_r1, IQ2S, 1, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_iq2_s_r2, IQ2S, 2, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_iq2_s_r4, IQ2S, 4, 1)
STRATA_GEMV_LOOP(strata_gemv_loop_f32_r1, F32, 1, 4)
STRATA_GEMV_LOOP(strata_gemv_loop_f32_r2, F32, 2, 4)
STRATA_GEMV_LOOP(strata_gemv_loop_f32_r4, F32, 4, 2)
STRATA_GEMV_LOOP(strata_gemv_loop_f16_r1, F16, 1, 4)
STRATA_GEMV_LOOP(strata_gemv_loop_f16_r2, F16, 2, 4)
STRATA_GEMV_LOOP(strata_gemv_loop_f16_r4, F16, 4, 2)
STRATA_PAIR_LOOP(strata_pair_loop_q4_0, Q40)
STRATA_PAIR_LOOP(strata_pair_loop_q8_0, Q80)
STRATA_PAIR_LOOP(strata_pair_loop_q4_k, Q4K)
STRATA_PAIR_LOOP(strata_pair_loop_q5_k, Q5K)
STRATA_PAIR_LOOP(strata_pair_loop_q6_k, Q6K)
STRATA_PAIR_LOOP(strata_pair_loop_iq4_xs, IQ4XS)
STRATA_PAIR_LOOP(strata_pair_loop_iq3_xxs, IQ3XXS)
STRATA_DOWN_LOOP(strata_down_loop_q4_0, Q40)
STRATA_DOWN_LOOP(strata_down_loop_q8_0, Q80)
STRATA_DOWN_LOOP(strata_down_loop_q4_k, Q4K)
STRATA_DOWN_LOOP(strata_down_loop_q5_k, Q5K)
STRATA_DOWN_LOOP(strata_down_loop_q6_k, Q6K)
STRATA_DOWN_LOOP(strata_down_loop_iq4_xs, IQ4XS)
STRATA_DOWN_LOOP(strata_down_loop_iq3_xxs, IQ3XXS)
STRATA_PAIR_LOOP_AT(strata_pair_loop_at_q4_0, Q40)
STRATA_PAIR_LOOP_AT(strata_pair_loop_at_q8_0, Q80)
STRATA_PAIR_LOOP_AT(strata_pair_loop_at_q4_k, Q4K)
STRATA_PAIR_LOOP_AT(strata_pair_loop_at_q5_k, Q5K)
STRATA_PAIR_LOOP_AT(strata_pair_loop_at_q6_k, Q6K)
STRATA_PAIR_LOOP_AT(strata_pair_loop_at_iq4_xs, IQ4XS)
STRATA_PAIR_LOOP_AT(strata_pair_loop_at_iq3_xxs, IQ3XXS)
STRATA_DOWN_LOOP_AT(strata_down_loop_at_q4_0, Q40)
STRATA_DOWN_LOOP_AT(strata_down_loop_at_q8_0, Q80)
STRATA_DOWN_LOOP_AT(strata_down_loop_at_q4_k, Q4K)
STRATA_DOWN_LOOP_AT(strata_down_loop_at_q5_k, Q5K)
STRATA_DOWN_LOOP_AT(strata_down_loop_at_q6_k, Q6K)
STRATA_DOWN_LOOP_AT(strata_down_loop_at_iq4_xs, IQ4XS)
STRATA_DOWN_LOOP_AT(strata_down_loop_at_iq3_xxs, IQ3XXS)
