"""The prefill GEMM's tile configurations: ``GemmConfig`` (FFMA) and ``MmaConfig`` (tensor cores),
and the defaults that pick between them for a weight format and a chunk's routed rows."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import tensor_core
from ._common import IS_SIMULATOR, OCTET, check_power_of_two
from .shared_tiles import shared_bytes

BLOCK_K = 32  # elements of K staged per step: one legacy block, one K-quant sub-block
MMA_LD = BLOCK_K + 8  # halves per staged row on the tensor-core path (padding against bank conflicts)
DEFAULT_BLOCK_MS = (64, 128)  # the rows default_config's tiles may have (moe_block_m's choices)
MOE_FULL_TILE_MIN_ROWS = 96  # mean routed rows an expert from which the MoE prefill takes 128-row tiles (else 64)
MMA_STEP_KS = (32, 64)  # K elements staged per barrier pair on the tensor-core path
OCTETS_PER_STEP = BLOCK_K // OCTET
# the formats cuda/gemm_mma.cu's fused loop reads: the block formats it dequantizes, and F16 values as they are
FUSED_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "F16")
# (16-row, 8-column) mma tiles per warp in cuda/gemm_mma.cu
_MMA_WARP_TILES = ((1, 1), (1, 2), (1, 4), (2, 4), (4, 4), (2, 8), (4, 8))


class GemmConfig(NamedTuple):
    block_m: int = 64
    block_n: int = 64
    thread_m: int = 4
    thread_n: int = 4

    @property
    def threads(self) -> int:
        return (self.block_m // self.thread_m) * (self.block_n // self.thread_n)

    def validate(self) -> "GemmConfig":
        for name in self._fields:
            check_power_of_two(name, getattr(self, name))
        if self.thread_m > self.block_m or self.thread_n > self.block_n:
            raise ValueError(f"thread tile {self.thread_m}x{self.thread_n} exceeds block tile "
                             f"{self.block_m}x{self.block_n}")
        if (self.block_n * OCTETS_PER_STEP) % self.threads or (self.block_m * BLOCK_K) % self.threads:
            raise ValueError(f"{self.threads} threads cannot stage a {self.block_m}x{self.block_n} tile evenly")
        if self.block_m > self.threads:
            raise ValueError(f"block_m {self.block_m} exceeds the {self.threads} threads that fill its row list")
        return self

    @property
    def acc_size(self) -> int:
        return self.thread_m * self.thread_n

    @property
    def xs_size(self) -> int:
        return BLOCK_K * self.block_m

    @property
    def ws_size(self) -> int:
        return BLOCK_K * self.block_n

    stage_dtype = np.float32


# the simulator runs a Python thread per GPU thread, each barrier a switch of every one: 64 threads a tile there
FFMA_DEFAULT_CONFIG = GemmConfig(thread_m=8, thread_n=8) if IS_SIMULATOR else GemmConfig()


class MmaConfig(NamedTuple):
    """Tensor-core tiles: warps_m x warps_n warps, each a (block_m / warps_m) x (block_n / warps_n) tile.

    Main-loop options (the defaults are the plain loop: one 32-wide step per barrier pair, W
    dequantized straight from global memory into shared memory):

        prefetch_w     W's raw words and scales for step s + 1 are loaded into registers before
                       step s's products and decoded into shared memory after them (formats with a
                       split dequantizer; the others keep the direct path)
        step_k         K elements staged per step: 32, or 64 (two 32-wide sub-steps per barrier
                       pair, half the barriers and mma calls; a K that is an odd multiple of 32
                       gets a zero-filled last half)
        stages         1, or 2: double-buffered tiles, the next step staged while this one's
                       products run, one barrier per step
        ldmatrix       fragments read with ldmatrix instead of 32-bit shared loads (C++ only)
        vector_stores  each thread stages whole octets of X and W as one 16-byte shared store
                       (C++ only; X loads become octet-per-thread)
        lto            link-time optimization of the kernels with the linked C++ (C++ only): the mma
                       step can inline, and its accumulators need not pass through local memory at
                       every call
        fused          the whole K loop in C++ (gemm_mma.py; C++ only, stages 2, step_k 32 or 64): the
                       accumulators stay in registers; weights of FUSED_FORMATS with float16 X
                       (the wrappers convert float32 X first), the Numba loop for the rest
    """

    block_m: int = 128  # 128 x 128 with 8 warps of 32 x 64: fastest of the shapes measured on the H200
    block_n: int = 128
    warps_m: int = 4
    warps_n: int = 2
    is_native: bool | None = None  # linked CUDA C++ (True) or the pure-Numba twin; None: native when available
    prefetch_w: bool = False
    step_k: int = 32
    stages: int = 1
    ldmatrix: bool = False
    vector_stores: bool = False
    lto: bool = False
    fused: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def warp_tile(self) -> tuple[int, int]:
        return self.block_m // self.warps_m, self.block_n // self.warps_n

    @property
    def acc_size(self) -> int:
        return self.warp_tile[0] // 16 * self.warp_tile[1] // 8 * 4

    @property
    def ld(self) -> int:
        """Halves per staged row: step_k + 8 (a row stride of 4 words mod 32 banks: conflict-free fragments)."""
        return self.step_k + 8

    @property
    def xs_size(self) -> int:
        return self.stages * self.ld * self.block_m

    @property
    def ws_size(self) -> int:
        return self.stages * self.ld * self.block_n

    def shared_bytes(self, num_weights: int = 1) -> int:
        """Shared memory of a kernel staging X and `num_weights` weight tiles (plus its row list); over
        48 KiB the tiles are dynamic shared memory (shared_tiles.py)."""
        return shared_bytes(self, num_weights)

    stage_dtype = np.float16

    def validate(self) -> "MmaConfig":
        for name in ("block_m", "block_n", "warps_m", "warps_n"):
            check_power_of_two(name, getattr(self, name))
        warp_m, warp_n = self.warp_tile
        if warp_m % 16 or warp_n % 8 or (warp_m // 16, warp_n // 8) not in _MMA_WARP_TILES:
            raise ValueError(f"warp tile {warp_m}x{warp_n} is not one of the compiled mma tiles "
                             f"{[(16 * m, 8 * n) for m, n in _MMA_WARP_TILES]}")
        if (self.block_n * OCTETS_PER_STEP) % self.threads or (self.block_m * BLOCK_K) % self.threads:
            raise ValueError(f"{self.threads} threads cannot stage a {self.block_m}x{self.block_n} tile evenly")
        if self.block_m > self.threads:
            raise ValueError(f"block_m {self.block_m} exceeds the {self.threads} threads that fill its row list")
        if self.step_k not in MMA_STEP_KS:
            raise ValueError(f"step_k must be one of {MMA_STEP_KS}, got {self.step_k}")
        if self.stages not in (1, 2):
            raise ValueError(f"stages must be 1 or 2, got {self.stages}")
        if self.vector_stores and (self.block_m * OCTETS_PER_STEP) % self.threads:
            raise ValueError(f"vector_stores: {self.threads} threads cannot stage {self.block_m} rows by octets evenly")
        limit = tensor_core.max_shared_bytes()
        if self.shared_bytes(2) > limit:  # an MoE's gate/up kernel stages two weight tiles
            raise ValueError(f"{self.shared_bytes(2)} bytes of shared memory (X and two weight tiles) exceed the "
                             f"{limit} a block may have: lower block_m, block_n, step_k or stages")
        if self.lto and self.is_native is False:
            raise ValueError("lto=True links the C++ main loop, but is_native=False runs the Numba twin, which has "
                             "nothing to link: set lto=False, or is_native=True on a GPU with tensor cores")
        if self.fused and self.stages != 2:
            raise ValueError(f"fused=True runs double-buffered K steps, but stages={self.stages}: set stages=2, "
                             "or fused=False")
        if self.fused and self.is_native is False:
            raise ValueError("fused=True runs the K loop in linked C++, but is_native=False runs the Numba twin: "
                             "set fused=False, or is_native=True on a GPU with tensor cores")
        if self.is_native is None:  # without tensor cores the C++-only options fall back to the twin's loop
            is_native = tensor_core.is_available()
            return self._replace(is_native=is_native, fused=self.fused and is_native, lto=self.lto and is_native)
        if self.is_native and not tensor_core.is_available():
            raise ValueError("is_native=True needs a GPU with tensor cores (compute capability 8.0+) and cffi")
        return self


def is_fused(config, *fmts: str) -> bool:
    """Whether weights of these formats run the C++ fused K loop under a validated config (X then float16)."""
    return (isinstance(config, MmaConfig) and config.fused and bool(config.is_native)
            and len(set(fmts)) == 1 and fmts[0] in FUSED_FORMATS)


def default_config(*fmts: str, block_m: int = 128):
    """The tiles for weights of these formats (none given: the fused loop's; an MoE passes gate, up, down,
    and gate and up share one loop, so they must share a format to fuse): tensor cores where available,
    else the FFMA tiles (the simulator, whose block_m is its own). block_m: the tile's rows, 128 or 64
    (moe_block_m picks it for an MoE chunk; one grouping of routed pairs serves any tiles of its block_m).

    On the H200 (MoE prefill at 2,048 / 8,192 routed tokens, dense 4096 x 4096 x 2048, TFLOP/s):
    the fused C++ K loop on 128 x 64 tiles, Q4_0 69 / 114 / 67, Q4_1 57 / 102 / 46, Q4_K 67 / 101 / 68,
    Q6_K 50 / 89 / 41. Later, Q4_0 75 / 122-125 / 67-71 with the MoE epilogue's vector reductions
    and the gate/up loop's shared X fragments; its 64-wide K steps 64 / 103 / 73. With Q4_0 and Q8_0
    dequantized in half2 arithmetic, gate/up alone 110 / 160. The Numba loop's
    best, 128 x 128 tiles with W prefetch, ldmatrix fragments and 16-byte shared stores, Q4_0
    48 / 62 / 45, Q4_1 37 / 50 / 48, Q4_K 35 / 49 / 34, Q6_K 31 / 43 / 40, which F16 and F32 weights
    keep. With block_m 64 the same loops run on half the rows (2 x 2 warps for the fused loop)."""
    if block_m not in DEFAULT_BLOCK_MS:
        raise ValueError(f"block_m must be one of {DEFAULT_BLOCK_MS}, got {block_m}")
    if not tensor_core.is_available():
        return FFMA_DEFAULT_CONFIG
    warps_m = block_m // 32
    if all(fmt in FUSED_FORMATS for fmt in fmts) and len(set(fmts[:2])) <= 1:
        return MmaConfig(block_m=block_m, block_n=64, warps_m=warps_m, warps_n=2, stages=2, fused=True).validate()
    return MmaConfig(block_m=block_m, warps_m=warps_m, prefetch_w=True, ldmatrix=True, vector_stores=True).validate()


def default_down_config(*fmts: str, block_m: int = 128):
    """The MoE down launch's tiles for experts of these formats (gate, up, down): where default_config
    fuses 128-row tiles, its 128 x 64 tiles on 4 x 1 warps (warp tiles 32 x 64, which one weight's
    accumulators allow) with 64-wide K steps; otherwise default_config's, 64-row tiles included. The same
    block_m: one grouping serves both launches.

    On the H200 (Q4_0, down alone at 2,048 / 8,192 routed tokens, TFLOP/s): 96-97 / 147-151, against
    87-88 / 125 on default_config's tiles (4 x 2 warps, 32-wide steps). Swept before the half2
    dequantizer (two calls), against 85 / 121 on default_config's tiles: 89 / 138 for these, 4 x 2 warps
    with 64-wide steps 85 / 127, 128 x 32 tiles 87 / 124, 128 x 128 tiles 75-80 / 107-116. On 64-row
    tiles at 512 / 2,048 tokens, down alone: gate/up's tiles 50.8 / 103.6, 64-wide steps 49.0 / 96.2, 2 x 1 warps
    48.3 / 102.7 (down alone)."""
    config = default_config(*fmts, block_m=block_m)
    if getattr(config, "fused", False) and block_m == 128:
        return config._replace(warps_n=1, step_k=64).validate()
    return config


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """The MoE prefill tiles' rows (the grouping's block_m) for a chunk of num_pairs routed (token, expert)
    pairs: with tensor cores, 64 where an expert gets fewer than MOE_FULL_TILE_MIN_ROWS of them on average (an
    expert's last tile is mostly padding, and a tile costs the same whatever its rows), else 128; without
    them the FFMA tiles' rows.

    On the H200 (Q4_0, both launches on default_config / default_down_config, TFLOP/s at 512 / 2,048 / 8,192
    tokens routed top-8 of 128 experts: 32 / 128 / 512 rows an expert on average): 128-row tiles
    40.5 / 113.0 / 162.5, 64-row tiles 61.1 / 111.0 / 143.5."""
    if not tensor_core.is_available():
        return FFMA_DEFAULT_CONFIG.block_m
    return 64 if num_pairs < MOE_FULL_TILE_MIN_ROWS * num_experts else 128
