"""Kernels reading pinned host memory directly: `python -m strata.bench.zero_copy [--tiny]`.

The question it answers: can decode's routed experts that miss the cache be read by the expert
kernels straight from the pinned expert pack (zero-copy, over PCIe), instead of being staged into
cache slots by DMA between a layer's routing and its experts (two captured segments)? Then a
decoded token needs no host work per layer (the whole token is one graph, as a fully cached model's
is), and the host's speed stops setting decode's pace. It pays only if a kernel pulls host memory at
about the DMA rate.

Rows (GB/s of the bytes read, each the median of --repeats CUDA-event timings after --warmup runs):
- the DMA rate: one pinned host buffer copied to the device (the engine's staging path);
- a copy kernel reading the same pinned buffer through its device address (16 bytes a thread a step);
- one token's routed experts (the engine's ``moe_experts_decode``, each path) with their planes in
  device memory, then in pinned host memory: the second's ratio is to the DMA rate.
Under the CUDA simulator (--tiny) the figures mean nothing; the run checks that the script works.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from numba import cuda

from strata.bench.kernels import (
    HBM_BYTES_PER_S,
    QWEN3_30B,
    TINY,
    TINY_GEMV,
    Row,
    Shapes,
    format_table,
    graph_ms,
    make_experts,
    median_ms,
    path_name,
)
from strata.gpu.kernels import tensor_core
from strata.gpu.kernels._common import IS_SIMULATOR
from strata.gpu.kernels.gemv import GemvConfig
from strata.gpu.kernels.moe import moe_experts_decode
from strata.gpu.kernels.packing import PackedMatrix

COPY_BYTES = 256 << 20  # a few times what a decode layer's misses come to (~16 MiB)
TINY_COPY_BYTES = 4096
_THREADS = 256


@cuda.jit
def _read_words(src, dst):  # src, dst [n, 2] uint64: 16 bytes a thread a step, grid-stride
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, src.shape[0], stride):
        dst[i, 0] = src[i, 0]
        dst[i, 1] = src[i, 1]


def _size(num_bytes: int) -> str:
    return f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes >> 10} KiB"


def mapped_copy(array) -> object:
    """``array``'s values in pinned host memory, as a device array over those pages (the kernels read them
    over PCIe: zero-copy); the simulator's mapped array itself there."""
    host = cuda.mapped_array(array.shape, dtype=array.dtype)
    host[...] = array.copy_to_host()
    if IS_SIMULATOR:
        return host
    from numba.cuda.cudadrv.devicearray import DeviceNDArray  # absent from the simulator

    # the kernels take device arrays (a mapped array is also a numpy array): the same pinned pages, seen from the device
    return DeviceNDArray(host.shape, host.strides, host.dtype, gpu_data=host.gpu_data)


def mapped_experts(experts: tuple) -> tuple:
    """The stacks ``experts`` (gate, up, down) with every plane in pinned host memory."""
    return tuple(PackedMatrix(m.fmt, m.num_rows, m.num_cols, *(mapped_copy(p) for p in (m.quants, m.scales, m.extra)))
                 for m in experts)


def bench_dma(num_bytes: int, timing) -> Row:
    host = cuda.pinned_array(num_bytes, dtype=np.uint8)
    host[:] = 1
    device = cuda.device_array(num_bytes, dtype=np.uint8)
    ms = median_ms(lambda: device.copy_to_device(host), *timing)
    return Row(f"DMA host→device, {_size(num_bytes)} pinned", num_bytes / ms / 1e6, "GB/s", None, None)


