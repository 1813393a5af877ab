// Device helpers shared by the tensor-core kernels (attention_mma.cu, gemm_mma.cu); the Python loader
// (tensor_core.cu_source) inlines this file where a source includes it.
//
// Quantized octets: 8 consecutive elements of one row of a packed matrix (packing.py's planes: quant
// words [rows][quant_pitch], f16 block scales [rows][scale_pitch]), read as two quant words and the
// block scale, dequantized to the f16 roundings of d * q (the values the Numba dequantizers stage),
// stored as one 16-byte shared store.
#ifndef STRATA_COMMON_CUH
#define STRATA_COMMON_CUH
#include <cuda_fp16.h>

namespace {

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// c[0..3] += A (16 x 16, f16) * B (16 x 8, f16), f32 accumulators in the m16n8k16 fragment layout
__device__ __forceinline__ void mma_16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

enum OctetFormat { kF16, kQ8_0, kQ4_0, kQ4_1, kQ4_K, kQ6_K };

[[maybe_unused]] __device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(addr), "l"(src), "r"(valid ? 16 : 0));
}
[[maybe_unused]] __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
[[maybe_unused]] __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// 2^23 + b as a float minus the bias: small integer to float without a conversion instruction
[[maybe_unused]] __device__ __forceinline__ float small_int(unsigned b, float bias) { return __int_as_float(0x4B000000 | b) - bias; }

// One quantized octet as read from global memory: two quant words and the block scale.
struct RawOctet {
  unsigned w0, w1;
  float d;
};

template <OctetFormat F>
__device__ __forceinline__ RawOctet load_octet(const unsigned* quants, const __half* scales, int row, int octet,
                                               int quant_pitch, int scale_pitch) {
  const int block = octet >> 2;
  const int word = F == kQ8_0 ? block * 8 + (octet & 3) * 2 : block * 4 + (octet & 1) * 2;
  const uint2 w = *reinterpret_cast<const uint2*>(quants + static_cast<size_t>(row) * quant_pitch + word);
  return {w.x, w.y, __half2float(scales[static_cast<size_t>(row) * scale_pitch + block])};
}

// Two halves d * (b - bias) from a word holding 1024 + b in each half (b a small integer): the bias subtracts
// exactly and the product rounds once, so each half equals d * (b - bias) computed in float (exact there: an
// 11-bit scale times an integer of at most 8 bits) and rounded to half, as the Numba dequantizers stage it.
[[maybe_unused]] __device__ __forceinline__ unsigned scaled_half2(unsigned biased, unsigned bias, __half2 d) {
  const __half2 value = *reinterpret_cast<const __half2*>(&biased), offset = *reinterpret_cast<const __half2*>(&bias);
  const __half2 h = __hmul2(__hsub2(value, offset), d);
  return *reinterpret_cast<const unsigned*>(&h);
}

// Q4_0 and Q8_0: the four bytes of each word (Q4_0 nibbles masked to bytes, Q8_0 bytes offset to unsigned) are
// set into the mantissas of 1024.0 (0x64XX) by byte permutes: a few integer and half2 instructions an octet
// where float conversions took four a value.
template <OctetFormat F>
__device__ __forceinline__ uint4 dequant_octet(const RawOctet& raw, int octet) {
  const __half2 d = __float2half2_rn(raw.d);  // exact: the scale was a half
  const unsigned bias = F == kQ8_0 ? 0x64806480u : 0x64086408u;  // 1024 + 128 (int8 offset), 1024 + 8
  unsigned w0, w1;
  if (F == kQ8_0) {
    w0 = raw.w0 ^ 0x80808080u;
    w1 = raw.w1 ^ 0x80808080u;
  } else {  // Q4_0: byte j holds element j (low nibble) and j + 16 (high)
    const int shift = ((octet & 3) >> 1) * 4;
    w0 = (raw.w0 >> shift) & 0x0F0F0F0Fu;
    w1 = (raw.w1 >> shift) & 0x0F0F0F0Fu;
  }
  // byte_perm selectors: result bytes (b0, 0x64, b1, 0x64) and (b2, 0x64, b3, 0x64)
  return {scaled_half2(__byte_perm(w0, 0x64646464u, 0x4140), bias, d),
          scaled_half2(__byte_perm(w0, 0x64646464u, 0x4342), bias, d),
          scaled_half2(__byte_perm(w1, 0x64646464u, 0x4140), bias, d),
          scaled_half2(__byte_perm(w1, 0x64646464u, 0x4342), bias, d)};
}

}  // namespace

#endif  // STRATA_COMMON_CUH
