// Warp-level tensor-core products for the prefill GEMMs (gemm_mma.py).
//
// One call: one K step (32 or 64 wide) of one warp's tile, acc[MI][NJ][4] += X[MI*16 rows][K] * W[NJ*8 rows][K]^T.
// X and W are float16 tiles in shared memory, row-major with a row stride of `ld` halves (padded so
// the 8 row groups of a fragment load hit different banks); acc is the warp's accumulator
// fragments in the mma.m16n8k16 layout (lane g = lane/4, t = lane%4: acc[i][j][r] is element
// (i*16 + g + 8*(r/2), j*8 + 2*t + r%2) of the warp tile).
//
// Fragments are read either with 32-bit shared loads (one per register) or with ldmatrix (one
// instruction per four 8 x 8 matrices; row addresses must be 16-byte aligned: ld * 2 and the
// tile bases are multiples of 16 bytes).
//
// gemm_fused below runs a block's whole K loop (staging included) with the accumulators in registers.
#include <cuda_fp16.h>

#include "common.cuh"

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(shared_address(p)));
}

__device__ __forceinline__ void ldmatrix_x2(unsigned& r0, unsigned& r1, const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(shared_address(p)));
}

template <int MI, bool LDMATRIX>
__device__ __forceinline__ void load_a_fragments(const __half* x, int ld, int kk, unsigned (&a)[MI][4]) {
  const int lane = threadIdx.x & 31;
  if (LDMATRIX) {
    // matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = kk + 8 * (lane >> 4);
#pragma unroll
    for (int i = 0; i < MI; ++i) ldmatrix_x4(a[i][0], a[i][1], a[i][2], a[i][3], x + (i * 16 + a_row) * ld + a_col);
  } else {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const __half* p = x + (i * 16 + g) * ld + kk + 2 * t;
      a[i][0] = *reinterpret_cast<const unsigned*>(p);
      a[i][1] = *reinterpret_cast<const unsigned*>(p + 8 * ld);
      a[i][2] = *reinterpret_cast<const unsigned*>(p + 8);
      a[i][3] = *reinterpret_cast<const unsigned*>(p + 8 * ld + 8);
    }
  }
}

template <int NJ, bool LDMATRIX>
__device__ __forceinline__ void load_b_fragments(const __half* w, int ld, int kk, unsigned (&b)[NJ][2]) {
  const int lane = threadIdx.x & 31;
  if (LDMATRIX) {
    // W rows are B's columns: matrices (rows j*8.., k 0-7), (j*8.., k 8-15), ((j+1)*8.., k 0-7), ((j+1)*8.., k 8-15)
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_col = kk + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int j = 0; j + 1 < NJ; j += 2)
      ldmatrix_x4(b[j][0], b[j][1], b[j + 1][0], b[j + 1][1], w + (j * 8 + b_row) * ld + b_col);
    if (NJ % 2) ldmatrix_x2(b[NJ - 1][0], b[NJ - 1][1], w + ((NJ - 1) * 8 + (lane & 7)) * ld + b_col);
  } else {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const __half* p = w + (j * 8 + g) * ld + kk + 2 * t;
      b[j][0] = *reinterpret_cast<const unsigned*>(p);
      b[j][1] = *reinterpret_cast<const unsigned*>(p + 8);
    }
  }
}

template <int MI, int NJ, bool LDMATRIX>
__device__ __forceinline__ void load_fragments(const __half* x, const __half* w, int ld, int kk, unsigned (&a)[MI][4],
                                               unsigned (&b)[NJ][2]) {
  load_a_fragments<MI, LDMATRIX>(x, ld, kk, a);
  load_b_fragments<NJ, LDMATRIX>(w, ld, kk, b);
}

