// MoE expert products for chunks of few routed rows an expert (moe_rows.py): the weight rows are the
// mma's M and the tile's tokens its N, so a tile of up to 64 tokens pays for whole 8-token groups only,
// and each weight element is dequantized once a tile, straight into A fragments in registers. Experts of
// Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS or IQ3_XXS (gate and up of one format, down of its own): the format is a
// template argument
// F, and the comments below describe Q4_0 first, then what the others change (see "Other formats").
//
// A block: 4 warps, each owning 16 weight rows (rows g and g + 8 of a lane: g = lane / 4, t = lane % 4) of
// the block's 64, of two weights (gate and up, or two halves of down), against all the tile's tokens in
// groups of 8. The number of groups G is a template argument, picked once a tile (a switch on the tile's
// rows): every loop over groups unrolls to exactly G, and a tile of 4 groups holds 32 accumulators, not 64.
// Every step stages 64 of K through a ring of STAGES by cp.async: the X rows of the tile's tokens, and the
// weights' raw Q4_0 blocks (quant words and f16 scales); one barrier a step.
//
// K order inside an mma: the products of a 16-wide mma may pair A's and B's k in any order, as long as
// both use the same. Lane t takes the physical elements 4t .. 4t + 3 of each 16-element half of a 32-element
// block: quant word t of the block (bytes 4t .. 4t + 3 hold elements 4t .. 4t + 3 in their low nibbles,
// 16 + 4t .. in their high), and one 8-byte load of each X row. In the mma, elements 4t and 4t + 2 are
// logical k 2t, 2t + 1 (registers a0 / a1, b0), and 4t + 1 and 4t + 3 are 2t + 8, 2t + 9 (a2 / a3, b1):
// one mask of a quant word then sets two nibbles (bytes 0 and 2, or 1 and 3) into the mantissas of a half2
// (Marlin's dequantization), with no byte permutes. X holds each aligned quad of columns in the order
// (0, 2, 1, 3) (moe_rows.stage_x; gate/up writes hidden so), so that one 8-byte load of X gives b0 and b1.
//
// A stage's shared layout (bank-conflict-free for the loads of a step), all three regions at one stage offset:
//   X   [64 tokens][64 halves]; the 16-byte chunk q of row r at chunk q ^ (2r mod 8)
//   Wq  [2 weights][64 rows][8 words]; the 4 words of block b of row r at 4 * (b ^ (r / 4 mod 2))
//   Ws  [4 warps][8 g][weight][row g, g + 8] words, each the f16 scales of the row's two blocks: one 16-byte
//       load a lane
// Numerics: each weight is the f16 rounding of d * (q - 8) (as gemm_mma.cu's dequantizer), X is f16,
// the sums f32 in the mma.
//
// Other formats. Every format stages X and orders K as Q4_0 does (X elements 32b + 4t .. 4t + 3 and 32b + 16 + 4t ..
// of a step's block b meet lane t's lo and hi registers); only where the weights come from differs:
//   Q8_0  a row's step is 64 quant bytes, 4 chunks of 16 (block b: chunks 2b, 2b + 1), at chunk c ^ (r / 2 mod 4);
//         lo takes word t of chunk 2b, hi word t of chunk 2b + 1, each byte an int8: (q + 128) set into the
//         mantissa of 1024 by one mask and xor, less 1152 is q, times d; 2 stages (3 would pass 48 KiB)
//   Q4_K  a step is a quarter of a 256-element super-block: its 32 quant bytes hold sub-block 2j + b (j = step
//         mod 4) in their low (b = 0) or high (b = 1) nibbles, bytes 0 .. 15 in chunk 0 and 16 .. 31 in chunk 1,
//         staged as Q4_0's two chunks; lo takes word t of chunk 0, hi word t of chunk 1, nibbles 4b up. Beside
//         them a row's record: the super-block's f16 d and dmin, and its 12 bytes of 6-bit scales and mins.
//         Each weight is the f16 rounding of the float d * sc * q - dmin * m, as gguf-py computes it in float32.
//   Q5_K  Q4_K's step and record, and beside the 32 bytes of qs the super-block's 32 bytes of qh (its fifth bits: bit
//         j of byte l for element l of sub-block j), a row's step 64 bytes as Q8_0's (qs in chunks 0, 1, qh in 2, 3;
//         2 stages). lo takes word t of qs chunk 0 and of qh chunk 2, hi those of chunks 1 and 3.
//   Q6_K  a super-block's 128 bytes of ql hold its 32-element groups 4h + i (low nibbles of bytes 64h + 32i ..) and
//         4h + 2 + i (high nibbles), h, i in 0, 1; its 64 bytes of qh their top two bits (bits 2 (c mod 4) of byte
//         32h + l for element l of group c). A step j of a super-block takes groups 4h + i and 4h + 2 + i (h = j / 2,
//         i = j mod 2): one 32-byte run of ql and the 32 bytes of qh of its half, staged as Q5_K's. So its X is
//         not 64 columns in a row but two runs of 32, 64 apart (x_step_column). The record: the word that holds
//         d, then the 8 int8 scales of the half (one a 16-element half of a group). Each weight is the f16 rounding
//         of the float d * sc * (q - 32), exact in float as gguf-py's.
//   IQ4_XS a step's 32 quant bytes are two 32-element sub-blocks laid out as Q4_0's blocks (low nibbles elements
//         0 .. 15, high 16 .. 31), staged as Q4_0's; each nibble picks one of 16 int8 levels (a byte permute of the
//         level table), set into halves as Q8_0's bytes. The record: Q6_K's word of d, then the two aligned words
//         that hold the super-block's 6 scale bytes (scales_h, scales_l; a row's extra pitch is even, so they start
//         at byte 0 or 2 of the first). Each weight is the f16 rounding of the float d * (ls - 32) * level, exact in
//         float as gguf-py's.
//   IQ3_XXS a step's two 32-element sub-blocks are 16 bytes of grid indices (8 a sub-block, each 4 elements' magnitudes
//         in kIq3XxsGrid) and 8 bytes of sign-and-scale words (one a sub-block: four 7-bit sign groups of 8 elements,
//         the 8th sign the group's parity, and a 4-bit scale ls), staged as Q4_0's two chunks (the words in the first 8
//         bytes of chunk 1). Lane t's elements 4t .. 4t + 3 and 16 + 4t .. of sub-block b are grid entries t and 4 + t:
//         bytes t of qs words 2b and 2b + 1. A row's scale word is Q6_K's word of d. Each weight is the f16 rounding of
//         the float d * (0.5 + ls) * 0.5 * magnitude, its sign set after (rounding is symmetric), as gguf-py's.
//
// Why the addressing is spelled out: at few groups a step's work is mostly the weights' side and the
// addresses. Every shared access is an ld.shared / cp.async from a base register set before the K loop
// plus the stage's offset, with the rest (group, weight, row half) an immediate, so ptxas has nothing to
// recompute inside the loop; the kernels pass the shared block as a generic pointer, through which each
// load would first test which memory it is.
#include <cuda_fp16.h>

#include "common.cuh"
#include "iquants.cuh"

