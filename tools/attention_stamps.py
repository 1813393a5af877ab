"""Where a direct decode attention launch spends its time: ``python tools/attention_stamps.py [SOURCE.cu ...]``.

Needs nvcc and an sm_90 GPU. For each source of ``cuda/attention_decode.cu`` (default: the package's; give an
older copy beside it to compare), writes a copy with ``clock64`` stamps at the kernel's phases (thread 0 of each
block: the position read, Q's fragments built, the KV loop, the warps met, the split's partial written, and in the
block that combines: the counter, the splits' (m, l) read, the output written), builds a CUDA C++ harness around it
(attention_stamps.cu: Qwen3-30B-A3B's heads, a 34,816-cell cache, the engine's grid of 33 splits) and runs it. Per
format, launch shape and position it prints the µs of a launch replayed back to back in a CUDA graph, after an L2
flush, and with hot code but cold data, then the stamps in µs from the block's start (at the rated clock) and a
hash of the output (equal hashes: equal bits). A diagnostic, not a bench: the stamps' stores cost a little; compare
sources in one run, e.g. ``git show HEAD:strata/gpu/kernels/cuda/attention_decode.cu > /tmp/old.cu`` and
``python tools/attention_stamps.py /tmp/old.cu strata/gpu/kernels/cuda/attention_decode.cu``. ``--wrap`` runs the
harness under another command, a profiler's for where the stamps cannot see (a warp's stall reasons), e.g.
``--wrap "ncu --section WarpStateStats --section SchedulerStats -k q4_0_w8_u2 --launch-count 4"`` (the harness's
kernels: q4_0_w8_u2, q4_0_w4_u2, f16_w8_u1, q8_0_w8_u1).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "strata" / "gpu" / "kernels" / "cuda"
HARNESS = Path(__file__).with_suffix(".cu")
STAMPS_PRELUDE = """
__device__ long long g_stamps[4096 * 16];
__device__ unsigned long long g_gt[4096 * 2];
#define BLOCK_ID (blockIdx.z * gridDim.y * gridDim.x + blockIdx.y * gridDim.x + blockIdx.x)
#define STAMP(i) do { if (threadIdx.x == 0) g_stamps[BLOCK_ID * 16 + (i)] = clock64(); } while (0)
"""
# (anchor, stamped text): the first anchor of each row found in the source is replaced; every row must match once
ANCHORS = (
    (("  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;\n",),
     "{0} STAMP(0);\n"),
    (("  if (split >= active) return;\n",), "{0} STAMP(1);\n"),
    (("  const int col0 = kvh * D;",), " STAMP(2);\n{0}"),
    (("  warp_loop<F, D, W, U>(planes, qa, begin, end, warp, g, t, st);\n",), "{0} STAMP(3);\n"),
    (("  __syncthreads();\n  const size_t part_row", "  __syncthreads();\n  // a thread a head"),
     "  __syncthreads();\n STAMP(4);\n{1}"),
    (("  if (active == 1) return;\n",), " STAMP(5);\n  if (active == 1) { STAMP(15); return; }\n"),
    (("  const bool last = *is_last;\n",), "{0} STAMP(6);\n"),
    (("  if (!last) return;\n",), "  if (!last) { STAMP(15); return; }\n"),
    (("    l_part_s[idx] = __ldcg(ml_part + ml + 16);\n  }\n  __syncthreads();\n",), "{0} STAMP(7);\n"),
    (("    o[3] = acc.w * inv_l;\n  }\n",), "{0}  STAMP(14); STAMP(15);\n"),
    (('#include "common.cuh"\n',), "{0}" + STAMPS_PRELUDE),
)


def instrument(source: str) -> str:
    """The kernel's source with its phases stamped; a ValueError names an anchor the source no longer has."""
    for anchors, stamped in ANCHORS:
        found = [a for a in anchors if source.count(a) == 1]
        if not found:
            raise ValueError(f"attention_decode.cu no longer holds one of {anchors!r}: "
                             "update tools/attention_stamps.py")
        anchor = found[0]
        # {0}: the anchor itself; {1}: what follows the anchor's first line
        source = source.replace(anchor, stamped.replace("{0}", anchor).replace("{1}", anchor.partition("\n")[2]))
    return source


def build(source_path: Path, folder: Path, nvcc: str) -> Path:
    for header in KERNELS.glob("*.cuh"):
        shutil.copy(header, folder / header.name)
    (folder / "stamped_kernel.cu").write_text(instrument(source_path.read_text()))
    shutil.copy(HARNESS, folder / "harness.cu")
    binary = folder / "harness"
    subprocess.run([nvcc, "-arch=sm_90", "-O3", "-std=c++17", f"-I{folder}", "-o", str(binary),
                    str(folder / "harness.cu")], check=True)
    return binary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", type=Path, default=[KERNELS / "attention_decode.cu"])
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    parser.add_argument("--wrap", default="", help="a command the harness runs under (a profiler's)")
    args = parser.parse_args(argv)
    if shutil.which(args.nvcc) is None:
        print(f"attention_stamps: no nvcc at {args.nvcc!r}; install the CUDA toolkit or pass --nvcc", file=sys.stderr)
        return 2
    try:
        wrap = shlex.split(args.wrap)
    except ValueError as exc:
        parser.error(f"--wrap {args.wrap!r}: {exc}")
    if wrap and shutil.which(wrap[0]) is None:
        print(f"attention_stamps: --wrap names {wrap[0]!r}, which is not on PATH", file=sys.stderr)
        return 2
    for source in args.sources:
        print(f"# {source}", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            done = subprocess.run([*wrap, str(build(source, Path(folder), args.nvcc))])
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