template <int MI, int NJ, int K, bool LDMATRIX>
__device__ __forceinline__ void mma_step(const __half* x, const __half* w, float* acc, int ld) {
  float c[MI][NJ][4];  // the accumulators stay in registers for the whole step
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) c[i][j][r] = acc[(i * NJ + j) * 4 + r];
#pragma unroll
  for (int kk = 0; kk < K; kk += 16) {
    unsigned a[MI][4], b[NJ][2];
    load_fragments<MI, NJ, LDMATRIX>(x, w, ld, kk, a, b);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[i][j][0]), "+f"(c[i][j][1]), "+f"(c[i][j][2]), "+f"(c[i][j][3])
            : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b[j][0]), "r"(b[j][1]));
      }
  }
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[(i * NJ + j) * 4 + r] = c[i][j][r];
}

#define STRATA_MMA_ONE(PREFIX, MI, NJ, K, LDM)                                                             \
  extern "C" __device__ void PREFIX##_k##K##_m##MI##_n##NJ(const __half* x, const __half* w, float* acc, \
                                                            int ld) {                                     \
    mma_step<MI, NJ, K, LDM>(x, w, acc, ld);                                                               \
  }

#define STRATA_MMA(MI, NJ)                          \
  STRATA_MMA_ONE(strata_mma, MI, NJ, 32, false)     \
  STRATA_MMA_ONE(strata_mma, MI, NJ, 64, false)     \
  STRATA_MMA_ONE(strata_mma_ldm, MI, NJ, 32, true)  \
  STRATA_MMA_ONE(strata_mma_ldm, MI, NJ, 64, true)

STRATA_MMA(1, 1)
STRATA_MMA(1, 2)
STRATA_MMA(1, 4)
STRATA_MMA(2, 4)
STRATA_MMA(4, 4)
STRATA_MMA(2, 8)
STRATA_MMA(4, 8)

// dst[0:8] = v0..v7 rounded to float16, one 16-byte shared store (dst 16-byte aligned).
extern "C" __device__ void strata_store8_f16(__half* dst, float v0, float v1, float v2, float v3, float v4, float v5,
                                             float v6, float v7) {
  const __half2 h[4] = {__floats2half2_rn(v0, v1), __floats2half2_rn(v2, v3), __floats2half2_rn(v4, v5),
                        __floats2half2_rn(v6, v7)};
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(h);
}

// ---- The fused K loop: a block's whole GEMM tile, the accumulators in registers from the first step to the last. ----

// A packed weight matrix's planes (packing.py): quant words, f16 block fields, K-quant sub-block bytes. An F16
// matrix's quants are its values (two a word); it has no other plane.
struct WeightPlanes {
  const unsigned* quants;
  const __half* scales;
  const unsigned char* extra;
  int quant_pitch, scale_pitch, extra_pitch;
};

// One octet of weights as loaded: quant words and the factors of its (sub-)block, x = d * q + m.
struct RawWeights {
  unsigned w0, w1, w2, w3;
  float d, m;
};