namespace {

enum RowsFormat { kRowsQ4_0, kRowsQ8_0, kRowsQ4_K, kRowsQ5_K, kRowsQ6_K, kRowsIQ4_XS, kRowsIQ3_XXS };

// K-quants and IQ4_XS: a record of the super-block a row and step
__host__ __device__ constexpr bool has_record(int F) {
  return F == kRowsQ4_K || F == kRowsQ5_K || F == kRowsQ6_K || F == kRowsIQ4_XS;
}
// one f16 d a super-block in the scale plane: read in the aligned word that holds it
__host__ __device__ constexpr bool has_lone_d(int F) { return F == kRowsQ6_K || F == kRowsIQ4_XS || F == kRowsIQ3_XXS; }
// qh beside the nibbles
__host__ __device__ constexpr bool has_high_bits(int F) { return F == kRowsQ5_K || F == kRowsQ6_K; }
// 64 quant bytes a row and step
__host__ __device__ constexpr bool is_wide(int F) { return F == kRowsQ8_0 || has_high_bits(F); }

constexpr int STEP_K = 64, WARP_ROWS = 16, NW = 2;
constexpr int X_BYTES = 2 * 64 * STEP_K;  // 8 KiB: 64 tokens
constexpr int GROUP_BYTES = 8 * 2 * STEP_K;  // 8 X rows

// A stage's regions for format F: X, then NW weights of 64 rows of ROW_BYTES quant bytes, then the scales.
// Q4_0: 2 KiB a weight (64 rows x 2 blocks x 16 B) and 512 B of scales, 12,800 B a stage.
template <int F>
struct Stage {
  static constexpr int STAGES = is_wide(F) ? 2 : 3;  // 3 of 64-byte rows would pass 48 KiB
  static constexpr int ROW_BYTES = is_wide(F) ? 64 : 32;  // a weight row's quant bytes a step
  static constexpr int W_BYTES = 64 * ROW_BYTES;
  static constexpr int S_ROW_BYTES = has_record(F) ? 16 : 4;  // K-quants: a 16-byte record a row and weight
  static constexpr int W_AT = X_BYTES, S_AT = X_BYTES + NW * W_BYTES;
  static constexpr int BYTES = S_AT + S_ROW_BYTES * NW * 64;
  static constexpr int ROW_HALF_BYTES = 8 * ROW_BYTES;  // 8 weight rows
};

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// cp.async of 16 / 4 bytes to shared address dst + OFFSET; with valid false nothing is read and zeros are written
template <int OFFSET>
__device__ __forceinline__ void copy16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0+%2], [%1], 16;" ::"r"(dst), "l"(src), "n"(OFFSET));
}
template <int OFFSET>
__device__ __forceinline__ void copy16_or_zeros(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0+%3], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0),
               "n"(OFFSET));
}
__device__ __forceinline__ void copy4_part(unsigned dst, const void* src, int num_bytes) {  // the rest zeros
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(num_bytes));
}
__device__ __forceinline__ void copy4_or_zeros(unsigned dst, const void* src, bool valid) {
  copy4_part(dst, src, valid ? 4 : 0);
}
__device__ __forceinline__ void copy8_or_zeros(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
}

// volatile: each stays between the barriers and cp.async waits that order it against the ring's copies
template <int OFFSET>
__device__ __forceinline__ unsigned load_shared(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.u32 %0, [%1+%2];" : "=r"(v) : "r"(addr), "n"(OFFSET));
  return v;
}
template <int OFFSET>
__device__ __forceinline__ uint2 load_shared2(unsigned addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2+%3];" : "=r"(v.x), "=r"(v.y) : "r"(addr), "n"(OFFSET));
  return v;
}
__device__ __forceinline__ uint4 load_shared4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

template <int N>
__device__ __forceinline__ void wait_pending() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Two f16 halves d * (q - 8) of the nibbles set by a mask (0x000F000F: the low nibbles of bytes 0 and 2;
// 0x00F000F0: their high nibbles) of `word`, into the mantissas of 1024.0 (`one024`: 0x64006400): a low nibble
// reads 1024 + q, less 1032 is q - 8; a high one reads 1024 + 16q, times 1/16 less 72 is q - 8 (exact in one
// rounding). The product with d rounds once, as gemm_mma.cu's dequantizer.
template <unsigned MASK>
__device__ __forceinline__ unsigned mask_into(unsigned word, unsigned one024) {  // (word & MASK) | one024
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(word), "n"(MASK), "r"(one024));
  return r;
}
__device__ __forceinline__ unsigned q4_low_pair(unsigned word, __half2 d, unsigned one024) {
  return scaled_half2(mask_into<0x000F000Fu>(word, one024), 0x64086408u, d);
}
__device__ __forceinline__ unsigned q4_high_pair(unsigned word, __half2 d, unsigned one024) {
  const unsigned biased = mask_into<0x00F000F0u>(word, one024);
  const __half2 value = *reinterpret_cast<const __half2*>(&biased);
  const __half2 h = __hmul2(__hfma2(value, __float2half2_rn(0.0625f), __float2half2_rn(-72.f)), d);
  return *reinterpret_cast<const unsigned*>(&h);
}

// Where moe_rows.stage_x puts column c of a row: each aligned quad in the order (0, 2, 1, 3).
__device__ __forceinline__ int staged_column(int c) { return (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1); }

// 0x64006400 in a register that ptxas does not see as a constant: given two immediates, it splits each
// mask_into in two LOP3 (one operand of a LOP3 may be an immediate), a third of the dequantization's work
__device__ __forceinline__ unsigned opaque_one024() {
  unsigned v;
  asm volatile("mov.b32 %0, 0x64006400;" : "=r"(v));
  return v;
}

// A fragments of block b's two 16-element halves (lo: low nibbles, hi: high) of rows g and g + 8, from their
// quant words w0, w1 and scale words s0, s1 (the f16 scales of the row's blocks 0 and 1).
__device__ __forceinline__ void dequant_block(unsigned w0, unsigned w1, unsigned s0, unsigned s1, int b,
                                              unsigned one024, unsigned (&lo)[4], unsigned (&hi)[4]) {
  const __half2 h0 = *reinterpret_cast<const __half2*>(&s0), h1 = *reinterpret_cast<const __half2*>(&s1);
  const __half2 d0 = b ? __high2half2(h0) : __low2half2(h0), d1 = b ? __high2half2(h1) : __low2half2(h1);
  const unsigned v0 = w0 >> 8, v1 = w1 >> 8;  // bytes 1 and 3 where bytes 0 and 2 were
  lo[0] = q4_low_pair(w0, d0, one024);
  lo[1] = q4_low_pair(w1, d1, one024);
  lo[2] = q4_low_pair(v0, d0, one024);
  lo[3] = q4_low_pair(v1, d1, one024);
  hi[0] = q4_high_pair(w0, d0, one024);
  hi[1] = q4_high_pair(w1, d1, one024);
  hi[2] = q4_high_pair(v0, d0, one024);
  hi[3] = q4_high_pair(v1, d1, one024);
}

// Q8_0: two f16 halves d * q of the int8 bytes 0 and 2 of `word`: (q + 128) | 0x6400 in each half (one mask and
// xor: `bias` is 0x64806480, 1024 + 128), less 1152 is q exactly, times d rounds once (common.cuh's dequant_octet).
__device__ __forceinline__ unsigned q8_pair(unsigned word, __half2 d, unsigned bias) {
  return scaled_half2((word & 0x00FF00FFu) ^ bias, 0x64806480u, d);
}

// A fragments of Q8_0 block b: lo from quant words l0 (row g), l8 (row g + 8), hi from h0, h8; scale words as Q4_0's.
__device__ __forceinline__ void dequant_q8_block(unsigned l0, unsigned l8, unsigned h0, unsigned h8, unsigned s0,
                                                 unsigned s1, int b, unsigned bias, unsigned (&lo)[4],
                                                 unsigned (&hi)[4]) {
  const __half2 h0s = *reinterpret_cast<const __half2*>(&s0), h1s = *reinterpret_cast<const __half2*>(&s1);
  const __half2 d0 = b ? __high2half2(h0s) : __low2half2(h0s), d1 = b ? __high2half2(h1s) : __low2half2(h1s);
  lo[0] = q8_pair(l0, d0, bias);
  lo[1] = q8_pair(l8, d1, bias);
  lo[2] = q8_pair(l0 >> 8, d0, bias);
  lo[3] = q8_pair(l8 >> 8, d1, bias);
  hi[0] = q8_pair(h0, d0, bias);
  hi[1] = q8_pair(h8, d1, bias);
  hi[2] = q8_pair(h0 >> 8, d0, bias);
  hi[3] = q8_pair(h8 >> 8, d1, bias);
}

