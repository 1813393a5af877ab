// Decode attention read at HBM speed (attention_decode_direct.py): a block per (query row, KV head, KV split), its
// W warps taking the split's 16-key tiles in turn (U tiles a step, loaded before any is used), K and V read from
// the cache straight into mma.m16n8k16 fragments with 16-byte loads and dequantized in registers: K and V are not
// staged in shared memory (only Q, once a block), no pass dequantizes the cache first. Each warp keeps its own
// online softmax; the warps meet in shared memory; with one split the block writes the output, else its partial
// (O, m, l), and the last of a row's splits to finish combines them all, in split order (the same bits whichever
// finishes last).
//
// Fragment roles (g = lane / 4, t = lane % 4). The group's G <= 8 query heads are A rows g (rows g + 8 zero):
//   S = Q K^T over a tile's keys in two n-tiles of 8. Lane (g, t) holds key 8j + g over dims [C t, C t + C),
//     C = D / 4: a dot product does not care which dims meet in which k-slot, so k-step kk's slots 2t, 2t + 1,
//     2t + 8, 2t + 9 are dims C t + 4 kk + 0..3, and Q's A fragments take the same dims.
//   O += P V, one k-step of the tile's 16 keys. P is the scores' C fragment as it stands (n-tile 0's columns
//     2t, 2t + 1 and n-tile 1's are the k-slots 2t, 2t + 1, 2t + 8, 2t + 9). V's B fragment pairs two keys of one
//     dim: the lane loads keys 2t, 2t + 1, 8 + 2t, 9 + 2t over its D / 8 dims and pairs them by byte permutes.
//     Output n-tile n's columns 2t, 2t + 1 are dims v_dim(n, 2t), v_dim(n, 2t + 1).
// K, V, Q (scaled by softmax_scale * log2(e)) and P are f16 (the cache's quants as the f16 roundings of d * q,
// the values attention_mma's staging makes); products and sums are f32; m is in log2 units.
//
// Masked keys (past the split's end) are loaded from the split's last key: finite, and P is 0 for them.
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ uint4 load_stream16(const unsigned* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// N consecutive 32-bit words from a 4 * N-byte aligned address (N = 1, 2 or a multiple of 4).
template <int N>
__device__ __forceinline__ void load_words(const unsigned* p, unsigned (&w)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint4 v = load_stream16(p + i);
      w[i] = v.x;
      w[i + 1] = v.y;
      w[i + 2] = v.z;
      w[i + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x;
    w[1] = v.y;
  } else {
    w[0] = __ldg(p);
  }
}

__device__ __forceinline__ float load_scale(const __half* p) {
  return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p))));
}

// ---- per format: where a lane's K and V words lie, and how they become f16 pairs (host-tested) ----

// Words of one key a lane loads for K (dims [C t, C t + C)) and for V (its D / 8 dims).
template <OctetFormat F, int D>
struct Words {
  static constexpr int K = F == kF16 ? D / 8 : F == kQ8_0 ? D / 16 : 4;
  static constexpr int V = F == kF16 ? D / 16 : F == kQ8_0 ? D / 32 : D / 64;
};

// The word (of the head's words in a cache row, from the head's first element) where lane t's K words start,
// and the scale block (of the head's blocks) they belong to.
template <OctetFormat F, int D>
__device__ __forceinline__ int k_word(int t) {
  constexpr int C = D / 4;
  if constexpr (F == kF16) return C * t / 2;
  if constexpr (F == kQ8_0) return C * t / 4;  // 8 words a 32-element block
  return (C * t / 32) * 4;                      // Q4_0: the whole 4-word block holding the dims
}
template <OctetFormat F, int D>
__device__ __forceinline__ int k_block(int t) { return D / 4 * t / 32; }

// Lane g's V words: F16 and Q8_0 dims (D / 8) g .. (D / 8) g + D / 8 - 1; Q4_0 words g * D / 64 .. (each word
// holds 4 elements in its low nibbles and the 4 sixteen further on in its high ones).
template <OctetFormat F, int D>
__device__ __forceinline__ int v_word(int g) {
  if constexpr (F == kF16) return D / 16 * g;
  if constexpr (F == kQ8_0) return D / 32 * g;
  return D / 64 * g;
}
template <OctetFormat F, int D>
__device__ __forceinline__ int v_block(int g) {
  if constexpr (F == kQ4_0) return D / 64 * g / 4;
  return D / 8 * g / 32;
}