// The octet's raw values; the same sums as quant_device.py's dequantizers (Q4_0 and Q8_0 as common.cuh reads them).
template <OctetFormat F>
__device__ __forceinline__ RawWeights load_weights(const WeightPlanes& p, int row, int octet) {
  const unsigned* q = p.quants + static_cast<size_t>(row) * p.quant_pitch;
  const __half* s = p.scales + static_cast<size_t>(row) * p.scale_pitch;
  if constexpr (F == kF16) {  // the values themselves, four words an octet; d = 1 marks them valid
    const uint4 w = *reinterpret_cast<const uint4*>(q + 4 * octet);
    return {w.x, w.y, w.z, w.w, 1.f, 0.f};
  } else if constexpr (F == kQ4_0 || F == kQ8_0) {
    const RawOctet r = load_octet<F>(p.quants, p.scales, row, octet, p.quant_pitch, p.scale_pitch);
    return {r.w0, r.w1, 0u, 0u, r.d, 0.f};
  } else if constexpr (F == kQ4_1) {  // d, m per 32; byte j holds element j (low nibble) and j + 16 (high)
    const int block = octet >> 2;
    const uint2 w = *reinterpret_cast<const uint2*>(q + block * 4 + (octet & 1) * 2);
    return {w.x, w.y, 0u, 0u, __half2float(s[2 * block]), __half2float(s[2 * block + 1])};
  } else if constexpr (F == kQ4_K) {  // 256 = 8 sub-blocks of 32; bytes 32c.. hold sub-blocks 2c (low), 2c + 1 (high)
    const int sb = octet >> 5, sub = octet & 31, j = sub >> 2;
    const uint2 w = *reinterpret_cast<const uint2*>(q + sb * 32 + (j >> 1) * 8 + (sub & 3) * 2);
    const unsigned char* e = p.extra + static_cast<size_t>(row) * p.extra_pitch + sb * 12;
    unsigned sc, mn;  // 6-bit scale and min of sub-block j
    if (j < 4) {
      sc = e[j] & 63;
      mn = e[j + 4] & 63;
    } else {
      sc = (e[j + 4] & 0xF) | ((e[j - 4] >> 6) << 4);
      mn = (e[j + 4] >> 4) | ((e[j] >> 6) << 4);
    }
    return {w.x, w.y, 0u, 0u, __half2float(s[2 * sb]) * static_cast<float>(sc),
            -(__half2float(s[2 * sb + 1]) * static_cast<float>(mn))};
  } else {  // Q6_K: element 32q + l of half n takes ql[64n + 32(q%2) + l] nibble q/2 and qh[32n + l] bits 2q
    const int sb = octet >> 5, e = (octet & 31) * 8, n = e >> 7, qq = (e & 127) >> 5, l0 = e & 31;
    const uint2 lo = *reinterpret_cast<const uint2*>(q + sb * 48 + n * 16 + (qq & 1) * 8 + (l0 >> 2));
    const uint2 hi = *reinterpret_cast<const uint2*>(q + sb * 48 + 32 + n * 8 + (l0 >> 2));
    const signed char sub_scale = static_cast<signed char>(
        p.extra[static_cast<size_t>(row) * p.extra_pitch + sb * 16 + n * 8 + qq * 2 + (l0 >> 4)]);
    return {lo.x, lo.y, hi.x, hi.y, __half2float(s[sb]) * static_cast<float>(sub_scale), 0.f};
  }
}

template <OctetFormat F>
__device__ __forceinline__ uint4 dequant_weights(const RawWeights& r, int octet) {
  if constexpr (F == kF16) {  // an octet past the end (d = 0): zeros
    if (r.d == 0.f) return {0u, 0u, 0u, 0u};
    return {r.w0, r.w1, r.w2, r.w3};
  } else if constexpr (F == kQ4_0 || F == kQ8_0) {
    return dequant_octet<F>(RawOctet{r.w0, r.w1, r.d}, octet);
  } else {
    float x[8];
    if constexpr (F == kQ6_K) {
      const int qq = (((octet & 31) * 8) & 127) >> 5, lo_shift = (qq >> 1) * 4, hi_shift = qq * 2;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[i] = r.d * small_int(((r.w0 >> (8 * i + lo_shift)) & 0xF) | (((r.w2 >> (8 * i + hi_shift)) & 3) << 4),
                               8388640.f);
        x[4 + i] = r.d * small_int(((r.w1 >> (8 * i + lo_shift)) & 0xF) | (((r.w3 >> (8 * i + hi_shift)) & 3) << 4),
                                   8388640.f);
      }
    } else {  // Q4_1, Q4_K: d * q + m, nibbles as in Q4_0
      const int shift = F == kQ4_1 ? ((octet & 3) >> 1) * 4 : (((octet & 31) >> 2) & 1) * 4;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[i] = r.d * small_int((r.w0 >> (8 * i + shift)) & 0xF, 8388608.f) + r.m;
        x[4 + i] = r.d * small_int((r.w1 >> (8 * i + shift)) & 0xF, 8388608.f) + r.m;
      }
    }
    return {pack_half2(x[0], x[1]), pack_half2(x[2], x[3]), pack_half2(x[4], x[5]), pack_half2(x[6], x[7])};
  }
}

// Accumulator fragments between registers c and their array acc (gemm_mma.py's order): in, or back out.
template <bool TO_REGISTERS, int MI, int NJ>
__device__ __forceinline__ void move_accumulators(float (&c)[MI][NJ][4], float* acc) {
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if constexpr (TO_REGISTERS) c[i][j][r] = acc[(i * NJ + j) * 4 + r];
        else acc[(i * NJ + j) * 4 + r] = c[i][j][r];
      }
}

