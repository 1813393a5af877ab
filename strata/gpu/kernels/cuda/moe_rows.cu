// MoE expert products for chunks of few routed rows an expert (moe_rows.py): the weight rows are the
// mma's M and the tile's tokens its N, so a tile of up to 64 tokens pays for whole 8-token groups only,
// and each weight element is dequantized once a tile, straight into A fragments in registers.
//
// A block: WARPS warps, each owning 16 weight rows (rows g and g + 8 of a lane: g = lane / 4, t = lane % 4)
// of the block's 16 * WARPS, against all the tile's tokens (8 groups of 8; groups past the tile's rows
// are skipped). Every step stages 64 of K through a ring of STAGES by cp.async: the X rows of the tile,
// and the weights' raw Q4_0 blocks (quant words and f16 scales); one barrier a step.
//
// K order inside an mma: the products of a 16-wide mma may pair A's and B's k in any order, as long as
// both use the same. Lane t takes the physical elements 4t .. 4t + 3 of each 16-element half of a 32-element
// block: quant word t of the block (bytes 4t .. 4t + 3 hold elements 4t .. 4t + 3 in their low nibbles,
// 16 + 4t .. in their high), and one 8-byte load of each X row. In the mma those are logical
// k 2t, 2t + 1 (registers a0 / a1, b0) and 2t + 8, 2t + 9 (a2 / a3, b1).
//
// Shared layouts (bank-conflict-free for the loads of a step):
//   X   [STAGES][64 rows][64 halves]; the 16-byte chunk q of row r at chunk q ^ (2r mod 8)
//   Wq  [STAGES][NW][64 rows][8 words]; the 4 words of block b of row r at 4 * (b ^ (r / 4 mod 2))
//   Ws  [STAGES][NW][64 rows] words: the f16 scales of the row's two blocks
// Numerics: each weight is the f16 rounding of d * (q - 8) (as gemm_mma.cu's dequantizer), X is f16,
// the sums f32 in the mma.
//
// Every shared access goes through the block's 32-bit shared addresses (ld.shared / st.shared): the kernels
// pass the shared block as a generic pointer, through which each load would first test which memory it is.
// A thread's cp.async sources and destinations are fixed but for the step's K offset and the stage, so
// they are set once before the K loop: at few tokens a tile the loop's work is mostly the weights' side.
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr int STEP_K = 64, STAGES = 3, TILE_TOKENS = 64, WARP_ROWS = 16;
constexpr int X_STAGE_HALVES = TILE_TOKENS * STEP_K;           // 4,096 halves: 8 KiB
constexpr int W_STAGE_WORDS = 64 * STEP_K / 8;                 // 64 rows x 2 blocks x 4 words: 2 KiB
constexpr int S_STAGE_WORDS = 64;                              // a scale pair a row

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// cp.async of 16 / 4 bytes to shared address dst; nothing is read (zeros are written) unless valid
__device__ __forceinline__ void copy16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy4(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}

// volatile: each stays between the barriers and cp.async waits that order it against the ring's copies
__device__ __forceinline__ unsigned load_shared(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 load_shared2(unsigned addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void store_shared(unsigned addr, int v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v));
}

template <int N>
__device__ __forceinline__ void wait_pending() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The f16 halves d * (q - 8) of the nibbles selected by `selector` (bytes (0, 1) or (2, 3)) of `nibbles`.
__device__ __forceinline__ unsigned q4_pair(unsigned nibbles, unsigned selector, __half2 d) {
  return scaled_half2(__byte_perm(nibbles, 0x64646464u, selector), 0x64086408u, d);
}

// The shared block's regions as 32-bit shared addresses (bytes).
template <int NW>
struct Smem {
  unsigned x, wq, ws, rows;
  __device__ explicit Smem(unsigned char* base)
      : x(shared_address(base)),
        wq(x + 2 * STAGES * X_STAGE_HALVES),
        ws(wq + 4 * STAGES * NW * W_STAGE_WORDS),
        rows(ws + 4 * STAGES * NW * S_STAGE_WORDS) {}
};

