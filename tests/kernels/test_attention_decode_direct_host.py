"""cuda/attention_decode.cu's fragment maps and split formula, run on the host.

The simulator cannot run linked C++, so this test compiles the kernel's per-format helpers (where each lane's K
and V words lie, how they become f16 pairs, which dim each pair element is) and its split formula, as their
source text stands, for the CPU with g++. Each lane of every KV head, for every key, must yield in its K
fragments the f16 roundings of d * q (gguf-py's values) of dims C t + 4 kk + 0..3, and in its V pairs those of
v_dim(n, g), every dim exactly once; the splits must be attention_decode_direct's (the twin's). The
tensor-core loop around them is tested on the GPU (test_attention_decode_direct).
"""

import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize as gguf_quantize
from host_cpp import BYTE_PERM_SHIM, HALF_SHIMS, between, build
from kernel_data import reference_dequant

from strata.gpu.kernels import attention_decode_direct, tensor_core
from strata.gpu.kernels.packing import pack

_SHIMS = HALF_SHIMS + BYTE_PERM_SHIM + r"""
#include <algorithm>
using std::max;
using std::min;
"""

_MAIN = (r"""
template <OctetFormat F, int D>
void lanes(int rows, int width, int word_pitch, int scale_pitch, const unsigned* q, const uint16_t* s, uint16_t* k_out,
           uint16_t* v_out) {
  for (int kvh = 0; kvh < width / D; ++kvh) {
    const int col0 = kvh * D;
    const int word0 = F == kF16 ? col0 / 2 : F == kQ8_0 ? col0 / 4 : col0 / 8;
    for (int row = 0; row < rows; ++row)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const unsigned* words = q + (size_t)row * word_pitch + word0;
        const uint16_t* scales = s + (size_t)row * scale_pitch + col0 / 32;
        unsigned kw[Words<F, D>::K], vw[Words<F, D>::V];
        for (int i = 0; i < Words<F, D>::K; ++i) kw[i] = words[k_word<F, D>(t) + i];
        for (int i = 0; i < Words<F, D>::V; ++i) vw[i] = words[v_word<F, D>(g) + i];
        const float kd = F == kF16 ? 0.f : __half2float(scales[k_block<F, D>(t)]);
        const float vd = F == kF16 ? 0.f : __half2float(scales[v_block<F, D>(g)]);
        if (g == 0) {  // K: every g of a t loads the same dims of its own key
          for (int kk = 0; kk < D / 16; ++kk) {
            unsigned b0, b1;
            k_pairs<F, D>(kw, kd, t, kk, b0, b1);
            const unsigned pairs[2] = {b0, b1};
            for (int e = 0; e < 4; ++e)
              k_out[(size_t)row * width + col0 + D / 4 * t + 4 * kk + e] = (uint16_t)(pairs[e / 2] >> (16 * (e % 2)));
          }
        }
        if (t == 0) {  // V: every t of a g loads its keys over the same dims
          for (int i = 0; i < D / 16; ++i) {
            const unsigned pair = v_pair<F, D>(vw, vd, i);
            for (int e = 0; e < 2; ++e) {
              uint16_t& slot = v_out[(size_t)row * width + col0 + v_dim<F, D>(2 * i + e, g)];
              if (slot != 0x7E00) slot = 0x7C01;  // written twice: a signalling NaN the test catches
              else slot = (uint16_t)(pair >> (16 * e));
            }
          }
        }
      }
  }
}

// argv: format (0 F16, 1 Q8_0, 2 Q4_0) head_dim rows width word_pitch scale_pitch planes.bin k.out v.out splits.out
int main(int argc, char** argv) {
  const int fmt = atoi(argv[1]), d = atoi(argv[2]), rows = atoi(argv[3]), width = atoi(argv[4]);
  const int word_pitch = atoi(argv[5]), scale_pitch = atoi(argv[6]);
  std::vector<unsigned> q((size_t)rows * word_pitch);
  std::vector<uint16_t> s((size_t)rows * scale_pitch + 1), k((size_t)rows * width, 0x7E00), v(k);
  FILE* f = fopen(argv[7], "rb");
  if (fread(q.data(), 4, q.size(), f) != q.size()) return 1;
  if (scale_pitch && fread(s.data(), 2, s.size() - 1, f) != s.size() - 1) return 1;
  fclose(f);
  if (fmt == 0 && d == 64) lanes<kF16, 64>(rows, width, word_pitch, scale_pitch, """
r"""q.data(), s.data(), k.data(), v.data());
  if (fmt == 0 && d == 128) lanes<kF16, 128>(rows, width, word_pitch, scale_pitch, """
r"""q.data(), s.data(), k.data(), v.data());
  if (fmt == 1 && d == 64) lanes<kQ8_0, 64>(rows, width, word_pitch, scale_pitch, """
r"""q.data(), s.data(), k.data(), v.data());
  if (fmt == 1 && d == 128) lanes<kQ8_0, 128>(rows, width, word_pitch, scale_pitch, """
r"""q.data(), s.data(), k.data(), v.data());
  if (fmt == 2 && d == 64) lanes<kQ4_0, 64>(rows, width, word_pitch, scale_pitch, """
r"""q.data(), s.data(), k.data(), v.data());
  if (fmt == 2 && d == 128) lanes<kQ4_0, 128>(rows, width, word_pitch, scale_pitch, """
r"""q.data(), s.data(), k.data(), v.data());
  f = fopen(argv[8], "wb"); fwrite(k.data(), 2, k.size(), f); fclose(f);
  f = fopen(argv[9], "wb"); fwrite(v.data(), 2, v.size(), f); fclose(f);
  f = fopen(argv[10], "w");  // span, splits, min_keys -> keys, active
  for (int span = 0; span <= 700; span += 7)
    for (int splits : {1, 2, 3, 33, 66})
      for (int min_keys : {16, 64, 256}) {
        const int keys = split_keys(span, splits, min_keys);
        fprintf(f, "%d %d %d %d %d\n", span, splits, min_keys, keys, active_splits(span, keys));
      }
  fclose(f);
  return 0;
}
""")

