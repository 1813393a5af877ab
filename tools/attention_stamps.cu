// tools/attention_stamps.py's harness: the direct decode attention launched as the engine launches it, timed in
// CUDA graphs (back to back, after an L2 flush, hot code with cold data), with the stamps of the instrumented copy
// (stamped_kernel.cu) read back after one launch. Static shared memory at the 48 KiB limit fits any shape here.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#include "stamped_kernel.cu"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__device__ __forceinline__ unsigned long long gtime() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

#define WRAP(NAME, FMT, W, U) \
STRATA_ATTENTION_DECODE(FMT, 128, 8, W, U) \
extern "C" __global__ void __launch_bounds__(32 * W) NAME(const float* q, const void* kq, const __half* ks, const void* vq, const __half* vs, int wp, int sp, const int* pos, int kv_len, int mk, float qs, float* out, float* op, float* ml, int* c) { \
  __shared__ __align__(16) float smem[12288]; \
  unsigned long long t0 = gtime(); \
  strata_attention_decode_##FMT##_d128_g8_w##W##_u##U(q,kq,ks,vq,vs,wp,sp,pos,kv_len,mk,qs,out,op,ml,c,smem); \
  if (threadIdx.x == 0) { g_gt[BLOCK_ID * 2] = t0; g_gt[BLOCK_ID * 2 + 1] = gtime(); } \
}
WRAP(q4_w8u2, Q4_0, 8, 2)
WRAP(q4_w8u1, Q4_0, 8, 1)
WRAP(q4_w4u2, Q4_0, 4, 2)
WRAP(f16_w8u1, F16, 8, 1)
WRAP(q8_w8u1, Q8_0, 8, 1)

extern "C" __global__ void empty_k(float* out) {
  __shared__ float smem[12288];
  if (threadIdx.x == 1000) { smem[0] = 1; out[0] = smem[threadIdx.x & 1]; }
}

extern "C" __global__ void codebig(float* out, float a, float b) {
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = threadIdx.x + i;
#pragma unroll
  for (int s = 0; s < 400; ++s)
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = fmaf(x[i], a, b);
  float r = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) r += x[i];
  if (r == 12345.f) out[0] = r;
}
extern "C" __global__ void codesmall(float* out, float a, float b) {
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = threadIdx.x + i;
#pragma unroll 1
  for (int s = 0; s < 400; ++s)
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = fmaf(x[i], a, b);
  float r = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) r += x[i];
  if (r == 12345.f) out[0] = r;
}

typedef void (*Kern)(const float*, const void*, const __half*, const void*, const __half*, int, int, const int*, int, int, float, float*, float*, float*, int*);