def bench_kernel_read(num_bytes: int, num_sms: int, dma_gb_per_s: float, timing) -> Row:
    num_words = num_bytes // 16
    host = cuda.mapped_array((num_words, 2), dtype=np.uint64)
    host[:] = 1
    device = cuda.device_array((num_words, 2), dtype=np.uint64)
    blocks = max(1, min(-(-num_words // _THREADS), 8 * num_sms))  # enough loads in flight to cover PCIe latency
    ms = median_ms(lambda: _read_words[blocks, _THREADS](host, device), *timing)
    if not np.array_equal(device.copy_to_host(), np.asarray(host)):
        raise RuntimeError("the zero-copy kernel read other bytes than the pinned buffer holds")
    return Row(f"kernel reading pinned host memory (zero-copy), {_size(num_bytes)}, {blocks} blocks",
               num_bytes / ms / 1e6, "GB/s", dma_gb_per_s, None)


def experts_output(s: Shapes, experts: tuple, native: bool, cfg: GemvConfig) -> tuple:
    """One token's routed experts (top_k distinct experts of the stack: gate, up, down) as a launch
    ``launch(stream)``, and its output [1, hidden] once launched on the default stream."""
    rng = np.random.default_rng(7)
    x = cuda.to_device(rng.standard_normal((1, s.hidden)).astype(np.float32))
    ids = cuda.to_device(rng.choice(s.num_experts, s.top_k, replace=False).astype(np.int32).reshape(1, -1))
    weights = cuda.to_device(np.full((1, s.top_k), 1.0 / s.top_k, np.float32))
    out, hidden = cuda.device_array((1, s.hidden), np.float32), cuda.device_array((s.top_k, s.ffn), np.float32)

    def launch(stream):
        return moe_experts_decode(x, ids, weights, *experts, out, num_experts=s.num_experts, hidden=hidden,
                                  config=cfg, native=native, stream=stream)
    launch(0)
    return launch, out.copy_to_host()


def bench_experts(s: Shapes, experts: tuple, launch, where: str, native: bool, ceiling: float, timing) -> Row:
    """GB/s of ``launch`` (``experts_output``'s) over the bytes of the top_k experts it reads."""
    ms = graph_ms(launch, timing, count=4)
    num_bytes = s.top_k * sum(m.nbytes for m in experts) // s.num_experts
    return Row(f"decode experts {experts[0].fmt}, top-{s.top_k} of {s.num_experts}, planes in {where}, "
               f"{path_name(native)}", num_bytes / ms / 1e6, "GB/s", ceiling, None)


def run_transfers(s: Shapes, num_bytes: int, timing) -> list[Row]:
    """The DMA row and the zero-copy kernel's row (its ceiling the DMA's rate)."""
    dma = bench_dma(num_bytes, timing)
    return [dma, bench_kernel_read(num_bytes, s.num_sms, dma.figure, timing)]


def run_experts(s: Shapes, dma: Row, cfg: GemvConfig, timing, fmt: str = "Q4_0") -> list[Row]:
    """One token's experts with their planes in device memory and in pinned host memory, each path."""
    rows = []
    experts = make_experts(s, fmt, np.random.default_rng(6))
    host_experts = mapped_experts(experts)
    paths = (True, False) if tensor_core.is_available() else (False,)
    for native in paths:
        (on_device, device_out), (on_host, host_out) = (experts_output(s, e, native, cfg)
                                                        for e in (experts, host_experts))
        if not np.array_equal(device_out, host_out):
            raise RuntimeError(f"the experts' output differs with their planes in pinned host memory "
                               f"({path_name(native)}): max difference {np.abs(device_out - host_out).max()}")
        rows.append(bench_experts(s, experts, on_device, "device memory", native, HBM_BYTES_PER_S / 1e9, timing))
        rows.append(bench_experts(s, host_experts, on_host, "pinned host memory", native, dma.figure, timing))
    return rows


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(prog="python -m strata.bench.zero_copy", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="toy shapes, for the CUDA simulator")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2, tiny 0)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 10, tiny 1)")
    parser.add_argument("--format", default="Q4_0", help="the routed experts' format (default Q4_0)")
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 2)
    repeats = args.repeats if args.repeats is not None else (1 if args.tiny else 10)
    shapes, num_bytes, cfg = (TINY, TINY_COPY_BYTES, TINY_GEMV) if args.tiny else (QWEN3_30B, COPY_BYTES, GemvConfig())
    device = "CUDA simulator: the figures are not GPU figures" if IS_SIMULATOR else cuda.get_current_device().name
    print(f"# {device}")
    rows = run_transfers(shapes, num_bytes, (warmup, repeats))
    print(format_table(rows), flush=True)  # before the experts' rows, which may fail on their own
    expert_rows = run_experts(shapes, rows[0], cfg, (warmup, repeats), args.format)
    print(format_table(expert_rows))
    return rows + expert_rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