_FORMATS = ("F16", "Q8_0", "Q4_0")


# argv: format (0 F16, 1 Q8_0, 2 Q4_0) head_dim; prints the O rows' pitch, then for each of the meet's stores
# (n, e) the shared-memory float index of each lane's O value (head g's row of warp 0), then o_col of every dim
_MEET_MAIN = r"""
template <OctetFormat F, int D>
void meet() {
  printf("%d\n", ORow<F, D>::PITCH);
  for (int n = 0; n < D / 8; ++n)
    for (int e = 0; e < 2; ++e) {
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        printf("%d ", g * ORow<F, D>::PITCH + o_col<F, D>(v_dim<F, D>(n, 2 * t + e)));
      }
      printf("\n");
    }
  for (int d = 0; d < D; ++d) printf("%d ", o_col<F, D>(d));
  printf("\n");
}

int main(int argc, char** argv) {
  const int fmt = atoi(argv[1]), d = atoi(argv[2]);
  if (fmt == 0) d == 64 ? meet<kF16, 64>() : meet<kF16, 128>();
  if (fmt == 1) d == 64 ? meet<kQ8_0, 64>() : meet<kQ8_0, 128>();
  if (fmt == 2) d == 64 ? meet<kQ4_0, 64>() : meet<kQ4_0, 128>();
  return 0;
}
"""


def _host_program(tmp_path_factory, name, main):
    common = tensor_core.source_text("common.cuh")
    decode = tensor_core.source_text("attention_decode.cu")
    source = "\n".join([
        _SHIMS,
        between(common, "enum OctetFormat", "[[maybe_unused]] __device__ __forceinline__ void cp_async_16"),
        between(common, "[[maybe_unused]] __device__ __forceinline__ unsigned scaled_half2", "// Q4_0 and Q8_0"),
        between(decode, "// ---- per format", "// ---- the KV loop of one warp"),
        between(decode, "// ---- splits ----", "__device__ __forceinline__ float weight_of"),
        main,
    ]).replace("[[maybe_unused]] ", "")
    folder = tmp_path_factory.mktemp(f"attention_decode_{name}")
    build(folder, name, source)
    return folder


@pytest.fixture(scope="module")
def lanes(tmp_path_factory):
    return _host_program(tmp_path_factory, "lanes", _MAIN)


def _run(folder, fmt, head_dim, values):
    rows, width = values.shape
    raw = gguf_quantize(values, QType[fmt]).view(np.uint8).reshape(rows, -1)
    packed = pack(raw, fmt)
    words = np.ascontiguousarray(packed.quants).view(np.uint32).reshape(rows, -1)
    scale_pitch = packed.scales.shape[1] if fmt != "F16" else 0
    with open(folder / "planes.bin", "wb") as f:
        f.write(words.tobytes())
        if scale_pitch:
            f.write(np.ascontiguousarray(packed.scales, np.float16).tobytes())
    outputs = [folder / name for name in ("k.out", "v.out", "splits.out")]
    subprocess.run([str(folder / "lanes"), str(_FORMATS.index(fmt)), str(head_dim), str(rows), str(width),
                    str(words.shape[1]), str(scale_pitch), str(folder / "planes.bin"), *map(str, outputs)], check=True)
    k, v = (np.fromfile(path, np.float16).reshape(rows, width) for path in outputs[:2])
    return reference_dequant(raw, fmt).astype(np.float16), k, v, outputs[2]