// The dim (within the head) of lane g's V pair element n (n < D / 8): B column g of output n-tile n.
template <OctetFormat F, int D>
__device__ __forceinline__ int v_dim(int n, int g) {
  if constexpr (F != kQ4_0) return D / 8 * g + n;
  constexpr int LOW = D / 16;  // elements from the low nibbles
  const int high = n >= LOW ? 1 : 0;
  const int m = n - high * LOW;
  const int word = D / 64 * g + m / 4;
  return 32 * (word / 4) + 4 * (word % 4) + m % 4 + 16 * high;
}

// Bytes 0, 1 (hi = 0) or 2, 3 (hi = 1) of a word of small integers as the f16 pair d * (b - bias).
template <OctetFormat F>
__device__ __forceinline__ unsigned int_pair(unsigned word, int hi, __half2 d) {
  const unsigned bias = F == kQ8_0 ? 0x64806480u : 0x64086408u;  // 1024 + 128 (int8 offset), 1024 + 8
  return scaled_half2(__byte_perm(word, 0x64646464u, hi ? 0x4342 : 0x4140), bias, d);
}

// K's B fragment of k-step kk for lane t: the f16 pairs of dims C t + 4 kk + (0, 1) and + (2, 3).
template <OctetFormat F, int D>
__device__ __forceinline__ void k_pairs(const unsigned (&w)[Words<F, D>::K], float d, int t, int kk, unsigned& b0,
                                        unsigned& b1) {
  if constexpr (F == kF16) {
    b0 = w[2 * kk];
    b1 = w[2 * kk + 1];
  } else if constexpr (F == kQ8_0) {
    const __half2 d2 = __float2half2_rn(d);
    const unsigned word = w[kk] ^ 0x80808080u;
    b0 = int_pair<F>(word, 0, d2);
    b1 = int_pair<F>(word, 1, d2);
  } else {
    const __half2 d2 = __float2half2_rn(d);
    const int base = D / 4 * t % 32;  // the lane's first element in its block: 0, or 16 at D = 64
    // byte j: block element base + 4 kk + j
    const unsigned word = (w[kk % 4] >> ((base + 4 * kk) / 16 * 4)) & 0x0F0F0F0Fu;
    b0 = int_pair<F>(word, 0, d2);
    b1 = int_pair<F>(word, 1, d2);
  }
}

// Lane g's V pair i (< D / 16) of one key: the f16 values of its elements 2i and 2i + 1 (dims v_dim(2i, g), ..).
template <OctetFormat F, int D>
__device__ __forceinline__ unsigned v_pair(const unsigned (&w)[Words<F, D>::V], float d, int i) {
  if constexpr (F == kF16) {
    return w[i];
  } else if constexpr (F == kQ8_0) {
    return int_pair<F>(w[i / 2] ^ 0x80808080u, i % 2, __float2half2_rn(d));
  } else {
    constexpr int LOW = D / 32;  // pairs from the low nibbles
    const int high = i >= LOW ? 1 : 0;
    const int m = i - high * LOW;
    return int_pair<F>((w[m / 2] >> (4 * high)) & 0x0F0F0F0Fu, m % 2, __float2half2_rn(d));
  }
}

// Where the meet keeps dim d of a warp's O row of one head: rows PITCH floats apart, each 32-dim block's dims
// permuted by an XOR. A store of the meet puts each lane's dim v_dim(n, 2 t + e) in head g's row, 32 t + c at
// D = 128 with c the same for the warp's lanes: unpermuted, a store's four t would share a bank (and with rows D
// apart, all 32 lanes). The XOR's step is the format's: at D = 64 Q4_0's nibbles put its lanes' dims 8 apart.
template <OctetFormat F, int D>
struct ORow {
  static constexpr int PITCH = D + 1;
  static constexpr int SKEW = F == kQ4_0 && D == 64 ? 16 : 8;
};
template <OctetFormat F, int D>
__device__ __forceinline__ int o_col(int d) { return d ^ (ORow<F, D>::SKEW * (d / 32)); }

// ---- the KV loop of one warp ----

