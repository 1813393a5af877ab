// MoE expert products for chunks of few routed rows an expert (moe_rows.py): the weight rows are the
// mma's M and the tile's tokens its N, so a tile of up to 64 tokens pays for whole 8-token groups only,
// and each weight element is dequantized once a tile, straight into A fragments in registers.
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
// Why the addressing is spelled out: at few groups a step's work is mostly the weights' side and the
// addresses. Every shared access is an ld.shared / cp.async from a base register set before the K loop
// plus the stage's offset, with the rest (group, weight, row half) an immediate, so ptxas has nothing to
// recompute inside the loop; the kernels pass the shared block as a generic pointer, through which each
// load would first test which memory it is.
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr int STEP_K = 64, STAGES = 3, WARP_ROWS = 16, NW = 2;
constexpr int X_BYTES = 2 * 64 * STEP_K;                              // 8 KiB: 64 tokens
constexpr int W_BYTES = 64 * STEP_K / 2;                              // 2 KiB a weight: 64 rows x 2 blocks x 16 B
constexpr int W_AT = X_BYTES, S_AT = X_BYTES + NW * W_BYTES;
constexpr int STAGE_BYTES = S_AT + 4 * NW * 64;                       // 12,800: the scales take 512 B
constexpr int ROW_HALF_BYTES = 8 * 32, GROUP_BYTES = 8 * 2 * STEP_K;  // 8 weight rows; 8 X rows

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
__device__ __forceinline__ void copy4_or_zeros(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
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

// acc[m][j] += W_m[w_row0 + 16 * warp ..][K] x X[rows of tokens 8j ..][K]^T over the whole K, for the G groups
// of a tile of num_rows <= 8G tokens.
//   x       f16 [.][x_pitch]; token n of the tile is X row pair_token[start + n] (GATHER) or start + n
//   qa, sa (qb, sb)  Q4_0 planes of the two weights; rows from w_row_end (w_row_end_b for qb) on read as zeros
//   smem    moe_rows.py's shared block (STAGES stages); every thread of the block calls this
template <int G, bool GATHER>
__device__ __forceinline__ void rows_tile(const __half* x, int x_pitch, int num_k32, const int* pair_token, int start,
                                          int num_rows, const unsigned* qa, const __half* sa, const unsigned* qb,
                                          const __half* sb, int quant_pitch, int scale_pitch, int w_row0,
                                          int w_row_end, int w_row_end_b, unsigned char* smem_base,
                                          float (&acc)[NW][G][4]) {
  static_assert(G >= 1 && G <= 8, "a tile holds up to 64 tokens");
  constexpr int KX = (G + 1) / 2;  // X rows a thread copies: 8 threads a row (a 16-byte chunk each), 16 rows a pass
  const unsigned smem = shared_address(smem_base);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int num_steps = num_k32 / 2;

  // X: 16-byte chunk xq of tile rows xr + 16k, at chunk xq ^ (2r mod 8) (the same for every k); rows past the
  // tile's tokens are not copied: they only reach the mma's columns of those tokens, which nothing stores
  const int xq = tid & 7, xr = tid >> 3;
  int xoff[KX];
#pragma unroll
  for (int k = 0; k < KX; ++k) {
    const int r = xr + 16 * k;
    xoff[k] = r < num_rows ? (GATHER ? pair_token[start + r] : start + r) * x_pitch + 8 * xq : -1;
  }
  const unsigned x_dst = smem + 2 * (xr * STEP_K + 8 * (xq ^ ((2 * xr) & 7)));
  // weights: quant chunk wb (16 bytes) of row wr of each weight, and the scale pair of row sr of weight sm
  const int wr = tid >> 1, wb = tid & 1, sr = tid & 63, sm = tid >> 6;
  const bool is_wa = w_row0 + wr < w_row_end, is_wb = w_row0 + wr < w_row_end_b;
  const bool is_s = w_row0 + sr < (sm ? w_row_end_b : w_row_end);
  const unsigned* wa_src = qa + static_cast<size_t>(is_wa ? w_row0 + wr : 0) * quant_pitch + 4 * wb;
  const unsigned* wb_src = qb + static_cast<size_t>(is_wb ? w_row0 + wr : 0) * quant_pitch + 4 * wb;
  const __half* s_src = (sm ? sb : sa) + static_cast<size_t>(is_s ? w_row0 + sr : 0) * scale_pitch;
  const unsigned w_dst = smem + W_AT + 32 * wr + 16 * (wb ^ ((wr >> 2) & 1));
  const unsigned s_dst = smem + S_AT + 4 * ((((sr >> 4) * 8 + (sr & 7)) * NW + sm) * 2 + ((sr >> 3) & 1));

  auto load = [&](int step, unsigned stage) {
    copy_x<0, KX>(x + step * STEP_K, xoff, x_dst + stage);
    copy16_or_zeros<0>(w_dst + stage, wa_src + 8 * step, is_wa);
    copy16_or_zeros<W_BYTES>(w_dst + stage, wb_src + 8 * step, is_wb);
    copy4_or_zeros(s_dst + stage, s_src + 2 * step, is_s);
    cp_async_commit();
  };

  // this lane's reads: its scale words, the quant words of row g of its warp's rows for block b (g + 8 at
  // +ROW_HALF_BYTES, the second weight at +W_BYTES), X of token g of group 0 for block b's low and high halves
  const int r0 = warp * WARP_ROWS + g, swizzle = (g >> 2) & 1, x_swizzle = (2 * g) & 7;
  const unsigned s_rd = smem + S_AT + 16 * (warp * 8 + g);
  const unsigned w_rd[2] = {smem + W_AT + 32 * r0 + 16 * swizzle + 4 * t,
                            smem + W_AT + 32 * r0 + 16 * (swizzle ^ 1) + 4 * t};
  const unsigned x_row = smem + 2 * (g * STEP_K + 4 * (t & 1));
  const unsigned x_rd[2][2] = {{x_row + 16 * ((t >> 1) ^ x_swizzle), x_row + 16 * ((2 + (t >> 1)) ^ x_swizzle)},
                               {x_row + 16 * ((4 + (t >> 1)) ^ x_swizzle), x_row + 16 * ((6 + (t >> 1)) ^ x_swizzle)}};

  const unsigned one024 = opaque_one024();
  auto compute = [&](unsigned stage) {
    const uint4 scales = load_shared4(s_rd + stage);  // weight 0 rows g, g + 8; weight 1 rows g, g + 8
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const unsigned wq = w_rd[b] + stage;
      unsigned lo[NW][4], hi[NW][4];
      dequant_block(load_shared<0>(wq), load_shared<ROW_HALF_BYTES>(wq), scales.x, scales.y, b, one024, lo[0],
                    hi[0]);
      dequant_block(load_shared<W_BYTES>(wq), load_shared<W_BYTES + ROW_HALF_BYTES>(wq), scales.z, scales.w, b,
                    one024, lo[1], hi[1]);
      group_mmas<0, G>(acc, lo, hi, x_rd[b][0] + stage, x_rd[b][1] + stage);
    }
  };

  unsigned loaded = 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_steps) load(s, loaded);
    else cp_async_commit();
    loaded += STAGE_BYTES;
  }
  unsigned computed = 0;  // loaded: the stage of step + STAGES - 1, the one computed the step before
  for (int step = 0; step < num_steps; ++step) {
    wait_pending<STAGES - 2>();
    __syncthreads();  // the step's stage is in place, and every warp is done with the stage loaded next
    const int next = step + STAGES - 1;
    if (next < num_steps) load(next, loaded);
    else cp_async_commit();
    compute(computed);
    loaded = loaded == (STAGES - 1) * STAGE_BYTES ? 0 : loaded + STAGE_BYTES;
    computed = computed == (STAGES - 1) * STAGE_BYTES ? 0 : computed + STAGE_BYTES;
  }
}

