"""The decode experts' row loops (cuda/gemv_rows.cu's pair_loop and down_loop) run on the host.

The simulator cannot run linked C++, so this test builds the loops, as their source text stands, for the CPU
with g++: each of a warp's 32 lanes is a thread, and warp_sum meets them at a barrier and adds their values in
the shuffles' butterfly order. A launch's warps run one after another, each taking the rows its j_begin and
j_step give it, as ExpertsConfig's grids deal them. It checks every gate/up pair (silu(gate . x) * (up . x)) and
every down row (out += sum_e w_e W_e . h_e) against gguf-py's values, ids outside the slots adding nothing, and
that one warp, three and seven give every row the same bits (a row's sums do not depend on the grid).
"""

import subprocess

import numpy as np
import pytest
from host_cpp import between, build, gemv_rows_items
from kernel_data import random_gguf_bytes, reference_dequant

from strata.gpu.kernels import gemv_native, tensor_core
from strata.gpu.kernels.packing import pack

_LANES = r"""
#include <condition_variable>
#include <cstring>
#include <vector>
#include <mutex>
#include <string>
#include <thread>
struct Dim3 { int x; };
static thread_local Dim3 threadIdx;
// the 32 lanes of the one warp running, met at each warp_sum
struct LaneBarrier {
  std::mutex m;
  std::condition_variable cv;
  int count = 0, generation = 0;
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    const int gen = generation;
    if (++count == 32) {
      count = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return gen != generation; });
    }
  }
};
static LaneBarrier g_barrier;
// two sets of slots, a call's parity picking one: a lane writes the next call's set only after every lane has
// met it at this call's barrier, and the set after that only after every lane has read this one
static float g_lanes[2][32];
static thread_local int t_calls;
static inline float warp_sum(float v) {
  float* slots = g_lanes[t_calls++ & 1];
  slots[threadIdx.x & 31] = v;
  g_barrier.wait();
  float w[32], n[32];
  memcpy(w, slots, sizeof w);
  for (int offset = 16; offset > 0; offset >>= 1) {  // v += __shfl_xor_sync(mask, v, offset)
    for (int l = 0; l < 32; ++l) n[l] = w[l] + w[l ^ offset];
    memcpy(w, n, sizeof w);
  }
  return w[threadIdx.x & 31];
}
template <class Fn>
static void run_warp(Fn fn) {
  std::vector<std::thread> lanes;
  for (int l = 0; l < 32; ++l) lanes.emplace_back([&fn, l] { threadIdx.x = l; t_calls = 0; fn(); });
  for (auto& t : lanes) t.join();
}
"""