// acc[m][j] += W_m[w_row0 + 16 * warp ..][K] x X[rows of tokens 8j ..][K]^T over the whole K.
//   x       f16 [.][x_pitch]; token n of the tile is X row pair_token[start + n] (GATHER) or start + n
//   qa, sa (qb, sb)  Q4_0 planes of the NW weights; rows from w_row_end (w_row_end_b for qb) on read as zeros
//   smem    moe_rows.py's shared block (Smem's layout); every thread of the block calls this
template <int NW, int WARPS, bool GATHER>
__device__ __forceinline__ void rows_tile(const __half* x, int x_pitch, int num_k32, const int* pair_token, int start,
                                          int num_rows, const unsigned* qa, const __half* sa, const unsigned* qb,
                                          const __half* sb, int quant_pitch, int scale_pitch, int w_row0,
                                          int w_row_end, int w_row_end_b, unsigned char* smem_base,
                                          float (&acc)[NW][8][4]) {
  constexpr int THREADS = 32 * WARPS, BLOCK_ROWS = WARP_ROWS * WARPS;
  static_assert(BLOCK_ROWS == 64, "the weight stages hold 64 rows");
  static_assert(NW == 2 && THREADS == 128, "a thread copies one quant chunk of each weight and one scale word a step");
  const Smem<NW> smem(smem_base);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int num_groups = (num_rows + 7) >> 3, num_steps = num_k32 / 2;
  if (tid < TILE_TOKENS)
    store_shared(smem.rows + 4 * tid, tid < num_rows ? (GATHER ? pair_token[start + tid] : start + tid) : -1);
  __syncthreads();

  // X: 16-byte chunk xq of tile rows xr + 16 k (k < 4, rows of the tile's groups), at chunk xq ^ (2r mod 8),
  // the same for every k
  const int xq = tid & 7, xr = tid >> 3;
  const unsigned x_dst = smem.x + 2 * (xr * STEP_K + 8 * (xq ^ ((2 * xr) & 7)));
  // weights: quant chunk wb (16 bytes) of row wr of each weight, and the scale pair of row sr of weight sm
  const int wr = (tid >> 1) & 63, wb = tid & 1, sr = tid & 63, sm = tid >> 6;
  const bool is_wa = w_row0 + wr < w_row_end, is_wb = w_row0 + wr < w_row_end_b;
  const bool is_s = w_row0 + sr < (sm ? w_row_end_b : w_row_end);
  const unsigned* wa_src = qa + static_cast<size_t>(is_wa ? w_row0 + wr : 0) * quant_pitch + 4 * wb;
  const unsigned* wb_src = qb + static_cast<size_t>(is_wb ? w_row0 + wr : 0) * quant_pitch + 4 * wb;
  const __half* s_src = (sm ? sb : sa) + static_cast<size_t>(is_s ? w_row0 + sr : 0) * scale_pitch;
  const unsigned w_dst = smem.wq + 4 * (wr * 8 + 4 * (wb ^ ((wr >> 2) & 1)));
  const unsigned s_dst = smem.ws + 4 * (sm * S_STAGE_WORDS + sr);

  auto load = [&](int step, int buf) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = xr + 16 * k;
      if (r < 8 * num_groups) {
        const int row = static_cast<int>(load_shared(smem.rows + 4 * r));
        copy16(x_dst + 2 * (buf * X_STAGE_HALVES + 16 * k * STEP_K),
               x + static_cast<size_t>(row < 0 ? 0 : row) * x_pitch + step * STEP_K + 8 * xq, row >= 0);
      }
    }
    const unsigned w_stage = w_dst + 4 * buf * NW * W_STAGE_WORDS;
    copy16(w_stage, wa_src + 8 * step, is_wa);
    copy16(w_stage + 4 * W_STAGE_WORDS, wb_src + 8 * step, is_wb);
    copy4(s_dst + 4 * buf * NW * S_STAGE_WORDS, s_src + 2 * step, is_s);
    cp_async_commit();
  };

  const int r0 = warp * WARP_ROWS + g, swizzle = (r0 >> 2) & 1, x_swizzle = (2 * g) & 7;
  auto compute = [&](int buf) {
    const unsigned xs = smem.x + 2 * buf * X_STAGE_HALVES;
    unsigned scales[NW][2];
#pragma unroll
    for (int m = 0; m < NW; ++m) {
      scales[m][0] = load_shared(smem.ws + 4 * ((buf * NW + m) * S_STAGE_WORDS + r0));
      scales[m][1] = load_shared(smem.ws + 4 * ((buf * NW + m) * S_STAGE_WORDS + r0 + 8));
    }
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      unsigned lo[NW][4], hi[NW][4];  // A fragments of the block's two 16-element halves
#pragma unroll
      for (int m = 0; m < NW; ++m) {
        const unsigned wq = smem.wq + 4 * ((buf * NW + m) * W_STAGE_WORDS + 4 * (b ^ swizzle) + t);
        const unsigned w0 = load_shared(wq + 4 * r0 * 8), w1 = load_shared(wq + 4 * (r0 + 8) * 8);
        const __half2 s0 = *reinterpret_cast<const __half2*>(&scales[m][0]);
        const __half2 s1 = *reinterpret_cast<const __half2*>(&scales[m][1]);
        const __half2 d0 = b ? __high2half2(s0) : __low2half2(s0), d1 = b ? __high2half2(s1) : __low2half2(s1);
        const unsigned l0 = w0 & 0x0F0F0F0Fu, l1 = w1 & 0x0F0F0F0Fu;
        const unsigned h0 = (w0 >> 4) & 0x0F0F0F0Fu, h1 = (w1 >> 4) & 0x0F0F0F0Fu;
        lo[m][0] = q4_pair(l0, 0x4140, d0);
        lo[m][1] = q4_pair(l1, 0x4140, d1);
        lo[m][2] = q4_pair(l0, 0x4342, d0);
        lo[m][3] = q4_pair(l1, 0x4342, d1);
        hi[m][0] = q4_pair(h0, 0x4140, d0);
        hi[m][1] = q4_pair(h1, 0x4140, d1);
        hi[m][2] = q4_pair(h0, 0x4342, d0);
        hi[m][3] = q4_pair(h1, 0x4342, d1);
      }
      const int chunk = 4 * b + (t >> 1), within = 4 * (t & 1);
      // two token groups at a time, so that no mma waits on the one before it (each accumulator still takes
      // its low half, then its high half); with one weight down measured faster one group at a time
      constexpr int AT_ONCE = NW == 2 ? 2 : 1;
#pragma unroll
      for (int j = 0; j < 8; j += AT_ONCE) {
        if (j < num_groups) {
          uint2 xl[AT_ONCE], xh[AT_ONCE];
#pragma unroll
          for (int p = 0; p < AT_ONCE; ++p) {
            const unsigned row = xs + 2 * ((8 * (j + p) + g) * STEP_K + within);  // a group past the tile: read, unused
            xl[p] = load_shared2(row + 2 * 8 * (chunk ^ x_swizzle));
            xh[p] = load_shared2(row + 2 * 8 * ((chunk + 2) ^ x_swizzle));
          }
#pragma unroll
          for (int p = 0; p < AT_ONCE; ++p)
#pragma unroll
            for (int m = 0; m < NW; ++m)
              if (j + p < num_groups)
                mma_16816(acc[m][j + p], lo[m][0], lo[m][1], lo[m][2], lo[m][3], xl[p].x, xl[p].y);
#pragma unroll
          for (int p = 0; p < AT_ONCE; ++p)
#pragma unroll
            for (int m = 0; m < NW; ++m)
              if (j + p < num_groups)
                mma_16816(acc[m][j + p], hi[m][0], hi[m][1], hi[m][2], hi[m][3], xh[p].x, xh[p].y);
        }
      }
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_steps) load(s, s);
    else cp_async_commit();
  }
  for (int step = 0; step < num_steps; ++step) {
    wait_pending<STAGES - 2>();
    __syncthreads();  // the step's stage is in place, and every warp is done with the stage loaded next
    const int next = step + STAGES - 1;
    if (next < num_steps) load(next, next % STAGES);
    else cp_async_commit();
    compute(step % STAGES);
  }
}