// Q4_K: byte k (0 .. 11) of a row record's scale bytes (record words y, z, w).
__device__ __forceinline__ unsigned record_byte(const uint4& record, int k) {
  const unsigned word = k < 4 ? record.y : (k < 8 ? record.z : record.w);
  return (word >> (8 * (k & 3))) & 0xFFu;
}

// Q4_K: (d * sc, dmin * m) of sub-block j (0 .. 7) of a row record, in float (exact: 11 by 6 bits).
__device__ __forceinline__ float2 q4_k_scale_min(const uint4& record, int j) {
  unsigned sc, mn;
  if (j < 4) {
    sc = record_byte(record, j) & 63;
    mn = record_byte(record, j + 4) & 63;
  } else {
    sc = (record_byte(record, j + 4) & 0xF) | ((record_byte(record, j - 4) >> 6) << 4);
    mn = (record_byte(record, j + 4) >> 4) | ((record_byte(record, j) >> 6) << 4);
  }
  const __half2 d = *reinterpret_cast<const __half2*>(&record.x);  // d, dmin
  return make_float2(__low2float(d) * static_cast<float>(sc), __high2float(d) * static_cast<float>(mn));
}

// K-quants: two f16 halves ds * q - dm of the quants set by MASK in bytes 0 and 2 of `word` (the caller shifts it
// and, for Q5_K and Q6_K, puts their high bits above the nibbles): set into the mantissas of 1024, less `bias` (1024;
// Q6_K's 1056) they are q (q - 32) exactly; ds * q is exact in float, less dm rounds once there, and the half rounds
// once more, as gguf-py's float32 values rounded to f16. Q6_K's dm is 0: ds * (q - 32) exact, a zero of the sign
// gguf-py's product gives it.
template <unsigned MASK>
__device__ __forceinline__ unsigned k_pair(unsigned word, float2 scale_min, unsigned one024, unsigned bias) {
  const unsigned biased = mask_into<MASK>(word, one024);
  const float2 q = __half22float2(__hsub2(*reinterpret_cast<const __half2*>(&biased),
                                          *reinterpret_cast<const __half2*>(&bias)));
  return pack_half2(__fmaf_rn(scale_min.x, q.x, -scale_min.y), __fmaf_rn(scale_min.x, q.y, -scale_min.y));
}

// A fragments of a K-quant block of a step from quant words (each byte a quant, as MASK reads it): lo from l0 (row
// g) and l8 (row g + 8), hi from h0, h8; lo0 .. hi8: the (ds, dm) of lo's and hi's elements of rows g and g + 8.
template <unsigned MASK>
__device__ __forceinline__ void dequant_k_block(unsigned l0, unsigned l8, unsigned h0, unsigned h8, float2 lo0,
                                                float2 lo8, float2 hi0, float2 hi8, unsigned one024, unsigned bias,
                                                unsigned (&lo)[4], unsigned (&hi)[4]) {
  lo[0] = k_pair<MASK>(l0, lo0, one024, bias);
  lo[1] = k_pair<MASK>(l8, lo8, one024, bias);
  lo[2] = k_pair<MASK>(l0 >> 8, lo0, one024, bias);
  lo[3] = k_pair<MASK>(l8 >> 8, lo8, one024, bias);
  hi[0] = k_pair<MASK>(h0, hi0, one024, bias);
  hi[1] = k_pair<MASK>(h8, hi8, one024, bias);
  hi[2] = k_pair<MASK>(h0 >> 8, hi0, one024, bias);
  hi[3] = k_pair<MASK>(h8 >> 8, hi8, one024, bias);
}

// A fragments of Q4_K block b of a step: lo from quant words l0 (row g), l8 (row g + 8) of chunk 0, hi from h0, h8
// of chunk 1, nibbles from 4b; sm0, sm8: the sub-block's (d * sc, dmin * m) of rows g and g + 8.
__device__ __forceinline__ void dequant_q4_k_block(unsigned l0, unsigned l8, unsigned h0, unsigned h8, float2 sm0,
                                                   float2 sm8, int b, unsigned one024, unsigned (&lo)[4],
                                                   unsigned (&hi)[4]) {
  const int shift = 4 * b;
  dequant_k_block<0x000F000Fu>(l0 >> shift, l8 >> shift, h0 >> shift, h8 >> shift, sm0, sm8, sm0, sm8, one024,
                               one024, lo, hi);
}

// Q5_K and Q6_K: each byte's quant, nibble 4b of `low` with the high bits of `high` at shift, ANDed with HIGH (Q5_K
// 1 bit, Q6_K 2), above it
template <unsigned HIGH>
__device__ __forceinline__ unsigned high_bit_quants(unsigned low, unsigned high, int b, int shift) {
  return ((low >> (4 * b)) & 0x0F0F0F0Fu) | (((high >> shift) & HIGH) << 4);
}

// A fragments of Q5_K block b of a step (sub-block j = 2 (step mod 4) + b): qs words l0, l8 (chunk 0), h0, h8
// (chunk 1), qh words ql0, ql8 (chunk 2: lo's), qh0, qh8 (chunk 3: hi's), of rows g and g + 8; sm0, sm8 as Q4_K's.
__device__ __forceinline__ void dequant_q5_k_block(unsigned l0, unsigned l8, unsigned h0, unsigned h8, unsigned ql0,
                                                   unsigned ql8, unsigned qh0, unsigned qh8, float2 sm0, float2 sm8,
                                                   int b, int j, unsigned one024, unsigned (&lo)[4],
                                                   unsigned (&hi)[4]) {
  constexpr unsigned HIGH = 0x01010101u;
  dequant_k_block<0x001F001Fu>(high_bit_quants<HIGH>(l0, ql0, b, j), high_bit_quants<HIGH>(l8, ql8, b, j),
                               high_bit_quants<HIGH>(h0, qh0, b, j), high_bit_quants<HIGH>(h8, qh8, b, j), sm0, sm8,
                               sm0, sm8, one024, one024, lo, hi);
}

// Q6_K: (d * sc, 0) of scale `k` (0 .. 7) of a row record: x the aligned word holding d at bit d_shift, y and z the
// 8 int8 scales of the step's half super-block. In float, exact (11 by 8 bits).
__device__ __forceinline__ float2 q6_k_scale(const uint4& record, int d_shift, int k) {
  const unsigned d_bits = record.x >> d_shift;
  const float d = __low2float(*reinterpret_cast<const __half2*>(&d_bits));
  const float ds = d * static_cast<float>(static_cast<signed char>((k < 4 ? record.y : record.z) >> (8 * (k & 3))));
  return make_float2(ds, 0.f);
}

// A fragments of Q6_K block b of step j of a super-block (groups 4 (j / 2) + j mod 2 + 2b): ql words l0 .. h8, qh
// words ql0 .. qh8 as Q5_K's; rec0, rec8: the records of rows g and g + 8, d at bit d_shift. The block's qh bits and
// its lo scale are both at k = 2 (j mod 2) + 4b (hi's scale at k + 1).
__device__ __forceinline__ void dequant_q6_k_block(unsigned l0, unsigned l8, unsigned h0, unsigned h8, unsigned ql0,
                                                   unsigned ql8, unsigned qh0, unsigned qh8, const uint4& rec0,
                                                   const uint4& rec8, int d_shift, int b, int k, unsigned one024,
                                                   unsigned (&lo)[4], unsigned (&hi)[4]) {
  constexpr unsigned HIGH = 0x03030303u;
  dequant_k_block<0x003F003Fu>(high_bit_quants<HIGH>(l0, ql0, b, k), high_bit_quants<HIGH>(l8, ql8, b, k),
                               high_bit_quants<HIGH>(h0, qh0, b, k), high_bit_quants<HIGH>(h8, qh8, b, k),
                               q6_k_scale(rec0, d_shift, k), q6_k_scale(rec8, d_shift, k),
                               q6_k_scale(rec0, d_shift, k + 1), q6_k_scale(rec8, d_shift, k + 1), one024,
                               0x64206420u, lo, hi);  // 1056: q - 32
}