// acc_a (and acc_b for NUM_W 2, gate and up sharing the X tile) += X[x_rows] * W[w_row0 ..]^T over 32 * num_k32:
//   x       f16 [rows][x_pitch] in global memory; x_rows [BM] (shared): the X row of each tile row, -1 a zero row
//   wa, wb  packed weights of format F; tile row n is W row w_row0 + n, zeros from w_row_end on
//   xs, wsa, wsb  shared f16 buffers of 2 x [BM][K + 8] and 2 x [BN][K + 8]: K steps (32 or 64 wide) alternate
//           between them; a 64-wide last step over an odd num_k32 is zero-filled past the end
// The next step's X rows fly as cp.async copies and its W octets as registers while this step's mma run, then
// the W octets are dequantized into the other buffer: one barrier a step (a 64-wide step halves the barriers and
// gives those loads twice the mma to hide behind). acc_* leave in gemm_mma.py's fragment order, read at the start
// and written at the end. Every thread of the block calls it.
template <OctetFormat F, int BM, int BN, int WARPS_M, int WARPS_N, int NUM_W, int K>
__device__ __forceinline__ void gemm_fused(const __half* x, int x_pitch, const int* x_rows, int num_k32,
                                           const WeightPlanes& wa, const WeightPlanes& wb, int w_row0, int w_row_end,
                                           __half* xs, __half* wsa, __half* wsb, float* acc_a, float* acc_b) {
  static_assert(K == 32 || K == 64, "K steps of 32 or 64");
  constexpr int LD = K + 8, THREADS = 32 * WARPS_M * WARPS_N, ROW_OCTETS = K / 8, ROW_SHIFT = K == 32 ? 2 : 3;
  constexpr int MI = BM / WARPS_M / 16, NJ = BN / WARPS_N / 8;
  constexpr int X_OCTETS = BM * ROW_OCTETS, W_OCTETS = BN * ROW_OCTETS;
  const int num_octets = 4 * num_k32, num_steps = K == 32 ? num_k32 : (num_k32 + 1) / 2;  // octets of a row, steps
  constexpr int PX = (X_OCTETS + THREADS - 1) / THREADS, PW = (W_OCTETS + THREADS - 1) / THREADS;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int x_off = (warp / WARPS_N) * (BM / WARPS_M) * LD, w_off = (warp % WARPS_N) * (BN / WARPS_N) * LD;

  float ca[MI][NJ][4], cb[NUM_W == 2 ? MI : 1][NUM_W == 2 ? NJ : 1][4];
  move_accumulators<true>(ca, acc_a);
  if constexpr (NUM_W == 2) move_accumulators<true>(cb, acc_b);
  RawWeights ra[PW], rb[NUM_W == 2 ? PW : 1];

  auto load = [&](int step, int buf) {  // X by cp.async into buffer buf, W octets into registers
#pragma unroll
    for (int i = 0; i < PX; ++i) {
      const int idx = tid + i * THREADS, m = idx >> ROW_SHIFT, oc = idx & (ROW_OCTETS - 1);
      const int octet = step * ROW_OCTETS + oc;
      if (X_OCTETS % THREADS == 0 || idx < X_OCTETS) {
        const int row = x_rows[m];
        const bool is_in_row = K == 32 || octet < num_octets;  // 32-wide steps never pass the end of a row
        cp_async_16(xs + buf * BM * LD + m * LD + 8 * oc,  // invalid: zeros, nothing read
                    x + static_cast<size_t>(row < 0 ? 0 : row) * x_pitch + (is_in_row ? 8 * octet : 0),
                    row >= 0 && is_in_row);
      }
    }
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < PW; ++i) {
      const int idx = tid + i * THREADS, n = idx >> ROW_SHIFT, octet = step * ROW_OCTETS + (idx & (ROW_OCTETS - 1));
      if (W_OCTETS % THREADS == 0 || idx < W_OCTETS) {
        const bool valid = w_row0 + n < w_row_end && (K == 32 || octet < num_octets);  // else row 0's octet 0, as zeros
        const int row = valid ? w_row0 + n : 0;
        ra[i] = load_weights<F>(wa, row, valid ? octet : 0);
        if (!valid) ra[i].d = ra[i].m = 0.f;
        if constexpr (NUM_W == 2) {
          rb[i] = load_weights<F>(wb, row, valid ? octet : 0);
          if (!valid) rb[i].d = rb[i].m = 0.f;
        }
      }
    }
  };
  auto store = [&](int step, int buf) {  // step's W octets dequantized into buffer buf, 16 bytes a store
#pragma unroll
    for (int i = 0; i < PW; ++i) {
      const int idx = tid + i * THREADS, n = idx >> ROW_SHIFT, oc = idx & (ROW_OCTETS - 1);
      const int octet = step * ROW_OCTETS + oc;
      if (W_OCTETS % THREADS == 0 || idx < W_OCTETS) {
        // an octet past the end has zero factors: zeros, whatever its position selects
        *reinterpret_cast<uint4*>(wsa + buf * BN * LD + n * LD + 8 * oc) = dequant_weights<F>(ra[i], octet);
        if constexpr (NUM_W == 2)
          *reinterpret_cast<uint4*>(wsb + buf * BN * LD + n * LD + 8 * oc) = dequant_weights<F>(rb[i], octet);
      }
    }
  };
  auto compute = [&](int buf) {
#pragma unroll
    for (int kk = 0; kk < K; kk += 16) {
      unsigned a[MI][4], b[NJ][2];
      load_fragments<MI, NJ, true>(xs + buf * BM * LD + x_off, wsa + buf * BN * LD + w_off, LD, kk, a, b);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j) mma_16816(ca[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b[j][0], b[j][1]);
      if constexpr (NUM_W == 2) {  // the same X fragments (a), against the second weight's B fragments
        load_b_fragments<NJ, true>(wsb + buf * BN * LD + w_off, LD, kk, b);
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NJ; ++j) mma_16816(cb[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b[j][0], b[j][1]);
      }
    }
  };

  if (num_steps > 0) {
    load(0, 0);
    store(0, 0);
  }
  for (int step = 0; step < num_steps; ++step) {
    const int cur = step & 1;
    cp_async_wait_all();
    __syncthreads();  // step's tiles are in place, and every warp is done with the other buffer
    const bool has_next = step + 1 < num_steps;
    if (has_next) load(step + 1, cur ^ 1);
    compute(cur);
    if (has_next) store(step + 1, cur ^ 1);
  }
  move_accumulators<false>(ca, acc_a);
  if constexpr (NUM_W == 2) move_accumulators<false>(cb, acc_b);
}

