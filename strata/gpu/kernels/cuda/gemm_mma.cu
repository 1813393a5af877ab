// Warp-level tensor-core products for the prefill GEMMs (gemm_mma.py).
//
// One call: one 32-wide K step of one warp's tile, acc[MI][NJ][4] += X[MI*16 rows][32] * W[NJ*8 rows][32]^T.
// X and W are float16 tiles in shared memory, row-major with a row stride of `ld` halves (padded so
// the 8 row groups of a fragment load hit different banks); acc is the warp's accumulator
// fragments in the mma.m16n8k16 layout (lane g = lane/4, t = lane%4: acc[i][j][r] is element
// (i*16 + g + 8*(r/2), j*8 + 2*t + r%2) of the warp tile).
#include <cuda_fp16.h>

template <int MI, int NJ>
__device__ __forceinline__ void mma_k32(const __half* x, const __half* w, float* acc, int ld) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < 32; kk += 16) {
    unsigned a[MI][4], b[NJ][2];
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
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        float* c = acc + (i * NJ + j) * 4;
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b[j][0]), "r"(b[j][1]));
      }
  }
}

#define STRATA_MMA_K32(MI, NJ)                                                                      \
  extern "C" __device__ void strata_mma_k32_m##MI##_n##NJ(const __half* x, const __half* w, float* acc, \
                                                          int ld) {                                  \
    mma_k32<MI, NJ>(x, w, acc, ld);                                                                  \
  }

STRATA_MMA_K32(1, 1)
STRATA_MMA_K32(1, 2)
STRATA_MMA_K32(1, 4)
STRATA_MMA_K32(2, 4)
STRATA_MMA_K32(4, 4)
STRATA_MMA_K32(2, 8)
STRATA_MMA_K32(4, 8)