@pytest.mark.parametrize("fmt", _FORMATS)
@pytest.mark.parametrize("head_dim", attention_decode_direct.HEAD_DIMS)
def test_lanes_hold_every_dim_of_k_and_v_once_as_gguf_values(lanes, fmt, head_dim):
    values = np.random.default_rng(50).standard_normal((3, 2 * head_dim)).astype(np.float32)  # 2 KV heads
    expected, k, v, _ = _run(lanes, fmt, head_dim, values)
    np.testing.assert_array_equal(k.view(np.uint16), expected.view(np.uint16))  # bit for bit, every dim
    np.testing.assert_array_equal(v.view(np.uint16), expected.view(np.uint16))


def test_splits_are_the_twins(lanes):
    values = np.zeros((1, 64), np.float32)
    _, _, _, splits = _run(lanes, "F16", 64, values)
    table = np.loadtxt(splits, dtype=np.int64)
    for span, num_splits, min_keys, keys, active in table:
        assert keys == attention_decode_direct.split_keys(span, num_splits, min_keys)
        assert active == attention_decode_direct.active_splits(span, keys)
        assert keys % attention_decode_direct.TILE_KEYS == 0 and keys >= min_keys
        assert active <= num_splits and (active - 1) * keys < max(span, 1) <= active * keys


def test_every_served_instantiation_compiles(tmp_path):
    # what attention_decode_direct appends to the source for each kernel (the simulator cannot link C++, so
    # without a GPU nvcc checks the source where it is installed): every format at the served shape, head dim
    # 64 with a group of 5 and 4 warps, a group of 1 with 4 tiles a step
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    config = attention_decode_direct.DEFAULT_CONFIG
    shapes = [(fmt, 128, 8, config.warps, config.tiles_for(fmt)) for fmt in _FORMATS]
    shapes += [("Q8_0", 64, 5, 4, 2), ("Q4_0", 128, 1, 8, 4)]
    lines = "".join(f"\nSTRATA_ATTENTION_DECODE({fmt}, {d}, {g}, {w}, {u})\n" for fmt, d, g, w, u in shapes)
    source = tmp_path / "attention_decode_x.cu"
    source.write_text(tensor_core.source_text("attention_decode.cu") + lines)
    done = subprocess.run(["nvcc", "-arch=sm_90", "-rdc=true", "-ptx", str(source), "-o", str(tmp_path / "x.ptx")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = (tmp_path / "x.ptx").read_text()
    for fmt, d, g, w, u in shapes:
        assert f".func strata_attention_decode_{fmt}_d{d}_g{g}_w{w}_u{u}(" in ptx


@pytest.mark.parametrize("fmt", _FORMATS)
@pytest.mark.parametrize("head_dim", attention_decode_direct.HEAD_DIMS)
def test_the_meets_stores_and_loads_fall_in_32_banks(tmp_path_factory, fmt, head_dim):
    # every store of the warps' O rows puts its 32 lanes in 32 banks (with rows head_dim apart and no permutation
    # they shared one: 32 wavefronts a store); each dim of a head has its own float inside the row; and the loads
    # that sum the warps' rows, 32 consecutive dims of one row a warp, stay in 32 banks
    folder = _host_program(tmp_path_factory, "meet", _MEET_MAIN)
    lines = subprocess.run([str(folder / "meet"), str(_FORMATS.index(fmt)), str(head_dim)], check=True,
                           capture_output=True, text=True).stdout.strip().split("\n")
    pitch = int(lines[0])
    stores = np.array([line.split() for line in lines[1:-1]], np.int64)  # [head_dim / 4 stores, 32 lanes]
    columns = np.array(lines[-1].split(), np.int64)  # o_col of dims 0 .. head_dim - 1
    assert stores.shape == (head_dim // 4, 32)
    for index in stores:
        assert len(set(index % 32)) == 32, index
    np.testing.assert_array_equal(stores // pitch, np.tile(np.arange(32) // 4, (head_dim // 4, 1)))  # head g's row
    assert sorted(columns) == list(range(head_dim)) and pitch > head_dim
    assert sorted(stores[:, :4].reshape(-1) % pitch) == list(range(head_dim))  # head 0's lanes: each dim once
    for start in range(0, head_dim, 32):
        assert len(set(columns[start:start + 32] % 32)) == 32
