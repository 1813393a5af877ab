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
#include <cuda_fp16.h>

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
