// Vector reductions into global memory, for epilogues that add into a shared output (moe.py's down
// product). A source of its own: a kernel links each source once, and the GEMM sources are linked
// with their own instantiations.

// dst[0] += a, dst[1] += b in one vector reduction (sm_90; dst 8-byte aligned): the MoE down
// epilogue adds each accumulator pair (adjacent columns of one row) with half the atomics.
extern "C" __device__ void strata_red_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// v as 64-bit fixed point in units of 2^-32 (fixed_sums.py; v * 2^32 is exact in float32), or the poison 2^57
// where v is not finite or of 2^19 or more, which the fold turns into NaN.
static __device__ __forceinline__ unsigned long long fixed_units(float v) {
  return static_cast<unsigned long long>(fabsf(v) < 524288.0f ? __float2ll_rn(v * 4294967296.0f) : (1LL << 57));
}

// dst[0] += a, dst[1] += b in fixed point: integer adds, so the sums have the same bits in any order.
extern "C" __device__ void strata_fixed_add2(long long* dst, float a, float b) {
  unsigned long long* at = reinterpret_cast<unsigned long long*>(dst);
  atomicAdd(at, fixed_units(a));
  atomicAdd(at + 1, fixed_units(b));
}