_MAIN = r"""
template <class T>
static std::vector<T> read_all(const char* path, size_t count) {
  std::vector<T> v(count);
  FILE* f = fopen(path, "rb");
  if (!f || fread(v.data(), sizeof(T), count, f) != count) exit(3);
  fclose(f);
  return v;
}

struct Stack {  // a stacked matrix's three planes, as read from one file
  std::vector<u32> q;
  std::vector<uint16_t> s;
  std::vector<u8> e;
  int qp, sp, ep;
  Stack(const char* path, long long rows, int qp_, int sp_, int ep_) : qp(qp_), sp(sp_), ep(ep_) {
    std::vector<u8> all = read_all<u8>(path, rows * (4LL * qp + 2LL * sp + ep));
    q.resize(rows * qp);
    s.resize(rows * sp);
    e.resize(rows * ep);
    memcpy(q.data(), all.data(), 4 * q.size());
    memcpy(s.data(), all.data() + 4 * q.size(), 2 * s.size());
    memcpy(e.data(), all.data() + 4 * q.size() + 2 * s.size(), e.size());
  }
  SlotPlanes planes(int num_slots, long long rows_each) const {
    return SlotPlanes{q.data(), s.data(), e.data(), num_slots, rows_each, qp, sp, ep};
  }
};

// pair: argv struct slots dim ffn top_k num_x qp sp ep gate.bin up.bin xs.bin ids.bin out.bin
// down: argv struct slots dim ffn top_k x_stride qp sp ep down.bin xs.bin ids.bin weights.bin out.bin (out: in and out)
template <class F>
static int run(int argc, char** argv) {
  const std::string mode = argv[1];
  const int slots = atoi(argv[3]), dim = atoi(argv[4]), ffn = atoi(argv[5]), top_k = atoi(argv[6]);
  const int num_x = atoi(argv[7]), qp = atoi(argv[8]), sp = atoi(argv[9]), ep = atoi(argv[10]);
  const int warp_counts[3] = {1, 3, 7};  // a launch's warps, one after another
  if (mode == "pair") {
    const Stack gate(argv[11], (long long)slots * ffn, qp, sp, ep), up(argv[12], (long long)slots * ffn, qp, sp, ep);
    std::vector<float> xs = read_all<float>(argv[13], num_x);
    std::vector<int> ids = read_all<int>(argv[14], top_k);
    g_xs = xs.data();
    std::vector<float> out((size_t)3 * top_k * ffn, -1.f);
    for (int c = 0; c < 3; ++c)
      for (int w = 0; w < warp_counts[c]; ++w)
        run_warp([&] {
          pair_loop<F, 2>(out.data() + (size_t)c * top_k * ffn, gate.planes(slots, ffn), up.planes(slots, ffn),
                          ids.data(), top_k, ffn, w, warp_counts[c], xs.data(), dim);
        });
    FILE* f = fopen(argv[15], "wb");
    fwrite(out.data(), 4, out.size(), f);
    fclose(f);
  } else {
    const Stack down(argv[11], (long long)slots * dim, qp, sp, ep);
    std::vector<float> xs = read_all<float>(argv[12], (size_t)top_k * num_x);
    std::vector<int> ids = read_all<int>(argv[13], top_k);
    std::vector<float> weights = read_all<float>(argv[14], top_k);
    std::vector<float> base = read_all<float>(argv[15], dim);
    g_xs = xs.data();
    std::vector<float> out;
    for (int c = 0; c < 3; ++c) {
      out.insert(out.end(), base.begin(), base.end());
      for (int w = 0; w < warp_counts[c]; ++w)
        run_warp([&] {
          down_loop<F, 4>(out.data() + (size_t)c * dim, down.planes(slots, dim), ids.data(), weights.data(), top_k,
                          w, warp_counts[c], dim, xs.data(), num_x, ffn);
        });
    }
    FILE* f = fopen(argv[15], "wb");
    fwrite(out.data(), 4, out.size(), f);
    fclose(f);
  }
  return 0;
}

int main(int argc, char** argv) {
  const std::string fmt = argv[2];
  if (fmt == "Q40") return run<Q40>(argc, argv);
  if (fmt == "Q4K") return run<Q4K>(argc, argv);
  if (fmt == "Q6K") return run<Q6K>(argc, argv);
  if (fmt == "IQ3XXS") return run<IQ3XXS>(argc, argv);
  return 2;
}
"""


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    source = tensor_core.source_text("gemv_rows.cu")
    parts = [_LANES, *gemv_rows_items(),
             between(source, "__device__ __forceinline__ RowPlanes row_planes", "// R rows of one or two"),
             between(source, "// Where a routed expert's rows lie.", "}  // namespace"), _MAIN]
    folder = tmp_path_factory.mktemp("expert_loops_host")
    build(folder, "loops", "\n".join(parts), extra_flags=("-pthread",))
    return folder


