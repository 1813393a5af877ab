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
// attention_fused below runs the same tile update over all of a block's KV tiles, staging them itself.
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

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

// This warp's Q as mma A fragments: a[kk] covers dims 16 kk .. 16 kk + 15 of rows g and g + 8.
template <int D>
struct QFragments {
  unsigned a[D / 16][4];
};

// Per-lane flash-attention state of rows g and g + 8: O accumulator fragments, running max m and sum l.
template <int D>
struct RowState {
  float o[D / 8][4];
  float m[2];
  float l[2];
};

template <int D>
__device__ __forceinline__ void load_q(const __half* q, QFragments<D>& f) {
  constexpr int LD = D + 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const __half* qp = q + g * LD + 16 * kk + 2 * t;
    f.a[kk][0] = load_u32(qp);
    f.a[kk][1] = load_u32(qp + 8 * LD);
    f.a[kk][2] = load_u32(qp + 8);
    f.a[kk][3] = load_u32(qp + 8 * LD + 8);
  }
}

// One KV tile: S = Q K^T, causal mask (keys past last0 / last1, tile-relative, when `masked`), online
// softmax, O += P V with P rounded to f16.
template <int D, int KT>
__device__ __forceinline__ void tile_update(const QFragments<D>& qf, const __half* k, const __half* v, int last0,
                                            int last1, bool masked, RowState<D>& st) {
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
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const __half* kp = k + (8 * j + g) * LD + 16 * kk + 2 * t;
      mma_16816(s[j], qf.a[kk][0], qf.a[kk][1], qf.a[kk][2], qf.a[kk][3], load_u32(kp), load_u32(kp + 8));
    }

  const int last[2] = {last0, last1};
  float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (masked && 8 * j + 2 * t + (r & 1) > last[r >> 1]) s[j][r] = neg_inf();
      tile_max[r >> 1] = fmaxf(tile_max[r >> 1], s[j][r]);
    }

  float m_new[2], alpha[2], row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    m_new[h] = fmaxf(st.m[h], tile_max[h]);
    alpha[h] = st.m[h] == neg_inf() ? 0.f : exp2f(st.m[h] - m_new[h]);
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
    st.l[h] = st.l[h] * alpha[h] + row_sum[h];
    st.m[h] = m_new[h];
  }

#pragma unroll
  for (int n = 0; n < OT; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) st.o[n][r] *= alpha[r >> 1];
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
      mma_16816(st.o[n], a0, a1, a2, a3, b0, b1);
      mma_16816(st.o[n + 1], a0, a1, a2, a3, b2, b3);
    }
  }
}

template <int D>
__device__ __forceinline__ void store_state(const RowState<D>& st, float* state) {
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) state[4 * n + r] = st.o[n][r];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    state[D / 2 + h] = st.m[h];
    state[D / 2 + 2 + h] = st.l[h];
  }
}

// ---- The fused KV loop: the whole block walks its KV tiles here, Q and O staying in registers. ----

// K and V of keys key0 .. key0 + KT - 1 into [KT][D + 8] f16 tiles; keys from `end` on are zeros (a NaN
// in V would survive P = 0). Each thread owns octets tid, tid + THREADS, ... of each matrix.
template <OctetFormat F, int D, int KT, int THREADS>
struct TileStager {
  static constexpr int LD = D + 8;
  static constexpr int OCTETS_PER_KEY = D / 8;
  static constexpr int OCTETS = KT * OCTETS_PER_KEY;
  static constexpr int PER_THREAD = (OCTETS + THREADS - 1) / THREADS;

  const void* k_quants;
  const __half* k_scales;
  const void* v_quants;
  const __half* v_scales;
  int quant_pitch, scale_pitch, col0, end;
  RawOctet raw_k[F == kF16 ? 1 : PER_THREAD], raw_v[F == kF16 ? 1 : PER_THREAD];

  __device__ __forceinline__ static bool owns(int i) {
    return OCTETS % THREADS == 0 || static_cast<int>(threadIdx.x) + i * THREADS < OCTETS;
  }

  // F16: asynchronous 16-byte copies (commit and wait are the caller's); quantized: global reads into raw_k / raw_v.
  __device__ __forceinline__ void load(int key0, __half* k, __half* v) {
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      if (!owns(i)) continue;
      const int idx = threadIdx.x + i * THREADS, key = idx / OCTETS_PER_KEY, oc = idx % OCTETS_PER_KEY;
      const bool valid = key0 + key < end;
      const int src_key = valid ? key0 + key : 0;
      if constexpr (F == kF16) {
        const size_t off = static_cast<size_t>(src_key) * quant_pitch + col0 + 8 * oc;
        cp_async_16(k + key * LD + 8 * oc, static_cast<const __half*>(k_quants) + off, valid);
        cp_async_16(v + key * LD + 8 * oc, static_cast<const __half*>(v_quants) + off, valid);
      } else {
        const int octet = col0 / 8 + oc;
        raw_k[i] = load_octet<F>(static_cast<const unsigned*>(k_quants), k_scales, src_key, octet, quant_pitch,
                                 scale_pitch);
        raw_v[i] = load_octet<F>(static_cast<const unsigned*>(v_quants), v_scales, src_key, octet, quant_pitch,
                                 scale_pitch);
        if (!valid) raw_k[i].d = raw_v[i].d = 0.f;
      }
    }
  }

  // Quantized only: the loaded octets dequantized into the tiles, 16 bytes per store.
  __device__ __forceinline__ void store(__half* k, __half* v) const {
    if constexpr (F != kF16) {
#pragma unroll
      for (int i = 0; i < PER_THREAD; ++i) {
        if (!owns(i)) continue;
        const int idx = threadIdx.x + i * THREADS, key = idx / OCTETS_PER_KEY, oc = idx % OCTETS_PER_KEY;
        const int octet = col0 / 8 + oc;
        *reinterpret_cast<uint4*>(k + key * LD + 8 * oc) = dequant_octet<F>(raw_k[i], octet);
        *reinterpret_cast<uint4*>(v + key * LD + 8 * oc) = dequant_octet<F>(raw_v[i], octet);
      }
    }
  }
};

