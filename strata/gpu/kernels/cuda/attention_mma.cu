// Flash-attention-2 step of one warp over one staged KV tile, on mma.sync.m16n8k16 (f16 in, f32 accumulate).
//
// The warp owns 16 query rows. Shared tiles, row-major f16 with row stride D + 8 halves (the pad puts
// the 8 rows a fragment load touches on distinct banks):
//   q [16 rows][D]   this warp's rows, already scaled by softmax_scale * log2(e)
//   k [KT keys][D]   keys key0 .. key0 + KT - 1
//   v [KT keys][D]
// row_last[16]: last visible key position of each row (causal limit, kv_len - 1 at most; -1: padding row).
// state, per lane: o[D / 8][4] accumulator fragments, then m[2] (running max, log2 units) and l[2]
// (running sum) of rows g and g + 8. Lane layout (g = lane / 4, t = lane % 4): accumulator element r of
// an n-tile is (row g + 8 * (r / 2), column 2 * t + r % 2).
//
// The pure-Numba twin in attention_mma.py follows the same layout and the same order of operations.
#include <cuda_fp16.h>

namespace {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ void mma_16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// B fragments of two adjacent n-tiles (8 dims each) from a row-major [keys][dims] tile: x4 transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(const __half* row_ptr, unsigned& r0, unsigned& r1, unsigned& r2,
                                                  unsigned& r3) {
  unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ unsigned load_u32(const __half* p) { return *reinterpret_cast<const unsigned*>(p); }

template <int D, int KT>
__device__ __forceinline__ void attention_tile(const __half* q, const __half* k, const __half* v, const int* row_last,
                                               int key0, float* state) {
  constexpr int LD = D + 8;
  constexpr int NT = KT / 8;  // score n-tiles
  constexpr int OT = D / 8;   // output n-tiles
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  float s[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[j][r] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D; kk += 16) {
    const __half* qp = q + g * LD + kk + 2 * t;
    unsigned a0 = load_u32(qp), a1 = load_u32(qp + 8 * LD), a2 = load_u32(qp + 8), a3 = load_u32(qp + 8 * LD + 8);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const __half* kp = k + (8 * j + g) * LD + kk + 2 * t;
      mma_16816(s[j], a0, a1, a2, a3, load_u32(kp), load_u32(kp + 8));
    }
  }

  const int last[2] = {row_last[g] - key0, row_last[g + 8] - key0};
  float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (8 * j + 2 * t + (r & 1) > last[r >> 1]) s[j][r] = neg_inf();
      tile_max[r >> 1] = fmaxf(tile_max[r >> 1], s[j][r]);
    }

  float* o = state;
  float* m = state + D / 2;
  float* l = m + 2;
  float m_new[2], alpha[2], row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    m_new[h] = fmaxf(m[h], tile_max[h]);
    alpha[h] = m[h] == neg_inf() ? 0.f : exp2f(m[h] - m_new[h]);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = r >> 1;
      s[j][r] = s[j][r] == neg_inf() ? 0.f : exp2f(s[j][r] - m_new[h]);
      row_sum[h] += s[j][r];
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
    l[h] = l[h] * alpha[h] + row_sum[h];
    m[h] = m_new[h];
  }

  float acc[OT][4];
#pragma unroll
  for (int n = 0; n < OT; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[n][r] = o[4 * n + r] * alpha[r >> 1];
#pragma unroll
  for (int kk = 0; kk < KT / 16; ++kk) {
    // P as the A operand: the score fragments of n-tiles 2kk and 2kk + 1 are exactly its halves
    const unsigned a0 = pack_half2(s[2 * kk][0], s[2 * kk][1]), a1 = pack_half2(s[2 * kk][2], s[2 * kk][3]);
    const unsigned a2 = pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    const unsigned a3 = pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    const __half* vp = v + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
#pragma unroll
    for (int n = 0; n < OT; n += 2) {
      unsigned b0, b1, b2, b3;
      ldmatrix_x4_trans(vp + 8 * n, b0, b1, b2, b3);
      mma_16816(acc[n], a0, a1, a2, a3, b0, b1);
      mma_16816(acc[n + 1], a0, a1, a2, a3, b2, b3);
    }
  }
#pragma unroll
  for (int n = 0; n < OT; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[4 * n + r] = acc[n][r];
}

}  // namespace

#define STRATA_ATTENTION_TILE(D, KT)                                                                               \
  extern "C" __device__ void strata_attention_mma_d##D##_k##KT(const __half* q, const __half* k, const __half* v,  \
                                                               const int* row_last, int key0, float* state) {    \
    attention_tile<D, KT>(q, k, v, row_last, key0, state);                                                        \
  }

STRATA_ATTENTION_TILE(64, 16)
STRATA_ATTENTION_TILE(64, 32)
STRATA_ATTENTION_TILE(64, 48)
STRATA_ATTENTION_TILE(64, 64)
STRATA_ATTENTION_TILE(128, 16)
STRATA_ATTENTION_TILE(128, 32)
STRATA_ATTENTION_TILE(128, 48)
STRATA_ATTENTION_TILE(128, 64)