// IQ4_XS: two f16 halves dl * level of the int8 levels in bytes 0 and 2 of `levels`, set into the mantissas of 1024
// as Q8_0's (one mask and xor), less 1152 they are the levels exactly; dl * level is exact in float (11 + 6 + 7 bits)
// and the half rounds once, as gguf-py's float32 values rounded to f16.
__device__ __forceinline__ unsigned iq4_pair(unsigned levels, float dl) {
  const unsigned biased = (levels & 0x00FF00FFu) ^ 0x64806480u, bias = 0x64806480u;
  const float2 q = __half22float2(__hsub2(*reinterpret_cast<const __half2*>(&biased),
                                          *reinterpret_cast<const __half2*>(&bias)));
  return pack_half2(dl * q.x, dl * q.y);
}

// IQ4_XS: d * (ls - 32) of sub-block j (0 .. 7) of a row record: x the aligned word holding d at bit d_shift (as
// Q6_K's), y and z the aligned words holding the super-block's scales_h (2 bytes), then scales_l (4), from byte
// e_offset (0 or 2) of y on. In float, exact (11 by 6 bits).
__device__ __forceinline__ float iq4_xs_scale(const uint4& record, int d_shift, int e_offset, int j) {
  const unsigned d_bits = record.x >> d_shift;
  const float d = __low2float(*reinterpret_cast<const __half2*>(&d_bits));
  const unsigned long long bytes = ((static_cast<unsigned long long>(record.z) << 32) | record.y) >> (8 * e_offset);
  const unsigned scales_h = static_cast<unsigned>(bytes) & 0xFFFFu, scales_l = static_cast<unsigned>(bytes >> 16);
  const int ls = static_cast<int>(((scales_l >> (4 * j)) & 0xFu) | (((scales_h >> (2 * j)) & 3u) << 4));
  return d * static_cast<float>(ls - 32);
}

// A fragments of IQ4_XS block b of a step (sub-block 2 (step mod 4) + b) from its quant words w0 (row g) and w8
// (row g + 8), laid out as Q4_0's; dl0, dl8: the sub-block's scales of rows g and g + 8.
__device__ __forceinline__ void dequant_iq4_xs_block(unsigned w0, unsigned w8, float dl0, float dl8,
                                                     unsigned (&lo)[4], unsigned (&hi)[4]) {
  const unsigned l0 = iq4_levels(w0 & 0x0F0F0F0Fu), l8 = iq4_levels(w8 & 0x0F0F0F0Fu);
  const unsigned h0 = iq4_levels((w0 >> 4) & 0x0F0F0F0Fu), h8 = iq4_levels((w8 >> 4) & 0x0F0F0F0Fu);
  lo[0] = iq4_pair(l0, dl0);
  lo[1] = iq4_pair(l8, dl8);
  lo[2] = iq4_pair(l0 >> 8, dl0);
  lo[3] = iq4_pair(l8 >> 8, dl8);
  hi[0] = iq4_pair(h0, dl0);
  hi[1] = iq4_pair(h8, dl8);
  hi[2] = iq4_pair(h0 >> 8, dl0);
  hi[3] = iq4_pair(h8 >> 8, dl8);
}

// IQ3_XXS: d of a row (an f16 at bit d_shift of its scale word, Q6_K's), in float
__device__ __forceinline__ float lone_d(unsigned word, int d_shift) {
  const unsigned d_bits = word >> d_shift;
  return __low2float(*reinterpret_cast<const __half2*>(&d_bits));
}

// IQ3_XXS: two f16 halves db * magnitude of bytes 0 and 2 of `grid` (set into the mantissas of 1024, less 1024 they are
// the magnitudes exactly; db * magnitude is exact in float), negated where bits 0 and 2 of `signs` are set
__device__ __forceinline__ unsigned iq3_pair(unsigned grid, unsigned signs, float db) {
  const unsigned biased = (grid & 0x00FF00FFu) | 0x64006400u, bias = 0x64006400u;
  const float2 m = __half22float2(__hsub2(*reinterpret_cast<const __half2*>(&biased),
                                          *reinterpret_cast<const __half2*>(&bias)));
  return pack_half2(db * m.x, db * m.y) ^ (((signs & 1u) << 15) | ((signs & 4u) << 29));
}

// A fragments of IQ3_XXS block b of a step for lane t: of row g, qs words q_lo (word 2b: entries 0 .. 3 of the
// sub-block) and q_hi (2b + 1: entries 4 .. 7), its sign-and-scale word aux and d; the same of row g + 8 (q_lo8 ..)
__device__ __forceinline__ void dequant_iq3_xxs_block(unsigned q_lo, unsigned q_hi, unsigned aux, float d,
                                                      unsigned q_lo8, unsigned q_hi8, unsigned aux8, float d8, int t,
                                                      unsigned (&lo)[4], unsigned (&hi)[4]) {
  const float db = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;  // as gguf-py's, exact
  const float db8 = d8 * (0.5f + static_cast<float>(aux8 >> 28)) * 0.5f;
  const unsigned g_lo = kIq3XxsGrid[(q_lo >> (8 * t)) & 0xFFu], g_hi = kIq3XxsGrid[(q_hi >> (8 * t)) & 0xFFu];
  const unsigned g_lo8 = kIq3XxsGrid[(q_lo8 >> (8 * t)) & 0xFFu], g_hi8 = kIq3XxsGrid[(q_hi8 >> (8 * t)) & 0xFFu];
  const unsigned s_lo = iq3_signs(aux, t), s_hi = iq3_signs(aux, 4 + t);
  const unsigned s_lo8 = iq3_signs(aux8, t), s_hi8 = iq3_signs(aux8, 4 + t);
  lo[0] = iq3_pair(g_lo, s_lo, db);
  lo[1] = iq3_pair(g_lo8, s_lo8, db8);
  lo[2] = iq3_pair(g_lo >> 8, s_lo >> 1, db);
  lo[3] = iq3_pair(g_lo8 >> 8, s_lo8 >> 1, db8);
  hi[0] = iq3_pair(g_hi, s_hi, db);
  hi[1] = iq3_pair(g_hi8, s_hi8, db8);
  hi[2] = iq3_pair(g_hi >> 8, s_hi >> 1, db);
  hi[3] = iq3_pair(g_hi8 >> 8, s_hi8 >> 1, db8);
}

// Q5_K and Q6_K: the first word of a row's step in its quant plane, of the step's nibbles (high false) or of its
// high bits (true); each two chunks of 16 bytes
template <int F>
__device__ __forceinline__ int step_words(int step, bool high) {
  const int super_block = step >> 2, j = step & 3;
  if constexpr (F == kRowsQ5_K) return 40 * super_block + (high ? 0 : 8 + 8 * j);  // qh[32], then qs[128]
  return 48 * super_block + (high ? 32 + 8 * (j >> 1) : 8 * j);                    // ql[128], then qh[64]
}

// The first X column of a step (Q6_K: of its first run of 32; its second is 64 further on)
template <int F>
__device__ __forceinline__ int x_step_column(int step) {
  return F == kRowsQ6_K ? STEP_K * step - 32 * (step & 1) : STEP_K * step;
}

// The X copies of a thread from K (rows xr + 16k, k >= K, of the tile's 8G): xoff[k] the row's offset in
// halves from the step's first column, or -1 where the row is not the tile's.
template <int K, int KX>
__device__ __forceinline__ void copy_x(const __half* x_step, const int (&xoff)[KX], unsigned dst) {
  if constexpr (K < KX) {
    if (xoff[K] >= 0) copy16<16 * K * 2 * STEP_K>(dst, x_step + xoff[K]);
    copy_x<K + 1, KX>(x_step, xoff, dst);
  }
}