[[maybe_unused]] __device__ __forceinline__ int warp_max(int x) {
#pragma unroll
  for (int mask = 16; mask; mask >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}
[[maybe_unused]] __device__ __forceinline__ int warp_min(int x) {
#pragma unroll
  for (int mask = 16; mask; mask >>= 1) x = min(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

// smem: at entry the block's Q ([W * 16][D + 8], scaled, f16); then STAGES buffers of K [KT][D + 8] and
// V [KT][D + 8]. row_last [W * 16]; the block reads keys begin .. end - 1 (0 .. end - 1 for prefill: every
// key some row sees; one KV split of a decode token); state as in the tile step, written once at the end.
// STAGES 2: tile j + 1 is in flight while tile j is multiplied, one barrier a tile. A warp whose rows are
// all padding (row_last -1, as in a decode block whose group fills one warp) only stages.
template <OctetFormat F, int D, int KT, int W, int STAGES>
__device__ __forceinline__ void attention_fused(__half* smem, const int* row_last, int begin, int end,
                                                const void* k_quants,
                                                const __half* k_scales, const void* v_quants, const __half* v_scales,
                                                int quant_pitch, int scale_pitch, int col0, float* state) {
  constexpr int LD = D + 8, TILE = KT * LD;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  QFragments<D> qf;
  load_q<D>(smem + warp * 16 * LD, qf);
  const int last0 = row_last[warp * 16 + g], last1 = row_last[warp * 16 + g + 8];
  const int warp_last = warp_max(max(last0, last1)), warp_first_last = warp_min(min(last0, last1));
  RowState<D> st;
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) st.o[n][r] = 0.f;
  st.m[0] = st.m[1] = neg_inf();
  st.l[0] = st.l[1] = 0.f;
  TileStager<F, D, KT, 32 * W> stager{k_quants, k_scales, v_quants, v_scales, quant_pitch, scale_pitch, col0, end};
  const int num_tiles = end > begin ? (end - begin + KT - 1) / KT : 0;
  __syncthreads();  // every warp holds its Q fragments: the buffers may overwrite Q

  auto compute = [&](int key0, const __half* k, const __half* v) {
    if (key0 > warp_last) return;  // all masked: the update would leave the state as it is
    tile_update<D, KT>(qf, k, v, last0 - key0, last1 - key0, key0 + KT - 1 > warp_first_last, st);
  };
  if constexpr (STAGES == 1) {
    for (int j = 0; j < num_tiles; ++j) {
      if (j) __syncthreads();  // every warp is done with the previous tile
      stager.load(begin + j * KT, smem, smem + TILE);
      if constexpr (F == kF16) {
        cp_async_commit();
        cp_async_wait_all();
      }
      stager.store(smem, smem + TILE);
      __syncthreads();
      compute(begin + j * KT, smem, smem + TILE);
    }
  } else {
    if (num_tiles) {
      stager.load(begin, smem, smem + TILE);
      cp_async_commit();
      stager.store(smem, smem + TILE);
    }
    for (int j = 0; j < num_tiles; ++j) {
      __half* cur = smem + (j & 1) * 2 * TILE;
      __half* next = smem + ((j + 1) & 1) * 2 * TILE;
      cp_async_wait_all();
      __syncthreads();  // tile j is in place, and every warp is done with tile j - 1, whose buffer is `next`
      const bool has_next = j + 1 < num_tiles;
      if (has_next) {
        stager.load(begin + (j + 1) * KT, next, next + TILE);
        cp_async_commit();
      }
      compute(begin + j * KT, cur, cur + TILE);
      if (has_next) stager.store(next, next + TILE);
    }
  }
  store_state<D>(st, state);
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

// The fused loop is instantiated on demand: attention_mma.py appends one STRATA_ATTENTION_FUSED line per kernel.
#define STRATA_ATTENTION_FUSED(FMT, D, KT, W, S)                                                                 \
  extern "C" __device__ void strata_attention_mma_fused_##FMT##_d##D##_k##KT##_w##W##_s##S(                      \
      __half* smem, const int* row_last, int begin, int end, const void* k_quants, const __half* k_scales,      \
      const void* v_quants, const __half* v_scales, int quant_pitch, int scale_pitch, int col0, float* state) {  \
    attention_fused<k##FMT, D, KT, W, S>(smem, row_last, begin, end, k_quants, k_scales, v_quants, v_scales,     \
                                         quant_pitch, scale_pitch, col0, state);                                 \
  }