__device__ __forceinline__ float silu_mul(float g, float u) {  // activation.py's device_silu_mul
  const float e = expf(-fabsf(g));
  const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return g * sigmoid * u;
}

}  // namespace

// Gate and up of one expert tile: hidden[start + n][col0 + c] = silu(gate) * up (f16) for the block's 64 weight
// rows (columns c of the expert's FFN, from w_row0 = expert * ffn + col0, up to w_row_end = expert * ffn + ffn).
extern "C" __device__ void strata_moe_rows_gate_up_q4_0(const __half* x, int x_pitch, int num_k32,
                                                        const int* pair_token, int start, int num_rows,
                                                        const unsigned* gq, const __half* gs, const unsigned* uq,
                                                        const __half* us, int quant_pitch, int scale_pitch,
                                                        int w_row0, int w_row_end, __half* hidden, int hidden_pitch,
                                                        int col0, unsigned char* smem) {
  float acc[2][8][4] = {};
  rows_tile<2, 4, true>(x, x_pitch, num_k32, pair_token, start, num_rows, gq, gs, uq, us, quant_pitch, scale_pitch,
                        w_row0, w_row_end, w_row_end, smem, acc);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, row = (threadIdx.x >> 5) * WARP_ROWS + g;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = 8 * j + 2 * t + (r & 1), c = row + 8 * (r >> 1);
      if (n < num_rows && w_row0 + c < w_row_end)
        hidden[static_cast<size_t>(start + n) * hidden_pitch + col0 + c] = __float2half_rn(silu_mul(acc[0][j][r], acc[1][j][r]));
    }
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
  float acc[2][8][4] = {};
  const bool has_second = w_row_end - w_row0 > 64;  // else every row of the second half reads as zeros
  const unsigned* dq_second = has_second ? dq + static_cast<size_t>(64) * quant_pitch : dq;
  const __half* ds_second = has_second ? ds + static_cast<size_t>(64) * scale_pitch : ds;
  rows_tile<2, 4, false>(hidden, hidden_pitch, num_k32, pair_token, start, num_rows, dq, ds, dq_second, ds_second,
                         quant_pitch, scale_pitch, w_row0, w_row_end, w_row_end - 64, smem, acc);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, row = (threadIdx.x >> 5) * WARP_ROWS + g;
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = 8 * j + 2 * t + (r & 1), c = 64 * m + row + 8 * (r >> 1);
        if (n < num_rows && w_row0 + c < w_row_end)
          atomicAdd(out + static_cast<size_t>(pair_token[start + n]) * out_pitch + col0 + c,
                    pair_weight[start + n] * acc[m][j][r]);
      }
}