template <OctetFormat F, int D>
struct HeadPlanes {
  const unsigned* k_words;  // the cache rows' words from this head's first element (F16: two halves a word)
  const __half* k_scales;   // from this head's first block
  const unsigned* v_words;
  const __half* v_scales;
  int word_pitch, scale_pitch;
};

// One tile's K and V as a lane loads them: keys 8j + g (K), keys 2t, 2t + 1, 8 + 2t, 9 + 2t (V).
template <OctetFormat F, int D>
struct TileWords {
  unsigned k[2][Words<F, D>::K];
  unsigned v[4][Words<F, D>::V];
  float kd[2], vd[4];
};

template <OctetFormat F, int D>
__device__ __forceinline__ void load_tile(const HeadPlanes<F, D>& p, int key0, int last, int g, int t,
                                          TileWords<F, D>& tw) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int row = min(key0 + 8 * j + g, last);
    load_words(p.k_words + static_cast<size_t>(row) * p.word_pitch + k_word<F, D>(t), tw.k[j]);
    tw.kd[j] = F == kF16 ? 0.f : load_scale(p.k_scales + static_cast<size_t>(row) * p.scale_pitch + k_block<F, D>(t));
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = min(key0 + 8 * (i >> 1) + 2 * t + (i & 1), last);
    load_words(p.v_words + static_cast<size_t>(row) * p.word_pitch + v_word<F, D>(g), tw.v[i]);
    tw.vd[i] = F == kF16 ? 0.f : load_scale(p.v_scales + static_cast<size_t>(row) * p.scale_pitch + v_block<F, D>(g));
  }
}

// c0, c1 += A (rows g: a0, a2; rows g + 8 zero) * B: the accumulators of rows g + 8 are dropped.
__device__ __forceinline__ void mma_rows_g(float& c0, float& c1, unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
  float c[4] = {c0, c1, 0.f, 0.f};
  mma_16816(c, a0, 0u, a2, 0u, b0, b1);
  c0 = c[0];
  c1 = c[1];
}

// A warp's online-softmax state for head g: O at dims v_dim(n, 2t + e) in o[n][e], running max m (log2 units)
// and sum l.
template <int D>
struct WarpState {
  float o[D / 8][2];
  float m, l;
};

// One tile: keys key0 .. key0 + 15, those from `end` on masked.
template <OctetFormat F, int D>
__device__ __forceinline__ void tile_update(const unsigned (&qa)[D / 16][2], const TileWords<F, D>& tw, int key0,
                                            int end, int t, WarpState<D>& st) {
  float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // [n-tile j][e]: keys key0 + 8j + 2t + e
  // k-steps outside, n-tiles inside: the two accumulator chains interleave (mma waits on its accumulator)
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      unsigned b0, b1;
      k_pairs<F, D>(tw.k[j], tw.kd[j], t, kk, b0, b1);
      mma_rows_g(s[j][0], s[j][1], qa[kk][0], qa[kk][1], b0, b1);
    }
  float tile_max = neg_inf();
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (key0 + 8 * j + 2 * t + e >= end) s[j][e] = neg_inf();
      tile_max = fmaxf(tile_max, s[j][e]);
    }
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
  const float m_new = fmaxf(st.m, tile_max);
  const float alpha = st.m == neg_inf() ? 0.f : exp2f(st.m - m_new);
  float row_sum = 0.f;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[j][e] = s[j][e] == neg_inf() ? 0.f : exp2f(s[j][e] - m_new);
      row_sum += s[j][e];
    }
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 2);
  st.l = st.l * alpha + row_sum;
  st.m = m_new;
  const unsigned a0 = pack_half2(s[0][0], s[0][1]), a2 = pack_half2(s[1][0], s[1][1]);
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const unsigned p0 = v_pair<F, D>(tw.v[0], tw.vd[0], i), p1 = v_pair<F, D>(tw.v[1], tw.vd[1], i);
    const unsigned p2 = v_pair<F, D>(tw.v[2], tw.vd[2], i), p3 = v_pair<F, D>(tw.v[3], tw.vd[3], i);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const unsigned selector = e ? 0x7632u : 0x5410u;  // the high halves (element 2i + 1) or the low ones
      const int n = 2 * i + e;
      st.o[n][0] *= alpha;
      st.o[n][1] *= alpha;
      mma_rows_g(st.o[n][0], st.o[n][1], a0, a2, __byte_perm(p0, p1, selector), __byte_perm(p2, p3, selector));
    }
  }
}