__device__ __forceinline__ float silu_mul(float g, float u) {  // activation.py's device_silu_mul
  const float e = expf(-fabsf(g));
  const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return g * sigmoid * u;
}

template <int G>
__device__ __forceinline__ void gate_up_tile(const __half* x, int x_pitch, int num_k32, const int* pair_token,
                                             int start, int num_rows, const unsigned* gq, const __half* gs,
                                             const unsigned* uq, const __half* us, int quant_pitch, int scale_pitch,
                                             int w_row0, int w_row_end, __half* hidden, int hidden_pitch, int col0,
                                             unsigned char* smem) {
  float acc[NW][G][4] = {};
  rows_tile<G, true>(x, x_pitch, num_k32, pair_token, start, num_rows, gq, gs, uq, us, quant_pitch, scale_pitch,
                     w_row0, w_row_end, w_row_end, smem, acc);
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

template <int G>
__device__ __forceinline__ void down_tile(const __half* hidden, int hidden_pitch, int num_k32, const int* pair_token,
                                          const float* pair_weight, int start, int num_rows, const unsigned* dq,
                                          const __half* ds, const unsigned* dq_second, const __half* ds_second,
                                          int quant_pitch, int scale_pitch, int w_row0, int w_row_end, float* out,
                                          int out_pitch, int col0, unsigned char* smem) {
  float acc[NW][G][4] = {};
  rows_tile<G, false>(hidden, hidden_pitch, num_k32, pair_token, start, num_rows, dq, ds, dq_second, ds_second,
                      quant_pitch, scale_pitch, w_row0, w_row_end, w_row_end - 64, smem, acc);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, row = (threadIdx.x >> 5) * WARP_ROWS + g;
#pragma unroll
  for (int m = 0; m < NW; ++m)
#pragma unroll
    for (int j = 0; j < G; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = 8 * j + 2 * t + (r & 1), c = 64 * m + row + 8 * (r >> 1);
        if (n < num_rows && w_row0 + c < w_row_end)
          atomicAdd(out + static_cast<size_t>(pair_token[start + n]) * out_pitch + col0 + c,
                    pair_weight[start + n] * acc[m][j][r]);
      }
}

}  // namespace