// The fused loop is instantiated on demand: gemm_mma.py appends one STRATA_GEMM_FUSED line per kernel.
#define STRATA_GEMM_FUSED(FMT, BM, BN, WM, WN, NW, K)                                                              \
  extern "C" __device__ void strata_gemm_fused_##FMT##_m##BM##_n##BN##_w##WM##x##WN##_x##NW##_k##K(               \
      const __half* x, int x_pitch, const int* x_rows, int num_k32, const unsigned* qa, const __half* sa,         \
      const unsigned char* ea, const unsigned* qb, const __half* sb, const unsigned char* eb, int quant_pitch,    \
      int scale_pitch, int extra_pitch, int w_row0, int w_row_end, __half* xs, __half* wsa, __half* wsb,          \
      float* acc_a, float* acc_b) {                                                                                \
    const WeightPlanes wa{qa, sa, ea, quant_pitch, scale_pitch, extra_pitch};                                      \
    const WeightPlanes wb{qb, sb, eb, quant_pitch, scale_pitch, extra_pitch};                                      \
    gemm_fused<k##FMT, BM, BN, WM, WN, NW, K>(x, x_pitch, x_rows, num_k32, wa, wb, w_row0, w_row_end, xs, wsa,    \
                                              wsb, acc_a, acc_b);                                                  \
  }