// Warp `warp` of W over keys begin .. end - 1: steps of U tiles (tiles warp * U .. warp * U + U - 1, then W * U
// further on, ...), each step's words loaded while the step before is multiplied.
template <OctetFormat F, int D, int W, int U>
__device__ __forceinline__ void warp_loop(const HeadPlanes<F, D>& p, const unsigned (&qa)[D / 16][2], int begin,
                                          int end, int warp, int g, int t, WarpState<D>& st) {
#pragma unroll
  for (int n = 0; n < D / 8; ++n) st.o[n][0] = st.o[n][1] = 0.f;
  st.m = neg_inf();
  st.l = 0.f;
  const int num_tiles = (end - begin + 15) / 16;
  TileWords<F, D> cur[U], next[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (warp * U + u < num_tiles) load_tile<F, D>(p, begin + 16 * (warp * U + u), end - 1, g, t, cur[u]);
  for (int tile0 = warp * U; tile0 < num_tiles; tile0 += W * U) {
    const int next0 = tile0 + W * U;
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (next0 + u < num_tiles) load_tile<F, D>(p, begin + 16 * (next0 + u), end - 1, g, t, next[u]);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (tile0 + u < num_tiles) tile_update<F, D>(qa, cur[u], begin + 16 * (tile0 + u), end, t, st);
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = next[u];
  }
}

// ---- splits ----

// Keys of each split of a row attending `span` keys over `num_splits` blocks: at least min_keys, whole tiles.
__device__ __forceinline__ int split_keys(int span, int num_splits, int min_keys) {
  const int share = ((span + num_splits - 1) / num_splits + 15) / 16 * 16;
  return max(share, min_keys);
}

// Splits that hold keys (at least one: a row with no key still writes its zeros).
__device__ __forceinline__ int active_splits(int span, int keys) { return max(1, (span + keys - 1) / keys); }

__device__ __forceinline__ float weight_of(float m, float m_max) { return m == neg_inf() ? 0.f : exp2f(m - m_max); }

// The block: q [T, Hq * D] f32, the cache's planes, q_positions [T], out [T, Hq * D]; o_part [S, T, Hq, D],
// ml_part [S, T, Hkv, 32] (m of head h at h, l at 16 + h), counters [T, Hkv] (zero between launches: the last
// block resets its own). smem: max(Q_OFFSET + G * (D + 8) / 2, 2 * S * G + G) floats, Q_OFFSET = W * G * (D + 3)
// rounded up to a multiple of 4 (the warps' states, then the staged Q; the last block's weights reuse it).
// grid (T, Hkv, S), W * 32 threads.
template <OctetFormat F, int D, int G, int W, int U>
__device__ __forceinline__ void decode_block(const float* q, const void* k_quants, const __half* k_scales,
                                             const void* v_quants, const __half* v_scales, int word_pitch,
                                             int scale_pitch, const int* q_positions, int kv_len, int min_keys,
                                             float q_scale, float* out, float* o_part, float* ml_part, int* counters,
                                             float* smem) {
  static_assert(G >= 1 && G <= 8, "the group's heads are the A rows g of one warp");
  constexpr int THREADS = 32 * W;
  const int row = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int num_rows = gridDim.x, num_kv_heads = gridDim.y, num_splits = gridDim.z;
  const int num_q_heads = num_kv_heads * G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // The group's Q rows go through shared memory: read from global memory, a warp's fragment loads span 8 heads x 4
  // dim quarters, 32 cache lines an instruction. The block's threads read them in order (before the position).
  constexpr int Q_QUADS = G * D / 4, Q_PER_THREAD = (Q_QUADS + THREADS - 1) / THREADS;
  constexpr int Q_PITCH = D + 8;  // halves a staged row: the padding spreads the rows over the banks
  const float* q_group = q + static_cast<size_t>(row) * num_q_heads * D + static_cast<size_t>(kvh) * G * D;
  float q_own[Q_PER_THREAD][4];
#pragma unroll
  for (int i = 0; i < Q_PER_THREAD; ++i) {
    const int quad = tid + i * THREADS;
#pragma unroll
    for (int e = 0; e < 4; ++e) q_own[i][e] = quad < Q_QUADS ? q_group[4 * quad + e] : 0.f;
  }

  const int span = max(0, min(kv_len, q_positions[row] + 1));
  const int keys = split_keys(span, num_splits, min_keys);
  const int active = active_splits(span, keys);
  if (split >= active) return;
  const int begin = min(split * keys, span), end = min(begin + keys, span);

  // [G][Q_PITCH], past the warps' states (16-byte aligned)
  constexpr int Q_OFFSET = (W * G * (ORow<F, D>::PITCH + 2) + 3) / 4 * 4;
  __half* q_s = reinterpret_cast<__half*>(smem + Q_OFFSET);
#pragma unroll
  for (int i = 0; i < Q_PER_THREAD; ++i) {
    const int quad = tid + i * THREADS;
    if (quad < Q_QUADS) {
      const int h = 4 * quad / D, d = 4 * quad % D;
      *reinterpret_cast<uint2*>(q_s + h * Q_PITCH + d) =
          make_uint2(pack_half2(q_own[i][0] * q_scale, q_own[i][1] * q_scale),
                     pack_half2(q_own[i][2] * q_scale, q_own[i][3] * q_scale));
    }
  }
  __syncthreads();
  unsigned qa[D / 16][2];  // rows g of Q's A fragments: dims C t + 4 kk + (0, 1) and (2, 3)
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint2 pair = g < G ? *reinterpret_cast<const uint2*>(q_s + g * Q_PITCH + D / 4 * t + 4 * kk)
                             : make_uint2(0u, 0u);
    qa[kk][0] = pair.x;
    qa[kk][1] = pair.y;
  }
  const int col0 = kvh * D;  // the head's first element of a cache row
  const int word0 = F == kF16 ? col0 / 2 : F == kQ8_0 ? col0 / 4 : col0 / 8;
  const HeadPlanes<F, D> planes{static_cast<const unsigned*>(k_quants) + word0, k_scales + col0 / 32,
                                static_cast<const unsigned*>(v_quants) + word0, v_scales + col0 / 32, word_pitch,
                                scale_pitch};
  WarpState<D> st;
  warp_loop<F, D, W, U>(planes, qa, begin, end, warp, g, t, st);

  // the warps meet: O [W][G][PITCH] (dim d at o_col(d)), then m [W][G] and l [W][G]
  constexpr int O_PITCH = ORow<F, D>::PITCH;
  float* o_s = smem;
  float* m_s = smem + W * G * O_PITCH;
  float* l_s = m_s + W * G;
  if (g < G) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) o_s[(warp * G + g) * O_PITCH + o_col<F, D>(v_dim<F, D>(n, 2 * t + e))] = st.o[n][e];
    if (t == 0) {
      m_s[warp * G + g] = st.m;
      l_s[warp * G + g] = st.l;
    }
  }
  __syncthreads();
  // a thread a head: the warps' weights, the block's max and sum (the staged Q is read: its room is free)
  static_assert(W + 1 <= (D + 8) / 2, "the warps' weights and the sums fit in the staged Q's room");
  float* weight_s = reinterpret_cast<float*>(q_s);  // [W][G]
  float* l_block_s = weight_s + W * G;               // [G]
  const size_t part_row = static_cast<size_t>(split) * num_rows + row;
  if (tid < G) {
    const int h = tid;
    float m_max = neg_inf();
#pragma unroll
    for (int w = 0; w < W; ++w) m_max = fmaxf(m_max, m_s[w * G + h]);
    float l_sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float weight = weight_of(m_s[w * G + h], m_max);
      weight_s[w * G + h] = weight;
      l_sum += l_s[w * G + h] * weight;
    }
    l_block_s[h] = l_sum;
    if (active > 1) {
      ml_part[(part_row * num_kv_heads + kvh) * 32 + h] = m_max;
      ml_part[(part_row * num_kv_heads + kvh) * 32 + 16 + h] = l_sum;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < G * D; idx += THREADS) {
    const int h = idx / D, d = idx % D;
    float o_sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) o_sum += o_s[(w * G + h) * O_PITCH + o_col<F, D>(d)] * weight_s[w * G + h];
    const int head = kvh * G + h;
    if (active == 1) {
      const float l_sum = l_block_s[h];
      out[static_cast<size_t>(row) * num_q_heads * D + static_cast<size_t>(head) * D + d] =
          l_sum > 0.f ? o_sum / l_sum : 0.f;
    } else {
      o_part[(part_row * num_q_heads + head) * D + d] = o_sum;
    }
  }
  if (active == 1) return;

  // the last of the row's active splits to finish combines them
  __threadfence();
  __syncthreads();
  int* is_last = reinterpret_cast<int*>(smem);  // o_s is read by every thread already
  if (tid == 0) {
    int* counter = counters + row * num_kv_heads + kvh;
    const int arrived = atomicAdd(counter, 1);
    *is_last = arrived == active - 1;
    if (arrived == active - 1) atomicExch(counter, 0);
  }
  __syncthreads();
  const bool last = *is_last;
  __syncthreads();  // every thread has read the flag before the weights overwrite it
  if (!last) return;
  __threadfence();
  float* w_s = smem;                 // [active][G] weights
  float* l_part_s = w_s + active * G;  // [active][G] sums, then [G] totals
  float* l_tot = l_part_s + active * G;
  for (int idx = tid; idx < active * G; idx += THREADS) {
    const size_t ml = ((static_cast<size_t>(idx / G) * num_rows + row) * num_kv_heads + kvh) * 32 + idx % G;
    w_s[idx] = __ldcg(ml_part + ml);
    l_part_s[idx] = __ldcg(ml_part + ml + 16);
  }
  __syncthreads();
  for (int h = warp; h < G; h += W) {  // a warp a head: the max, the weights and the sum over splits
    float m_max = neg_inf();
    for (int s = lane; s < active; s += 32) m_max = fmaxf(m_max, w_s[s * G + h]);
#pragma unroll
    for (int offset = 16; offset; offset >>= 1) m_max = fmaxf(m_max, __shfl_xor_sync(0xffffffffu, m_max, offset));
    float l_sum = 0.f;
    for (int s = lane; s < active; s += 32) {
      const float weight = weight_of(w_s[s * G + h], m_max);
      w_s[s * G + h] = weight;
      l_sum += l_part_s[s * G + h] * weight;
    }
#pragma unroll
    for (int offset = 16; offset; offset >>= 1) l_sum += __shfl_xor_sync(0xffffffffu, l_sum, offset);
    if (lane == 0) l_tot[h] = l_sum;
  }
  __syncthreads();
  for (int idx = tid; idx < G * D / 4; idx += THREADS) {
    const int h = idx / (D / 4), d4 = idx % (D / 4);
    const int head = kvh * G + h;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < active; ++s) {
      const float4 o4 = __ldcg(reinterpret_cast<const float4*>(
                                   o_part + ((static_cast<size_t>(s) * num_rows + row) * num_q_heads + head) * D) + d4);
      const float weight = w_s[s * G + h];
      acc.x += o4.x * weight;
      acc.y += o4.y * weight;
      acc.z += o4.z * weight;
      acc.w += o4.w * weight;
    }
    const float inv_l = l_tot[h] > 0.f ? 1.f / l_tot[h] : 0.f;
    float* o = out + static_cast<size_t>(row) * num_q_heads * D + static_cast<size_t>(head) * D + 4 * d4;
    o[0] = acc.x * inv_l;
    o[1] = acc.y * inv_l;
    o[2] = acc.z * inv_l;
    o[3] = acc.w * inv_l;
  }
}

}  // namespace

// Instantiated on demand: attention_decode_direct.py appends one STRATA_ATTENTION_DECODE line per kernel.
#define STRATA_ATTENTION_DECODE(FMT, D, G, W, U)                                                                    \
  extern "C" __device__ void strata_attention_decode_##FMT##_d##D##_g##G##_w##W##_u##U(                            \
      const float* q, const void* k_quants, const __half* k_scales, const void* v_quants, const __half* v_scales,   \
      int word_pitch, int scale_pitch, const int* q_positions, int kv_len, int min_keys, float q_scale, float* out, \
      float* o_part, float* ml_part, int* counters, float* smem) {                                                  \
    decode_block<k##FMT, D, G, W, U>(q, k_quants, k_scales, v_quants, v_scales, word_pitch, scale_pitch,            \
                                     q_positions, kv_len, min_keys, q_scale, out, o_part, ml_part, counters, smem); \
  }
