// tools/attention_stamps.py's harness: the direct decode attention launched as the engine launches it, timed in
// CUDA graphs (back to back, after an L2 flush, hot code with cold data), with the stamps of the instrumented copy
// (stamped_kernel.cu) read back after one launch, in µs at the rated clock, and a hash of that launch's output (two
// sources with equal hashes wrote the same bits). The cold K/V pair shares the warm pair's scales. Static shared
// memory at the 48 KiB limit fits any shape here.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "stamped_kernel.cu"

#define CHECK(call)                                                                   \
  do {                                                                                \
    cudaError_t error = (call);                                                       \
    if (error != cudaSuccess) {                                                       \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(error), __LINE__); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#define HARNESS_KERNEL(NAME, FMT, W, U)                                                                       \
  STRATA_ATTENTION_DECODE(FMT, 128, 8, W, U)                                                                  \
  extern "C" __global__ void __launch_bounds__(32 * W)                                                        \
      NAME(const float* q, const void* kq, const __half* ks, const void* vq, const __half* vs, int word_pitch, \
           int scale_pitch, const int* pos, int kv_len, int min_keys, float q_scale, float* out, float* o_part, \
           float* ml_part, int* counters) {                                                                   \
    __shared__ __align__(16) float smem[12288];                                                               \
    const unsigned long long start = global_ns();                                                            \
    strata_attention_decode_##FMT##_d128_g8_w##W##_u##U(q, kq, ks, vq, vs, word_pitch, scale_pitch, pos,       \
                                                        kv_len, min_keys, q_scale, out, o_part, ml_part,      \
                                                        counters, smem);                                      \
    if (threadIdx.x == 0) {                                                                                   \
      g_gt[BLOCK_ID * 2] = start;                                                                             \
      g_gt[BLOCK_ID * 2 + 1] = global_ns();                                                                   \
    }                                                                                                         \
  }
HARNESS_KERNEL(q4_0_w8_u2, Q4_0, 8, 2)
HARNESS_KERNEL(q4_0_w4_u2, Q4_0, 4, 2)
HARNESS_KERNEL(f16_w8_u1, F16, 8, 1)
HARNESS_KERNEL(q8_0_w8_u1, Q8_0, 8, 1)

using Kernel = void (*)(const float*, const void*, const __half*, const void*, const __half*, int, int, const int*,
                        int, int, float, float*, float*, float*, int*);

namespace {

constexpr int kKvHeads = 4, kHeadDim = 128, kQHeads = 32, kCells = 34816, kSplits = 33, kGraphLaunches = 20;
constexpr size_t kFlushBytes = size_t(256) << 20;

struct Shape {
  const char* name;
  Kernel kernel;
  int elements_per_word;  // of the quants plane's 32-bit words: F16 2, Q8_0 4, Q4_0 8
  int warps;
};

struct Buffers {
  void *k_quants, *v_quants, *k_cold, *v_cold;  // the cold pair: the same values, not in L2 after the first pair
  __half *k_scales, *v_scales;
  float *q, *out, *o_part, *ml_part;
  int *position, *counters;
  char* flush;
};

Buffers allocate() {
  Buffers b;
  const size_t plane_bytes = size_t(kCells) * kKvHeads * kHeadDim * 2;  // room for F16
  std::vector<unsigned short> halves(plane_bytes / 2);
  for (auto& h : halves) h = 0x2000 + (std::rand() & 0x3ff);  // small f16 values; as Q4_0/Q8_0 bytes, varied
  for (void** plane : {&b.k_quants, &b.v_quants, &b.k_cold, &b.v_cold}) {
    CHECK(cudaMalloc(plane, plane_bytes));
    CHECK(cudaMemcpy(*plane, halves.data(), plane_bytes, cudaMemcpyHostToDevice));
  }
  const std::vector<unsigned short> scales(size_t(kCells) * kKvHeads * kHeadDim / 32, 0x2000);
  for (__half** plane : {&b.k_scales, &b.v_scales}) {
    CHECK(cudaMalloc(plane, scales.size() * 2));
    CHECK(cudaMemcpy(*plane, scales.data(), scales.size() * 2, cudaMemcpyHostToDevice));
  }
  std::vector<float> q(kQHeads * kHeadDim);
  for (auto& x : q) x = (std::rand() % 2001 - 1000) / 250.f;  // scores spread enough that the softmax is not flat
  CHECK(cudaMalloc(&b.q, q.size() * 4));
  CHECK(cudaMemcpy(b.q, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&b.out, kQHeads * kHeadDim * 4));
  CHECK(cudaMalloc(&b.o_part, size_t(kSplits) * kQHeads * kHeadDim * 4));
  CHECK(cudaMalloc(&b.ml_part, size_t(kSplits) * kKvHeads * 32 * 4));
  CHECK(cudaMalloc(&b.position, 4));
  CHECK(cudaMalloc(&b.counters, kKvHeads * 4));
  CHECK(cudaMemset(b.counters, 0, kKvHeads * 4));
  CHECK(cudaMalloc(&b.flush, kFlushBytes));
  return b;
}

unsigned long long fnv1a(const std::vector<float>& values) {
  unsigned long long hash = 14695981039346656037ull;
  const auto* bytes = reinterpret_cast<const unsigned char*>(values.data());
  for (size_t i = 0; i < values.size() * sizeof(float); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

// µs a launch of `body`, captured kGraphLaunches times in one graph and replayed `replays` times
template <typename Body>
double graph_us(cudaStream_t stream, Body body, int replays) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kGraphLaunches; ++i) body();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t begin, end;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));
  CHECK(cudaEventRecord(begin, stream));
  for (int r = 0; r < replays; ++r) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(end, stream));
  CHECK(cudaEventSynchronize(end));
  float ms;
  CHECK(cudaEventElapsedTime(&ms, begin, end));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return ms * 1e3 / replays / kGraphLaunches;
}

}  // namespace

