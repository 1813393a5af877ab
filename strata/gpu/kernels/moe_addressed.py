"""A decode step's routed experts read where they lie: through a table of plane addresses per expert.

``moe_experts_decode`` reads stacked experts (cache slots, one base address a plane). Here each expert of
a layer has its own nine planes' device addresses (gate, up, down; quants, scales, extra each) in a row of
``table`` [N, PLANES_PER_EXPERT] uint64: a cached expert's slot addresses, or the addresses of its packed
bytes in pinned host memory, which the kernels read over PCIe (zero-copy, ~0.9 of the DMA rate on the
reference H200). The kernels take routed expert ids, not slots, so a decode token needs no host work
between its layers: its routing, experts and attention are one captured graph.

The table's last column is 1 where the expert's planes are in host memory; the gate/up launch counts
those routed pairs into ``host_reads`` [1] int32 (a decode step's misses).

Same C++ rows as ``gemv_native``'s experts (cuda/gemv_rows.cu, ``AddressPlanes``); the products are the
same sums in the same order as the stacked form's, so the output is bit-identical to it.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from . import gemv_native, tensor_core
from ._common import check_array, empty, stand_in, zeros
from .launcher import jit
from .packing import PackedMatrix

PLANES_PER_EXPERT = 9  # gate, up, down x quants, scales, extra
HOST_FLAG = PLANES_PER_EXPERT  # the column that says the planes are in host memory
TABLE_COLUMNS = PLANES_PER_EXPERT + 1
_WARP = 32
_U64_PTR = types.CPointer(types.uint64)
_I32, _I32_PTR = tensor_core.INT32, types.CPointer(types.int32)
_STRIDES = (_I32,) * 3


def can_address(gate: PackedMatrix, up: PackedMatrix, down: PackedMatrix, top_k: int) -> bool:
    """True where the addressed kernels run these experts' formats and shapes (the stacked C++ rows can)."""
    return gemv_native.experts_supported(gate, up, down, top_k)


def moe_experts_addressed(x, ids, weights, table, gate: PackedMatrix, down: PackedMatrix, out, *,
                          norm_weight=None, eps: float = 1e-6, hidden=None, host_reads=None,
                          config: gemv_native.ExpertsConfig | None = None, stream=0):
    """out [T, H] += the routed experts ``ids`` [T, k] (expert ids; one outside [0, N) adds nothing) weighted
    by ``weights`` [T, k], each expert's planes at ``table`` [N, TABLE_COLUMNS] uint64; x [T, H] float32
    (RMSNorm-ed here when norm_weight [H] is given). gate and down: stacks in the experts' formats and row
    layout (their planes are not read; up is gate's format). hidden: optional [T * k, F] float32 scratch.
    host_reads: optional [1] int32, += the routed pairs whose planes are in host memory."""
    check_array("x", x, dtypes=np.float32, ndim=2)
    num_tokens, dim = x.shape
    check_array("ids", ids, dtypes=np.int32, shape=(num_tokens, None))
    top_k = ids.shape[1]
    check_array("weights", weights, dtypes=np.float32, shape=(num_tokens, top_k))
    check_array("table", table, dtypes=np.uint64, shape=(None, TABLE_COLUMNS))
    check_array("out", out, dtypes=np.float32, shape=(num_tokens, dim))
    if not can_address(gate, gate, down, top_k):
        raise ValueError(f"addressed experts need the linked C++ rows on a GPU and formats of "
                         f"{', '.join(gemv_native.EXPERT_FORMATS)}, got {gate.fmt} and {down.fmt}")
    ffn = down.num_cols
    if gate.num_cols != dim or down.num_rows % dim or gate.num_rows % ffn:
        raise ValueError(f"experts of [{ffn}, {dim}] and [{dim}, {ffn}] rows do not fit x of {dim} columns")
    if hidden is None:
        hidden = empty((num_tokens * top_k, ffn), np.float32, x)
    check_array("hidden", hidden, dtypes=np.float32, shape=(num_tokens * top_k, ffn))
    if host_reads is None:  # a count of its own: the kernel adds to it (a stand-in view would alias ids)
        host_reads = zeros((1,), np.int32, x)
    check_array("host_reads", host_reads, dtypes=np.int32, shape=(1,))
    if num_tokens == 0:
        return out
    has_norm = norm_weight is not None
    if has_norm:
        check_array("norm_weight", norm_weight, dtypes=np.float32, shape=(dim,))
    norm_w = norm_weight if has_norm else stand_in(x, np.float32, 1)
    config = (gemv_native.experts_config(num_tokens) if config is None else config).validate()
    gate_up_kernel, down_kernel = _kernels(gate.fmt, down.fmt, dim, ffn, top_k, config.warps, config.down_warps,
                                           has_norm, config.max_registers)
    num_experts = np.int32(table.shape[0])
    gate_up_blocks = config.blocks_per_token(top_k * ffn, config.warps, num_tokens)
    gate_up_kernel[(gate_up_blocks, num_tokens), config.warps * _WARP, stream](
        x, norm_w, np.float32(eps), ids, table, num_experts, *gemv_native._row_strides(gate), hidden, host_reads)
    down_blocks = config.blocks_per_token(dim, config.down_warps, num_tokens)
    down_kernel[(down_blocks, num_tokens), config.down_warps * _WARP, stream](
        hidden, ids, weights, table, num_experts, *gemv_native._row_strides(down), out)
    return out