// The mma of token groups J .. G - 1, two at a time, so that no mma waits on the one before it (each
// accumulator still takes its low half, then its high half). xl, xh: this lane's X addresses in group 0 for
// the block's two halves.
template <int J, int G>
__device__ __forceinline__ void group_mmas(float (&acc)[NW][G][4], const unsigned (&lo)[NW][4],
                                           const unsigned (&hi)[NW][4], unsigned xl, unsigned xh) {
  if constexpr (J < G) {
    constexpr int N = J + 1 < G ? 2 : 1;
    uint2 bl[N], bh[N];
    bl[0] = load_shared2<GROUP_BYTES * J>(xl);
    bh[0] = load_shared2<GROUP_BYTES * J>(xh);
    if constexpr (N == 2) {
      bl[1] = load_shared2<GROUP_BYTES * (J + 1)>(xl);
      bh[1] = load_shared2<GROUP_BYTES * (J + 1)>(xh);
    }
#pragma unroll
    for (int p = 0; p < N; ++p)
#pragma unroll
      for (int m = 0; m < NW; ++m) mma_16816(acc[m][J + p], lo[m][0], lo[m][1], lo[m][2], lo[m][3], bl[p].x, bl[p].y);
#pragma unroll
    for (int p = 0; p < N; ++p)
#pragma unroll
      for (int m = 0; m < NW; ++m) mma_16816(acc[m][J + p], hi[m][0], hi[m][1], hi[m][2], hi[m][3], bh[p].x, bh[p].y);
    group_mmas<J + 2, G>(acc, lo, hi, xl, xh);
  }
}

// A weight's planes as the kernels read them (packing.py): quant words, f16 block fields, K-quant scale bytes.
struct RowsPlanes {
  const unsigned* quants;
  const __half* scales;
  const unsigned char* extra;
};

