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

template <int MI, int NJ, bool LDMATRIX>
__device__ __forceinline__ void load_fragments(const __half* x, const __half* w, int ld, int kk, unsigned (&a)[MI][4],
                                               unsigned (&b)[NJ][2]) {
  const int lane = threadIdx.x & 31;
  if (LDMATRIX) {
    // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = kk + 8 * (lane >> 4);
#pragma unroll
    for (int i = 0; i < MI; ++i) ldmatrix_x4(a[i][0], a[i][1], a[i][2], a[i][3], x + (i * 16 + a_row) * ld + a_col);
    // B (W rows are B's columns): matrices (rows j*8.., k 0-7), (j*8.., k 8-15), ((j+1)*8.., k 0-7), ((j+1)*8.., k 8-15)
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_col = kk + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int j = 0; j + 1 < NJ; j += 2)
      ldmatrix_x4(b[j][0], b[j][1], b[j + 1][0], b[j + 1][1], w + (j * 8 + b_row) * ld + b_col);
    if (NJ % 2) ldmatrix_x2(b[NJ - 1][0], b[NJ - 1][1], w + ((NJ - 1) * 8 + (lane & 7)) * ld + b_col);
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
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const __half* p = w + (j * 8 + g) * ld + kk + 2 * t;
      b[j][0] = *reinterpret_cast<const unsigned*>(p);
      b[j][1] = *reinterpret_cast<const unsigned*>(p + 8);
    }
  }
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
//
// acc_a (and acc_b for NUM_W 2, gate and up sharing the X tile) += X[x_rows] * W[w_row0 ..]^T over K = 32 * num_k32:
//   x       f16 [rows][x_pitch] in global memory; x_rows [BM] (shared): the X row of each tile row, -1 a zero row
//   W       packed Q4_0 / Q8_0 planes (quant words [rows][quant_pitch], f16 scales [rows][scale_pitch]);
//           tile row n is W row w_row0 + n, zeros from w_row_end on
//   xs, wsa, wsb  shared f16 buffers of 2 x [BM][40] and 2 x [BN][40]: K steps of 32 alternate between them
// The next step's X rows fly as cp.async copies and its W octets as registers while this step's mma run, then
// the W octets are dequantized into the other buffer: one barrier a step. acc_* leave in gemm_mma.py's fragment
// order, written once at the end. Every thread of the block calls it.
template <OctetFormat F, int BM, int BN, int WARPS_M, int WARPS_N, int NUM_W>
__device__ __forceinline__ void gemm_fused(const __half* x, int x_pitch, const int* x_rows, int num_k32,
                                           const unsigned* qa, const __half* sa, const unsigned* qb, const __half* sb,
                                           int quant_pitch, int scale_pitch, int w_row0, int w_row_end, __half* xs,
                                           __half* wsa, __half* wsb, float* acc_a, float* acc_b) {
  constexpr int K = 32, LD = K + 8, THREADS = 32 * WARPS_M * WARPS_N;
  constexpr int MI = BM / WARPS_M / 16, NJ = BN / WARPS_N / 8;
  constexpr int X_OCTETS = BM * K / 8, W_OCTETS = BN * K / 8;
  constexpr int PX = (X_OCTETS + THREADS - 1) / THREADS, PW = (W_OCTETS + THREADS - 1) / THREADS;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int x_off = (warp / WARPS_N) * (BM / WARPS_M) * LD, w_off = (warp % WARPS_N) * (BN / WARPS_N) * LD;

  float ca[MI][NJ][4], cb[NUM_W == 2 ? MI : 1][NUM_W == 2 ? NJ : 1][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        ca[i][j][r] = 0.f;
        if constexpr (NUM_W == 2) cb[i][j][r] = 0.f;
      }
  RawOctet ra[PW], rb[NUM_W == 2 ? PW : 1];

  auto load = [&](int step, int buf) {  // X by cp.async into buffer buf, W octets into registers
#pragma unroll
    for (int i = 0; i < PX; ++i) {
      const int idx = tid + i * THREADS, m = idx >> 2, oc = idx & 3;
      if (X_OCTETS % THREADS == 0 || idx < X_OCTETS) {
        const int row = x_rows[m];
        cp_async_16(xs + buf * BM * LD + m * LD + 8 * oc, x + static_cast<size_t>(row < 0 ? 0 : row) * x_pitch +
                    step * K + 8 * oc, row >= 0);
      }
    }
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < PW; ++i) {
      const int idx = tid + i * THREADS, n = idx >> 2, octet = step * 4 + (idx & 3);
      if (W_OCTETS % THREADS == 0 || idx < W_OCTETS) {
        const bool valid = w_row0 + n < w_row_end;
        const int row = valid ? w_row0 + n : 0;
        ra[i] = load_octet<F>(qa, sa, row, octet, quant_pitch, scale_pitch);
        if (!valid) ra[i].d = 0.f;
        if constexpr (NUM_W == 2) {
          rb[i] = load_octet<F>(qb, sb, row, octet, quant_pitch, scale_pitch);
          if (!valid) rb[i].d = 0.f;
        }
      }
    }
  };
  auto store = [&](int buf) {  // the W octets dequantized into buffer buf, 16 bytes a store
#pragma unroll
    for (int i = 0; i < PW; ++i) {
      const int idx = tid + i * THREADS, n = idx >> 2, oc = idx & 3;
      if (W_OCTETS % THREADS == 0 || idx < W_OCTETS) {
        *reinterpret_cast<uint4*>(wsa + buf * BN * LD + n * LD + 8 * oc) = dequant_octet<F>(ra[i], oc);
        if constexpr (NUM_W == 2)
          *reinterpret_cast<uint4*>(wsb + buf * BN * LD + n * LD + 8 * oc) = dequant_octet<F>(rb[i], oc);
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
      if constexpr (NUM_W == 2) {
        load_fragments<MI, NJ, true>(xs + buf * BM * LD + x_off, wsb + buf * BN * LD + w_off, LD, kk, a, b);
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NJ; ++j) mma_16816(cb[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b[j][0], b[j][1]);
      }
    }
  };

  if (num_k32 > 0) {
    load(0, 0);
    store(0);
  }
  for (int step = 0; step < num_k32; ++step) {
    const int cur = step & 1;
    cp_async_wait_all();
    __syncthreads();  // step's tiles are in place, and every warp is done with the other buffer
    const bool has_next = step + 1 < num_k32;
    if (has_next) load(step + 1, cur ^ 1);
    compute(cur);
    if (has_next) store(cur ^ 1);
  }
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        acc_a[(i * NJ + j) * 4 + r] = ca[i][j][r];
        if constexpr (NUM_W == 2) acc_b[(i * NJ + j) * 4 + r] = cb[i][j][r];
      }
}

// The fused loop is instantiated on demand: gemm_mma.py appends one STRATA_GEMM_FUSED line per kernel.
#define STRATA_GEMM_FUSED(FMT, BM, BN, WM, WN, NW)                                                               \
  extern "C" __device__ void strata_gemm_fused_##FMT##_m##BM##_n##BN##_w##WM##x##WN##_x##NW(                    \
      const __half* x, int x_pitch, const int* x_rows, int num_k32, const unsigned* qa, const __half* sa,       \
      const unsigned* qb, const __half* sb, int quant_pitch, int scale_pitch, int w_row0, int w_row_end,        \
      __half* xs, __half* wsa, __half* wsb, float* acc_a, float* acc_b) {                                        \
    gemm_fused<k##FMT, BM, BN, WM, WN, NW>(x, x_pitch, x_rows, num_k32, qa, sa, qb, sb, quant_pitch, scale_pitch, \
                                           w_row0, w_row_end, xs, wsa, wsb, acc_a, acc_b);                       \
  }