// Gate and up of one expert tile: hidden[start + n][col0 + c] = silu(gate) * up (f16) for the block's 64 weight
// rows (columns c of the expert's FFN, from w_row0 = expert * ffn + col0, up to w_row_end = expert * ffn + ffn),
// each aligned quad of columns stored in the order (0, 2, 1, 3). x: staged by moe_rows.stage_x.
extern "C" __device__ void strata_moe_rows_gate_up_q4_0(const __half* x, int x_pitch, int num_k32,
                                                        const int* pair_token, int start, int num_rows,
                                                        const unsigned* gq, const __half* gs, const unsigned* uq,
                                                        const __half* us, int quant_pitch, int scale_pitch,
                                                        int w_row0, int w_row_end, __half* hidden, int hidden_pitch,
                                                        int col0, unsigned char* smem) {
#define STRATA_GATE_UP(G)                                                                                        \
  case G:                                                                                                        \
    gate_up_tile<G>(x, x_pitch, num_k32, pair_token, start, num_rows, gq, gs, uq, us, quant_pitch, scale_pitch, \
                    w_row0, w_row_end, hidden, hidden_pitch, col0, smem);                                        \
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
extern "C" __device__ void strata_moe_rows_down_q4_0(const __half* hidden, int hidden_pitch, int num_k32,
                                                     const int* pair_token, const float* pair_weight, int start,
                                                     int num_rows, const unsigned* dq, const __half* ds,
                                                     int quant_pitch, int scale_pitch, int w_row0, int w_row_end,
                                                     float* out, int out_pitch, int col0, unsigned char* smem) {
  const bool has_second = w_row_end - w_row0 > 64;  // else every row of the second half reads as zeros
  const unsigned* dq_second = has_second ? dq + static_cast<size_t>(64) * quant_pitch : dq;
  const __half* ds_second = has_second ? ds + static_cast<size_t>(64) * scale_pitch : ds;
#define STRATA_DOWN(G)                                                                                          \
  case G:                                                                                                       \
    down_tile<G>(hidden, hidden_pitch, num_k32, pair_token, pair_weight, start, num_rows, dq, ds, dq_second,   \
                 ds_second, quant_pitch, scale_pitch, w_row0, w_row_end, out, out_pitch, col0, smem);           \
    break;
  switch ((num_rows + 7) >> 3) {
    STRATA_DOWN(1) STRATA_DOWN(2) STRATA_DOWN(3) STRATA_DOWN(4)
    STRATA_DOWN(5) STRATA_DOWN(6) STRATA_DOWN(7) STRATA_DOWN(8)
    default: break;
  }
#undef STRATA_DOWN
}