// acc[m][j] += W_m[w_row0 + 16 * warp ..][K] x X[rows of tokens 8j ..][K]^T over the whole K, for the G groups
// of a tile of num_rows <= 8G tokens.
//   x       f16 [.][x_pitch]; token n of the tile is X row pair_token[start + n] (GATHER) or start + n
//   wa, wb  the planes of the two weights, of format F; rows from w_row_end (w_row_end_b for wb) on read as zeros
//   smem    moe_rows.py's shared block (Stage<F>::STAGES stages); every thread of the block calls this
template <int F, int G, bool GATHER>
__device__ __forceinline__ void rows_tile(const __half* x, int x_pitch, int num_k32, const int* pair_token, int start,
                                          int num_rows, RowsPlanes wa, RowsPlanes wb, int quant_pitch,
                                          int scale_pitch, int extra_pitch, int w_row0, int w_row_end,
                                          int w_row_end_b, unsigned char* smem_base, float (&acc)[NW][G][4]) {
  static_assert(G >= 1 && G <= 8, "a tile holds up to 64 tokens");
  using S = Stage<F>;
  constexpr int KX = (G + 1) / 2;  // X rows a thread copies: 8 threads a row (a 16-byte chunk each), 16 rows a pass
  const unsigned smem = shared_address(smem_base);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int num_steps = num_k32 / 2;

  // X: 16-byte chunk xq of tile rows xr + 16k, at chunk xq ^ (2r mod 8) (the same for every k); rows past the
  // tile's tokens are not copied: they only reach the mma's columns of those tokens, which nothing stores. Q6_K:
  // the chunks of a step's second run of 32 columns are 32 columns further on (x_step_column)
  const int xq = tid & 7, xr = tid >> 3;
  const int x_col = 8 * xq + (F == kRowsQ6_K && xq >= 4 ? 32 : 0);
  int xoff[KX];
#pragma unroll
  for (int k = 0; k < KX; ++k) {
    const int r = xr + 16 * k;
    xoff[k] = r < num_rows ? (GATHER ? pair_token[start + r] : start + r) * x_pitch + x_col : -1;
  }
  const unsigned x_dst = smem + 2 * (xr * STEP_K + 8 * (xq ^ ((2 * xr) & 7)));
  // weights: quant chunk wc (16 bytes; Q8_0 chunks 2wc, 2wc + 1; Q5_K, Q6_K: the nibbles' two chunks (wc = 0), or
  // the high bits' (1)) of row wr of each weight, and the scales (records) of row sr of weight sm
  const int wr = tid >> 1, wc = tid & 1, sr = tid & 63, sm = tid >> 6;
  const bool is_wa = w_row0 + wr < w_row_end, is_wb = w_row0 + wr < w_row_end_b;
  const bool is_s = w_row0 + sr < (sm ? w_row_end_b : w_row_end);
  // a thread's first word of a step (IQ3_XXS: its own branch of load)
  constexpr int CHUNK_WORDS = F == kRowsQ8_0 ? 8 : (has_high_bits(F) || F == kRowsIQ3_XXS ? 0 : 4);
  const unsigned* wa_src = wa.quants + static_cast<size_t>(is_wa ? w_row0 + wr : 0) * quant_pitch + CHUNK_WORDS * wc;
  const unsigned* wb_src = wb.quants + static_cast<size_t>(is_wb ? w_row0 + wr : 0) * quant_pitch + CHUNK_WORDS * wc;
  const size_t s_row = is_s ? w_row0 + sr : 0;
  const __half* s_src = (sm ? wb.scales : wa.scales) + s_row * scale_pitch;
  const unsigned char* e_src = (sm ? wb.extra : wa.extra) + s_row * extra_pitch;  // K-quants only
  unsigned w_dst, w_dst_next = 0;  // 64-byte rows: the second chunk
  if constexpr (is_wide(F)) {
    const int swizzle = (wr >> 1) & 3;
    w_dst = smem + S::W_AT + 64 * wr + 16 * ((2 * wc) ^ swizzle);
    w_dst_next = smem + S::W_AT + 64 * wr + 16 * ((2 * wc + 1) ^ swizzle);
  } else {
    w_dst = smem + S::W_AT + 32 * wr + 16 * (wc ^ ((wr >> 2) & 1));
  }
  // Q4_0 and Q8_0: the scale words [4 warps][8 g][weight][row g, g + 8]; K-quants: the 16-byte records in that order
  const unsigned s_dst = has_record(F)
      ? smem + S::S_AT + 16 * ((((sr >> 4) * 8 + (sr & 7)) * NW + sm) * 2 + ((sr >> 3) & 1))
      : smem + S::S_AT + 4 * ((((sr >> 4) * 8 + (sr & 7)) * NW + sm) * 2 + ((sr >> 3) & 1));

  auto load = [&](int step, unsigned stage) {
    copy_x<0, KX>(x + x_step_column<F>(step), xoff, x_dst + stage);
    if constexpr (is_wide(F)) {
      int at = 16 * step;
      if constexpr (has_high_bits(F)) at = step_words<F>(step, wc);
      copy16_or_zeros<0>(w_dst + stage, wa_src + at, is_wa);
      copy16_or_zeros<0>(w_dst_next + stage, wa_src + at + 4, is_wa);
      copy16_or_zeros<S::W_BYTES>(w_dst + stage, wb_src + at, is_wb);
      copy16_or_zeros<S::W_BYTES>(w_dst_next + stage, wb_src + at + 4, is_wb);
    } else if constexpr (F == kRowsIQ3_XXS) {
      // a super-block's 24 words: qs (16), then the sign-and-scale words (8); chunk 0 the step's 16 bytes of qs,
      // chunk 1 its 2 words
      const int at = 24 * (step >> 2) + (wc ? 16 + 2 * (step & 3) : 4 * (step & 3));
      if (wc) {
        copy8_or_zeros(w_dst + stage, wa_src + at, is_wa);
        copy8_or_zeros(w_dst + stage + S::W_BYTES, wb_src + at, is_wb);
      } else {
        copy16_or_zeros<0>(w_dst + stage, wa_src + at, is_wa);
        copy16_or_zeros<S::W_BYTES>(w_dst + stage, wb_src + at, is_wb);
      }
    } else {
      copy16_or_zeros<0>(w_dst + stage, wa_src + 8 * step, is_wa);
      copy16_or_zeros<S::W_BYTES>(w_dst + stage, wb_src + 8 * step, is_wb);
    }
    if constexpr (F == kRowsQ4_K || F == kRowsQ5_K) {  // the super-block's d and dmin, then its 12 scale bytes
      const int super_block = step >> 2;
      copy4_or_zeros(s_dst + stage, s_src + 2 * super_block, is_s);
      copy4_or_zeros(s_dst + stage + 4, e_src + 12 * super_block, is_s);
      copy4_or_zeros(s_dst + stage + 8, e_src + 12 * super_block + 4, is_s);
      copy4_or_zeros(s_dst + stage + 12, e_src + 12 * super_block + 8, is_s);
    } else if constexpr (has_lone_d(F)) {
      // the aligned word that holds d (an odd half's word begins at the half before it; an even half's is read
      // alone, the word's other half zeros, so no read passes the plane), then Q6_K's 8 scales of the half
      // super-block, or IQ4_XS's 6 scale bytes in the two aligned words that hold them (from byte 0 or 2 of the
      // first; past the 6, the second's last 2 bytes are zeros, not read)
      const int super_block = step >> 2;
      const __half* d = s_src + super_block;
      const int is_odd = (reinterpret_cast<size_t>(d) >> 1) & 1;
      copy4_part(s_dst + stage, d - is_odd, is_s ? 2 + 2 * is_odd : 0);
      if constexpr (F == kRowsQ6_K) {
        const unsigned char* scales = e_src + 16 * super_block + 8 * ((step >> 1) & 1);
        copy4_or_zeros(s_dst + stage + 4, scales, is_s);
        copy4_or_zeros(s_dst + stage + 8, scales + 4, is_s);
      } else if constexpr (F == kRowsIQ4_XS) {
        const unsigned char* scales = e_src + 6 * super_block;
        const int offset = static_cast<int>(reinterpret_cast<size_t>(scales) & 3);
        copy4_part(s_dst + stage + 4, scales - offset, is_s ? 4 : 0);
        copy4_part(s_dst + stage + 8, scales - offset + 4, is_s ? 2 + offset : 0);
      }
    } else {
      copy4_or_zeros(s_dst + stage, s_src + 2 * step, is_s);
    }
    cp_async_commit();
  };

  // this lane's reads: its scale words (records), the quant words of row g of its warp's rows for block b (g + 8
  // at +ROW_HALF_BYTES, the second weight at +W_BYTES), X of token g of group 0 for block b's low and high halves
  const int r0 = warp * WARP_ROWS + g, x_swizzle = (2 * g) & 7;
  const unsigned s_rd = smem + S::S_AT + S::S_ROW_BYTES * 4 * (warp * 8 + g);
  unsigned w_rd[4];  // Q4_0, Q4_K: chunks 0, 1; 64-byte rows: chunks 0 .. 3
  if constexpr (is_wide(F)) {
    const int swizzle = (g >> 1) & 3;
#pragma unroll
    for (int c = 0; c < 4; ++c) w_rd[c] = smem + S::W_AT + 64 * r0 + 16 * (c ^ swizzle) + 4 * t;
  } else {
    const int swizzle = (g >> 2) & 1;
    w_rd[0] = smem + S::W_AT + 32 * r0 + 16 * swizzle + 4 * t;
    w_rd[1] = smem + S::W_AT + 32 * r0 + 16 * (swizzle ^ 1) + 4 * t;
    w_rd[2] = w_rd[3] = 0;
  }
  const unsigned x_row = smem + 2 * (g * STEP_K + 4 * (t & 1));
  const unsigned x_rd[2][2] = {{x_row + 16 * ((t >> 1) ^ x_swizzle), x_row + 16 * ((2 + (t >> 1)) ^ x_swizzle)},
                               {x_row + 16 * ((4 + (t >> 1)) ^ x_swizzle), x_row + 16 * ((6 + (t >> 1)) ^ x_swizzle)}};

  // Q6_K, IQ4_XS: d of super-block 0 of this lane's rows (g, g + 8, of both weights) is an odd half of the scale
  // plane (4-byte aligned, moe_rows._is_aligned) when this is 1: the record's word holds it in its high half.
  // IQ4_XS: the scale bytes of super-block 0 of those rows start at this byte of an aligned word (0 or 2)
  const unsigned d_parity = has_lone_d(F) ? (static_cast<unsigned>(w_row0 + r0) * scale_pitch) & 1 : 0;
  const unsigned e_parity = F == kRowsIQ4_XS ? (static_cast<unsigned>(w_row0 + r0) * extra_pitch) & 3 : 0;
  const unsigned one024 = opaque_one024();
  constexpr int RH = S::ROW_HALF_BYTES, WB = S::W_BYTES;
  auto compute = [&](int step, unsigned stage) {
    if constexpr (F == kRowsQ4_K) {
      // records: weight 0 rows g, g + 8; weight 1 rows g, g + 8
      const uint4 rec[NW][2] = {{load_shared4(s_rd + stage), load_shared4(s_rd + 16 + stage)},
                                {load_shared4(s_rd + 32 + stage), load_shared4(s_rd + 48 + stage)}};
      const unsigned c0 = w_rd[0] + stage, c1 = w_rd[1] + stage;
      const unsigned l[NW][2] = {{load_shared<0>(c0), load_shared<RH>(c0)},
                                 {load_shared<WB>(c0), load_shared<WB + RH>(c0)}};  // chunk 0: [weight][row half]
      const unsigned h[NW][2] = {{load_shared<0>(c1), load_shared<RH>(c1)},
                                 {load_shared<WB>(c1), load_shared<WB + RH>(c1)}};  // chunk 1
      const int sub_block0 = 2 * (step & 3);
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        unsigned lo[NW][4], hi[NW][4];
#pragma unroll
        for (int m = 0; m < NW; ++m)
          dequant_q4_k_block(l[m][0], l[m][1], h[m][0], h[m][1], q4_k_scale_min(rec[m][0], sub_block0 + b),
                             q4_k_scale_min(rec[m][1], sub_block0 + b), b, one024, lo[m], hi[m]);
        group_mmas<0, G>(acc, lo, hi, x_rd[b][0] + stage, x_rd[b][1] + stage);
      }
    } else if constexpr (F == kRowsIQ4_XS) {
      const uint4 rec[NW][2] = {{load_shared4(s_rd + stage), load_shared4(s_rd + 16 + stage)},
                                {load_shared4(s_rd + 32 + stage), load_shared4(s_rd + 48 + stage)}};
      const int super_odd = (step >> 2) & 1;
      const int d_shift = 16 * (d_parity ^ super_odd), e_offset = (e_parity + 2 * super_odd) & 3;
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int j = 2 * (step & 3) + b;
        unsigned lo[NW][4], hi[NW][4];
        const unsigned wq = w_rd[b] + stage;
        dequant_iq4_xs_block(load_shared<0>(wq), load_shared<RH>(wq), iq4_xs_scale(rec[0][0], d_shift, e_offset, j),
                             iq4_xs_scale(rec[0][1], d_shift, e_offset, j), lo[0], hi[0]);
        dequant_iq4_xs_block(load_shared<WB>(wq), load_shared<WB + RH>(wq),
                             iq4_xs_scale(rec[1][0], d_shift, e_offset, j),
                             iq4_xs_scale(rec[1][1], d_shift, e_offset, j), lo[1], hi[1]);
        group_mmas<0, G>(acc, lo, hi, x_rd[b][0] + stage, x_rd[b][1] + stage);
      }
    } else if constexpr (F == kRowsIQ3_XXS) {
      const uint4 d_words = load_shared4(s_rd + stage);  // weight 0 rows g, g + 8; weight 1 rows g, g + 8
      const int d_shift = 16 * (d_parity ^ ((step >> 2) & 1));
      const float d[NW][2] = {{lone_d(d_words.x, d_shift), lone_d(d_words.y, d_shift)},
                              {lone_d(d_words.z, d_shift), lone_d(d_words.w, d_shift)}};
      const unsigned c0 = w_rd[0] - 4 * t + stage, c1 = w_rd[1] - 4 * t + stage;  // the row's chunks 0 and 1
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        unsigned lo[NW][4], hi[NW][4];
        const unsigned q = c0 + 8 * b, a = c1 + 4 * b;  // qs words 2b, 2b + 1; sign-and-scale word b
        dequant_iq3_xxs_block(load_shared<0>(q), load_shared<4>(q), load_shared<0>(a), d[0][0], load_shared<RH>(q),
                              load_shared<RH + 4>(q), load_shared<RH>(a), d[0][1], t, lo[0], hi[0]);
        dequant_iq3_xxs_block(load_shared<WB>(q), load_shared<WB + 4>(q), load_shared<WB>(a), d[1][0],
                              load_shared<WB + RH>(q), load_shared<WB + RH + 4>(q), load_shared<WB + RH>(a), d[1][1],
                              t, lo[1], hi[1]);
        group_mmas<0, G>(acc, lo, hi, x_rd[b][0] + stage, x_rd[b][1] + stage);
      }
    } else if constexpr (has_high_bits(F)) {
      const uint4 rec[NW][2] = {{load_shared4(s_rd + stage), load_shared4(s_rd + 16 + stage)},
                                {load_shared4(s_rd + 32 + stage), load_shared4(s_rd + 48 + stage)}};
      // chunks 0, 1: the nibbles of lo and hi; chunks 2, 3: their high bits; each [weight][row half]
      const unsigned c0 = w_rd[0] + stage, c1 = w_rd[1] + stage, c2 = w_rd[2] + stage, c3 = w_rd[3] + stage;
      const unsigned l[NW][2] = {{load_shared<0>(c0), load_shared<RH>(c0)},
                                 {load_shared<WB>(c0), load_shared<WB + RH>(c0)}};
      const unsigned h[NW][2] = {{load_shared<0>(c1), load_shared<RH>(c1)},
                                 {load_shared<WB>(c1), load_shared<WB + RH>(c1)}};
      const unsigned lq[NW][2] = {{load_shared<0>(c2), load_shared<RH>(c2)},
                                  {load_shared<WB>(c2), load_shared<WB + RH>(c2)}};
      const unsigned hq[NW][2] = {{load_shared<0>(c3), load_shared<RH>(c3)},
                                  {load_shared<WB>(c3), load_shared<WB + RH>(c3)}};
      // both blocks' fragments before their mma, so that the words and records die first (down at 128 registers,
      // ptxas for sm_90 spills 32 bytes of Q5_K's and 28 of Q6_K's so, 164 and 24 a block at a time)
      unsigned lo[2][NW][4], hi[2][NW][4];
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int m = 0; m < NW; ++m) {
          if constexpr (F == kRowsQ5_K) {
            const int j = 2 * (step & 3) + b;
            dequant_q5_k_block(l[m][0], l[m][1], h[m][0], h[m][1], lq[m][0], lq[m][1], hq[m][0], hq[m][1],
                               q4_k_scale_min(rec[m][0], j), q4_k_scale_min(rec[m][1], j), b, j, one024, lo[b][m],
                               hi[b][m]);
          } else {
            dequant_q6_k_block(l[m][0], l[m][1], h[m][0], h[m][1], lq[m][0], lq[m][1], hq[m][0], hq[m][1], rec[m][0],
                               rec[m][1], 16 * (d_parity ^ ((step >> 2) & 1)), b, 2 * (step & 1) + 4 * b, one024,
                               lo[b][m], hi[b][m]);
          }
        }