def _declare_pair_loop(fmt: str):
    return tensor_core.declare(
        f"strata_pair_loop_at_{fmt.lower()}",
        (tensor_core.FLOAT_PTR, _U64_PTR, _I32, _I32, *_STRIDES, _I32_PTR, _I32, _I32, _I32, _I32,
         tensor_core.FLOAT_PTR, _I32), "gemv_rows.cu")


def _declare_down_loop(fmt: str):
    return tensor_core.declare(
        f"strata_down_loop_at_{fmt.lower()}",
        (tensor_core.FLOAT_PTR, _U64_PTR, _I32, _I32, *_STRIDES, _I32_PTR, tensor_core.FLOAT_PTR, _I32, _I32, _I32,
         _I32, tensor_core.FLOAT_PTR, _I32, _I32), "gemv_rows.cu")


@functools.cache
def _kernels(fmt_gate_up: str, fmt_down: str, dim: int, ffn: int, top_k: int, warps: int, down_warps: int,
             has_norm: bool, max_registers: int = 0):
    threads, down_threads = warps * _WARP, down_warps * _WARP
    pair_fn, down_fn = _declare_pair_loop(fmt_gate_up), _declare_down_loop(fmt_down)
    options = gemv_native.register_options(max_registers)
    ffi = tensor_core.ffi()
    num_x, hidden_stride = gemv_native.x_floats(dim), gemv_native.x_floats(ffn)
    stage_x = gemv_native._stage_rows_device(dim, threads, has_norm, 1, num_x)
    stage_hidden = gemv_native._stage_rows_device(ffn, down_threads, False, top_k, hidden_stride)
    num_hidden_x = top_k * hidden_stride
    columns = np.int32(TABLE_COLUMNS)

    @jit(**options)
    def gate_up_kernel(x, norm_w, eps, ids, table, num_experts, words, halves, extra_bytes, hidden, host_reads):
        tid = cuda.threadIdx.x  # grid (blocks, T), as gemv_native's experts
        red = cuda.shared.array(warps, np.float32)
        xs = cuda.shared.array(num_x, np.float32, alignment=16)  # read as float4 by the C++
        token = cuda.blockIdx.y
        if cuda.blockIdx.x == 0:  # one count a routed pair
            for j in range(tid, top_k, threads):
                expert = ids[token, j]
                if 0 <= expert < num_experts and table[expert, HOST_FLAG] != 0:
                    cuda.atomic.add(host_reads, 0, 1)
        stage_x(x[token:token + 1], norm_w, eps, red, xs, tid)
        cuda.syncthreads()
        pair_fn(ffi.from_buffer(hidden[token * top_k]), ffi.from_buffer(table), columns, num_experts, words, halves,
                extra_bytes, ffi.from_buffer(ids[token]), top_k, ffn, cuda.blockIdx.x * warps + tid // _WARP,
                cuda.gridDim.x * warps, ffi.from_buffer(xs), dim)

    @jit(**options)
    def down_kernel(hidden, ids, weights, table, num_experts, words, halves, extra_bytes, out):  # out [T, H] +=
        tid = cuda.threadIdx.x
        xs = cuda.shared.array(num_hidden_x, np.float32, alignment=16)
        token = cuda.blockIdx.y
        stage_hidden(hidden[token * top_k:(token + 1) * top_k], hidden[0], np.float32(0.0), xs, xs, tid)
        cuda.syncthreads()
        down_fn(ffi.from_buffer(out[token]), ffi.from_buffer(table), columns, num_experts, words, halves, extra_bytes,
                ffi.from_buffer(ids[token]), ffi.from_buffer(weights[token]), top_k,
                cuda.blockIdx.x * down_warps + tid // _WARP, cuda.gridDim.x * down_warps, dim, ffi.from_buffer(xs),
                hidden_stride, ffn)

    return gate_up_kernel, down_kernel