def _stack(fmt: str, num_rows: int, num_cols: int, rng, path):
    """A stacked matrix's planes written to path; (pitches, gguf-py's values)."""
    raw = random_gguf_bytes(fmt, num_rows, num_cols, rng)
    packed = pack(raw, fmt)
    planes = [np.ascontiguousarray(packed.quants).view(np.uint8).reshape(num_rows, -1)]
    planes += [np.ascontiguousarray(p).view(np.uint8).reshape(num_rows, -1) if p.shape[0] == num_rows
               else np.zeros((num_rows, 0), np.uint8) for p in (packed.scales, packed.extra)]
    with open(path, "wb") as f:
        f.writelines(plane.tobytes() for plane in planes)
    return (planes[0].shape[1] // 4, planes[1].shape[1] // 2, planes[2].shape[1]), reference_dequant(raw, fmt)


def _staged(x: np.ndarray) -> np.ndarray:
    """x [T, K] staged as the kernels stage it (32-element groups X_STRIDE floats apart, padding NaN): [T, x_floats]."""
    groups = x.reshape(x.shape[0], -1, gemv_native.X_GROUP)
    padded = np.full((x.shape[0], groups.shape[1], gemv_native.X_STRIDE), np.nan, np.float32)
    padded[:, :, :gemv_native.X_GROUP] = groups
    return padded.reshape(x.shape[0], -1)


def _silu_mul(g, u):
    return g / (1.0 + np.exp(-g)) * u


@pytest.mark.parametrize("fmt_gate_up, fmt_down", [("Q4_0", "Q4_0"), ("Q4_K", "Q6_K"), ("IQ3_XXS", "Q4_K")])
def test_expert_loops_give_gguf_values_and_the_same_bits_whatever_the_warps(loops, fmt_gate_up, fmt_down):
    # a gate/up row of 72 items (two steps of a warp's 64, the second partly idle); a down row of 4 x 48 items
    # (two steps of 128); whole 256-element super-blocks
    num_slots, dim, ffn, top_k = 3, 2304, 1536, 4
    rng = np.random.default_rng(720)
    ids = np.array([2, -1, 1, 3], np.int32)  # -1 and 3: no such slot, nothing added
    structs = {fmt: gemv_native._ROWS_SHAPES[fmt][0] for fmt in (fmt_gate_up, fmt_down)}

    pitches, gate_v = _stack(fmt_gate_up, num_slots * ffn, dim, rng, loops / "gate.bin")
    _, up_v = _stack(fmt_gate_up, num_slots * ffn, dim, rng, loops / "up.bin")
    x = rng.standard_normal((1, dim)).astype(np.float32)
    staged = _staged(x)
    staged.tofile(loops / "xs.bin")
    ids.tofile(loops / "ids.bin")
    subprocess.run([str(loops / "loops"), "pair", structs[fmt_gate_up], str(num_slots), str(dim), str(ffn),
                    str(top_k), str(staged.shape[1]), *map(str, pitches), str(loops / "gate.bin"),
                    str(loops / "up.bin"), str(loops / "xs.bin"), str(loops / "ids.bin"), str(loops / "out.bin")],
                   check=True, timeout=120)  # lanes that met at different warp_sums would hang
    hidden = np.fromfile(loops / "out.bin", np.float32).reshape(3, top_k, ffn)
    np.testing.assert_array_equal(hidden[1], hidden[0])
    np.testing.assert_array_equal(hidden[2], hidden[0])
    x64 = x[0].astype(np.float64)
    for e, slot in enumerate(ids):
        if not 0 <= slot < num_slots:
            assert not hidden[0, e].any()
            continue
        rows = slice(slot * ffn, (slot + 1) * ffn)
        ref = _silu_mul(gate_v[rows] @ x64, up_v[rows] @ x64)
        scale = (np.abs(gate_v[rows]) @ np.abs(x64)) * (np.abs(up_v[rows]) @ np.abs(x64))
        assert np.all(np.abs(hidden[0, e] - ref) <= 2e-5 * scale + 1e-6), np.max(np.abs(hidden[0, e] - ref))

    pitches, down_v = _stack(fmt_down, num_slots * dim, ffn, rng, loops / "down.bin")
    h = rng.standard_normal((top_k, ffn)).astype(np.float32)
    staged = _staged(h)
    staged.tofile(loops / "hs.bin")
    weights = rng.uniform(0.1, 1.0, top_k).astype(np.float32)
    weights.tofile(loops / "weights.bin")
    base = rng.standard_normal(dim).astype(np.float32)
    base.tofile(loops / "base.bin")
    subprocess.run([str(loops / "loops"), "down", structs[fmt_down], str(num_slots), str(dim), str(ffn), str(top_k),
                    str(staged.shape[1]), *map(str, pitches), str(loops / "down.bin"), str(loops / "hs.bin"),
                    str(loops / "ids.bin"), str(loops / "weights.bin"), str(loops / "base.bin")],
                   check=True, timeout=120)
    out = np.fromfile(loops / "base.bin", np.float32).reshape(3, dim)
    np.testing.assert_array_equal(out[1], out[0])
    np.testing.assert_array_equal(out[2], out[0])
    ref, scale = base.astype(np.float64), np.abs(base).astype(np.float64)
    for e, slot in enumerate(ids):
        if 0 <= slot < num_slots:
            w = down_v[slot * dim:(slot + 1) * dim].astype(np.float64)
            ref = ref + weights[e] * (w @ h[e])
            scale = scale + weights[e] * (np.abs(w) @ np.abs(h[e]))
    assert np.all(np.abs(out[0] - ref) <= 2e-5 * scale + 1e-6), np.max(np.abs(out[0] - ref))