int main() {
  const int Hkv = 4, D = 128, Hq = 32, cells = 34816, S = 33;
  int clock_khz; CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  int num_sms; CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  printf("clock %d MHz, %d SMs\n", clock_khz / 1000, num_sms);
  // planes big enough for F16 (2 bytes an element)
  size_t row_bytes = Hkv * D * 2, plane = (size_t)cells * row_bytes;
  void *kq, *vq, *kq2, *vq2; __half *ks, *vs;
  CK(cudaMalloc(&kq, plane)); CK(cudaMalloc(&vq, plane)); CK(cudaMalloc(&kq2, plane)); CK(cudaMalloc(&vq2, plane));
  CK(cudaMalloc(&ks, (size_t)cells * Hkv * D / 32 * 2)); CK(cudaMalloc(&vs, (size_t)cells * Hkv * D / 32 * 2));
  {
    std::vector<unsigned short> h(plane / 2);
    for (size_t i = 0; i < h.size(); ++i) h[i] = 0x2000 + (rand() & 0x3ff);  // small positive halves; as bytes: random-ish
    CK(cudaMemcpy(kq, h.data(), plane, cudaMemcpyHostToDevice)); CK(cudaMemcpy(vq, h.data(), plane, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(kq2, h.data(), plane, cudaMemcpyHostToDevice)); CK(cudaMemcpy(vq2, h.data(), plane, cudaMemcpyHostToDevice));
    std::vector<unsigned short> s((size_t)cells * Hkv * D / 32, 0x2000);
    CK(cudaMemcpy(ks, s.data(), s.size() * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(vs, s.data(), s.size() * 2, cudaMemcpyHostToDevice));
  }
  float *q, *out, *op, *ml; int *pos, *cnt; char* flush;
  CK(cudaMalloc(&q, Hq * D * 4)); CK(cudaMalloc(&out, Hq * D * 4));
  CK(cudaMalloc(&op, (size_t)S * Hq * D * 4)); CK(cudaMalloc(&ml, (size_t)S * Hkv * 32 * 4));
  CK(cudaMalloc(&pos, 4)); CK(cudaMalloc(&cnt, Hkv * 4)); CK(cudaMemset(cnt, 0, Hkv * 4));
  CK(cudaMemset(q, 0, Hq * D * 4));
  const size_t flush_bytes = 256u << 20; CK(cudaMalloc(&flush, flush_bytes));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));

  struct V { const char* name; Kern k; int fmt; int warps; };  // fmt: 0 F16, 1 Q8_0, 2 Q4_0
  V vs_[] = {{"Q4_0 w8u2", q4_w8u2, 2, 8}, {"Q4_0 w8u1", q4_w8u1, 2, 8}, {"Q4_0 w4u2", q4_w4u2, 2, 4},
             {"F16 w8u1", f16_w8u1, 0, 8}, {"Q8_0 w8u1", q8_w8u1, 1, 8}};
  auto pitches = [&](int fmt, int& wp, int& sp) { wp = fmt == 0 ? Hkv * D / 2 : fmt == 1 ? Hkv * D / 4 : Hkv * D / 8; sp = Hkv * D / 32; };
  auto time_graph = [&](auto body, int reps) -> double {  // µs a replay of a graph of 20 bodies
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 20; ++i) body();
    CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, st)); CK(cudaStreamSynchronize(st));
    CK(cudaEventRecord(e0, st));
    for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    return ms * 1e3 / reps / 20;
  };
  auto flush_l2 = [&]() { CK(cudaMemsetAsync(flush, 1, flush_bytes, st)); };
  double t_empty = time_graph([&] { empty_k<<<dim3(1, Hkv, S), 256, 0, st>>>(out); }, 20);
  double t_flush = time_graph(flush_l2, 10);
  double t_empty_fl = time_graph([&] { flush_l2(); empty_k<<<dim3(1, Hkv, S), 256, 0, st>>>(out); }, 10) - t_flush;
  {
    double a = time_graph([&] { codebig<<<dim3(1, Hkv, S), 256, 0, st>>>(out, 1.0001f, 0.5f); }, 20);
    double af = time_graph([&] { flush_l2(); codebig<<<dim3(1, Hkv, S), 256, 0, st>>>(out, 1.0001f, 0.5f); }, 10) - t_flush;
    double b = time_graph([&] { codesmall<<<dim3(1, Hkv, S), 256, 0, st>>>(out, 1.0001f, 0.5f); }, 20);
    double bf = time_graph([&] { flush_l2(); codesmall<<<dim3(1, Hkv, S), 256, 0, st>>>(out, 1.0001f, 0.5f); }, 10) - t_flush;
    printf("3,200 FFMAs straight-line (~51 KB of code): %.2f us hot, %.2f after a flush; as a loop: %.2f / %.2f\n", a, af, b, bf);
  }
  printf("empty kernel (1,4,33)x256: %.2f us back to back, %.2f us after an L2 flush; flush %.1f us\n", t_empty, t_empty_fl, t_flush);
  printf("%-10s %6s %5s %6s | %8s %8s %8s | stamps of block (split 0, kvh 0) in us: pos q loop meet part | last block: flag ml end | blocks' start spread, longest\n",
         "kernel", "pos", "minK", "splits", "b2b us", "flush us", "hotcode");
  int positions[] = {15, 255, 2047, 2047, 32767};
  int minks[] = {256, 256, 256, 2048, 256};
  for (auto& v : vs_) {
    int wp, sp; pitches(v.fmt, wp, sp);
    cudaFuncSetAttribute(v.k, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    for (int c = 0; c < 5; ++c) {
      int p = positions[c], mk = minks[c];
      CK(cudaMemcpy(pos, &p, 4, cudaMemcpyHostToDevice));
      auto launch = [&] { v.k<<<dim3(1, Hkv, S), 32 * v.warps, 0, st>>>(q, kq, ks, vq, vs, wp, sp, pos, cells, mk, 0.1f, out, op, ml, cnt); };
      auto launch2 = [&] { v.k<<<dim3(1, Hkv, S), 32 * v.warps, 0, st>>>(q, kq2, ks, vq2, vs, wp, sp, pos, cells, mk, 0.1f, out, op, ml, cnt); };
      double tb = time_graph(launch, 20);
      double thot = time_graph([&] { flush_l2(); launch(); launch2(); }, 10) - t_flush;
      double tf = time_graph([&] { flush_l2(); launch(); }, 10) - t_flush;
      thot -= tf;
      // stamps: one flushed launch
      std::vector<long long> zs(4096 * 16, 0);
      CK(cudaMemcpyToSymbol(g_stamps, zs.data(), zs.size() * 8));
      flush_l2(); launch(); CK(cudaStreamSynchronize(st));
      std::vector<long long> stv(4096 * 16); std::vector<unsigned long long> gt(4096 * 2);
      CK(cudaMemcpyFromSymbol(stv.data(), g_stamps, stv.size() * 8)); CK(cudaMemcpyFromSymbol(gt.data(), g_gt, gt.size() * 8));
      double cyc_us = clock_khz / 1e3;
      auto d = [&](int b, int i) { long long s0 = stv[b * 16], si = stv[b * 16 + i]; return (s0 && si) ? (si - s0) / cyc_us : -1.0; };
      int b0 = 0;  // split 0, kvh 0
      int last = -1;
      for (int b = 0; b < S * Hkv; ++b) if (stv[b * 16 + 14]) { last = b; break; }
      unsigned long long gmin = ~0ull, gmax = 0, longest = 0;
      for (int b = 0; b < S * Hkv; ++b) { if (!gt[b * 2]) continue; gmin = std::min(gmin, gt[b * 2]); gmax = std::max(gmax, gt[b * 2]); longest = std::max(longest, gt[b * 2 + 1] - gt[b * 2]); }
      printf("%-10s %6d %5d %6d | %8.2f %8.2f %8.2f | %5.2f %5.2f %5.2f %5.2f %5.2f | ", v.name, p, mk, S, tb, tf, thot,
             d(b0, 1), d(b0, 2), d(b0, 3), d(b0, 4), d(b0, 5));
      if (last >= 0) printf("%5.2f %5.2f %5.2f | ", d(last, 6), d(last, 7), d(last, 14)); else printf("  -     -     -   | ");
      printf("%.2f %.2f\n", (gmax - gmin) / 1e3, longest / 1e3);
      CK(cudaMemset(cnt, 0, Hkv * 4));
    }
  }
  return 0;
}