#pragma unroll
      for (int b = 0; b < 2; ++b) group_mmas<0, G>(acc, lo[b], hi[b], x_rd[b][0] + stage, x_rd[b][1] + stage);
    } else {
      const uint4 scales = load_shared4(s_rd + stage);  // weight 0 rows g, g + 8; weight 1 rows g, g + 8
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        unsigned lo[NW][4], hi[NW][4];
        if constexpr (F == kRowsQ8_0) {
          const unsigned lq = w_rd[2 * b] + stage, hq = w_rd[2 * b + 1] + stage;
          dequant_q8_block(load_shared<0>(lq), load_shared<RH>(lq), load_shared<0>(hq), load_shared<RH>(hq),
                           scales.x, scales.y, b, one024 ^ 0x00800080u, lo[0], hi[0]);
          dequant_q8_block(load_shared<WB>(lq), load_shared<WB + RH>(lq), load_shared<WB>(hq),
                           load_shared<WB + RH>(hq), scales.z, scales.w, b, one024 ^ 0x00800080u, lo[1], hi[1]);
        } else {
          const unsigned wq = w_rd[b] + stage;
          dequant_block(load_shared<0>(wq), load_shared<RH>(wq), scales.x, scales.y, b, one024, lo[0], hi[0]);
          dequant_block(load_shared<WB>(wq), load_shared<WB + RH>(wq), scales.z, scales.w, b, one024, lo[1],
                        hi[1]);
        }
        group_mmas<0, G>(acc, lo, hi, x_rd[b][0] + stage, x_rd[b][1] + stage);
      }
    }
  };

  constexpr int STAGES = S::STAGES;
  unsigned loaded = 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_steps) load(s, loaded);
    else cp_async_commit();
    loaded += S::BYTES;
  }
  unsigned computed = 0;  // loaded: the stage of step + STAGES - 1, the one computed the step before
  for (int step = 0; step < num_steps; ++step) {
    wait_pending<STAGES - 2>();
    __syncthreads();  // the step's stage is in place, and every warp is done with the stage loaded next
    const int next = step + STAGES - 1;
    if (next < num_steps) load(next, loaded);
    else cp_async_commit();
    compute(step, computed);
    loaded = loaded == (STAGES - 1) * S::BYTES ? 0 : loaded + S::BYTES;
    computed = computed == (STAGES - 1) * S::BYTES ? 0 : computed + S::BYTES;
  }
}

__device__ __forceinline__ float silu_mul(float g, float u) {  // activation.py's device_silu_mul
  const float e = expf(-fabsf(g));
  const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return g * sigmoid * u;
}

template <int F, int G>
__device__ __forceinline__ void gate_up_tile(const __half* x, int x_pitch, int num_k32, const int* pair_token,
                                             int start, int num_rows, RowsPlanes gate, RowsPlanes up, int quant_pitch,
                                             int scale_pitch, int extra_pitch, int w_row0, int w_row_end,
                                             __half* hidden, int hidden_pitch, int col0, unsigned char* smem) {
  float acc[NW][G][4] = {};
  rows_tile<F, G, true>(x, x_pitch, num_k32, pair_token, start, num_rows, gate, up, quant_pitch, scale_pitch,
                        extra_pitch, w_row0, w_row_end, w_row_end, smem, acc);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, row = (threadIdx.x >> 5) * WARP_ROWS + g;
  const int stored_row = staged_column(row);  // and row + 8 at stored_row + 8: a quad moves as a whole
#pragma unroll
  for (int j = 0; j < G; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = 8 * j + 2 * t + (r & 1), c = row + 8 * (r >> 1);
      if (n < num_rows && w_row0 + c < w_row_end)
        hidden[static_cast<size_t>(start + n) * hidden_pitch + col0 + stored_row + 8 * (r >> 1)] =
            __float2half_rn(silu_mul(acc[0][j][r], acc[1][j][r]));
    }
}