int main() {
  int clock_khz;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const double cycles_per_us = clock_khz / 1e3;
  Buffers b = allocate();
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  auto flush = [&] { CHECK(cudaMemsetAsync(b.flush, 1, kFlushBytes, stream)); };
  const double flush_us = graph_us(stream, flush, 10);

  const Shape shapes[] = {{"Q4_0 w8u2", q4_0_w8_u2, 8, 8}, {"Q4_0 w4u2", q4_0_w4_u2, 8, 4},
                          {"F16 w8u1", f16_w8_u1, 2, 8}, {"Q8_0 w8u1", q8_0_w8_u1, 4, 8}};
  const int positions[] = {15, 255, 2047, 2047, 32767};
  const int min_keys[] = {256, 256, 256, 2048, 256};
  std::printf("%-10s %6s %5s | %7s %7s %7s | split 0's block, us from its start: %s | the combining block: %s | %s\n",
              "kernel", "pos", "min_k", "b2b us", "flushed", "hot code", "pos    q   loop  meet  part",
              "flag   ml   end", "blocks' start spread, longest | output hash");
  for (const Shape& shape : shapes) {
    const int word_pitch = kKvHeads * kHeadDim / shape.elements_per_word;
    const int scale_pitch = kKvHeads * kHeadDim / 32;
    for (int c = 0; c < 5; ++c) {
      CHECK(cudaMemcpy(b.position, &positions[c], 4, cudaMemcpyHostToDevice));
      auto launch_on = [&](void* k, void* v) {
        shape.kernel<<<dim3(1, kKvHeads, kSplits), 32 * shape.warps, 0, stream>>>(
            b.q, k, b.k_scales, v, b.v_scales, word_pitch, scale_pitch, b.position, kCells, min_keys[c], 0.1f,
            b.out, b.o_part, b.ml_part, b.counters);
      };
      auto launch = [&] { launch_on(b.k_quants, b.v_quants); };
      const double back_to_back = graph_us(stream, launch, 20);
      const double flushed = graph_us(stream, [&] { flush(); launch(); }, 10) - flush_us;
      const double hot_code = graph_us(stream, [&] { flush(); launch(); launch_on(b.k_cold, b.v_cold); }, 10) -
                              flush_us - flushed;

      const std::vector<long long> zeros(4096 * 16, 0);
      CHECK(cudaMemcpyToSymbol(g_stamps, zeros.data(), zeros.size() * 8));
      flush();
      launch();
      CHECK(cudaStreamSynchronize(stream));
      std::vector<float> out(kQHeads * kHeadDim);
      CHECK(cudaMemcpy(out.data(), b.out, out.size() * 4, cudaMemcpyDeviceToHost));
      std::vector<long long> stamps(4096 * 16);
      std::vector<unsigned long long> times(4096 * 2);
      CHECK(cudaMemcpyFromSymbol(stamps.data(), g_stamps, stamps.size() * 8));
      CHECK(cudaMemcpyFromSymbol(times.data(), g_gt, times.size() * 8));
      auto since_start = [&](int block, int phase) {
        const long long first = stamps[block * 16], at = stamps[block * 16 + phase];
        return first && at ? (at - first) / cycles_per_us : -1.0;
      };
      int combining = -1;
      for (int block = 0; block < kSplits * kKvHeads && combining < 0; ++block)
        if (stamps[block * 16 + 14]) combining = block;
      unsigned long long first_start = ~0ull, last_start = 0, longest = 0;
      for (int block = 0; block < kSplits * kKvHeads; ++block) {
        if (!times[block * 2]) continue;
        first_start = std::min(first_start, times[block * 2]);
        last_start = std::max(last_start, times[block * 2]);
        longest = std::max(longest, times[block * 2 + 1] - times[block * 2]);
      }
      std::printf("%-10s %6d %5d | %7.2f %7.2f %7.2f | %5.2f %5.2f %5.2f %5.2f %5.2f | ", shape.name, positions[c],
                  min_keys[c], back_to_back, flushed, hot_code, since_start(0, 1), since_start(0, 2),
                  since_start(0, 3), since_start(0, 4), since_start(0, 5));
      if (combining >= 0) {
        std::printf("%5.2f %5.2f %5.2f | ", since_start(combining, 6), since_start(combining, 7),
                    since_start(combining, 14));
      } else {
        std::printf("  -     -     -   | ");
      }
      std::printf("%.2f %.2f | %016llx\n", (last_start - first_start) / 1e3, longest / 1e3, fnv1a(out));
      CHECK(cudaMemset(b.counters, 0, kKvHeads * 4));
    }
  }
  return 0;
}