// The down epilogue's add of one product into its token's row: a float atomic (the order of a token's k products
// varies from run to run, and so may the sum's last bit), or 64-bit fixed point in units of 2^-32 (fixed_sums.py:
// integer adds give the same bits in any order; v * 2^32 is exact in float32; a non-finite product or one of
// 2^19 or more adds the poison 2^57, which the fold turns into NaN).
__device__ __forceinline__ void add_product(float* at, float v) { atomicAdd(at, v); }
__device__ __forceinline__ void add_product(long long* at, float v) {
  const long long units = fabsf(v) < 524288.0f ? __float2ll_rn(v * 4294967296.0f) : (1LL << 57);
  atomicAdd(reinterpret_cast<unsigned long long*>(at), static_cast<unsigned long long>(units));
}

template <int F, int G, class Sum>
__device__ __forceinline__ void down_tile(const __half* hidden, int hidden_pitch, int num_k32, const int* pair_token,
                                          const float* pair_weight, int start, int num_rows, RowsPlanes down,
                                          RowsPlanes down_second, int quant_pitch, int scale_pitch, int extra_pitch,
                                          int w_row0, int w_row_end, Sum* out, int out_pitch, int col0,
                                          unsigned char* smem) {
  float acc[NW][G][4] = {};
  rows_tile<F, G, false>(hidden, hidden_pitch, num_k32, pair_token, start, num_rows, down, down_second, quant_pitch,
                         scale_pitch, extra_pitch, w_row0, w_row_end, w_row_end - 64, smem, acc);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, row = (threadIdx.x >> 5) * WARP_ROWS + g;
#pragma unroll
  for (int m = 0; m < NW; ++m)
#pragma unroll
    for (int j = 0; j < G; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = 8 * j + 2 * t + (r & 1), c = 64 * m + row + 8 * (r >> 1);
        if (n < num_rows && w_row0 + c < w_row_end)
          add_product(out + static_cast<size_t>(pair_token[start + n]) * out_pitch + col0 + c,
                      pair_weight[start + n] * acc[m][j][r]);
      }
}

// Gate and up of one expert tile: hidden[start + n][col0 + c] = silu(gate) * up (f16) for the block's 64 weight
// rows (columns c of the expert's FFN, from w_row0 = expert * ffn + col0, up to w_row_end = expert * ffn + ffn),
// each aligned quad of columns stored in the order (0, 2, 1, 3). x: staged by moe_rows.stage_x.
template <int F>
__device__ __forceinline__ void gate_up(const __half* x, int x_pitch, int num_k32, const int* pair_token, int start,
                                        int num_rows, RowsPlanes gate, RowsPlanes up, int quant_pitch,
                                        int scale_pitch, int extra_pitch, int w_row0, int w_row_end, __half* hidden,
                                        int hidden_pitch, int col0, unsigned char* smem) {
#define STRATA_GATE_UP(G)                                                                                         \
  case G:                                                                                                         \
    gate_up_tile<F, G>(x, x_pitch, num_k32, pair_token, start, num_rows, gate, up, quant_pitch, scale_pitch,     \
                       extra_pitch, w_row0, w_row_end, hidden, hidden_pitch, col0, smem);                         \
    break;
  switch ((num_rows + 7) >> 3) {
    STRATA_GATE_UP(1) STRATA_GATE_UP(2) STRATA_GATE_UP(3) STRATA_GATE_UP(4)
    STRATA_GATE_UP(5) STRATA_GATE_UP(6) STRATA_GATE_UP(7) STRATA_GATE_UP(8)
    default: break;  // no rows (or more than a tile's, which the grouping never makes)
  }
#undef STRATA_GATE_UP
}

// Down of one expert tile: out[pair_token[start + n]][col0 + c] += pair_weight[start + n] * (W_down hidden row
// start + n) for the block's 128 output columns (weight rows from w_row0 = expert * dim + col0, up to w_row_end =
// expert * dim + dim), as two 64-row weights (the second from row w_row0 + 64): every warp then has two A
// fragments for each X fragment, as gate/up does.
template <int F, class Sum>
__device__ __forceinline__ void down(const __half* hidden, int hidden_pitch, int num_k32, const int* pair_token,
                                     const float* pair_weight, int start, int num_rows, RowsPlanes w,
                                     int quant_pitch, int scale_pitch, int extra_pitch, int w_row0, int w_row_end,
                                     Sum* out, int out_pitch, int col0, unsigned char* smem) {
  const bool has_second = w_row_end - w_row0 > 64;  // else every row of the second half reads as zeros
  const RowsPlanes second = has_second ? RowsPlanes{w.quants + static_cast<size_t>(64) * quant_pitch,
                                                    w.scales + static_cast<size_t>(64) * scale_pitch,
                                                    w.extra + static_cast<size_t>(64) * extra_pitch}
                                       : w;
#define STRATA_DOWN(G)                                                                                          \
  case G:                                                                                                       \
    down_tile<F, G, Sum>(hidden, hidden_pitch, num_k32, pair_token, pair_weight, start, num_rows, w, second,   \
                    quant_pitch, scale_pitch, extra_pitch, w_row0, w_row_end, out, out_pitch, col0, smem);     \
    break;
  switch ((num_rows + 7) >> 3) {
    STRATA_DOWN(1) STRATA_DOWN(2) STRATA_DOWN(3) STRATA_DOWN(4)
    STRATA_DOWN(5) STRATA_DOWN(6) STRATA_DOWN(7) STRATA_DOWN(8)
    default: break;
  }
#undef STRATA_DOWN
}

}  // namespace

// The exported calls, one a launch and format: moe_rows.py appends the instantiation a kernel calls (moe_rows.instance,
// e.g. STRATA_MOE_ROWS_DOWN(q4_k, kRowsQ4_K)) to this text, so a link compiles that one only. The extra plane is
// read by the K-quants only.
#define STRATA_MOE_ROWS_GATE_UP(NAME, F)                                                                          \
  extern "C" __device__ void strata_moe_rows_gate_up_##NAME(                                                      \
      const __half* x, int x_pitch, int num_k32, const int* pair_token, int start, int num_rows,                 \
      const unsigned* gq, const __half* gs, const unsigned char* ge, const unsigned* uq, const __half* us,       \
      const unsigned char* ue, int quant_pitch, int scale_pitch, int extra_pitch, int w_row0, int w_row_end,     \
      __half* hidden, int hidden_pitch, int col0, unsigned char* smem) {                                          \
    gate_up<F>(x, x_pitch, num_k32, pair_token, start, num_rows, RowsPlanes{gq, gs, ge}, RowsPlanes{uq, us, ue}, \
               quant_pitch, scale_pitch, extra_pitch, w_row0, w_row_end, hidden, hidden_pitch, col0, smem);       \
  }
#define STRATA_MOE_ROWS_DOWN_INTO(NAME, F, SUM)                                                                   \
  extern "C" __device__ void NAME(                                                                                \
      const __half* hidden, int hidden_pitch, int num_k32, const int* pair_token, const float* pair_weight,      \
      int start, int num_rows, const unsigned* dq, const __half* ds, const unsigned char* de, int quant_pitch,   \
      int scale_pitch, int extra_pitch, int w_row0, int w_row_end, SUM* out, int out_pitch, int col0,            \
      unsigned char* smem) {                                                                                      \
    down<F, SUM>(hidden, hidden_pitch, num_k32, pair_token, pair_weight, start, num_rows,                        \
                 RowsPlanes{dq, ds, de}, quant_pitch, scale_pitch, extra_pitch, w_row0, w_row_end, out, out_pitch, \
                 col0, smem);                                                                                     \
  }
// into the float32 residual (float atomics), or into fixed-point sums (int64 units of 2^-32)
#define STRATA_MOE_ROWS_DOWN(NAME, F) STRATA_MOE_ROWS_DOWN_INTO(strata_moe_rows_down_##NAME, F, float)
#define STRATA_MOE_ROWS_DOWN_FIXED(NAME, F) STRATA_MOE_ROWS_DOWN_INTO(strata_moe_rows_down_fixed_##NAME, F, long long)
